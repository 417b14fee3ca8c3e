"""`gpuwatch agent` -> `python -m gpuwatch.agent.daemon`: the config survives the hand-over exactly, and
the daemon refuses to start without one (it is not a second command line)."""

from __future__ import annotations

import os
import subprocess
import sys

from gpuwatch.agent.daemon import CONFIG_ENV, AgentConfig, config_from_json, config_to_json
from gpuwatch.containers import BundleRoots


def test_every_field_survives_the_hand_over() -> None:
    config = AgentConfig(listen_host="::1", listen_port=9500, node="n1", interval_s=0.5, nvml_library="/x/lib.so",
                         probes=False, policy_path="/p.yaml", dry_run=True, webhook=("127.0.0.1", 9401),
                         webhook_token_file="/t", snapshot_remote=True, kmsg_path=None,
                         ignored_xids=frozenset({13, 31}), network=False, network_exclude="veth.*",
                         bundle_roots=BundleRoots(runc_state=("/run/runc", "/tmp/r")))
    assert config_from_json(config_to_json(config)) == config
    assert config_from_json(config_to_json(AgentConfig())) == AgentConfig()


def test_the_daemon_without_a_handed_config_says_how_to_start_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    out = subprocess.run([sys.executable, "-m", "gpuwatch.agent.daemon"], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2
    assert "gpuwatch agent" in out.stderr and "Traceback" not in out.stderr
