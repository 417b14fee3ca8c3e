"""One journal per state file (issue 20, item 6 e), as real processes.

Two agents with different --lock-file but the same --state-file used to both run and rewrite
the one journal from their own view, each wiping the other's entries (a pod the first froze
would then no longer be listed for recovery after a crash). Now the agent also locks the state
file (flock on `<state-file>.lock`) right after the node lock: the second agent exits at once,
naming the state file and the fix, and touches nothing."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.system.promstack import free_port
from tests.system.test_agent import is_frozen, running_agent, sample, scrape, wait_until
from tests.system.test_agent_hardening import SIGTERM_BUDGET_S, file_state, node, policy_file, stop_within

pytestmark = [pytest.mark.root]


def test_second_agent_with_its_own_lock_but_the_same_state_file_refuses(tmp_path: Path) -> None:
    with node(tmp_path) as n:
        assert n.trainer is not None
        first, second = tmp_path / "first", tmp_path / "second"
        first.mkdir()
        second.mkdir()
        state = first / "frozen.json"
        port = free_port()
        argv = n.argv(port, first, f"--policy={policy_file(first)}", f"--lock-file={first / 'agent.lock'}")
        with running_agent(argv, n.env, first / "agent.log", port) as agent:
            wait_until(lambda: is_frozen(n.trainer), 30, "the first agent to pause the trainer")
            wait_until(lambda: b"trainer" in state.read_bytes() if state.exists() else False, 10,
                       "the journal to list the trainer")
            before = file_state(state)
            second_argv = n.argv(free_port(), second, f"--policy={policy_file(second)}",
                                 f"--lock-file={second / 'agent.lock'}", f"--state-file={state}")
            started = time.monotonic()
            try:
                done = subprocess.run(second_argv, env=n.env, capture_output=True, text=True, timeout=30,
                                      check=False)
            except subprocess.TimeoutExpired as err:
                raise AssertionError("the second agent ran on the first one's state file") from err
            took = time.monotonic() - started
            assert done.returncode != 0, done.stderr
            assert str(state) in done.stderr and "--state-file" in done.stderr, done.stderr
            assert f"pid {agent.pid}" in done.stderr, done.stderr
            assert done.stderr.count("Error:") == 1, done.stderr
            assert took < 15
            assert file_state(state) == before, "the second agent touched the journal"
            assert not (second / "audit.jsonl").exists()
            assert is_frozen(n.trainer)
            assert sample(scrape(port), "gpuwatch_enforce_paused", pod="trainer-0") == 1
            stop_within(agent, SIGTERM_BUDGET_S, first / "agent.log")
        assert not is_frozen(n.trainer)
