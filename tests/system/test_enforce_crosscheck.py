"""The probe vs NVML cross-check with the real probes on the simulated node (root, BPF, runc).

Divergence: the libcuda probes keep (tgid, ptr) -> size in a bounded map (`max_cuda_allocs`);
an allocation made while it is full is counted but its entry is not kept (counted overflow),
so its cuMemFree cannot be matched and the counter keeps its bytes: a real leak of the very
counter the in-kernel limit reads (bpf/cuda.bpf.c). The workload holds 64 MiB, allocates and
frees 3 x 64 MiB (2 of them overflow the 2-entry map): NVML (the sim ledger) says 64 MiB, the
probe counter 192 MiB (256 when the map was already full). After 3 snapshots the enforcer
takes the container out of the kernel limit map (audited, metric 1, the alert rule fires);
the workload then allocates 2 x 64 MiB more -- 320 MiB or more on the leaked counter, over
the 300 MiB kill limit, 192 MiB in NVML's view -- and is not killed.

Agreement: where the counters agree the in-kernel kill still holds the ledger at the limit
(0 bytes over), with the cross-check running on every snapshot.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpuwatch.core.labels import identity_labels
from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, ProcessUsage, Snapshot
from gpuwatch.core.probe_nvml import compare_probe_nvml
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.inkernel_guard import SUSPENDED_METRIC
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.exporter.crosscheck_metrics import DIVERGENCE_METRIC
from gpuwatch.probes.manager import ProbeManager
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import RunningContainer
from tests.conftest import need_binary
from tests.system.enforce_lab import LedgerWatch, identity_of, kernel_limit_lab, run_pod
from tests.system.sim_helpers import EXACT_DRIVER, private_node, sim_container

pytestmark = [pytest.mark.root, pytest.mark.runc, pytest.mark.bpf]
MIB = 1024**2
LIMIT_MIB = 300
POLICY = f"""
rules:
  - name: capped
    match: {{namespace: ml}}
    limits: {{gpu_memory: {LIMIT_MIB}MiB}}
    actions: [{{do: kill, at: 100%}}]
"""
# Drives the stub libcuda through ctypes as a CUDA program would; phases are marker files.
LEAKER = r"""
import ctypes, pathlib, sys, time
lib, markers, mib = ctypes.CDLL(sys.argv[1]), pathlib.Path(sys.argv[2]), 1 << 20
lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
lib.cuMemFree_v2.argtypes = [ctypes.c_ulonglong]
def ok(rc, what):
    if rc:
        print(what, "failed", rc, flush=True)
        sys.exit(3)
def alloc(n):
    ptr = ctypes.c_ulonglong()
    ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), n * mib), "cuMemAlloc_v2")
    return ptr.value
ok(lib.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
held = [alloc(64)]
for ptr in [alloc(64) for _ in range(3)]:
    ok(lib.cuMemFree_v2(ptr), "cuMemFree_v2")
(markers / "freed").write_text("")
while not (markers / "go").exists():
    time.sleep(0.02)
held += [alloc(64), alloc(64)]
(markers / "allocated").write_text("")
time.sleep(600)
"""


@pytest.fixture
def sim(tmp_path: Path, runc_required: str, bcc_required: None) -> Iterator[simnode.SimNode]:
    with private_node(tmp_path, devices=1, memory_bytes=4096 * MIB) as node:
        yield node


def nvml_and_probe_snapshot(sim: simnode.SimNode, c: RunningContainer, identity: ContainerIdentity,
                            pm: ProbeManager) -> Snapshot:
    """What the agent's snapshot holds for the container: NVML's per-process memory (the sim
    ledger the fake NVML reports) and the kernel probes' counters of its cgroup."""
    state = simnode.status(sim)
    pids = set(c.pids())
    procs = tuple(ProcessUsage(p.host_pid, None, "python3", p.memory_bytes, 0.0)
                  for p in state.processes if p.host_pid in pids)
    dev = state.devices[0]
    info = DeviceInfo(0, "GPU-0", "sim", None, dev.memory_total_bytes, dev.memory_used_bytes,
                      dev.memory_total_bytes - dev.memory_used_bytes, simulated=True)
    rows = (ContainerUsage(identity, 0, "GPU-0", sum(p.memory_bytes or 0 for p in procs), 0.0, 0.0,
                           processes=procs),) if procs else ()
    counters = tuple(c for c in pm.read() if c.cgroup_id == identity.cgroup_id)
    return Snapshot(timestamp_s=time.monotonic(), node="sim", devices=(info,), containers=rows, simulated=True,
                    probes_up=True, probe_counters=counters, probe_identities=((identity.cgroup_id or 0, identity),))


RULES = Path(__file__).resolve().parents[2] / "dashboards" / "gpuwatch-rules.yml"
ALERT = "GpuwatchInKernelEnforcementSuspended"


def assert_alert_fires(registry: CollectorRegistry, tmp_path: Path) -> None:
    """The shipped alert rule fires on the suspension series exactly as the enforcer exports it
    (name and labels taken from a real collection, evaluated by promtool)."""
    promtool = need_binary("promtool", "prometheus")
    series = [sample for family in registry.collect() for sample in family.samples
              if sample.name == SUSPENDED_METRIC and sample.value == 1.0]
    assert len(series) == 1, series
    labels = series[0].labels
    selector = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if r.get("alert") == ALERT)
    summary = (f"In-kernel GPU memory enforcement suspended for {labels['namespace']}/{labels['pod']}/"
               f"{labels['container']} on {labels['node']}")
    test = {"rule_files": [str(RULES)], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": f"{SUSPENDED_METRIC}{{{selector}}}", "values": "1x10"}],
        "alert_rule_test": [{"eval_time": "2m", "alertname": ALERT, "exp_alerts": [{
            "exp_labels": {**{k: v for k, v in labels.items() if v}, "severity": "warning"},  # "" = absent
            # the summary templated with the series' labels; the others (description, runbook_url) as written
            "exp_annotations": {**rule["annotations"], "summary": summary}}]}]}]}
    path = tmp_path / "alert_test.yml"
    path.write_text(yaml.safe_dump(test))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


def wait_for(path: Path, c: RunningContainer, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert c.running(), f"workload exited: {c.logs()}"
        assert time.monotonic() < deadline, f"no {path.name} marker: {c.logs()}"
        time.sleep(0.05)


def test_leaked_probe_counter_suspends_the_kernel_kill_and_polling_goes_on(sim: simnode.SimNode,
                                                                          tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    script = markers / "leaker.py"
    script.write_text(LEAKER)
    (tmp_path / "policy.yaml").write_text(POLICY)
    with kernel_limit_lab(tmp_path, sim, max_cuda_allocs=2) as (pm, lab, enforcer):
        registry = CollectorRegistry()
        registry.register(enforcer.metrics_collector())
        try:
            pod = lab.run(sim_container(
                sim, "leaker", [sys.executable, str(script), str(sim.libraries.cuda_path), str(markers)],
                # exact driver: the leak is in the libcuda counter (cuMemAlloc bytes); a 518 MiB context
                # would be over the 300 MiB limit in NVML alone and hide the leak under the RM counter
                env=EXACT_DRIVER, binds=[markers], namespace="ml", pod="leak-0"))
            identity = identity_of(pod)
            assert identity.cgroup_id is not None
            wait_for(markers / "freed", pod)
            seen = pm.poll_events(0)
            snapshots = []
            for _ in range(3):
                snapshot = nvml_and_probe_snapshot(sim, pod, identity, pm)
                snapshots.append(snapshot)
                if len(snapshots) == 1:
                    # before the 3rd diverging interval the kill limit is in the kernel
                    enforcer.on_snapshot(snapshot, seen)
                    assert pm.limit_of(identity.cgroup_id) == (LIMIT_MIB * MIB, "kill")
                else:
                    enforcer.on_snapshot(snapshot, pm.poll_events(0))
                time.sleep(0.1)
            first = snapshots[0]
            nvml = first.containers[0].memory_bytes
            probe = first.probe_counters[0].cuda_allocated_bytes
            print(f"\nNVML {nvml / MIB:.0f} MiB, libcuda probe counter {(probe or 0) / MIB:.0f} MiB")
            # 64 MiB held + the frees it could not match: 2 (or 3, when the map was full before
            # the first of them) of the 3 passing allocations
            assert probe in (192 * MIB, 256 * MIB) and 64 * MIB <= nvml < 128 * MIB, "the leak did not happen"
            assert pm.limit_of(identity.cgroup_id) is None, "suspended: no entry for the kernel to act on"
            labels = {"node": "sim", **dict(zip(("namespace", "pod", "pod_uid", "container", "container_id"),
                                                identity_labels(identity), strict=True))}
            assert registry.get_sample_value(SUSPENDED_METRIC, labels) == 1.0
            assert_alert_fires(registry, tmp_path)
            exporter = CollectorRegistry()
            exporter.register(SnapshotCollector(lambda: snapshots[-1], clock=time.monotonic))
            divergence = exporter.get_sample_value(DIVERGENCE_METRIC, labels)
            assert divergence is not None and divergence > 64 * MIB

            (markers / "go").write_text("")
            wait_for(markers / "allocated", pod)
            decisions = []
            for _ in range(3):  # polling enforcement keeps judging on NVML numbers: under the limit
                decisions += enforcer.on_snapshot(nvml_and_probe_snapshot(sim, pod, identity, pm), pm.poll_events(0))
                time.sleep(0.1)
            time.sleep(0.3)
            assert pod.running(), f"killed on a counter NVML contradicts: {pod.logs()}"
            counters = [c for c in pm.read() if c.cgroup_id == identity.cgroup_id]
            assert counters[0].cuda_allocated_bytes == probe + 128 * MIB > LIMIT_MIB * MIB  # what the kernel reads
            assert simnode.status(sim).devices[0].memory_used_bytes < LIMIT_MIB * MIB
            assert decisions == []
            events = seen + pm.poll_events(100)
            assert not [e for e in events if e.type in ("kill", "stop", "over_limit")]
        finally:
            enforcer.close()
    records = [r for r in read_audit(tmp_path / "audit.jsonl") if r["event"] == "crosscheck"]
    assert [(r["action"], r["target"]["container"]) for r in records] == [  # type: ignore[index]
        ("suspend-inkernel", "leaker")]
    assert records[0]["measured"]["divergence_bytes"] >= 64 * MIB  # type: ignore[index, operator]


def test_kernel_kill_still_holds_the_limit_where_probes_and_nvml_agree(sim: simnode.SimNode,
                                                                      tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    (tmp_path / "policy.yaml").write_text(POLICY)
    with kernel_limit_lab(tmp_path, sim) as (pm, lab, enforcer):
        watch = LedgerWatch(sim)
        try:
            pod = run_pod(lab, sim, markers)  # 128 MiB steps: the 3rd is over 300 MiB
            identity = identity_of(pod)
            divergences: list[int] = []
            deadline = time.monotonic() + 15
            while pod.running() and time.monotonic() < deadline:
                snapshot = nvml_and_probe_snapshot(sim, pod, identity, pm)
                found = compare_probe_nvml(snapshot).get(identity.key)
                if found is not None and found.divergence_bytes is not None:
                    divergences.append(found.divergence_bytes)
                enforcer.on_snapshot(snapshot, pm.poll_events(0))
                time.sleep(0.05)
            assert pod.wait(5) == 128 + signal.SIGKILL, pod.logs()
        finally:
            peak = watch.stop()
            enforcer.close()
    assert len(divergences) >= 3, "the cross-check never compared the two numbers"
    print(f"\nprobe - NVML while growing: {min(divergences) / MIB:+.1f} .. {max(divergences) / MIB:+.1f} MiB "
          f"over {len(divergences)} snapshots")
    assert enforcer.kernel_guard.changes_total == 0
    assert 0 < peak <= LIMIT_MIB * MIB, f"ledger peak {peak / MIB:.0f} MiB > limit {LIMIT_MIB} MiB"
