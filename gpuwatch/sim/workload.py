"""The Python workload behind `gpuwatch sim run`: a GPU program for the simulated node.

It drives the stub libcuda through ctypes exactly as a CUDA program drives the real
driver (cuInit, cuCtxCreate, cuMemAlloc/cuMemFree, cuLaunchKernel), so every layer of
gpuwatch sees a real process doing real (simulated) GPU work:

* memory pattern: `hold` allocates `steps` x `mib_per_step` and keeps it; `leak` keeps
  allocating every interval until the device is full (or `steps` is reached); `free`
  allocates, holds for one interval and frees, in a loop;
* kernel duty: kernels of `kernel_ms` are launched with idle gaps so that the process
  is busy `duty` of the time;
* progress: a counter of completed work units (kernels + allocation steps), written to
  <sim root>/progress/<pid> (as "<count> <unix time>") and printed once a second --
  what progress-aware policies read;
* checkpoint: on the checkpoint signal (default SIGUSR1) it writes the marker file
  (its content is the progress count) and exits 0, unless told to keep running.

Exit codes: 0 done or checkpointed, 2 out of GPU memory, 3 other CUDA error.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from gpuwatch.errors import SimError

CUDA_ERROR_OUT_OF_MEMORY = 2
EXIT_OOM = 2
EXIT_CUDA_ERROR = 3
PATTERNS = ("hold", "leak", "free")
MIB = 1024 * 1024


@dataclass(frozen=True)
class WorkloadSpec:
    """What one workload does; defaults hold 1 GiB on GPU 0 with no kernels."""

    gpu: int = 0
    mib_per_step: float = 1024.0
    steps: int = 1
    interval_s: float = 1.0
    pattern: str = "hold"
    duty: float = 0.0
    kernel_ms: float = 10.0
    lifetime_s: float = 0.0  # 0: until killed (hold) / until OOM or steps done (leak)
    progress_file: Path | None = None
    checkpoint_signal: int = int(signal.SIGUSR1)
    checkpoint_marker: Path | None = None
    exit_on_checkpoint: bool = True

    def validate(self) -> None:
        if self.pattern not in PATTERNS:
            raise SimError(f"unknown memory pattern {self.pattern!r}", fix=f"use one of {', '.join(PATTERNS)}")
        if not 0.0 <= self.duty <= 1.0:
            raise SimError(f"duty {self.duty} is outside 0..1", fix="pass --duty between 0 and 1")
        if self.kernel_ms <= 0 or self.interval_s < 0 or self.steps < 0 or self.mib_per_step < 0:
            raise SimError(
                "kernel-ms must be > 0; interval-s, steps and mib-per-step >= 0",
                fix="check the numbers passed to `gpuwatch sim run`",
            )


class StubCuda:
    """Thin ctypes binding of the stub libcuda's driver API (checked results)."""

    def __init__(self, path: str) -> None:
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as err:
            raise SimError(
                f"cannot load the stub libcuda ({path}): {err}",
                fix="run `gpuwatch sim up` and launch workloads with `gpuwatch sim run`",
            ) from err
        self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t]
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_ulonglong]
        self.lib.cuLaunchKernel.argtypes = (
            [ctypes.c_void_p]
            + [ctypes.c_uint] * 7
            + [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        )
        self._kernel_us = ctypes.c_uint64(0)
        self._params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(self._kernel_us), ctypes.c_void_p))

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CudaCallFailed(rc, what)

    def open_device(self, gpu: int) -> None:
        self.check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), gpu), f"cuDeviceGet({gpu})")
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc_v2({nbytes})")
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check(self.lib.cuMemFree_v2(ptr), "cuMemFree_v2")

    def kernel(self, duration_us: int) -> None:
        """One kernel of `duration_us` of work (the stub's convention: kernelParams[0])."""
        self._kernel_us.value = duration_us
        self.check(
            self.lib.cuLaunchKernel(ctypes.c_void_p(1), 1, 1, 1, 1, 1, 1, 0, None, self._params, None),
            "cuLaunchKernel",
        )


class CudaCallFailed(Exception):
    def __init__(self, code: int, what: str) -> None:
        super().__init__(f"{what} failed with CUDA error {code}")
        self.code = code


def stub_cuda_path() -> str:
    """The stub to load: GPUWATCH_SIM_LIBCUDA, else the soname via LD_LIBRARY_PATH."""
    return os.environ.get("GPUWATCH_SIM_LIBCUDA") or "libcuda.so.1"


class Workload:
    """Runs one WorkloadSpec in this process."""

    def __init__(self, spec: WorkloadSpec, cuda: StubCuda, out: TextIO | None = None) -> None:
        spec.validate()
        self.spec = spec
        self.cuda = cuda
        self.progress = 0
        self.held: list[int] = []
        self.held_bytes = 0
        self._checkpoint_requested = False
        self._last_report = 0.0
        self._deadline: float | None = None
        self._next_kernel = time.monotonic()
        self._out = out or sys.stdout

    # -- reporting --
    def _say(self, line: str) -> None:
        print(line, file=self._out, flush=True)

    def _write_progress(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_report < 1.0:
            return
        self._last_report = now
        self._say(f"progress {self.progress}")
        path = self.spec.progress_file
        if path is None:
            return
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(f"{self.progress} {now:.3f}\n")
            tmp.replace(path)
        except OSError as err:
            self._say(f"warning: cannot write progress file {path}: {err}")

    # -- checkpoint --
    def _on_checkpoint(self, signum: int, frame: FrameType | None) -> None:
        self._checkpoint_requested = True

    def _checkpoint_if_asked(self) -> bool:
        """Write the marker when a checkpoint was requested; True when we should exit."""
        if not self._checkpoint_requested:
            return False
        self._checkpoint_requested = False
        marker = self.spec.checkpoint_marker
        if marker is not None:
            marker.write_text(f"{self.progress}\n")
        self._say(f"checkpoint {self.progress}")
        return self.spec.exit_on_checkpoint

    # -- main loop --
    def _lifetime_over(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _spend(self, seconds: float) -> bool:
        """Spend `seconds` (capped by the lifetime) at the commanded duty.

        Returns True when the workload should stop (checkpoint or end of lifetime)."""
        spec = self.spec
        until = time.monotonic() + seconds
        if self._deadline is not None:
            until = min(until, self._deadline)
        while True:
            if self._checkpoint_if_asked():
                return True
            left = until - time.monotonic()
            if left <= 0:
                return self._lifetime_over()
            if spec.duty <= 0:
                time.sleep(min(left, 0.05))
                continue
            wait = self._next_kernel - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, left, 0.05))
                continue
            r0 = _runnable_s()
            self.cuda.kernel(int(spec.kernel_ms * 1000))
            self.progress += 1
            self._write_progress()
            # next kernel when busy / duty of wall time has passed (busy = the runnable
            # time the launch took, what the stub credits), so busy / wall == duty
            # however long launches or wake-ups took; at most 0.5 s of backlog
            self._next_kernel = max(self._next_kernel + (_runnable_s() - r0) / spec.duty, time.monotonic() - 0.5)

    def _allocate(self, nbytes: int) -> None:
        self.held.append(self.cuda.alloc(nbytes))
        self.held_bytes += nbytes
        self.progress += 1
        self._write_progress()

    def _allocation_phase(self) -> bool:
        """Run the memory pattern's steps. Returns True when asked to stop."""
        spec = self.spec
        step_bytes = int(spec.mib_per_step * MIB)
        if step_bytes == 0:
            return False
        step = 0
        while spec.steps == 0 or step < spec.steps:
            if spec.pattern == "free":
                self._allocate(step_bytes)
                if self._spend(spec.interval_s):
                    return True
                self.cuda.free(self.held.pop())
                self.held_bytes -= step_bytes
            else:
                self._allocate(step_bytes)
                last = spec.steps != 0 and step + 1 >= spec.steps
                if not last and self._spend(spec.interval_s):
                    return True
            step += 1
            if spec.steps == 0 and spec.pattern == "hold":
                break  # hold with steps=0 means one step
        return False

    def run(self) -> int:
        """Run the workload; its progress file is removed when it exits on its own."""
        try:
            return self._run()
        finally:
            if self.spec.progress_file is not None:
                self.spec.progress_file.unlink(missing_ok=True)

    def _run(self) -> int:
        spec = self.spec
        signal.signal(spec.checkpoint_signal, self._on_checkpoint)
        self._deadline = time.monotonic() + spec.lifetime_s if spec.lifetime_s > 0 else None
        try:
            self.cuda.open_device(spec.gpu)
            if not self._allocation_phase():
                self._say(f"ready {os.getpid()} {self.held_bytes}")
                while not self._spend(0.25):
                    pass
        except CudaCallFailed as err:
            self._write_progress(force=True)
            if err.code == CUDA_ERROR_OUT_OF_MEMORY:
                self._say(f"oom {os.getpid()} {self.held_bytes}")
                return EXIT_OOM
            self._say(f"error: {err}")
            return EXIT_CUDA_ERROR
        self._write_progress(force=True)
        for ptr in self.held:
            self.cuda.free(ptr)
        return 0


def _runnable_s() -> float:
    """Runnable time of this thread: CPU time + run-queue wait (schedstat field 2)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            delay_ns = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        delay_ns = 0
    return (time.thread_time_ns() + delay_ns) / 1e9


def default_progress_file() -> Path | None:
    """<sim root>/progress/<pid> when the sim root is known and writable."""
    root = os.environ.get("GPUWATCH_SIM_ROOT")
    if not root:
        return None
    directory = Path(root) / "progress"
    return directory / str(os.getpid()) if directory.is_dir() and os.access(directory, os.W_OK) else None


def run_workload(spec: WorkloadSpec) -> int:
    """Run `spec` in this process against the node named by the environment."""
    return Workload(spec, StubCuda(stub_cuda_path())).run()
