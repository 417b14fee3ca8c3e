"""An Enforcer for a test: keyword arguments are sorted into EnforcerConfig fields,
EnforcerHooks fields and the constructor's own (actions, initial_policy), so a test names
only what it changes. The freeze journal and the audit log live in tmp_path, and no cgroup
is the agent's own (the test process's cgroups may be acted on) unless the test says so."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.cgroup_ops import CgroupTree
from gpuwatch.enforce.enforcer import Enforcer, EnforcerConfig, EnforcerHooks

CONFIG_FIELDS = {f.name for f in dataclasses.fields(EnforcerConfig)}
HOOK_FIELDS = {f.name for f in dataclasses.fields(EnforcerHooks)}


def enforcer_for(policy: Path, tmp_path: Path, audit: AuditLog | None = None, **kwargs: Any) -> Enforcer:
    """On the host's cgroups unless `cgroups=` is given."""
    config: dict[str, Any] = {"frozen_state_path": tmp_path / "frozen.json", "own_cgroups": frozenset()}
    hooks: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for name, value in kwargs.items():
        (config if name in CONFIG_FIELDS else hooks if name in HOOK_FIELDS else rest)[name] = value
    return Enforcer(policy, EnforcerConfig(**config), audit=audit or AuditLog(tmp_path / "audit.jsonl"),
                    hooks=EnforcerHooks(**hooks), **rest)


def enforcer_on_fake_tree(tmp_path: Path, policy_text: str, **kwargs: Any) -> Enforcer:
    """The policy text written to tmp_path/policy.yaml; cgroups: a fake v2 tree under tmp_path/cg."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text)
    kwargs.setdefault("cgroups", CgroupTree(v2_root=tmp_path / "cg", autodetect=False))
    return enforcer_for(policy, tmp_path, **kwargs)
