"""Record NVML's raw per-process answers on a GPU host while a command runs (RECORDING.md).

    python3 nvml_record.py --out run.jsonl [--interval-s 0.5] [--nvml-library PATH] -- COMMAND...
    gpuwatch sim record-nvml --out run.jsonl -- COMMAND...      (the same, through the CLI)

Needs nothing but the Python standard library and nvidia-ml-py (pynvml), so it can be copied
to a GPU host on its own. Every `--interval-s`, for every GPU, it writes one JSON line per call
with the wall time before and after it and the answer as the driver gave it:

* ``ProcessUtilization``: ``nvmlDeviceGetProcessUtilization(handle, lastSeen)`` with lastSeen =
  the newest sample timestamp seen on that GPU so far (0 at the first read, which returns the
  whole ring: history from before the recording), every sample as
  ``[pid, timeStamp_us, smUtil, memUtil, encUtil, decUtil]``, ``rc`` ("SUCCESS", "NOT_FOUND" =
  no sample newer than lastSeen, or the error's name), the call's thread CPU time;
* ``ComputeRunningProcesses``: ``[[pid, usedGpuMemory], ...]`` (None for N/A memory);
* ``UtilizationRates``: the device's ``gpu`` and ``memory`` percentages.

The first line is a header (devices, driver, the command, the start time), the last an ``end``
line with the command's exit status. The recorder starts reading before the command and keeps
reading for `--tail-s` after it exits, so the last periods' samples are in the file.
`gpuwatch sim replay-nvml FILE` replays such a file through the simulated node's fake NVML.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

# The recorder is a stand-alone tool for GPU hosts (pynvml + stdlib, nothing of gpuwatch), so it
# calls NVML itself instead of going through gpuwatch/gpu/nvml.py.
import pynvml  # noqa: TID251

FORMAT_VERSION = 1


def _rc_name(err: pynvml.NVMLError) -> str:
    return "NOT_FOUND" if err.value == pynvml.NVML_ERROR_NOT_FOUND else f"ERROR_{err.value}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Recorder:
    """The reads of one recording: per GPU, the newest sample timestamp seen so far."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.last_seen_us = [0] * len(self.handles)

    def _write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")

    def header(self, command: list[str], interval_s: float) -> None:
        devices = []
        for i, h in enumerate(self.handles):
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            devices.append({"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)),
                            "uuid": _text(pynvml.nvmlDeviceGetUUID(h)), "pci_bus_id": _text(pci.busId)})
        self._write({"kind": "header", "version": FORMAT_VERSION, "started": time.time(),
                     "host": socket.gethostname(), "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                     "nvml": _text(pynvml.nvmlSystemGetNVMLVersion()), "devices": devices,
                     "command": command, "interval_s": interval_s})

    def read_all(self) -> None:
        """One round: the three calls on every GPU."""
        for i, h in enumerate(self.handles):
            self._process_utilization(i, h)
            t = time.time()
            try:
                procs = [[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
                self._write({"kind": "ComputeRunningProcesses", "t": t, "t_end": time.time(), "gpu": i,
                             "rc": "SUCCESS", "processes": procs})
            except pynvml.NVMLError as err:
                self._write({"kind": "ComputeRunningProcesses", "t": t, "gpu": i, "rc": _rc_name(err)})
            t = time.time()
            try:
                u = pynvml.nvmlDeviceGetUtilizationRates(h)
                self._write({"kind": "UtilizationRates", "t": t, "t_end": time.time(), "gpu": i, "rc": "SUCCESS",
                             "gpu_util": u.gpu, "memory_util": u.memory})
            except pynvml.NVMLError as err:
                self._write({"kind": "UtilizationRates", "t": t, "gpu": i, "rc": _rc_name(err)})
        self.out.flush()

    def _process_utilization(self, i: int, h: Any) -> None:
        last_seen = self.last_seen_us[i]
        t, cpu = time.time(), time.thread_time()
        try:
            raw = pynvml.nvmlDeviceGetProcessUtilization(h, last_seen)
            rc = "SUCCESS"
        except pynvml.NVMLError as err:
            raw, rc = [], _rc_name(err)
        cpu_us = (time.thread_time() - cpu) * 1e6
        samples = [[s.pid, s.timeStamp, s.smUtil, s.memUtil, s.encUtil, s.decUtil] for s in raw]
        if samples:
            self.last_seen_us[i] = max(last_seen, max(s[1] for s in samples))
        self._write({"kind": "ProcessUtilization", "t": t, "t_end": time.time(), "gpu": i,
                     "last_seen_us": last_seen, "rc": rc, "cpu_us": round(cpu_us, 1), "samples": samples})


def record(out_path: Path, command: list[str], *, interval_s: float = 0.5, tail_s: float = 1.0,
           library: str | None = None) -> int:
    """Record while `command` runs (or for `tail_s` when it is empty); returns its exit status."""
    if library:  # pynvml then finds this library by its soname
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    pynvml.nvmlInit()
    rc = 0
    try:
        with open(out_path, "w") as out:
            rec = Recorder(out)
            rec.header(command, interval_s)
            rec.read_all()  # before the command: the ring's history, and where lastSeen starts
            proc = subprocess.Popen(command) if command else None
            next_read = time.monotonic() + interval_s
            while proc is not None and proc.poll() is None:
                time.sleep(max(0.0, min(next_read - time.monotonic(), 0.05)))
                if time.monotonic() >= next_read:
                    rec.read_all()
                    next_read += interval_s
            rc = proc.returncode if proc is not None else 0
            tail_end = time.monotonic() + tail_s
            while time.monotonic() < tail_end:  # the last periods are published after they end
                time.sleep(min(interval_s, max(0.0, tail_end - time.monotonic())))
                rec.read_all()
            out.write(json.dumps({"kind": "end", "t": time.time(), "rc": rc}) + "\n")
    finally:
        pynvml.nvmlShutdown()
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON-lines file to write")
    parser.add_argument("--interval-s", type=float, default=0.5, help="seconds between reads (default 0.5)")
    parser.add_argument("--tail-s", type=float, default=1.0, help="keep reading this long after the command")
    parser.add_argument("--nvml-library", default=os.environ.get("GPUWATCH_NVML_LIBRARY"),
                        help="libnvidia-ml.so.1 to load (default: the system's)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return record(args.out, command, interval_s=args.interval_s, tail_s=args.tail_s, library=args.nvml_library)


if __name__ == "__main__":
    sys.exit(main())
