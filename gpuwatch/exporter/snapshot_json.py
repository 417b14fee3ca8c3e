"""Snapshot <-> JSON document, for `/snapshot.json` (so `gpuwatch top` can attach to a
running agent) and `gpuwatch top --json`.

The document is the Snapshot's fields, nested as they are in the model; tuples become
lists. `snapshot_from_dict` rebuilds the immutable model exactly, so a consumer reading
the document sees the same values the agent published.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gpuwatch.model import (
    ContainerIdentity,
    ContainerUsage,
    DeviceInfo,
    GroupUsage,
    ProbeCounters,
    ProcessUsage,
    Snapshot,
)

SCHEMA_VERSION = 1


def snapshot_to_dict(snapshot: Snapshot) -> dict[str, Any]:
    document = dataclasses.asdict(snapshot)
    document["schema_version"] = SCHEMA_VERSION
    return document


def snapshot_to_json(snapshot: Snapshot) -> str:
    return json.dumps(snapshot_to_dict(snapshot), separators=(",", ":"))


def _identity(d: dict[str, Any]) -> ContainerIdentity:
    return ContainerIdentity(**{k: _tuplify(v) for k, v in d.items()})


def _tuplify(value: Any) -> Any:
    """JSON lists back to the model's tuples (nested pairs included)."""
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value


def _probe(d: dict[str, Any]) -> ProbeCounters:
    return ProbeCounters(**{k: _tuplify(v) for k, v in d.items()})


def _container(d: dict[str, Any]) -> ContainerUsage:
    return ContainerUsage(**{
        **d,
        "identity": _identity(d["identity"]),
        "processes": tuple(ProcessUsage(**p) for p in d.get("processes", ())),
        "probe": _probe(d["probe"]) if d.get("probe") else None,
    })


def snapshot_from_dict(d: dict[str, Any]) -> Snapshot:
    """Rebuild a Snapshot from `snapshot_to_dict` output (unknown keys are ignored)."""
    known = {f.name for f in dataclasses.fields(Snapshot)}
    fields = {k: v for k, v in d.items() if k in known}
    fields["devices"] = tuple(DeviceInfo(**x) for x in d.get("devices", ()))
    fields["containers"] = tuple(_container(x) for x in d.get("containers", ()))
    fields["pods"] = tuple(GroupUsage(**x) for x in d.get("pods", ()))
    fields["namespaces"] = tuple(GroupUsage(**x) for x in d.get("namespaces", ()))
    fields["probe_counters"] = tuple(_probe(x) for x in d.get("probe_counters", ()))
    fields["probe_identities"] = tuple((int(cg), _identity(i)) for cg, i in d.get("probe_identities", ()))
    fields["notes"] = tuple(d.get("notes", ()))
    return Snapshot(**fields)


def snapshot_from_json(text: str) -> Snapshot:
    return snapshot_from_dict(json.loads(text))
