"""The enforcer's side of device isolation without root: a gate that cannot apply a rule
(container gone, kernel refused) is logged and retried on the next snapshot — it never
stops the enforcer, and a gate already in force stays in force; closing the enforcer
closes the gate (the BPF gate detaches its program then)."""

from __future__ import annotations

import time
from pathlib import Path

from gpuwatch.core.errors import EnforcementError
from tests.unit.test_enforce_enforcer import ALERT_POLICY, GIB, make, snap, who

DEVICES_POLICY = ALERT_POLICY.replace("{gpu_memory: 1GiB, gpu_time_share: 50%}", "{devices: [1]}")


class RefusingGate:
    """A DeviceGate that refuses the first `refusals` allow_only calls, like BpfDeviceGate
    when the cgroup directory is not there yet or the kernel refuses the link."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.allowed: dict[int, tuple[int, ...]] = {}
        self.calls = 0
        self.closed = False

    def allow_only(self, cgroup_id: int, gpu_indices: tuple[int, ...]) -> None:
        self.calls += 1
        if self.refusals > 0:
            self.refusals -= 1
            raise EnforcementError(f"no cgroup v2 directory has id {cgroup_id}", fix="none")
        self.allowed[cgroup_id] = gpu_indices

    def clear(self, cgroup_id: int) -> None:
        self.allowed.pop(cgroup_id, None)

    def close(self) -> None:
        self.closed = True


def test_refused_gate_is_retried_next_snapshot(tmp_path: Path) -> None:
    gate = RefusingGate(refusals=1)
    enforcer = make(tmp_path, DEVICES_POLICY, device_gate=gate)
    t = time.time()
    enforcer.on_snapshot(snap((who("a", 7), GIB), t=t - 1.0))  # refused: logged, not raised
    assert gate.calls == 1 and gate.allowed == {}
    enforcer.on_snapshot(snap((who("a", 7), GIB), t=t - 0.5))
    assert gate.calls == 2 and gate.allowed == {7: (1,)}
    enforcer.on_snapshot(snap((who("a", 7), GIB), t=t))  # unchanged: not pushed again
    assert gate.calls == 2
    enforcer.close()
    assert gate.closed


def test_refused_change_keeps_the_gate_in_force(tmp_path: Path) -> None:
    gate = RefusingGate(refusals=0)
    policy = tmp_path / "policy.yaml"
    enforcer = make(tmp_path, DEVICES_POLICY, device_gate=gate)
    t = time.time()
    enforcer.on_snapshot(snap((who("a", 7), GIB), t=t - 1.0))
    assert gate.allowed == {7: (1,)}
    policy.write_text(DEVICES_POLICY.replace("[1]", "[0]"))
    assert enforcer.reload()
    gate.refusals = 1
    enforcer.on_snapshot(snap((who("a", 7), GIB), t=t - 0.5))  # the change is refused
    assert gate.allowed == {7: (1,)}, "a refused change must not lift the gate in force"
    enforcer.on_snapshot(snap((who("a", 7), GIB), t=t))
    assert gate.allowed == {7: (0,)}
    enforcer.close()
