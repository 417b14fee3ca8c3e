"""The probe vs NVML cross-check (policy/probe_trust.py): what is compared per container, the
allowance max(64 MiB, 10% of NVML), hysteresis (3 diverging intervals suspend, 3 agreeing
resume), containers appearing and disappearing, and no judgement without an NVML number."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatch.core.model import (
    ContainerIdentity,
    ContainerUsage,
    ProbeCounters,
    ProbeNvmlComparison,
    ProcessUsage,
    Snapshot,
)
from gpuwatch.core.probe_nvml import compare_probe_nvml, probe_nvml_of
from gpuwatch.policy.probe_trust import ProbeNvmlCrossCheck

MIB = 1024**2
A = ContainerIdentity(runtime="k8s", cgroup_path="/kubepods/a", container_id="a" * 64, container_name="a",
                      pod_name="pa", pod_namespace="ml", cgroup_id=11)
B = ContainerIdentity(runtime="k8s", cgroup_path="/kubepods/b", container_id="b" * 64, container_name="b",
                      pod_name="pb", pod_namespace="ml", cgroup_id=22)


def cmp(identity: ContainerIdentity, probe_mib: float | None, nvml_mib: float | None) -> ProbeNvmlComparison:
    return ProbeNvmlComparison(identity, None if probe_mib is None else int(probe_mib * MIB),
                               None if nvml_mib is None else int(nvml_mib * MIB))


def run(check: ProbeNvmlCrossCheck, *intervals: dict[str, ProbeNvmlComparison]) -> list[list[tuple[str, bool]]]:
    return [[(c.identity.container_name, c.suspended) for c in check.observe(i)] for i in intervals]


def test_three_diverging_intervals_suspend_and_three_agreeing_resume() -> None:
    check = ProbeNvmlCrossCheck()
    over = {A.key: cmp(A, 500, 300)}
    agree = {A.key: cmp(A, 300, 300)}
    assert run(check, over, over) == [[], []]
    assert not check.is_suspended(A.key)
    assert run(check, over) == [[("a", True)]]
    assert check.suspended() == {A.key: A}
    assert run(check, over, agree, agree) == [[], [], []]  # no second suspension, not resumed yet
    assert check.is_suspended(A.key)
    assert run(check, agree) == [[("a", False)]]
    assert check.suspended() == {}


def test_an_agreeing_interval_restarts_the_count() -> None:
    check = ProbeNvmlCrossCheck()
    over, agree = {A.key: cmp(A, 1000, 100)}, {A.key: cmp(A, 100, 100)}
    assert run(check, over, over, agree, over, over) == [[]] * 5
    assert run(check, over) == [[("a", True)]]
    # a diverging interval while suspended restarts the resume count too
    assert run(check, agree, agree, over, agree, agree) == [[]] * 5
    assert run(check, agree) == [[("a", False)]]


@pytest.mark.parametrize(("probe_mib", "nvml_mib", "diverges"), [
    (64, 0, False),  # exactly the 64 MiB floor over: allowed
    (64.01, 0, True),
    (100 + 64, 100, False),  # 10% of 100 MiB is under the floor
    (100 + 65, 100, True),
    (2000 + 200, 2000, False),  # 10% of 2000 MiB is over the floor
    (2000 + 201, 2000, True),
    (0, 5000, False),  # an undercount never makes the kernel act: agreeing
])
def test_allowance_is_64_mib_or_10_percent(probe_mib: float, nvml_mib: float, diverges: bool) -> None:
    assert ProbeNvmlCrossCheck().diverges(cmp(A, probe_mib, nvml_mib)) is diverges


def test_no_nvml_number_is_no_judgement() -> None:
    check = ProbeNvmlCrossCheck()
    over, unknown = {A.key: cmp(A, 900, 100)}, {A.key: cmp(A, 900, None)}
    assert check.diverges(unknown[A.key]) is None
    assert run(check, unknown, unknown, unknown, unknown) == [[]] * 4
    assert not check.is_suspended(A.key)
    # gaps neither count nor break a streak
    assert run(check, over, unknown, over, unknown, over) == [[], [], [], [], [("a", True)]]
    # suspended: an interval without NVML keeps it suspended (the safe side)
    assert run(check, unknown, {A.key: cmp(A, None, 100)}) == [[], []]
    assert check.is_suspended(A.key)


def test_containers_come_and_go_independently() -> None:
    check = ProbeNvmlCrossCheck()
    both_over = {A.key: cmp(A, 900, 100), B.key: cmp(B, 900, 100)}
    a_over = {A.key: cmp(A, 900, 100), B.key: cmp(B, 100, 100)}
    assert run(check, both_over, a_over, a_over) == [[], [], [("a", True)]]
    assert not check.is_suspended(B.key)
    # A leaves: forgotten, so a new container with its key starts from scratch
    assert run(check, {B.key: cmp(B, 100, 100)}) == [[]]
    assert check.tracked() == {B.key: (B, False)}
    assert run(check, {A.key: cmp(A, 900, 100)}) == [[]]
    assert not check.is_suspended(A.key)


def test_thresholds_are_configurable_and_checked() -> None:
    check = ProbeNvmlCrossCheck(min_excess_bytes=0, excess_ratio=0.5, suspend_after_intervals=1,
                                resume_after_intervals=2)
    assert run(check, {A.key: cmp(A, 151, 100)}) == [[("a", True)]]
    assert run(check, {A.key: cmp(A, 150, 100)}, {A.key: cmp(A, 150, 100)}) == [[], [("a", False)]]
    with pytest.raises(ValueError):
        ProbeNvmlCrossCheck(suspend_after_intervals=0)
    with pytest.raises(ValueError):
        ProbeNvmlCrossCheck(min_excess_bytes=-1)


def test_change_says_why() -> None:
    check = ProbeNvmlCrossCheck()
    over = {A.key: cmp(A, 500, 100)}
    changes = [c for _ in range(3) for c in check.observe(over)]
    assert len(changes) == 1
    change = changes[0]
    assert change.suspended and change.intervals == 3 and change.allowed_excess_bytes == 64 * MIB
    assert "suspended" in change.reason and str(500 * MIB) in change.reason


# ---- what is compared, from a snapshot ---------------------------------------------------------


def row(identity: ContainerIdentity, gpu: int, nvml_mib: float | None, pids: tuple[int, ...] = (1,)) -> ContainerUsage:
    procs = tuple(ProcessUsage(p, None, "job", None if nvml_mib is None else int(nvml_mib * MIB) // len(pids), 0.0)
                  for p in pids)
    return ContainerUsage(identity, gpu, f"GPU-{gpu}", int((nvml_mib or 0) * MIB), 0.0, 0.0, processes=procs)


def snap(rows: tuple[ContainerUsage, ...], counters: tuple[ProbeCounters, ...],
         identities: tuple[tuple[int, ContainerIdentity], ...], gpu_up: bool = True,
         probes_up: bool = True) -> Snapshot:
    return Snapshot(timestamp_s=1.0, node="n", devices=(), containers=rows, gpu_up=gpu_up, probes_up=probes_up,
                    probe_counters=counters, probe_identities=identities)


def test_snapshot_comparison_sums_gpus_and_cgroups_and_takes_the_larger_counter() -> None:
    sub_cgroup = 33  # a second cgroup id of container A
    counters = (
        ProbeCounters(cgroup_id=11, allocated_bytes_by_gpu=((-1, 10 * MIB), (0, 100 * MIB), (1, 50 * MIB)),
                      cuda_allocated_bytes=120 * MIB),
        ProbeCounters(cgroup_id=sub_cgroup, allocated_bytes_by_gpu=(), cuda_allocated_bytes=40 * MIB),
        ProbeCounters(cgroup_id=22, allocated_bytes_by_gpu=((0, 30 * MIB),), cuda_allocated_bytes=None),
        ProbeCounters(cgroup_id=999, allocated_bytes_by_gpu=((0, 1 << 40),)),  # nobody we can name
    )
    identities = ((11, A), (sub_cgroup, A), (22, B))
    rows = (row(A, 0, 100, pids=(1, 2)), row(A, 1, 60), row(B, 0, 20))
    found = compare_probe_nvml(snap(rows, counters, identities))
    assert set(found) == {A.key, B.key}
    assert found[A.key].probe_bytes == (160 + 40) * MIB  # driver 160 > libcuda 120, plus the sub-cgroup
    assert found[A.key].nvml_bytes == 160 * MIB
    assert found[A.key].divergence_bytes == 40 * MIB
    assert found[B.key].divergence_bytes == 10 * MIB


def test_snapshot_without_numbers_gives_none() -> None:
    counters = (ProbeCounters(cgroup_id=11, allocated_bytes_by_gpu=((0, 100 * MIB),)),)
    # NVML lists the container but every process reads N/A
    found = compare_probe_nvml(snap((row(A, 0, None),), counters, ((11, A),)))
    assert found[A.key].nvml_bytes is None and found[A.key].probe_bytes == 100 * MIB
    assert not found[A.key].judgeable
    # NVML down / probes down: that side is unknown for everyone
    assert compare_probe_nvml(snap((row(A, 0, 50),), counters, ((11, A),), gpu_up=False))[A.key].nvml_bytes is None
    found = compare_probe_nvml(snap((row(A, 0, 50),), counters, ((11, A),), probes_up=False))
    assert found[A.key].probe_bytes is None and found[A.key].nvml_bytes == 50 * MIB


def test_the_comparison_is_made_once_per_interval_and_read_from_the_snapshot() -> None:
    """The sampler stores the comparison in the snapshot; the exporter and the enforcer read
    that one (a copy with other fields keeps it), and only a hand-built snapshot computes it."""
    counters = (ProbeCounters(cgroup_id=11, allocated_bytes_by_gpu=((0, 300 * MIB),)),)
    built = snap((row(A, 0, 100),), counters, ((11, A),))
    assert built.probe_nvml is None and probe_nvml_of(built) == compare_probe_nvml(built)
    made = dataclasses.replace(built, probe_nvml=(ProbeNvmlComparison(A, 1, 2),))
    assert probe_nvml_of(made) == {A.key: ProbeNvmlComparison(A, 1, 2)}  # the stored one, not recomputed
    assert probe_nvml_of(dataclasses.replace(made, cycle_seconds=0.5)) == probe_nvml_of(made)
