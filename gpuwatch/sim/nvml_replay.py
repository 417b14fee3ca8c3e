"""Replay a recorded NVML stream (gpuwatch/sim/nvml_record.py) through the fake NVML.

`compile_recording` turns the JSON-lines recording into the flat little-endian file the fake
NVML maps (csrc/nvml.c "replay": header, then samples, process lists, their processes and
utilisation readings, each sorted by GPU and time, times relative to the recording's start);
`gpuwatch.sim.node.set_nvml_replay` names it in the node's state with an origin time.
`integrate_recording` is the reference a replay is checked against: each GPU seconds per
(GPU, pid) = sum of smUtil x the GPU's sample period over its samples, the period being the
median gap between the GPU's distinct sample timestamps.

Sample timestamps: NVML's are CPU time in microseconds; the compiler checks them against the
wall time of the calls that returned them and, when the two clocks differ by more than
CLOCK_SKEW_LIMIT_S, moves the samples onto the wall clock by the median difference.
Samples older than the recording's start (the first read returns the driver's whole ring)
are left out.
"""

from __future__ import annotations

import itertools
import json
import statistics
import struct
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.core.errors import SimError

MAGIC = b"GWNVRP01"
VERSION = 1
CLOCK_SKEW_LIMIT_S = 5.0
_HEADER = struct.Struct("<8sIIQIIII")
_SAMPLE = struct.Struct("<QIIII")  # ts_rel_us, device, pid, sm, mem
_SNAP = struct.Struct("<QIIII")  # wall_rel_us, device, count, first entry, pad
_ENTRY = struct.Struct("<QII")  # used bytes, pid, pad
_UTIL = struct.Struct("<QIIII")  # wall_rel_us, device, gpu %, memory %, pad


@dataclass(frozen=True)
class Sample:
    """One process-utilisation sample as recorded (timestamp on the wall clock, us)."""

    gpu: int
    pid: int
    timestamp_us: int
    sm_percent: int
    mem_percent: int


@dataclass(frozen=True)
class Recording:
    """A parsed recording: its start (s), end (s), GPUs, unique samples and the other answers."""

    started_s: float
    ended_s: float
    devices: int
    samples: tuple[Sample, ...]
    process_lists: tuple[tuple[float, int, tuple[tuple[int, int], ...]], ...]  # (t, gpu, ((pid, bytes), ...))
    utilization: tuple[tuple[float, int, int, int], ...]  # (t, gpu, gpu %, memory %)
    clock_offset_us: int  # added to the recorded sample timestamps (0: same clock as the calls)


@dataclass(frozen=True)
class ReplayInfo:
    devices: int
    samples: int
    duration_s: float


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise SimError(f"{path}:{n}: not JSON ({err})", fix="pass a file nvml_record.py wrote") from err


def load_recording(path: Path) -> Recording:
    """Parse a recording; samples deduplicated by (GPU, pid, timestamp)."""
    header: dict[str, Any] | None = None
    ended = 0.0
    raw: dict[tuple[int, int, int], tuple[int, int]] = {}
    skews: list[float] = []
    procs: list[tuple[float, int, tuple[tuple[int, int], ...]]] = []
    utils: list[tuple[float, int, int, int]] = []
    for rec in _lines(path):
        kind = rec.get("kind")
        t = float(rec.get("t", 0.0))
        ended = max(ended, float(rec.get("t_end", t)))
        if kind == "header":
            header = rec
        elif kind == "ProcessUtilization" and rec.get("samples"):
            newest = max(s[1] for s in rec["samples"])
            skews.append(float(rec.get("t_end", t)) * 1e6 - newest)
            for pid, ts, sm, mem, *_ in rec["samples"]:
                raw[(int(rec["gpu"]), int(pid), int(ts))] = (int(sm), int(mem))
        elif kind == "ComputeRunningProcesses" and rec.get("rc") == "SUCCESS":
            procs.append((t, int(rec["gpu"]), tuple((int(p), int(m or 0)) for p, m in rec["processes"])))
        elif kind == "UtilizationRates" and rec.get("rc") == "SUCCESS":
            utils.append((t, int(rec["gpu"]), int(rec["gpu_util"]), int(rec["memory_util"])))
    if header is None:
        raise SimError(f"{path} has no header line", fix="pass a file nvml_record.py wrote")
    started = float(header["started"])
    offset = statistics.median(skews) if skews else 0.0
    offset_us = round(offset) if abs(offset) > CLOCK_SKEW_LIMIT_S * 1e6 else 0
    start_us = started * 1e6
    samples = tuple(sorted(
        (Sample(gpu, pid, ts + offset_us, sm, mem) for (gpu, pid, ts), (sm, mem) in raw.items()
         if ts + offset_us >= start_us),
        key=lambda s: (s.gpu, s.timestamp_us, s.pid)))
    return Recording(started_s=started, ended_s=max(ended, started), devices=len(header.get("devices", [])),
                     samples=samples, process_lists=tuple(sorted(procs, key=lambda p: (p[1], p[0]))),
                     utilization=tuple(sorted(utils, key=lambda u: (u[1], u[0]))), clock_offset_us=offset_us)


def sample_period_us(samples: list[Sample]) -> float:
    """A GPU's sample period as its samples show it: the median gap between distinct timestamps."""
    stamps = sorted({s.timestamp_us for s in samples})
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return float(statistics.median(gaps)) if gaps else 1e6 / 6


def integrate_recording(recording: Recording, *, after_us: dict[int, int] | None = None,
                        until_us: dict[int, int] | None = None) -> dict[tuple[int, int], float]:
    """GPU seconds per (GPU, pid): sum of smUtil/100 x the GPU's sample period over the samples
    with a timestamp in (after_us[gpu], until_us[gpu]] (recorded wall clock; default: all)."""
    by_gpu: dict[int, list[Sample]] = defaultdict(list)
    for s in recording.samples:
        by_gpu[s.gpu].append(s)
    out: dict[tuple[int, int], float] = defaultdict(float)
    for gpu, samples in by_gpu.items():
        period_s = sample_period_us(samples) / 1e6
        lo = (after_us or {}).get(gpu, 0)
        hi = (until_us or {}).get(gpu, 1 << 62)
        for s in samples:
            if lo < s.timestamp_us <= hi:
                out[(gpu, s.pid)] += s.sm_percent / 100.0 * period_s
    return dict(out)


def compile_recording(path: Path, out: Path) -> ReplayInfo:
    """Write the fake NVML's replay file for the recording at `path`; what it holds."""
    rec = load_recording(path)
    start_us = round(rec.started_s * 1e6)

    def rel(t_s: float) -> int:
        return max(0, round(t_s * 1e6) - start_us)

    samples = b"".join(_SAMPLE.pack(max(0, s.timestamp_us - start_us), s.gpu, s.pid, s.sm_percent, s.mem_percent)
                       for s in rec.samples)
    snaps: list[bytes] = []
    entries: list[bytes] = []
    for t, gpu, plist in rec.process_lists:
        snaps.append(_SNAP.pack(rel(t), gpu, len(plist), len(entries), 0))
        entries.extend(_ENTRY.pack(mem, pid, 0) for pid, mem in plist)
    utils = b"".join(_UTIL.pack(rel(t), gpu, g, m, 0) for t, gpu, g, m in rec.utilization)
    duration_us = rel(rec.ended_s)
    header = _HEADER.pack(MAGIC, VERSION, rec.devices, duration_us, len(rec.samples), len(snaps), len(entries),
                          len(rec.utilization))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(header + samples + b"".join(snaps) + b"".join(entries) + utils)
    tmp.replace(out)  # a reader that mapped the old file keeps it; the new one is whole
    return ReplayInfo(devices=rec.devices, samples=len(rec.samples), duration_s=duration_us / 1e6)
