"""Snapshot <-> JSON document (pure; no I/O).

The document is what `gpuwatch top --once --json` prints, what `--snapshot-file` reads,
and what the agent serves as /snapshot.json (consumers share this one format). It carries every Snapshot field, so
`loads(dumps(s)) == s`. Layout (version 1)::

    {"format": "gpuwatch.snapshot/1", "node": ..., "time": "2026-11-22T18:00:00.000Z",
     "timestamp_s": ..., "gpu_up": ..., "gpu_error": ..., "simulated": ...,
     "devices": [{index, uuid, name, memory_total_bytes, ...}],
     "containers": [{"identity": {runtime, cgroup_path, container_id, container_name,
                                  pod_name, pod_namespace, pod_uid, ...},
                     "gpu_index", "gpu_uuid", "memory_bytes", "sm_utilization_ratio",
                     "kernel_seconds_total",
                     "processes": [{pid (host), container_pid, comm, memory_bytes, ...}],
                     "probe": {...} | null}],
     "pods": [...], "namespaces": [...], "probe_counters": [...], "notes": [...],
     "progress": [{"identity": {...}, "path", "goal", "value", "rate_per_gpu_second", ...}],
     "enforcement": [{"identity": {...}, "state", "reason", "memory_limit_bytes", "time_share", ...}]}

Readers ignore unknown keys and use defaults for optional ones, so older documents and
newer writers interoperate. Non-finite floats (NaN/inf) are written as null.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from datetime import UTC, datetime
from typing import Any, TypeVar

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.jsonbounds import JsonRejected, parse_json
from gpuwatch.core.model import (
    ContainerEnforcement,
    ContainerIdentity,
    ContainerNetwork,
    ContainerProgress,
    ContainerUsage,
    ContainerXid,
    DeviceFields,
    DeviceInfo,
    GpuHealth,
    GpuLink,
    GpuTopology,
    GroupUsage,
    NicStats,
    NodeSignals,
    ProbeCounters,
    ProcessUsage,
    RdmaPort,
    Snapshot,
    TopologyLevel,
)

FORMAT = "gpuwatch.snapshot/1"
MAX_JSON_DEPTH = 32
"""A snapshot document is under 10 deep; deeper input is refused before it is walked."""

T = TypeVar("T")


class SnapshotDocError(GpuwatchError):
    """A snapshot JSON document is malformed."""


# --------------------------------------------------------------------------- encode


def _num(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _flat(obj: Any) -> dict[str, Any]:
    """Fields of a flat dataclass (primitives only) as a dict."""
    return {f.name: _num(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _probe_to_dict(probe: ProbeCounters) -> dict[str, Any]:
    """Counters; per-op / per-GPU pair tuples become objects ({"alloc": 12, "0": 1024})."""
    out = _flat(probe)
    for f in dataclasses.fields(probe):
        if str(f.type).startswith("tuple[tuple["):
            out[f.name] = {str(key): value for key, value in getattr(probe, f.name)}
    return out


def _device_to_dict(device: DeviceInfo) -> dict[str, Any]:
    """A device; its DCGM-style field readings (a nested dataclass) as an object or null."""
    out = _flat(device)
    out["fields"] = _flat(device.fields) if device.fields is not None else None
    return out


def _identity_to_dict(ident: ContainerIdentity) -> dict[str, Any]:
    out = _flat(ident)
    out["labels"] = [list(pair) for pair in ident.labels]
    out["is_container"] = ident.is_container
    out["display_name"] = ident.display_name
    return out


def _container_to_dict(usage: ContainerUsage) -> dict[str, Any]:
    return {
        "identity": _identity_to_dict(usage.identity),
        "gpu_index": usage.gpu_index,
        "gpu_uuid": usage.gpu_uuid,
        "memory_bytes": usage.memory_bytes,
        "sm_utilization_ratio": _num(usage.sm_utilization_ratio),
        "kernel_seconds_total": _num(usage.kernel_seconds_total),
        "processes": [_flat(p) for p in usage.processes],
        "probe": _probe_to_dict(usage.probe) if usage.probe is not None else None,
    }


def iso_time(timestamp_s: float) -> str:
    """Unix seconds -> '2026-11-22T18:00:00.000Z' (UTC, milliseconds)."""
    if not math.isfinite(timestamp_s):
        return ""
    try:
        moment = datetime.fromtimestamp(timestamp_s, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return ""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _plain(value: Any) -> Any:
    """A field value the document has no special layout for, as JSON-ready data."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, ContainerIdentity):
        return _identity_to_dict(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return _num(value)


UNIX_TIME_MIN_S = 1e9
"""Timestamps at or above this (2001-09-09) are Unix time; below, the sampler's monotonic
clock (seconds since boot: no host has been up for 31 years)."""


def wall_time_s(timestamp_s: float, now_wall_s: float | None = None,
                now_monotonic_s: float | None = None) -> float:
    """Unix time of a Snapshot timestamp.

    The sampler stamps Snapshots with `time.monotonic()` (CLOCK_MONOTONIC is system-wide on
    Linux, so any process on the node can convert it); hand-written documents may carry
    Unix time already, which is returned unchanged. Clocks are injectable for tests.
    """
    if not math.isfinite(timestamp_s) or timestamp_s >= UNIX_TIME_MIN_S:
        return timestamp_s
    now_wall = time.time() if now_wall_s is None else now_wall_s
    now_mono = time.monotonic() if now_monotonic_s is None else now_monotonic_s
    return now_wall - (now_mono - timestamp_s)


def parse_iso_time(text: Any) -> float | None:
    """Inverse of `iso_time`; None for anything unparsable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def snapshot_to_dict(snapshot: Snapshot, wall_s: float | None = None) -> dict[str, Any]:
    """The JSON-ready document for one Snapshot (plain dicts, lists, str, numbers).

    "time" is the sample's Unix time in ISO 8601 (`wall_s`, or converted from the
    monotonic `timestamp_s`, which is kept as is for an exact round trip). Known fields
    get the documented layout; any other Snapshot field is written under its own name, so
    fields added to the model later still reach the document.
    """
    doc: dict[str, Any] = {
        "format": FORMAT,
        "node": snapshot.node,
        "time": iso_time(wall_s if wall_s is not None else wall_time_s(snapshot.timestamp_s)),
        "timestamp_s": _num(snapshot.timestamp_s),
        "simulated": snapshot.simulated,
        "gpu_up": snapshot.gpu_up,
        "gpu_error": snapshot.gpu_error,
        "devices": [_device_to_dict(d) for d in snapshot.devices],
        "containers": [_container_to_dict(c) for c in snapshot.containers],
        "pods": [_flat(g) for g in snapshot.pods],
        "namespaces": [_flat(g) for g in snapshot.namespaces],
        "probe_counters": [_probe_to_dict(p) for p in snapshot.probe_counters],
        "notes": list(snapshot.notes),
    }
    for f in dataclasses.fields(snapshot):
        if f.name not in doc:
            doc[f.name] = _plain(getattr(snapshot, f.name))
    return doc


def dumps(snapshot: Snapshot, indent: int | None = 2, wall_s: float | None = None) -> str:
    """The JSON text of `snapshot` (strict JSON: no NaN)."""
    return json.dumps(snapshot_to_dict(snapshot, wall_s), indent=indent, ensure_ascii=False,
                      allow_nan=False)


# --------------------------------------------------------------------------- decode


def _expect_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SnapshotDocError(f"snapshot document: {where} must be an object, got {type(value).__name__}",
                               fix="produce the file with `gpuwatch top --once --json`")
    return value


def _expect_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise SnapshotDocError(f"snapshot document: {where} must be a list, got {type(value).__name__}",
                               fix="produce the file with `gpuwatch top --once --json`")
    return value


def _tuple_value(type_text: str, value: Any, where: str) -> Any:
    """A JSON value for a tuple-typed field: lists become tuples; an object becomes
    (key, value) pairs (keys converted to int when the field's pairs are int-keyed)."""
    if isinstance(value, dict) and type_text.startswith("tuple[tuple["):
        int_keys = type_text.startswith("tuple[tuple[int")
        try:
            return tuple((int(k) if int_keys else str(k), v) for k, v in value.items())
        except ValueError as err:
            raise SnapshotDocError(f"snapshot document: {where}: {err}") from err
    if isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


def _flat_from(cls: type[T], data: Any, where: str, **overrides: Any) -> T:
    """Build a flat dataclass from `data`, using defaults for missing optional fields."""
    data = _expect_dict(data, where)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif f.name in data:
            value = data[f.name]
            if str(f.type).startswith("tuple["):
                value = _tuple_value(str(f.type), value, f"{where}.{f.name}")
            kwargs[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SnapshotDocError(f"snapshot document: {where} lacks required field {f.name!r}",
                                   fix="produce the file with `gpuwatch top --once --json`")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise SnapshotDocError(f"snapshot document: {where}: {err}") from err


def _nan_if_none(value: Any) -> float:
    return math.nan if value is None else float(value)


def _device_from(data: Any, where: str) -> DeviceInfo:
    fields = _expect_dict(data, where).get("fields")
    nested = None if fields is None else _flat_from(DeviceFields, fields, f"{where}.fields")
    return _flat_from(DeviceInfo, data, where, fields=nested)


def _probe_from(data: Any, where: str) -> ProbeCounters:
    return _flat_from(ProbeCounters, data, where)


def _identity_from(data: Any, where: str) -> ContainerIdentity:
    data = _expect_dict(data, where)
    labels = tuple((str(k), str(v)) for k, v in _expect_list(data.get("labels"), f"{where}.labels"))
    return _flat_from(ContainerIdentity, data, where, labels=labels)


def _container_from(data: Any, where: str) -> ContainerUsage:
    data = _expect_dict(data, where)
    processes = tuple(_flat_from(ProcessUsage, p, f"{where}.processes[{i}]")
                      for i, p in enumerate(_expect_list(data.get("processes"), f"{where}.processes")))
    probe = data.get("probe")
    return _flat_from(
        ContainerUsage, data, where,
        identity=_identity_from(data.get("identity"), f"{where}.identity"),
        processes=processes,
        probe=_probe_from(probe, f"{where}.probe") if probe is not None else None,
        sm_utilization_ratio=_nan_if_none(data.get("sm_utilization_ratio", 0.0)),
        kernel_seconds_total=_nan_if_none(data.get("kernel_seconds_total", 0.0)),
    )


def _probe_identities_from(value: Any, where: str) -> tuple[tuple[int, ContainerIdentity], ...]:
    pairs = []
    for i, pair in enumerate(_expect_list(value, where)):
        pair = _expect_list(pair, f"{where}[{i}]")
        if len(pair) != 2:
            raise SnapshotDocError(f"snapshot document: {where}[{i}] must be [cgroup_id, identity]")
        pairs.append((int(pair[0]), _identity_from(pair[1], f"{where}[{i}][1]")))
    return tuple(pairs)


def _topology_from(data: Any, where: str) -> GpuTopology:
    data = _expect_dict(data, where)
    links = []
    for i, link in enumerate(_expect_list(data.get("links"), f"{where}.links")):
        link = _expect_dict(link, f"{where}.links[{i}]")
        level = link.get("level")
        try:
            level = TopologyLevel(int(level)) if level is not None else None
        except (TypeError, ValueError) as err:
            raise SnapshotDocError(f"snapshot document: {where}.links[{i}].level: {err}") from err
        links.append(_flat_from(GpuLink, link, f"{where}.links[{i}]", level=level))
    return _flat_from(GpuTopology, data, where, links=tuple(links))


def _each(data: dict[str, Any], name: str, prefix: str = "") -> list[tuple[str, Any]]:
    """The items of the list `data[name]` with the path each is at ("{prefix}{name}[i]")."""
    return [(f"{prefix}{name}[{i}]", v) for i, v in enumerate(_expect_list(data.get(name), f"{prefix}{name}"))]


def _with_identity(cls: type[T], data: dict[str, Any], name: str, prefix: str = "") -> tuple[T, ...]:
    """The list `data[name]` as `cls` rows whose `identity` is a nested ContainerIdentity object."""
    return tuple(_flat_from(cls, v, at, identity=_identity_from(_expect_dict(v, at).get("identity"),
                                                               f"{at}.identity"))
                 for at, v in _each(data, name, prefix))


def _signals_from(data: Any, where: str) -> NodeSignals:
    """NodeSignals from its document form (nested dataclasses, identities as objects)."""
    data = _expect_dict(data, where)

    def each(name: str) -> list[tuple[str, Any]]:
        return _each(data, name, f"{where}.")

    def with_identity(cls: type[T], name: str) -> tuple[T, ...]:
        return _with_identity(cls, data, name, f"{where}.")

    topology = data.get("topology")
    return _flat_from(
        NodeSignals, data, where,
        health=tuple(_flat_from(GpuHealth, v, at) for at, v in each("health")),
        topology=_topology_from(topology, f"{where}.topology") if topology is not None else None,
        nics=tuple(_flat_from(NicStats, v, at) for at, v in each("nics")),
        rdma_ports=tuple(_flat_from(RdmaPort, v, at) for at, v in each("rdma_ports")),
        container_xids=with_identity(ContainerXid, "container_xids"),
        container_network=with_identity(ContainerNetwork, "container_network"),
        errors_total=tuple((str(k), int(v)) for k, v in (_expect_list(data.get("errors_total"),
                                                                        f"{where}.errors_total"))),
    )


def snapshot_from_dict(data: Any) -> Snapshot:
    """Inverse of `snapshot_to_dict`; raises SnapshotDocError naming the bad field."""
    data = _expect_dict(data, "document")
    fmt = data.get("format", FORMAT)
    if not isinstance(fmt, str) or not fmt.startswith("gpuwatch.snapshot/"):
        raise SnapshotDocError(f"not a gpuwatch snapshot document (format {fmt!r})",
                               fix="produce the file with `gpuwatch top --once --json`")

    def items(name: str) -> list[Any]:
        return _expect_list(data.get(name), name)

    special: dict[str, Any] = {
        "timestamp_s": _nan_if_none(data.get("timestamp_s", 0.0)),
        "devices": tuple(_device_from(d, f"devices[{i}]") for i, d in enumerate(items("devices"))),
        "containers": tuple(_container_from(c, f"containers[{i}]")
                            for i, c in enumerate(items("containers"))),
        "pods": tuple(_flat_from(GroupUsage, g, f"pods[{i}]") for i, g in enumerate(items("pods"))),
        "namespaces": tuple(_flat_from(GroupUsage, g, f"namespaces[{i}]")
                            for i, g in enumerate(items("namespaces"))),
        "probe_counters": tuple(_probe_from(p, f"probe_counters[{i}]")
                                for i, p in enumerate(items("probe_counters"))),
        "notes": tuple(str(n) for n in items("notes")),
    }
    names = {f.name for f in dataclasses.fields(Snapshot)}
    if data.get("signals") is not None:
        special["signals"] = _signals_from(data["signals"], "signals")
    if "probe_identities" in names:
        special["probe_identities"] = _probe_identities_from(data.get("probe_identities"), "probe_identities")
    if "progress" in names:
        special["progress"] = _with_identity(ContainerProgress, data, "progress")
    if "enforcement" in names:
        special["enforcement"] = _with_identity(ContainerEnforcement, data, "enforcement")
    return _flat_from(Snapshot, data, "document", **{k: v for k, v in special.items() if k in names})


def loads(text: str, wall_clock: bool = False) -> Snapshot:
    """Parse a JSON document into a Snapshot; malformed JSON becomes SnapshotDocError.

    With `wall_clock`, a monotonic `timestamp_s` (meaningless outside the boot it came
    from) is replaced by the document's Unix "time", for showing a saved document.
    """
    try:
        data = parse_json(text, MAX_JSON_DEPTH)
    except JsonRejected as err:  # not JSON, or nested deeper than a snapshot ever is: never a traceback
        raise SnapshotDocError(f"snapshot document is not valid JSON ({err})",
                               fix="produce the file with `gpuwatch top --once --json`") from None
    snapshot = snapshot_from_dict(data)
    if wall_clock and snapshot.timestamp_s < UNIX_TIME_MIN_S:
        written = parse_iso_time(data.get("time"))
        if written is not None:
            snapshot = dataclasses.replace(snapshot, timestamp_s=written)
    return snapshot
