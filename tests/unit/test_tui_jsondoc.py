"""Snapshot <-> JSON document: round trips, layout, tolerance and errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from gpuwatch.core.model import (
    HOST_IDENTITY,
    ContainerIdentity,
    DeviceFields,
    ProbeCounters,
    Snapshot,
)
from gpuwatch.core.snapshot_doc import (
    FORMAT,
    SnapshotDocError,
    dumps,
    iso_time,
    loads,
    parse_iso_time,
    snapshot_from_dict,
    snapshot_to_dict,
    wall_time_s,
)
from tests.unit.test_tui_samples import GIB, T0, TRAINER, device, ident, sample_snapshot, usage


def test_round_trip_of_the_sample_is_exact() -> None:
    snap = sample_snapshot()
    assert loads(dumps(snap)) == snap
    assert loads(dumps(snap, indent=None)) == snap


def test_round_trip_with_every_optional_part_set() -> None:
    labelled = dataclasses.replace(TRAINER, labels=(("app", "trainer"), ("tier", "gpu")),
                                   qos_class="guaranteed", cgroup_id=4242)
    probe = ProbeCounters(cgroup_id=4242, ioctl_calls_by_op=(("alloc", 3),), ioctl_failures_total=1,
                          allocated_bytes_by_gpu=((0, GIB), (3, 2 * GIB)), allocations_total=5, frees_total=2,
                          allocation_failures_total=1, launches_total=None)
    snap = Snapshot(
        timestamp_s=T0 + 0.25, node="n",
        devices=(device(0, is_mig=True, parent_uuid="GPU-parent", healthy=False, xid_errors_total=3,
                        minor_number=0),),
        containers=(usage(labelled, 0, GIB, 0.5, 1.5, ((1, None, "a", None),), probe=probe),
                    usage(HOST_IDENTITY, 0, 0, 0.0, 0.0)),
        gpu_up=False, gpu_error="NVML_ERROR_GPU_IS_LOST", probes_up=True, probe_counters=(probe,),
        cycle_seconds=0.01, interval_s=2.0, simulated=True, notes=("a", "b"),
    )
    fields = {f.name for f in dataclasses.fields(Snapshot)}
    if "probe_identities" in fields:
        snap = dataclasses.replace(snap, probe_identities=((4242, labelled),))  # type: ignore[call-arg]
    assert loads(dumps(snap)) == snap


def test_round_trip_of_a_device_with_its_dcgm_field_readings() -> None:
    """DeviceInfo.fields is a nested dataclass: /snapshot.json must encode it (a plain field
    walk handed json a DeviceFields object: the agent answered 500) and read it back."""
    names = [f.name for f in dataclasses.fields(DeviceFields)]
    readings = DeviceFields(**{name: None for name in names})
    readings = dataclasses.replace(readings, **{names[0]: 7, names[-1]: 3})
    snap = dataclasses.replace(sample_snapshot(), devices=(dataclasses.replace(device(0), fields=readings),))
    doc = json.loads(dumps(snap))
    assert doc["devices"][0]["fields"][names[0]] == 7
    assert loads(dumps(snap)) == snap


def test_every_snapshot_field_reaches_the_document() -> None:
    doc = snapshot_to_dict(sample_snapshot())
    missing = {f.name for f in dataclasses.fields(Snapshot)} - set(doc)
    assert missing == set()


def test_document_layout_for_scripts() -> None:
    doc = json.loads(dumps(sample_snapshot()))
    assert doc["format"] == FORMAT
    assert doc["node"] == "sim-node-1"
    assert doc["time"] == iso_time(T0) and doc["time"].endswith("Z")
    assert doc["simulated"] is True
    trainer = next(c for c in doc["containers"] if c["identity"]["container_name"] == "trainer")
    assert trainer["identity"]["pod_name"] == "train-0"
    assert trainer["identity"]["pod_namespace"] == "team-a"
    assert trainer["identity"]["is_container"] is True
    assert trainer["memory_bytes"] == 8 * GIB
    assert [(p["pid"], p["container_pid"], p["comm"]) for p in trainer["processes"]] == [
        (4321, 1, "python3"), (4322, 7, "worker")]
    assert trainer["probe"]["ioctl_calls_by_op"] == {"alloc": 12000, "free": 345}
    host = next(c for c in doc["containers"] if not c["identity"]["is_container"])
    assert host["processes"][0]["container_pid"] is None
    assert {p["pod"] for p in doc["pods"]} == {"train-0", "serve-1", "nb-7"}
    assert {n["namespace"] for n in doc["namespaces"]} == {"team-a", "research"}
    assert doc["devices"][0]["memory_total_bytes"] == 40 * GIB


def test_non_finite_floats_become_null_and_read_back_as_na() -> None:
    snap = Snapshot(T0, "n", (device(0, temperature_celsius=math.inf),),
                    (usage(TRAINER, 0, GIB, math.nan, 1.0),))
    text = dumps(snap)
    doc = json.loads(text)  # strict JSON: no NaN/Infinity tokens
    assert "NaN" not in text and "Infinity" not in text
    assert doc["devices"][0]["temperature_celsius"] is None
    back = loads(text)
    assert back.devices[0].temperature_celsius is None
    assert math.isnan(back.containers[0].sm_utilization_ratio)


def test_unicode_is_written_as_text() -> None:
    snap = Snapshot(T0, "节点", (), (usage(ident("ns", "训练", "c", "id"), 0, 1, 0.0, 0.0),))
    text = dumps(snap)
    assert "训练" in text and "节点" in text
    assert loads(text) == snap


def test_minimal_document_uses_defaults_and_ignores_unknown_keys() -> None:
    snap = snapshot_from_dict({"node": "x", "timestamp_s": 5, "devices": [], "containers": [],
                               "future_field": {"anything": 1}})
    assert (snap.node, snap.timestamp_s, snap.gpu_up, snap.devices) == ("x", 5.0, True, ())


def test_identity_only_needs_runtime_and_path() -> None:
    doc = snapshot_to_dict(Snapshot(T0, "n", (), (usage(ContainerIdentity("docker", "/docker/abc", "abc"),
                                                        0, 1, 0.0, 0.0),)))
    ident_doc = doc["containers"][0]["identity"]
    for key in ("container_name", "pod_name", "labels", "display_name", "is_container"):
        ident_doc.pop(key)
    back = snapshot_from_dict(doc)
    assert back.containers[0].identity == ContainerIdentity("docker", "/docker/abc", "abc")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be an object"),
        ('{"format": "other/1", "node": "n", "timestamp_s": 0}', "not a gpuwatch snapshot"),
        ('{"timestamp_s": 0}', "node"),
        ('{"node": "n", "devices": {}}', "devices must be a list"),
        ('{"node": "n", "devices": [{"index": 0}]}', "devices[0] lacks required field 'uuid'"),
        ('{"node": "n", "containers": [{"gpu_index": 0}]}', "containers[0].identity must be an object"),
    ],
)
def test_malformed_documents_raise_a_typed_error_naming_the_problem(text: str, needle: str) -> None:
    with pytest.raises(SnapshotDocError) as err:
        loads(text)
    assert needle in str(err.value)


def test_iso_time_formats_utc_milliseconds_and_survives_bad_values() -> None:
    assert iso_time(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso_time(1.5) == "1970-01-01T00:00:01.500Z"
    assert iso_time(math.nan) == ""
    assert iso_time(1e300) == ""


def _non_default(type_text: str, i: int) -> object:
    if type_text.startswith("tuple[tuple[int"):
        return ((i, 10 * i), (i + 1, 7))
    if type_text.startswith("tuple[tuple[str"):
        return ((f"op{i}", i), ("free", 3))
    if type_text.startswith("int"):
        return 100 + i
    raise AssertionError(f"extend this test for a ProbeCounters field of type {type_text}")


def test_every_probe_counter_field_round_trips() -> None:
    """A field added to ProbeCounters later must survive the document too."""
    values = {f.name: _non_default(str(f.type), i) for i, f in enumerate(dataclasses.fields(ProbeCounters))}
    probe = ProbeCounters(**values)  # type: ignore[arg-type]
    snap = Snapshot(T0, "n", (), (usage(TRAINER, 0, GIB, 0.5, 1.0, probe=probe),), probe_counters=(probe,))
    assert loads(dumps(snap)) == snap


def test_wall_time_converts_monotonic_stamps_and_keeps_unix_ones() -> None:
    assert wall_time_s(T0) == T0
    assert wall_time_s(100.0, now_wall_s=T0 + 50.0, now_monotonic_s=150.0) == T0
    assert math.isnan(wall_time_s(math.nan))


def test_document_time_is_wall_clock_even_for_monotonic_snapshots() -> None:
    snap = dataclasses.replace(sample_snapshot(), timestamp_s=1234.5)  # as the sampler stamps it
    doc = snapshot_to_dict(snap, wall_s=T0)
    assert doc["time"] == iso_time(T0) and doc["timestamp_s"] == 1234.5
    assert loads(dumps(snap, wall_s=T0)).timestamp_s == 1234.5  # exact round trip by default
    assert loads(dumps(snap, wall_s=T0), wall_clock=True).timestamp_s == T0  # for showing a saved file
    assert parse_iso_time(iso_time(T0 + 0.25)) == T0 + 0.25
    assert parse_iso_time("yesterday") is None and parse_iso_time(None) is None


def test_round_trip_with_node_signals_and_health_inputs() -> None:
    from gpuwatch.core.model import (
        ContainerNetwork,
        ContainerXid,
        GpuHealth,
        GpuLink,
        GpuTopology,
        NicStats,
        NodeSignals,
        RdmaPort,
        TopologyLevel,
    )

    signals = NodeSignals(
        health=(GpuHealth(0, "GPU-0", False, "xid", "XID 79 (fallen off the bus)", 3, 79),
                GpuHealth(1, "GPU-1", True, "ok")),
        topology=GpuTopology(links=(GpuLink(0, 1, TopologyLevel.SINGLE, 4), GpuLink(1, 0, None, 0)),
                             nvswitch=False, nvlink_supported=True),
        nics=(NicStats("eth0", "up", 1.25e9, 10, 20, rdma=True), NicStats("eth1", "down", None, 0, 0)),
        rdma_ports=(RdmaPort("mlx5_0", 1, "ACTIVE", 2.5e10, 400, None, "InfiniBand"),),
        container_xids=(ContainerXid(TRAINER, 0, 79, 2),),
        container_network=(ContainerNetwork(TRAINER, 5, 6),),
        errors_total=(("kmsg", 1), ("network_nics", 0)),
        kmsg_malformed_total=4,
    )
    snap = dataclasses.replace(
        sample_snapshot(), signals=signals, driver_version="550.54.15", cuda_driver_version=12040,
        devices=(device(0, lost=True, xid_events=(79, 48), ecc_uncorrected_volatile=2, row_remap_failure=True,
                        compute_capability=(9, 0)),))
    again = loads(dumps(snap))
    assert again == snap
    assert again.signals is not None and again.signals.topology is not None
    assert again.signals.topology.links[0].level is TopologyLevel.SINGLE
