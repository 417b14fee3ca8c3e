"""`gpuwatch agent` under abuse and faults (issue 13, items 1, 2 and 6), as real processes.

* One agent per node: a second agent -- same state file, or another one -- exits at once
  naming the holder's pid, and touches nothing (the paused pod stays paused, the state
  file and the audit log are unchanged, the first agent still reports the pod paused). An
  agent for a second simulated node on the same machine (its own --lock-file) neither thaws
  the first agent's pod at start nor takes it over, so its SIGTERM leaves it frozen.
* Enforcement state that cannot strand a pod: the agent that paused the pod is killed
  (SIGKILL), its state file is deleted / garbage / the wrong shape / names an unknown
  mechanism; the next agent (even without --policy) thaws the pod at start, moves a broken
  file aside, audits and counts the thaw.
* Policy reads that cannot hang or flood: the policy replaced by a FIFO, by a 10 MB file,
  by a symlink to /dev/zero -- the running policy is kept and SIGTERM ends the agent within
  2 s; SIGTERM while a 1 MiB policy is still being parsed at start also ends it within 2 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwatch.enforce.audit import read_audit
from gpuwatch.sim import demo
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.conftest import need_binary, need_root
from tests.system.promstack import free_port
from tests.system.test_agent import (
    PAUSE_TRAINER,
    agent_argv,
    is_frozen,
    running_agent,
    sample,
    scrape,
    sim_node,
    wait_until,
)

pytestmark = [pytest.mark.root]

TRAINER = next(w for w in demo.DEFAULT_WORKLOADS if w.pod == "trainer-0")
SIGTERM_BUDGET_S = 2.0


@dataclass
class Node:
    sim: simnode.SimNode
    base: Path
    trainer: RunningContainer | None
    env: dict[str, str]

    def argv(self, port: int, tmp: Path, *extra: str) -> list[str]:
        return agent_argv(self.sim, self.base, port, tmp, "--no-probes", "--kmsg=none", "--no-network", *extra)


@contextmanager
def node(tmp_path: Path, with_trainer: bool = True) -> Iterator[Node]:
    need_root()
    need_binary("runc", "runc")
    with ExitStack() as stack:
        sim = stack.enter_context(sim_node(tmp_path / "node"))
        trainer = None
        if with_trainer:
            lab = stack.enter_context(ContainerLab(**demo.default_lab_dirs(tmp_path / "node")))
            (trainer,) = demo.start_workloads(lab, sim, workloads=(TRAINER,))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUWATCH_SIM_STATE": str(sim.state_path)}
        yield Node(sim, tmp_path / "node", trainer, env)


def policy_file(tmp: Path, text: str = PAUSE_TRAINER) -> Path:
    path = tmp / "policy.yaml"
    path.write_text(text)
    return path


def stop_within(proc: subprocess.Popen[bytes], budget_s: float, log: Path) -> float:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=budget_s + 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"SIGTERM did not end the agent:\n{log.read_text()[-3000:]}") from None
    took = time.monotonic() - started
    print(f"SIGTERM -> exit in {took:.2f}s")
    assert rc == 0, log.read_text()[-3000:]
    assert took < budget_s, f"SIGTERM took {took:.2f}s (budget {budget_s}s)"
    return took


def file_state(path: Path) -> tuple[bytes, int, int] | None:
    if not path.exists():
        return None
    st = path.stat()
    return path.read_bytes(), st.st_mtime_ns, st.st_ino


# -- item 1: one agent per node -------------------------------------------------------------------

def test_second_agent_exits_at_once_and_touches_nothing(tmp_path: Path) -> None:
    with node(tmp_path) as n:
        assert n.trainer is not None
        first = tmp_path / "first"
        first.mkdir()
        port = free_port()
        lock = tmp_path / "agent.lock"
        argv = n.argv(port, first, f"--policy={policy_file(first)}", f"--lock-file={lock}")
        with running_agent(argv, n.env, first / "agent.log", port) as agent:
            wait_until(lambda: is_frozen(n.trainer), 30, "the first agent to pause the trainer")
            wait_until(lambda: sample(scrape(port), "gpuwatch_enforce_paused", pod="trainer-0") == 1, 10,
                       "the first agent to report the pause")
            before = {p: file_state(p) for p in (first / "frozen.json", first / "audit.jsonl")}
            assert before[first / "frozen.json"] is not None
            second = tmp_path / "second"
            second.mkdir()
            variants = {
                # the case: same state file (and the busy port)
                "same state file": n.argv(port, first, f"--policy={policy_file(second)}", f"--lock-file={lock}"),
                # another state file, audit log and port: the node is still the same
                "other state file": n.argv(free_port(), second, f"--policy={policy_file(second)}",
                                           f"--lock-file={lock}"),
            }
            for what, second_argv in variants.items():
                started = time.monotonic()
                done = subprocess.run(second_argv, env=n.env, capture_output=True, text=True, timeout=60, check=False)
                took = time.monotonic() - started
                assert done.returncode != 0, (what, done.stderr)
                assert f"another gpuwatch agent is already running on this node (pid {agent.pid}" in done.stderr, (
                    what, done.stderr)
                assert f"ps -o pid,args -p {agent.pid}" in done.stderr
                assert done.stderr.count("Error:") == 1, done.stderr
                assert "recover" not in done.stderr and "thaw" not in done.stderr, done.stderr
                assert took < 15, f"{what}: the second agent took {took:.1f}s to give up"
                assert is_frozen(n.trainer), f"{what}: the second agent thawed the first one's pod"
                assert {p: file_state(p) for p in before} == before, f"{what}: a file was touched"
                assert not (second / "frozen.json").exists() and not (second / "audit.jsonl").exists()
                assert sample(scrape(port), "gpuwatch_enforce_paused", pod="trainer-0") == 1
            assert agent.poll() is None
            stop_within(agent, SIGTERM_BUDGET_S, first / "agent.log")
        assert not is_frozen(n.trainer), "SIGTERM thaws what the agent froze"


def test_agent_of_another_simulated_node_never_thaws_or_takes_over(tmp_path: Path) -> None:
    """Two agents that each hold their own lock (two simulated nodes on one machine), both
    with the policy that pauses the trainer: the second neither thaws the first one's pod at
    start (the freeze marker names a live agent) nor takes it over, so its SIGTERM leaves
    the pod frozen; the first one's SIGTERM thaws it."""
    with node(tmp_path) as n:
        assert n.trainer is not None
        first, other = tmp_path / "first", tmp_path / "other"
        first.mkdir()
        other.mkdir()
        port, port2 = free_port(), free_port()
        argv = n.argv(port, first, f"--policy={policy_file(first)}", f"--lock-file={first / 'agent.lock'}")
        with running_agent(argv, n.env, first / "agent.log", port) as agent:
            wait_until(lambda: is_frozen(n.trainer), 30, "the first agent to pause the trainer")
            argv2 = n.argv(port2, other, f"--policy={policy_file(other)}", f"--lock-file={other / 'agent.lock'}")
            with running_agent(argv2, n.env, other / "agent.log", port2) as agent2:
                wait_until(lambda: any(r["action"] == "pause" for r in read_audit(other / "audit.jsonl"))
                           if (other / "audit.jsonl").exists() else False, 30, "the other agent to try a pause")
                assert is_frozen(n.trainer)
                tried = [r for r in read_audit(other / "audit.jsonl") if r["action"] == "pause"]
                assert tried[0]["result"] == "failed"
                assert f"held frozen by another gpuwatch agent (pid {agent.pid}" in str(tried[0]["detail"])
                stop_within(agent2, SIGTERM_BUDGET_S, other / "agent.log")
            assert is_frozen(n.trainer), "the other agent's SIGTERM thawed a pod the first one holds"
            # only the trainer's record: cgroups other tests of the run froze and still hold (a live
            # owner) are left alone too, and are not this test's business
            trainer_path = n.trainer.cgroup_path.rstrip("/")
            recovery = [r for r in read_audit(other / "audit.jsonl") if r["event"] == "recovery"
                        and str(r["target"]["cgroup_path"]).rstrip("/").endswith(trainer_path)]
            assert [(r["action"], r["result"]) for r in recovery] == [("leave", "skipped")], recovery
            assert f"a live gpuwatch agent holds it (pid {agent.pid}" in str(recovery[0]["reason"])
            stop_within(agent, SIGTERM_BUDGET_S, first / "agent.log")
        assert not is_frozen(n.trainer)


# -- item 2: a killed agent's pod is thawed by the next one, whatever the state file says ----------

BROKEN_STATE = {
    "deleted": None,
    "empty": b"",
    "garbage": b"\x00\x01 not json",
    "list": b"[]",
    "frozen-int": b'{"frozen": 5}',
    "missing-key": b'{"frozen": [{"mechanism": "v2"}]}',
    "non-numeric-time": b'{"frozen": [{"cgroup_path": "/x", "mechanism": "v2", "reason": "", "since_s": "soon"}]}',
    "unknown-mechanism": "unknown",
}


def test_killed_agents_pod_is_thawed_whatever_the_state_file_says(tmp_path: Path) -> None:
    with node(tmp_path) as n:
        assert n.trainer is not None
        lock = tmp_path / "agent.lock"
        for round_, (what, content) in enumerate(BROKEN_STATE.items()):
            run = tmp_path / f"round{round_}"
            run.mkdir()
            state = run / "frozen.json"
            port = free_port()
            argv = n.argv(port, run, f"--policy={policy_file(run)}", f"--lock-file={lock}")
            with running_agent(argv, n.env, run / "agent.log", port) as agent:
                wait_until(lambda: is_frozen(n.trainer), 30, f"{what}: the agent to pause the trainer")
                agent.kill()  # a crash: no thaw
                agent.wait()
            assert is_frozen(n.trainer), "the killed agent left the pod frozen"
            assert stat_mode(state) == 0o600
            if content is None:
                state.unlink()
            elif content == "unknown":
                data = json.loads(state.read_text())
                data["frozen"][0]["mechanism"] = "cgroup-v9"
                state.write_text(json.dumps(data))
            else:
                assert isinstance(content, bytes)
                state.write_bytes(content)
            # the next agent, without a policy: recovery does not need one
            port = free_port()
            started = time.monotonic()
            with running_agent(n.argv(port, run, f"--lock-file={lock}"), n.env, run / "next.log", port) as nxt:
                assert not is_frozen(n.trainer), f"{what}: the next agent did not thaw the pod\n" + (
                    run / "next.log").read_text()[-3000:]
                text = scrape(port)
                assert sample(text, "gpuwatch_recovery_actions_total", action="thaw", result="ok") == 1, what
                stop_within(nxt, SIGTERM_BUDGET_S, run / "next.log")
            assert time.monotonic() - started < 30
            records = [r for r in read_audit(run / "audit.jsonl") if r["event"] == "recovery"]
            thaws = [r for r in records if r["action"] == "thaw"]
            assert [(r["result"], r["target"]["cgroup_path"]) for r in thaws] == [  # type: ignore[index]
                ("ok", n.trainer.cgroup_path)], (what, records)
            broken = content not in (None, "unknown")
            assert (run / "frozen.json.bad").exists() == broken, what
            assert any(r["action"] == "move-aside" for r in records) == broken, what
            if broken:
                assert (run / "frozen.json.bad").read_bytes() == content
            log = (run / "next.log").read_text()
            assert "Traceback" not in log, log
            # the trainer runs again: the next round's agent pauses it afresh


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


# -- item 6: policy reads that cannot hang or flood ------------------------------------------------

def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.parametrize("kind", ["fifo", "10MB", "dev-zero"])
def test_bad_policy_replacement_keeps_running_and_sigterm_ends_within_2s(tmp_path: Path, kind: str) -> None:
    with node(tmp_path, with_trainer=False) as n:
        port = free_port()
        policy = policy_file(tmp_path, PAUSE_TRAINER)
        argv = n.argv(port, tmp_path, f"--policy={policy}", f"--lock-file={tmp_path / 'agent.lock'}")
        log = tmp_path / "agent.log"
        with running_agent(argv, n.env, log, port) as agent:
            rss_before = rss_mib(agent.pid)
            policy.unlink()
            if kind == "fifo":
                os.mkfifo(policy)
            elif kind == "10MB":
                policy.write_bytes(b"# padding\n" * (1 << 20))
            else:
                policy.symlink_to("/dev/zero")
            agent.send_signal(signal.SIGHUP)  # and the mtime/inode changed: either triggers a reload
            wait_until(lambda: "refusing to read policy file" in log.read_text(), 15, "the reload to be refused")
            # The interval poll may see the new file before the SIGHUP lands (the 10 MB write takes
            # a while), and a SIGHUP that arrives while that read runs asks for one more: one or two
            # refusals are both right. What must not happen is a retry of the same file every interval.
            time.sleep(1.0)
            failures = sample(scrape(port), "gpuwatch_policy_reloads_total", result="failure")
            assert failures in (1, 2)
            time.sleep(5 * 0.5)  # five more --interval=0.5 snapshots
            assert sample(scrape(port), "gpuwatch_policy_reloads_total", result="failure") == failures, \
                "the same refused file was read again on later intervals"
            assert sample(scrape(port), "gpuwatch_policy_reloads_total", result="success") == 1  # the start
            assert rss_mib(agent.pid) < rss_before + 20, "the refused file was read into memory"
            stop_within(agent, SIGTERM_BUDGET_S, log)


def big_valid_policy(path: Path, target_bytes: int = 1000 * 1024) -> None:
    lines = ["version: 1", "rules:"]
    size = sum(len(x) + 1 for x in lines)
    i = 0
    while size < target_bytes - 200:
        rule = [f"  - name: r{i}", f"    match: {{namespace: ns{i}}}", "    limits: {gpu_memory: 8GiB}",
                "    actions:", "      - {do: alert, at: 100%}"]
        lines += rule
        size += sum(len(x) + 1 for x in rule)
        i += 1
    lines += ["  - name: d", "    match: {default: true}", "    limits: {gpu_memory: 8GiB}", "    actions:",
              "      - {do: alert, at: 100%}"]
    path.write_text("\n".join(lines) + "\n")


def test_sigterm_while_a_large_policy_parses_at_start(tmp_path: Path) -> None:
    """A valid policy just under 1 MiB takes seconds to parse: the agent parses it in a
    worker while the rest starts and still ends within 2 s of SIGTERM."""
    with node(tmp_path, with_trainer=False) as n:
        policy = tmp_path / "policy.yaml"
        big_valid_policy(policy)
        port = free_port()
        argv = n.argv(port, tmp_path, f"--policy={policy}", f"--lock-file={tmp_path / 'agent.lock'}")
        log = tmp_path / "agent.log"
        with log.open("wb") as out:
            agent = subprocess.Popen(argv, env=n.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            # the exporter starts once the enforcer has its policy: wait for the step before
            wait_until(lambda: "probes disabled" in log.read_text() or agent.poll() is not None, 30,
                       "the agent to start")
            time.sleep(0.5)
            assert agent.poll() is None, log.read_text()
            assert "enforcer on" not in log.read_text(), "the policy parsed faster than expected: test proves nothing"
            stop_within(agent, SIGTERM_BUDGET_S, log)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def test_sigterm_while_a_large_policy_reloads(tmp_path: Path) -> None:
    """The same 1 MiB policy as a reload: the agent keeps running with the old policy
    meanwhile and SIGTERM during the parse still ends it within 2 s."""
    with node(tmp_path, with_trainer=False) as n:
        policy = policy_file(tmp_path, PAUSE_TRAINER)
        port = free_port()
        argv = n.argv(port, tmp_path, f"--policy={policy}", f"--lock-file={tmp_path / 'agent.lock'}")
        log = tmp_path / "agent.log"
        with running_agent(argv, n.env, log, port) as agent:
            big = tmp_path / "big.yaml"
            big_valid_policy(big)
            os.replace(big, policy)
            agent.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            assert "policy reloaded" not in log.read_text(), "parsed faster than expected: test proves nothing"
            scrape(port)  # still serving while the worker parses
            stop_within(agent, SIGTERM_BUDGET_S, log)


@pytest.mark.parametrize("kind", ["fifo", "10MB", "dev-zero", "directory"])
def test_bad_policy_at_start_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    with node(tmp_path, with_trainer=False) as n:
        policy = tmp_path / "policy.yaml"
        if kind == "fifo":
            os.mkfifo(policy)
        elif kind == "10MB":
            policy.write_bytes(b"# padding\n" * (1 << 20))
        elif kind == "dev-zero":
            policy.symlink_to("/dev/zero")
        else:
            policy.mkdir()
        argv = n.argv(free_port(), tmp_path, f"--policy={policy}", f"--lock-file={tmp_path / 'agent.lock'}")
        started = time.monotonic()
        done = subprocess.run(argv, env=n.env, capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode != 0
        # (click itself refuses a directory given as --policy)
        expect = "is a directory" if kind == "directory" else "refusing to read policy file"
        assert expect in done.stderr, done.stderr[-3000:]
        assert time.monotonic() - started < 15
