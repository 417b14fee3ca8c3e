"""Enforcement state that cannot strand a pod (issue 13, item 2), on fixture cgroup trees
without root: the freeze marker on the cgroup is the truth, the state file a journal.

A state file of any wrong shape is moved aside and ignored (never fatal) while the markers
still find what to thaw; an unknown mechanism thaws both freezers; a live agent's marker is
left alone and never taken over; every step is reported, audited and counted; the journal
and the audit log are created 0600/0640 without following symlinks. Also the node lock."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuwatch.agent.nodelock import AgentAlreadyRunning, NodeLock, read_holder_pid
from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.audit import AuditLog, read_audit
from gpuwatch.enforce.cgroup_ops import V1_FREEZER, V2, CgroupTree
from gpuwatch.enforce.control import FreezeControl
from gpuwatch.enforce.enforcer import Enforcer, EnforcerConfig
from gpuwatch.enforce.freeze.frozen_state import FrozenRegistry, RecoveryAction, parse_journal
from gpuwatch.enforce.freeze.markers import (
    LIVE_OTHER,
    MINE,
    STALE,
    UNKNOWN_OTHER,
    Marker,
    MarkerOwner,
    XattrMarkers,
    classify,
)
from gpuwatch.enforce.freeze.recovery import RecoveryMetrics, recover_node

PATH = "/kubepods/pod-a/c1"


class DictMarkers:
    """The MarkerStore protocol over a dict (xattrs need root on some filesystems)."""

    def __init__(self) -> None:
        self.values: dict[Path, bytes] = {}

    def get(self, directory: Path) -> bytes | None:
        return self.values.get(directory) if directory.is_dir() else None

    def set(self, directory: Path, value: bytes) -> None:
        if not directory.is_dir():
            raise FileNotFoundError(directory)
        self.values[directory] = value

    def remove(self, directory: Path) -> None:
        self.values.pop(directory, None)


class Node:
    """A fixture node: v2 tree and v1 freezer tree under tmp, one frozen cgroup in each."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.v2 = tmp / "unified"
        self.v1 = tmp / "freezer"
        self.tree = CgroupTree(v2_root=self.v2, v1_freezer_root=self.v1, autodetect=False)
        self.markers = DictMarkers()
        self.state = tmp / "run" / "frozen.json"
        self.state.parent.mkdir()

    def cgroup(self, path: str = PATH, v2: str | None = "1", v1: str | None = None) -> str:
        if v2 is not None:
            d = self.v2 / path.lstrip("/")
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup.freeze").write_text(v2)
            (d / "cgroup.procs").write_text("")
        if v1 is not None:
            d = self.v1 / path.lstrip("/")
            d.mkdir(parents=True, exist_ok=True)
            (d / "freezer.state").write_text(v1)
            (d / "cgroup.procs").write_text("")
        return path

    def v2_frozen(self, path: str = PATH) -> bool:
        return (self.v2 / path.lstrip("/") / "cgroup.freeze").read_text().strip() == "1"

    def v1_frozen(self, path: str = PATH) -> bool:
        return (self.v1 / path.lstrip("/") / "freezer.state").read_text().strip() != "THAWED"

    def registry(self, owner: MarkerOwner | None = None) -> FrozenRegistry:
        return FrozenRegistry(self.tree, self.state, owner=owner or MarkerOwner.current(self.tmp / "agent.lock"),
                              markers=self.markers)

    def mark_by(self, owner: MarkerOwner, path: str = PATH, tree: str = V2) -> None:
        root = self.v2 if tree == V2 else self.v1
        self.markers.values[root / path.lstrip("/")] = Marker(owner, tree, "rule: over limit", 1.0).encode()


def dead_owner(lock: str | None = None) -> MarkerOwner:
    """The owner record of a process that has exited."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    me = MarkerOwner.current()
    return MarkerOwner(int(proc.stdout), 12345, me.pidns, lock)


def live_owner(lock: str | None = "/run/other/agent.lock") -> MarkerOwner:
    parent = MarkerOwner.current()
    return MarkerOwner(os.getppid(), None, parent.pidns, lock)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


# -- the journal --------------------------------------------------------------------------

WRONG_SHAPES = {
    "list": b"[]",
    "frozen-int": b'{"frozen": 5}',
    "missing-key": b'{"frozen": [{"mechanism": "v2"}]}',
    "missing-mechanism": b'{"frozen": [{"cgroup_path": "/kubepods/pod-a/c1"}]}',
    "non-numeric-time": b'{"frozen": [{"cgroup_path": "/kubepods/pod-a/c1", "mechanism": "v2", "since_s": "x"}]}',
    "bool-time": b'{"frozen": [{"cgroup_path": "/kubepods/pod-a/c1", "mechanism": "v2", "since_s": true}]}',
    "entry-not-object": b'{"frozen": ["/kubepods/pod-a/c1"]}',
    "root-path": b'{"frozen": [{"cgroup_path": "/", "mechanism": "v2"}]}',
    "dotdot-path": b'{"frozen": [{"cgroup_path": "/a/../..", "mechanism": "v2"}]}',
    "garbage": b"\x00\xffnot json at all",
    "empty": b"",
    "truncated": b'{"frozen": [{"cgroup_path": "/kubepods/po',
}


@pytest.mark.parametrize("raw", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_parse_journal_rejects_wrong_shapes(raw: bytes) -> None:
    with pytest.raises(ValueError):
        parse_journal(raw)


@pytest.mark.parametrize("raw", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_wrong_shape_is_moved_aside_and_the_marker_still_thaws(node: Node, raw: bytes) -> None:
    node.cgroup()
    node.mark_by(dead_owner())
    node.state.write_bytes(raw)
    steps: list[RecoveryAction] = []
    assert node.registry().recover(steps.append) == [PATH]
    assert not node.v2_frozen()
    assert node.markers.values == {}, "the marker goes with the thaw"
    assert (node.state.parent / "frozen.json.bad").read_bytes() == raw
    assert json.loads(node.state.read_text()) == {"frozen": []}
    assert [(s.action, s.result) for s in steps] == [("move-aside", "ok"), ("thaw", "ok")]
    assert steps[1].source == "marker"


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "huge"])
def test_state_path_that_is_not_a_small_regular_file_is_moved_aside(node: Node, kind: str) -> None:
    node.cgroup()
    node.mark_by(dead_owner())
    target = node.tmp / "elsewhere.json"
    target.write_text('{"frozen": []}')
    if kind == "symlink":
        node.state.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(node.state)
    elif kind == "directory":
        node.state.mkdir()
    else:
        node.state.write_bytes(b" " * (5 << 20))
    steps: list[RecoveryAction] = []
    assert node.registry().recover(steps.append) == [PATH]
    assert steps[0].action == "move-aside"
    assert not node.v2_frozen()
    assert target.read_text() == '{"frozen": []}', "a symlink's target is never written"


def test_deleted_state_file_marker_still_thaws(node: Node) -> None:
    node.cgroup()
    node.cgroup("/kubepods/pod-b/c2", v2=None, v1="FROZEN")
    node.mark_by(dead_owner())
    node.mark_by(dead_owner(), "/kubepods/pod-b/c2", tree=V1_FREEZER)
    steps: list[RecoveryAction] = []
    assert node.registry().recover(steps.append) == ["/kubepods/pod-a/c1", "/kubepods/pod-b/c2"]
    assert not node.v2_frozen() and not node.v1_frozen("/kubepods/pod-b/c2")
    assert {(s.cgroup_path, s.action, s.result, s.source) for s in steps} == {
        (PATH, "thaw", "ok", "marker"), ("/kubepods/pod-b/c2", "thaw", "ok", "marker")}


def test_unknown_mechanism_thaws_both_freezers(node: Node) -> None:
    node.cgroup(v2="1", v1="FROZEN")
    node.state.write_text(json.dumps({"frozen": [
        {"cgroup_path": PATH, "mechanism": "cgroup-v3", "reason": "x", "since_s": 1.0}]}))
    steps: list[RecoveryAction] = []
    assert node.registry().recover(steps.append) == [PATH]
    assert not node.v2_frozen() and not node.v1_frozen()
    assert steps[0].detail == "thawed via v1-freezer and v2" and steps[0].source == "journal"


def test_journal_entry_for_a_gone_cgroup_is_reported_gone(node: Node) -> None:
    node.state.write_text(json.dumps({"frozen": [{"cgroup_path": PATH, "mechanism": "v2"}]}))
    steps: list[RecoveryAction] = []
    node.registry().recover(steps.append)
    assert [(s.action, s.result) for s in steps] == [("thaw", "gone")]


def test_thaw_that_does_not_take_is_reported_failed(node: Node) -> None:
    node.cgroup()
    node.mark_by(dead_owner())
    (node.v2 / PATH.lstrip("/") / "cgroup.freeze").chmod(0o444)
    if os.access(node.v2 / PATH.lstrip("/") / "cgroup.freeze", os.W_OK):
        # root writes through 0444: replace the file with a directory so the write fails
        (node.v2 / PATH.lstrip("/") / "cgroup.freeze").unlink()
        (node.v2 / PATH.lstrip("/") / "cgroup.freeze").mkdir()
    steps: list[RecoveryAction] = []
    assert node.registry().recover(steps.append) == []
    assert steps[0].result == "failed"
    assert node.markers.values, "a failed thaw keeps its marker (the next start tries again)"


# -- whose marker ---------------------------------------------------------------------------

def test_live_agents_marker_is_left_and_never_taken_over(node: Node) -> None:
    node.cgroup()
    other = live_owner()
    node.mark_by(other)
    node.state.write_text(json.dumps({"frozen": [{"cgroup_path": PATH, "mechanism": "v2"}]}))
    registry = node.registry()
    steps: list[RecoveryAction] = []
    assert registry.recover(steps.append) == []
    assert node.v2_frozen(), "another live agent holds it"
    assert [(s.action, s.result) for s in steps] == [("leave", "skipped")]
    assert f"pid {other.pid}" in steps[0].reason
    with pytest.raises(EnforcementError, match="held frozen by another gpuwatch agent"):
        registry.mark(PATH, V2, "mine now")
    assert Marker.decode(node.markers.values[node.v2 / PATH.lstrip("/")]).owner == other  # type: ignore[union-attr]


def test_marker_under_my_lock_is_stale_even_if_its_pid_lives(node: Node) -> None:
    """A restart of the agent in a fresh pid namespace may see its old pid reused: the
    node lock I hold decides."""
    node.cgroup()
    node.mark_by(live_owner(str(node.tmp / "agent.lock")))
    assert node.registry().recover() == [PATH]
    assert not node.v2_frozen()


def test_classify() -> None:
    me = MarkerOwner.current("/run/gpuwatch/agent.lock")
    assert classify(Marker(me, V2), me) == MINE
    assert classify(None, me) == STALE  # not a value gpuwatch wrote
    assert classify(Marker(dead_owner(), V2), me) == STALE
    assert classify(Marker(live_owner(), V2), me) == LIVE_OTHER
    assert classify(Marker(live_owner(me.lock), V2), me) == STALE
    foreign = MarkerOwner(os.getppid(), None, "pid:[1]", "/other.lock")
    assert classify(Marker(foreign, V2), me) == UNKNOWN_OTHER


def test_marker_roundtrip_and_garbage() -> None:
    marker = Marker(MarkerOwner.current("/l"), V1_FREEZER, "r" * 1000, 12.5)
    back = Marker.decode(marker.encode())
    assert back is not None and back.owner == marker.owner and back.mechanism == V1_FREEZER
    assert len(back.reason) == 200 and back.since_s == 12.5
    for raw in (b"", b"x", b"[]", b'{"pid": "1"}', b'{"pid": 1, "start": "x"}'):
        assert Marker.decode(raw) is None


def test_garbage_marker_is_thawed(node: Node) -> None:
    node.cgroup()
    node.markers.values[node.v2 / PATH.lstrip("/")] = b"\x00garbage"
    assert node.registry().recover() == [PATH]


# -- marking, the journal file ----------------------------------------------------------------

def test_mark_sets_marker_and_journal_unmark_removes_both(node: Node) -> None:
    node.cgroup(v2="0")
    registry = node.registry()
    registry.mark(PATH, V2, "rule: over")
    marker = Marker.decode(node.markers.values[node.v2 / PATH.lstrip("/")])
    assert marker is not None and marker.owner.pid == os.getpid() and marker.owner.lock == str(node.tmp / "agent.lock")
    assert json.loads(node.state.read_text())["frozen"][0]["cgroup_path"] == PATH
    assert stat.S_IMODE(node.state.stat().st_mode) == 0o600
    registry.unmark(PATH)
    assert node.markers.values == {} and json.loads(node.state.read_text()) == {"frozen": []}


def test_pause_and_close_through_freeze_control(node: Node) -> None:
    node.cgroup(v2="0")
    control = FreezeControl(node.tree, node.registry())
    control.pause(PATH, "rule: over")
    assert node.v2_frozen() and node.markers.values
    assert control.close() == [PATH]
    assert not node.v2_frozen() and node.markers.values == {}


def test_journal_write_never_follows_a_planted_symlink(node: Node) -> None:
    node.cgroup(v2="0")
    victim = node.tmp / "victim"
    victim.write_text("keep")
    node.state.symlink_to(victim)
    for name in ("frozen.json.tmp", ".frozen.json.tmp"):
        (node.state.parent / name).symlink_to(victim)
    node.registry().mark(PATH, V2, "r")
    assert victim.read_text() == "keep"
    assert not node.state.is_symlink() and stat.S_IMODE(node.state.stat().st_mode) == 0o600


def test_xattr_store_on_a_directory(tmp_path: Path) -> None:
    store = XattrMarkers()
    try:
        store.set(tmp_path, b"v")
    except OSError as err:
        pytest.skip(f"no {store.name} xattrs on {tmp_path}: {err}")
    assert store.get(tmp_path) == b"v"
    store.remove(tmp_path)
    assert store.get(tmp_path) is None
    store.remove(tmp_path)  # removing twice is fine


# -- audit and metrics -------------------------------------------------------------------------

POLICY = ("rules:\n  - name: r\n    match: {namespace: ml}\n    limits: {gpu_memory: 1GiB}\n"
          "    actions: [{do: alert, at: 100%}]\n")


def test_enforcer_recovery_is_audited_and_counted(node: Node) -> None:
    node.cgroup()
    node.state.write_text("garbage")
    policy = node.tmp / "policy.yaml"
    policy.write_text(POLICY)
    control = FreezeControl(node.tree, node.registry())
    node.mark_by(dead_owner())
    from gpuwatch.enforce.actions import build_actions

    enforcer = Enforcer(policy, EnforcerConfig(own_cgroups=frozenset()), actions=build_actions(control),
                        audit=AuditLog(node.tmp / "audit.jsonl"))
    assert enforcer.recovered == [PATH]
    records = read_audit(node.tmp / "audit.jsonl")
    assert [(r["event"], r["action"], r["result"]) for r in records] == [
        ("recovery", "move-aside", "ok"), ("recovery", "thaw", "ok")]
    assert records[1]["target"]["cgroup_path"] == PATH  # type: ignore[index]
    registry = CollectorRegistry()
    registry.register(enforcer.recovery_metrics)
    assert registry.get_sample_value("gpuwatch_recovery_actions_total", {"action": "thaw", "result": "ok"}) == 1
    assert registry.get_sample_value("gpuwatch_recovery_actions_total",
                                     {"action": "move-aside", "result": "ok"}) == 1
    enforcer.close()


def test_recover_node_opens_the_audit_log_only_with_something_to_record(tmp_path: Path) -> None:
    tree = CgroupTree(v2_root=tmp_path / "cg", autodetect=False)
    (tmp_path / "cg").mkdir()
    metrics = RecoveryMetrics()
    assert recover_node(tree, tmp_path / "frozen.json", tmp_path / "lock", tmp_path / "audit.jsonl", metrics) == []
    assert not (tmp_path / "audit.jsonl").exists() and metrics.counts == {}
    (tmp_path / "frozen.json").write_text('{"frozen": 5}')
    recover_node(tree, tmp_path / "frozen.json", tmp_path / "lock", tmp_path / "audit.jsonl", metrics)
    assert metrics.counts == {("move-aside", "ok"): 1}
    assert [r["action"] for r in read_audit(tmp_path / "audit.jsonl")] == ["move-aside"]


def test_audit_log_mode_and_no_symlink(tmp_path: Path) -> None:
    AuditLog(tmp_path / "a.jsonl").close()
    assert stat.S_IMODE((tmp_path / "a.jsonl").stat().st_mode) & ~0o640 == 0
    loose = tmp_path / "loose.jsonl"
    loose.write_text("")
    loose.chmod(0o666)
    AuditLog(loose).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o640
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(EnforcementError, match="symbolic link"):
        AuditLog(tmp_path / "link.jsonl")
    assert not (tmp_path / "elsewhere").exists()
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(EnforcementError):
        AuditLog(tmp_path / "fifo.jsonl")


# -- the node lock -------------------------------------------------------------------------------

def test_node_lock_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "run" / "agent.lock"
    with NodeLock(path):
        assert read_holder_pid(path) == os.getpid()
        with pytest.raises(AgentAlreadyRunning) as info:
            NodeLock(path).acquire()  # a second open file description: flock conflicts
        assert info.value.pid == os.getpid()
        assert f"pid {os.getpid()}" in str(info.value) and str(path) in str(info.value)
        assert f"ps -o pid,args -p {os.getpid()}" in str(info.value)
    assert read_holder_pid(path) is None  # emptied on release
    with NodeLock(path):  # free again
        pass


def test_node_lock_is_released_when_the_holder_dies(tmp_path: Path) -> None:
    path = tmp_path / "agent.lock"
    code = ("import os, sys; from gpuwatch.agent.nodelock import NodeLock; "
            f"NodeLock({str(path)!r}).acquire(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
    assert read_holder_pid(path) is not None  # the pid of the dead holder is still written
    with NodeLock(path):
        assert read_holder_pid(path) == os.getpid()


def test_node_lock_refuses_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "agent.lock").symlink_to(tmp_path / "target")
    with pytest.raises(Exception, match="cannot open the agent lock file"):
        NodeLock(tmp_path / "agent.lock").acquire()
    assert not (tmp_path / "target").exists()
