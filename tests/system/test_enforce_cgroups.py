"""Enforcement on real cgroups with real processes (root): pause/resume (v2 and the v1
freezer fallback), kill, checkpoint-then-kill, throttle accuracy, dry run, protected and
own targets, close() thaws everything, crash recovery from the state file, policy-path
latency."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.enforce.actions import Status
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.cgroup_ops import V1_FREEZER, V2, CgroupTree
from gpuwatch.enforce.control import FreezeControl, cgroup_cpu_busy
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.freeze.frozen_state import FrozenRegistry
from tests.enforcer_setup import enforcer_for
from tests.system.enforce_lab import GIB, CgroupLab, Worker, identity, snapshot

pytestmark = [pytest.mark.root]

PAUSE_POLICY = """
tuning: {release_after: 0s, min_hold: 0s}
rules:
  - name: lab-pause
    match: {namespace: lab}
    limits: {gpu_memory: 1GiB}
    actions:
      - {do: pause, at: 100%}
"""


@pytest.fixture
def lab(root_required: None, tmp_path: Path) -> Iterator[CgroupLab]:
    lab = CgroupLab(tmp_path)
    try:
        yield lab
    finally:
        lab.cleanup()


def write_policy(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def make_enforcer(tmp_path: Path, text: str, **kwargs: object) -> Enforcer:
    return enforcer_for(write_policy(tmp_path, text), tmp_path, busy_source=cgroup_cpu_busy, **kwargs)


def progresses(worker: Worker, seconds: float = 0.4) -> bool:
    before_count, before_cpu = worker.progress(), worker.cpu_seconds()
    time.sleep(seconds)
    return worker.progress() > before_count and worker.cpu_seconds() > before_cpu


def test_pause_stops_progress_and_release_resumes(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("a")
    worker = lab.spawn(path)
    who = identity(path, "a")
    enforcer = make_enforcer(tmp_path, PAUSE_POLICY)
    try:
        decisions = enforcer.on_snapshot(snapshot((who, 2 * GIB)))
        assert [d.verb.value for d in decisions] == ["pause"]
        assert enforcer.last_outcomes[0].result.status is Status.OK
        assert "v2" in enforcer.last_outcomes[0].result.detail
        time.sleep(0.1)
        assert not progresses(worker), "a paused worker must not make progress"
        assert path in json.loads((tmp_path / "frozen.json").read_text())["frozen"][0]["cgroup_path"]
        decisions = enforcer.on_snapshot(snapshot((who, GIB // 2)))
        assert [d.verb.value for d in decisions] == ["release"]
        assert progresses(worker)
        assert json.loads((tmp_path / "frozen.json").read_text())["frozen"] == []
    finally:
        enforcer.close()
    records = read_audit(tmp_path / "audit.jsonl")
    assert [(r["action"], r["result"]) for r in records] == [("pause", "ok"), ("release", "ok")]
    assert records[0]["target"]["cgroup_path"] == path and records[0]["rule"] == "lab-pause"  # type: ignore[index]
    assert records[0]["measured"]["memory_bytes"] == 2 * GIB  # type: ignore[index]


def test_v1_freezer_fallback(lab: CgroupLab, tmp_path: Path) -> None:
    if lab.v1_root is None:
        pytest.skip("pure cgroup v2 host: no v1 freezer to fall back to")
    path = lab.make("v1only", tree="v1")
    worker = lab.spawn(path, tree="v1")
    tree = CgroupTree()
    handle = tree.handle(path)
    assert handle.mechanism() == V1_FREEZER
    control = FreezeControl(tree, FrozenRegistry(tree, tmp_path / "frozen.json"))
    try:
        assert control.pause(path, "test") == V1_FREEZER
        time.sleep(0.1)
        assert handle.is_frozen() and not progresses(worker)
    finally:
        control.close()
    assert not handle.is_frozen() and progresses(worker)


def test_v2_is_preferred_when_it_holds_the_processes(lab: CgroupLab) -> None:
    path = lab.make("both")
    lab.spawn(path)
    assert CgroupTree().handle(path).mechanism() == V2


def test_kill_removes_every_process(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("k")
    workers = [lab.spawn(path), lab.spawn(path)]
    enforcer = make_enforcer(tmp_path, PAUSE_POLICY.replace("do: pause", "do: kill"))
    try:
        enforcer.on_snapshot(snapshot((identity(path, "k"), 2 * GIB)))
        assert enforcer.last_outcomes[0].result.status is Status.OK
        for worker in workers:
            worker.popen.wait(3)
        assert CgroupTree().handle(path).pids() == []
    finally:
        enforcer.close()


def test_checkpoint_signal_arrives_before_the_kill(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("ckpt")
    worker = lab.spawn(path)  # writes its marker on SIGUSR1 and keeps running
    policy = PAUSE_POLICY.replace("{do: pause, at: 100%}", "{do: checkpoint-then-kill, at: 100%, grace: 1s}")
    enforcer = make_enforcer(tmp_path, policy)
    try:
        sent = time.time()
        enforcer.on_snapshot(snapshot((identity(path, "ckpt"), 2 * GIB)))
        assert enforcer.last_outcomes[0].result.status is Status.STARTED
        assert enforcer.actions.checkpoint.wait(5.0)
        worker.popen.wait(3)
        assert worker.popen.returncode == -signal.SIGKILL
        marker_time = float(worker.marker.read_text().split()[0])
        assert sent <= marker_time < sent + 1.0, "marker written after the signal, before the kill"
    finally:
        enforcer.close()
    records = read_audit(tmp_path / "audit.jsonl")
    assert [(r["event"], r["result"]) for r in records] == [("decision", "started"), ("completed", "ok")]
    assert "killed 1 after grace" in str(records[1]["detail"])


def test_checkpoint_exiting_worker_is_not_killed(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("ckpt2")
    worker = lab.spawn(path, exit_on_signal=True, checkpoint_signal=signal.SIGTERM)
    policy = PAUSE_POLICY.replace(
        "{do: pause, at: 100%}", "{do: checkpoint-then-kill, at: 100%, grace: 5s, signal: SIGTERM}"
    )
    enforcer = make_enforcer(tmp_path, policy)
    try:
        enforcer.on_snapshot(snapshot((identity(path, "ckpt2"), 2 * GIB)))
        assert enforcer.actions.checkpoint.wait(6.0)
        assert worker.popen.wait(3) == 0 and worker.marker.exists()
    finally:
        enforcer.close()
    assert "exited within the grace period" in str(read_audit(tmp_path / "audit.jsonl")[-1]["detail"])


def test_pause_then_checkpoint_thaws_first_so_the_signal_is_handled(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("pk")
    worker = lab.spawn(path)
    policy = PAUSE_POLICY.replace(
        "      - {do: pause, at: 100%}",
        "      - {do: pause, at: 100%}\n      - {do: checkpoint-then-kill, at: 100%, for: 1s, grace: 1s}",
    )
    enforcer = make_enforcer(tmp_path, policy)
    who = identity(path, "pk")
    try:
        t0 = time.time()
        assert [d.verb.value for d in enforcer.on_snapshot(snapshot((who, 2 * GIB), t=t0))] == ["pause"]
        assert not progresses(worker, 0.3)
        time.sleep(max(t0 + 1.05 - time.time(), 0.0))
        decisions = enforcer.on_snapshot(snapshot((who, 2 * GIB)))
        assert [d.verb.value for d in decisions] == ["checkpoint-then-kill"]
        assert enforcer.actions.checkpoint.wait(5.0)
        worker.popen.wait(3)
        assert worker.marker.exists(), "the frozen worker was thawed and handled the checkpoint signal"
    finally:
        enforcer.close()


def test_dry_run_changes_nothing(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("dry")
    worker = lab.spawn(path)
    policy = PAUSE_POLICY.replace("{do: pause, at: 100%}", "{do: kill, at: 100%}")
    enforcer = make_enforcer(tmp_path, policy, dry_run=True)
    try:
        decisions = enforcer.on_snapshot(snapshot((identity(path, "dry"), 2 * GIB)))
        assert [d.verb.value for d in decisions] == ["kill"]
        assert worker.alive() and progresses(worker)
        assert not CgroupTree().handle(path).is_frozen()
    finally:
        enforcer.close()
    (record,) = read_audit(tmp_path / "audit.jsonl")
    assert record["dry_run"] is True and record["result"] == "dry_run" and record["action"] == "kill"
    assert not (tmp_path / "frozen.json").exists() or json.loads((tmp_path / "frozen.json").read_text())["frozen"] == []


def test_protected_namespace_and_own_cgroup_never_touched(lab: CgroupLab, tmp_path: Path) -> None:
    sys_path, own_path = lab.make("sys"), lab.make("own")
    sys_worker, own_worker = lab.spawn(sys_path), lab.spawn(own_path)
    policy = """
rules:
  - name: everyone
    match: {default: true}
    limits: {gpu_memory: 1GiB}
    actions: [{do: kill}]
"""
    enforcer = enforcer_for(write_policy(tmp_path, policy), tmp_path, own_cgroups=frozenset({own_path}))
    try:
        for _ in range(3):
            enforcer.on_snapshot(
                snapshot(
                    (identity(sys_path, "coredns", "kube-system"), 8 * GIB), (identity(own_path, "agent"), 8 * GIB)
                )
            )
            time.sleep(0.05)
        assert sys_worker.alive() and own_worker.alive()
        assert progresses(sys_worker) and progresses(own_worker)
    finally:
        enforcer.close()
    records = read_audit(tmp_path / "audit.jsonl")
    assert [(r["target"]["cgroup_path"], r["result"]) for r in records] == [(own_path, "suppressed")]  # type: ignore[index]
    assert "contains the agent itself" in str(records[0]["suppressed"])


def test_close_thaws_paused_and_throttled(lab: CgroupLab, tmp_path: Path) -> None:
    paths = [lab.make("c1"), lab.make("c2")]
    workers = [lab.spawn(p) for p in paths]
    tree = CgroupTree()
    control = FreezeControl(tree, FrozenRegistry(tree, tmp_path / "frozen.json"), cgroup_cpu_busy)
    control.pause(paths[0], "test")
    control.throttle("k", paths[1], 0.1, "test")
    time.sleep(0.3)
    assert not progresses(workers[0], 0.2)
    thawed = control.close()
    assert sorted(thawed) == sorted(paths)
    assert all(not tree.handle(p).is_frozen() for p in paths)
    assert all(progresses(w) for w in workers)
    assert json.loads((tmp_path / "frozen.json").read_text())["frozen"] == []


CRASHER = r"""
import os, sys
from pathlib import Path
from tests.enforcer_setup import enforcer_for
from tests.system.enforce_lab import identity, snapshot, GIB
tmp, path = Path(sys.argv[1]), sys.argv[2]
enforcer = enforcer_for(tmp / "policy.yaml", tmp)
enforcer.on_snapshot(snapshot((identity(path, "crash"), 2 * GIB)))
os._exit(3)  # crash: no close(), no atexit
"""


def test_crash_recovery_thaws_from_state_file(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("crash")
    worker = lab.spawn(path)
    write_policy(tmp_path, PAUSE_POLICY)
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", CRASHER, str(tmp_path), path], cwd=repo, timeout=30)
    assert done.returncode == 3
    handle = CgroupTree().handle(path)
    assert handle.is_frozen() and not progresses(worker, 0.3), "the crashed agent left it frozen"
    enforcer = make_enforcer(tmp_path, PAUSE_POLICY)
    try:
        assert enforcer.recovered == [path]
        assert not handle.is_frozen() and progresses(worker)
    finally:
        enforcer.close()


def test_throttle_accuracy_table(lab: CgroupLab, tmp_path: Path) -> None:
    """Closed-loop freeze/thaw duty cycle vs the worker's own CPU time (the simulated
    node's kernels burn CPU, so this is the GPU-time share the sim would report)."""
    path = lab.make("thr")
    worker = lab.spawn(path)
    tree = CgroupTree()
    control = FreezeControl(
        tree,
        FrozenRegistry(tree, tmp_path / "frozen.json"),
        cgroup_cpu_busy,
        throttle_period_s=0.1,
        throttle_control_s=0.25,
    )
    rows = []
    try:
        for share in (0.25, 0.50, 0.75):
            control.throttle("thr", path, share, "accuracy")
            time.sleep(2.0)
            cpu0, t0 = worker.cpu_seconds(), time.monotonic()
            time.sleep(3.5)
            measured = (worker.cpu_seconds() - cpu0) / (time.monotonic() - t0)
            rows.append((share, measured))
            control.stop_throttle(path)
    finally:
        control.close()
    print("\nthrottle accuracy (freeze/thaw duty cycle, closed loop, period 100 ms)")
    print("target  measured  error(points)")
    for share, measured in rows:
        print(f"{share:6.0%}  {measured:8.1%}  {100 * (measured - share):+6.1f}")
    for share, measured in rows:
        assert abs(measured - share) <= 0.05, f"target {share:.0%}, measured {measured:.1%}"


def test_polling_path_latency(lab: CgroupLab, tmp_path: Path) -> None:
    """Time from a snapshot showing the violation to the container being frozen."""
    path = lab.make("lat")
    lab.spawn(path)
    enforcer = make_enforcer(tmp_path, PAUSE_POLICY)
    who = identity(path, "lat")
    latencies = []
    try:
        for i in range(5):
            t0 = time.perf_counter()
            enforcer.on_snapshot(snapshot((who, 2 * GIB)))
            latencies.append(time.perf_counter() - t0)
            assert CgroupTree().handle(path).is_frozen()
            enforcer.on_snapshot(snapshot((who, 0)))
            assert not CgroupTree().handle(path).is_frozen(), f"round {i}"
    finally:
        enforcer.close()
    latencies.sort()
    print(
        f"\npolling path: snapshot -> frozen in {latencies[len(latencies) // 2] * 1e3:.2f} ms median, "
        f"{latencies[-1] * 1e3:.2f} ms max (plus up to one sample interval to see the violation)"
    )
    assert latencies[-1] < 0.5


def test_throttle_with_stepwise_busy_source(lab: CgroupLab, tmp_path: Path) -> None:
    """Like the agent's default source: kernel seconds from the latest snapshot, updated
    once per sample interval (here 0.5 s) — the loop must still hold the share."""
    path = lab.make("step")
    worker = lab.spawn(path)
    tree = CgroupTree()
    handle = tree.handle(path)
    sampled = {"busy": handle.cpu_seconds()}
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(0.5):
            sampled["busy"] = handle.cpu_seconds()

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    control = FreezeControl(
        tree,
        FrozenRegistry(tree, tmp_path / "frozen.json"),
        lambda _k, _h: lambda: sampled["busy"],
        throttle_control_s=0.1,
    )
    try:
        control.throttle("step", path, 0.4, "stepwise")
        time.sleep(3.0)
        cpu0, t0 = worker.cpu_seconds(), time.monotonic()
        time.sleep(4.0)
        measured = (worker.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    finally:
        stop.set()
        control.close()
    print(f"\nstepwise source (0.5 s samples): target 40%, measured {measured:.1%}")
    assert abs(measured - 0.4) <= 0.05


def test_release_never_thaws_what_someone_else_froze(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("foreign")
    worker = lab.spawn(path)
    tree = CgroupTree()
    handle = tree.handle(path)
    handle.set_frozen(True)  # e.g. `docker pause` by an operator
    control = FreezeControl(tree, FrozenRegistry(tree, tmp_path / "frozen.json"))
    try:
        assert control.release(path) is False
        assert control.close() == []
        assert handle.is_frozen() and not progresses(worker, 0.3)
    finally:
        handle.set_frozen(False)


SIGTERMED = r"""
import sys, time
from pathlib import Path
from gpuwatch.enforce.enforcer import install_exit_handlers
from tests.enforcer_setup import enforcer_for
from tests.system.enforce_lab import identity, snapshot, GIB
tmp, path = Path(sys.argv[1]), sys.argv[2]
enforcer = enforcer_for(tmp / "policy.yaml", tmp)
install_exit_handlers(enforcer)
enforcer.on_snapshot(snapshot((identity(path, "term"), 2 * GIB)))
print("paused", flush=True)
time.sleep(60)
"""


def test_sigterm_thaws_through_the_exit_handler(lab: CgroupLab, tmp_path: Path) -> None:
    path = lab.make("term")
    worker = lab.spawn(path)
    write_policy(tmp_path, PAUSE_POLICY)
    repo = Path(__file__).resolve().parents[2]
    agent = subprocess.Popen(
        [sys.executable, "-c", SIGTERMED, str(tmp_path), path], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "paused"
        handle = CgroupTree().handle(path)
        assert handle.is_frozen() and not progresses(worker, 0.3)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(10) == 128 + signal.SIGTERM
        assert not handle.is_frozen() and progresses(worker)
        assert json.loads((tmp_path / "frozen.json").read_text())["frozen"] == []
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(5)
