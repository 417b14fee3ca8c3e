"""A JSON Schema for the policy file, generated from the loader's own model.

Editors (yaml-language-server: `# yaml-language-server: $schema=...`) and CI validators
(check-jsonschema) check a policy before it reaches an agent. The sections and their keys
come from the loader's key tuples (`TOP_KEYS`, `RULE_KEYS`, ...), the actions, limit names
and fair-share splits from the model's enums, so a key the loader learns cannot be missing
here; `FIELD_TYPES` gives each key its value shape and a test checks every key has one.
The published file (`gpuwatch/policy/policy.schema.json`, `gpuwatch policy schema`) is this
module's output, kept equal by a test.

The schema is the first-line check (shapes, names, unit spelling). The loader remains the
authority: what a schema cannot say (ranges inside "90%", ladder order, a rule after the
catch-all, duplicate names, `throttle` without a share) it reports with its line numbers
and fixes (`gpuwatch policy check`).
"""

from __future__ import annotations

import json
from typing import Any

from gpuwatch.core.units import DURATION_FORM, RATIO_FORM, SIZE_FORM
from gpuwatch.policy import loader
from gpuwatch.policy.rules import (
    ActionKind,
    AdmissionOrder,
    ElasticDivide,
    ElasticThrottle,
    FairShareSplit,
    LimitKind,
)

SCHEMA_ID = "https://github.com/gpuwatch/gpuwatch/blob/main/gpuwatch/policy/policy.schema.json"

_NUMBER = r"^\s*[0-9]+(\.[0-9]+)?\s*"
SIZE: dict[str, Any] = {
    "description": SIZE_FORM,
    "oneOf": [
        {"type": "integer", "exclusiveMinimum": 0},
        {"type": "string", "pattern": _NUMBER + r"([bB]|[kKmMgGtT][iI]?[bB]?|%)?\s*$"},
    ],
}
DURATION: dict[str, Any] = {
    "description": DURATION_FORM,
    "oneOf": [
        {"type": "number", "minimum": 0},
        {"type": "string", "pattern": _NUMBER + r"([mM][sS]|[sS]|[mM]([iI][nN])?|[hH])?\s*$"},
    ],
}
SIGNAL: dict[str, Any] = {
    "description": "a signal name like SIGUSR1, USR1 or SIGTERM, or its number",
    "oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": r"^[A-Za-z][A-Za-z0-9+]*$"}],
}
BOOLEAN: dict[str, Any] = {"type": "boolean"}
NAME: dict[str, Any] = {"type": "string", "minLength": 1}


def ratio(maximum: float) -> dict[str, Any]:
    """A fraction or percentage above 0 and at most `maximum` (as a fraction)."""
    return {
        "description": f"{RATIO_FORM}, at most {maximum * 100:g}%",
        "oneOf": [
            {"type": "number", "exclusiveMinimum": 0, "maximum": maximum},
            {"type": "string", "pattern": _NUMBER + r"%?\s*$"},
        ],
    }


def integer(minimum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum}


def _ladder() -> dict[str, Any]:
    return {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/step"}}


_ON = {"enum": [k.value for k in LimitKind]}

# section -> key -> value shape; the sections' keys are the loader's (checked by a test)
FIELD_TYPES: dict[str, dict[str, dict[str, Any]]] = {
    "top": {
        "version": {"const": 1},
        "protected_namespaces": {"type": "array", "items": NAME},
        "tuning": {"$ref": "#/$defs/tuning"},
        "deadlock": {"$ref": "#/$defs/deadlock"},
        "fair_share": {"$ref": "#/$defs/fair_share"},
        "rescheduling": {"$ref": "#/$defs/rescheduling"},
        "elastic": {"$ref": "#/$defs/elastic"},
        "rules": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/rule"}},
        "namespace_quotas": {"type": "array", "items": {"$ref": "#/$defs/namespace_quota"}},
    },
    "rule": {
        "name": NAME,
        "priority": {"type": "integer"},
        "match": {"$ref": "#/$defs/match"},
        "limits": {"$ref": "#/$defs/limits"},
        "actions": _ladder(),
    },
    "match": {
        "namespace": NAME, "pod": NAME, "container": NAME, "container_id": NAME, "cgroup": NAME,
        "labels": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
        "default": {"const": True},
    },
    "limits": {
        "gpu_memory": SIZE,
        "gpu_time_share": ratio(loader.MAX_GPU_SHARE),
        "window": DURATION,
        "devices": {"type": "array", "items": integer(0)},
        "max_processes": integer(1),
    },
    "namespace_quota": {
        "namespace": NAME,
        "limits": {"$ref": "#/$defs/quota_limits"},
        "actions": _ladder(),
    },
    "quota_limits": {
        "gpu_memory": SIZE,
        "gpu_time_share": ratio(loader.MAX_GPU_SHARE),
        "window": DURATION,
        "max_processes": integer(1),
    },
    "step": {
        "do": {"enum": [k.value for k in ActionKind]},
        "at": ratio(10.0),
        "for": DURATION,
        "on": {"oneOf": [_ON, {"type": "array", "items": _ON}]},
        "signal": SIGNAL,
        "grace": DURATION,
        "share": ratio(1.0),
        "repeat": DURATION,
    },
    "tuning": {
        "hysteresis": ratio(0.5),
        "release_after": DURATION,
        "min_hold": DURATION,
        "max_actions_per_minute": integer(1),
    },
    "deadlock": {
        "enabled": BOOLEAN,
        "action": {"enum": [ActionKind.PAUSE.value, ActionKind.CHECKPOINT_KILL.value, ActionKind.KILL.value]},
        "grace": DURATION,
        "signal": SIGNAL,
        "blocked_window": DURATION,
    },
    "fair_share": {"enabled": BOOLEAN, "split": {"enum": [s.value for s in FairShareSplit]}},
    "rescheduling": {
        "checkpoint_after": {"oneOf": [DURATION, {"const": "never"}]},
        "grace": DURATION,
        "signal": SIGNAL,
        "gate_new": BOOLEAN,
        "demand_from_limit": BOOLEAN,
        "order": {"enum": [o.value for o in AdmissionOrder]},
        "headroom": ratio(1.0),
    },
    "elastic": {
        "enabled": BOOLEAN,
        "window": DURATION,
        "floor": ratio(0.5),
        "hysteresis": ratio(0.5),
        "min_dwell": DURATION,
        "plateau": ratio(1.0),
        "min_gpu_time": DURATION,
        "period": DURATION,
        "contended": ratio(1.0),
        "throttle": {"enum": [t.value for t in ElasticThrottle]},
        "divide": {"enum": [d.value for d in ElasticDivide]},
        "checkpoint_plateaued": BOOLEAN,
    },
}

# section -> the loader's tuple of allowed keys (the model the schema is generated from)
LOADER_KEYS: dict[str, tuple[str, ...]] = {
    "top": loader.TOP_KEYS,
    "rule": loader.RULE_KEYS,
    "match": loader.MATCH_KEYS,
    "limits": loader.LIMIT_KEYS,
    "namespace_quota": loader.QUOTA_KEYS,
    "quota_limits": loader.QUOTA_LIMIT_KEYS,
    "step": loader.STEP_KEYS,
    "tuning": loader.TUNING_KEYS,
    "deadlock": loader.DEADLOCK_KEYS,
    "fair_share": loader.FAIR_SHARE_KEYS,
    "rescheduling": loader.RESCHEDULING_KEYS,
    "elastic": loader.ELASTIC_KEYS,
}
REQUIRED: dict[str, list[str]] = {
    "top": ["rules"],
    "rule": ["name", "match"],
    "namespace_quota": ["namespace", "limits"],
    "step": ["do"],
}


def _section(name: str) -> dict[str, Any]:
    keys = LOADER_KEYS[name]
    missing = [k for k in keys if k not in FIELD_TYPES[name]]
    if missing:
        raise KeyError(f"policy schema: section {name!r} has no value shape for {missing}; "
                       "add them to gpuwatch/policy/jsonschema.py FIELD_TYPES")
    out: dict[str, Any] = {
        "type": "object",
        "properties": {k: FIELD_TYPES[name][k] for k in keys},
        "additionalProperties": False,
    }
    if name in REQUIRED:
        out["required"] = REQUIRED[name]
    return out


def _step() -> dict[str, Any]:
    """A ladder step; `signal`/`grace`, `share` and `repeat` only with the action they belong to."""
    step = _section("step")
    step["allOf"] = [
        {"if": {"anyOf": [{"required": [key]} for key in keys]},
         "then": {"properties": {"do": {"const": kind.value}}}}
        for kind, keys in _only_for().items()
    ]
    return step


def _only_for() -> dict[ActionKind, list[str]]:
    out: dict[ActionKind, list[str]] = {}
    for key, kind in loader.STEP_ONLY_FOR.items():
        out.setdefault(kind, []).append(key)
    return out


def policy_json_schema() -> dict[str, Any]:
    """The policy file's JSON Schema (draft 2020-12)."""
    top = _section("top")
    defs = {name: _section(name) for name in LOADER_KEYS if name not in ("top", "step")}
    defs["step"] = _step()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "gpuwatch policy file (version 1)",
        "description": "Generated from gpuwatch/policy/loader.py by gpuwatch/policy/jsonschema.py "
                       "(`gpuwatch policy schema`); the reference is gpuwatch/policy/SCHEMA.md and "
                       "`gpuwatch policy check` the authority (line-numbered errors with fixes).",
        **top,
        "$defs": dict(sorted(defs.items())),
    }


def render_schema() -> str:
    """The published file's text: stable key order, two-space indent, final newline."""
    return json.dumps(policy_json_schema(), indent=2) + "\n"
