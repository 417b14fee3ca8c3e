"""The Python workload behind `gpuwatch sim run`: a GPU program for the simulated node.

It drives the stub libcuda through ctypes exactly as a CUDA program drives the real
driver (cuInit, cuCtxCreate, cuMemAlloc/cuMemFree, cuLaunchKernel), so every layer of
gpuwatch sees a real process doing real (simulated) GPU work:

* memory pattern: `hold` allocates `steps` x `mib_per_step` and keeps it; `leak` keeps
  allocating every interval until the device is full (or `steps` is reached); `free`
  allocates, holds for one interval and frees, in a loop; with `managed` the steps are
  cuMemAllocManaged (nvidia-uvm) instead of cuMemAlloc. How the stub turns them into
  driver calls (RM_ALLOC or VID_HEAP_CONTROL, chunks, context memory) is the
  environment's (`gpuwatch.sim.node.driver_env`, `gpuwatch sim run --alloc-path ...`);
* kernel duty: kernels of `kernel_ms` are launched with idle gaps so that the process
  is busy `duty` of the time -- the GPU-idle part of a training step (waiting for the input
  pipeline, the CPU's share of the step, host-device copies);
* pauses: with `pause_every_s` and `pause_s` the job stops launching for `pause_s` of wall
  time after every `pause_every_s` GPU-seconds of work (a checkpoint save or an evaluation
  pass on the host), GPU-idle as such phases are. The time in each phase (gpu: kernels
  running or waiting for the engine, input: the duty's gaps, pause) is printed at the end
  as `phases gpu=<s> input=<s> pause=<s>` -- what a test checks the job model against;
* memory warm-up: the `steps` are allocated `interval_s` apart while the job works (a
  caching allocator's pool growing over the first iterations), then held: the footprint
  plateaus;
* progress: a counter of completed work units (kernels + allocation steps), written to
  <sim root>/progress/<pid> (as "<count> <unix time>") and printed once a second --
  what progress-aware policies read;
* checkpoint: on the checkpoint signal (default SIGUSR1) it writes the marker file
  (its content is the progress count) and exits 0, unless told to keep running;
* amount of work: with `work_s` the job has that many GPU-seconds of kernels to run
  (kernel time done, not wall time: a job that gets half a GPU takes twice as long) and
  exits when they are done, printing `done <pid> <work_s>`;
* evaluation function (`ProgressModel`): a loss-like value as a function of the GPU work
  done so far -- exp, linear or log, with its own rate and start per job -- rewritten
  atomically (temp file + rename, one line) to `evaluation_file` a few times a second
  and printed as `evaluation <value> <work done s>` once a second. This is what a
  container declares with the gpuwatch.io/progress-file annotation.

Exit codes: 0 done or checkpointed, 2 out of GPU memory, 3 other CUDA error.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from gpuwatch.core.errors import SimError

CUDA_ERROR_OUT_OF_MEMORY = 2
EXIT_OOM = 2
EXIT_CUDA_ERROR = 3
PATTERNS = ("hold", "leak", "free")
MIB = 1024 * 1024
CURVES = ("exp", "linear", "log")
GOALS = ("minimize", "maximize")


@dataclass(frozen=True)
class ProgressModel:
    """A job's evaluation function as a function of the GPU work w (seconds) done so far.

    The loss-like curves, with rate K and start V0:
      exp     loss(w) = V0 * exp(-K w)           (gains K * loss per GPU-second)
      linear  loss(w) = max(0, V0 - K w)         (gains K per GPU-second until 0)
      log     loss(w) = max(0, V0 - K ln(1 + w)) (gains K / (1 + w) per GPU-second)
    goal "minimize" writes loss(w) (a loss falling from V0); "maximize" writes
    V0 - loss(w) (an accuracy-like score rising from 0 towards V0)."""

    curve: str = "exp"
    rate: float = 1.0
    start: float = 1.0
    goal: str = "minimize"

    def validate(self) -> None:
        if self.curve not in CURVES:
            raise SimError(f"unknown progress curve {self.curve!r}", fix=f"use one of {', '.join(CURVES)}")
        if self.goal not in GOALS:
            raise SimError(f"unknown progress goal {self.goal!r}", fix="use minimize or maximize")
        if not (math.isfinite(self.rate) and self.rate > 0 and math.isfinite(self.start) and self.start > 0):
            raise SimError(
                f"progress rate {self.rate} and start {self.start} must be positive numbers",
                fix="pass --progress-rate and --progress-start > 0",
            )

    def loss(self, work_s: float) -> float:
        w = max(0.0, work_s)
        if self.curve == "exp":
            return self.start * math.exp(-self.rate * w)
        if self.curve == "linear":
            return max(0.0, self.start - self.rate * w)
        return max(0.0, self.start - self.rate * math.log1p(w))

    def value(self, work_s: float) -> float:
        """What the job writes after `work_s` GPU-seconds of work."""
        loss = self.loss(work_s)
        return loss if self.goal == "minimize" else self.start - loss


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
    work_s: float = 0.0  # GPU-seconds of kernels to run, then exit 0 ("done"); 0: no end
    progress: ProgressModel | None = None  # the job's evaluation function, None: none
    evaluation_file: Path | None = None  # where the evaluation value is rewritten
    evaluation_interval_s: float = 0.2  # how often at most
    managed: bool = False  # allocate with cuMemAllocManaged (nvidia-uvm), not cuMemAlloc
    pause_every_s: float = 0.0  # GPU-seconds of work between GPU-idle pauses (checkpoint, eval); 0: none
    pause_s: float = 0.0  # wall seconds each pause lasts

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
        if not (math.isfinite(self.work_s) and self.work_s >= 0):
            raise SimError(f"work of {self.work_s} GPU-seconds is not >= 0", fix="pass --work-s >= 0")
        if self.work_s > 0 and self.duty <= 0:
            raise SimError("a job with --work-s runs kernels: its duty must be > 0", fix="pass --duty > 0")
        if self.progress is not None:
            self.progress.validate()
        if self.evaluation_file is not None and self.progress is None:
            raise SimError("--progress-file needs an evaluation function", fix="pass --progress-curve")
        if self.evaluation_interval_s <= 0:
            raise SimError("the evaluation interval must be > 0", fix="pass --progress-interval-s > 0")
        if not (math.isfinite(self.pause_every_s) and self.pause_every_s >= 0
                and math.isfinite(self.pause_s) and self.pause_s >= 0):
            raise SimError("pause-every-s and pause-s must be >= 0", fix="pass --pause-every-s / --pause-s >= 0")


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
        self.lib.cuMemAllocManaged.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.c_uint]
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

    def alloc(self, nbytes: int, managed: bool = False) -> int:
        ptr = ctypes.c_ulonglong()
        if managed:
            attach_global = 1  # CU_MEM_ATTACH_GLOBAL
            self.check(self.lib.cuMemAllocManaged(ctypes.byref(ptr), nbytes, attach_global),
                       f"cuMemAllocManaged({nbytes})")
        else:
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
        self.work_done_s = 0.0  # GPU-seconds of kernels completed
        self._work_complete = False
        self._last_evaluation = float("-inf")
        self.phase_s = {"gpu": 0.0, "input": 0.0, "pause": 0.0}  # wall time per phase while working
        self._next_pause_s = spec.pause_every_s if spec.pause_every_s > 0 else math.inf
        self._paused_s = 0.0  # of the pause in progress

    # -- reporting --
    def _say(self, line: str) -> None:
        print(line, file=self._out, flush=True)

    def _write_progress(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_report < 1.0:
            return
        self._last_report = now
        self._say(f"progress {self.progress}")
        if self.spec.progress is not None:
            self._say(f"evaluation {self.spec.progress.value(self.work_done_s):.9g} {self.work_done_s:.3f}")
        if self.spec.progress_file is not None:
            self._replace_line(self.spec.progress_file, f"{self.progress} {now:.3f}\n", "progress")

    def _write_evaluation(self, force: bool = False) -> None:
        """Rewrite the evaluation file: one line, replaced atomically (never seen half written)."""
        spec = self.spec
        if spec.progress is None or spec.evaluation_file is None:
            return
        now = time.monotonic()
        if not force and now - self._last_evaluation < spec.evaluation_interval_s:
            return
        self._last_evaluation = now
        self._replace_line(spec.evaluation_file, f"{spec.progress.value(self.work_done_s):.9g}\n", "evaluation")

    def _replace_line(self, path: Path, line: str, what: str) -> None:
        """Write `line` to `path` through a temporary file renamed over it (never seen half
        written); a failure is a warning line, not the end of the workload."""
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(line)
            tmp.replace(path)
        except OSError as err:
            self._say(f"warning: cannot write {what} file {path}: {err}")

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
            if self.work_done_s >= self._next_pause_s:
                if self._pause(until):
                    return True
                continue
            wait = self._next_kernel - time.monotonic()
            if wait > 0:
                nap = min(wait, left, 0.05)
                time.sleep(nap)
                self.phase_s["input"] += nap
                continue
            r0 = _runnable_s()
            w0 = time.monotonic()
            kernel_us = int(spec.kernel_ms * 1000)
            if spec.work_s > 0:
                kernel_us = max(1, min(kernel_us, round((spec.work_s - self.work_done_s) * 1e6)))
            self.cuda.kernel(kernel_us)
            self.phase_s["gpu"] += time.monotonic() - w0
            self.work_done_s += kernel_us / 1e6
            self.progress += 1
            self._write_progress()
            self._write_evaluation()
            if spec.work_s > 0 and self.work_done_s >= spec.work_s - 5e-7:
                self._work_complete = True
                return True
            # next kernel when busy / duty of wall time has passed (busy = the runnable
            # time the launch took, what the stub credits; at least the kernel's duration,
            # which is what it credits on a node whose kernels sleep), so busy / wall ==
            # duty however long launches or wake-ups took; at most 0.5 s of backlog
            busy_s = max(_runnable_s() - r0, kernel_us / 1e6)
            self._next_kernel = max(self._next_kernel + busy_s / spec.duty, time.monotonic() - 0.5)

    def _pause(self, until: float) -> bool:
        """A GPU-idle pause (checkpoint save, evaluation on the host) of `pause_s`, within the
        current spend (`until`); the rest of it carries over. True when asked to stop."""
        spec = self.spec
        end = time.monotonic() + spec.pause_s - self._paused_s
        while time.monotonic() < min(end, until):
            if self._checkpoint_if_asked():
                return True
            nap = min(end, until) - time.monotonic()
            if nap > 0:
                time.sleep(min(nap, 0.05))
                self.phase_s["pause"] += min(nap, 0.05)
        self._paused_s = spec.pause_s - max(end - time.monotonic(), 0.0)
        if time.monotonic() >= end:
            self._paused_s = 0.0
            self._next_pause_s += spec.pause_every_s
            self._next_kernel = time.monotonic()  # the step after a pause starts at once
        return self._lifetime_over()

    def _allocate(self, nbytes: int) -> None:
        self.held.append(self.cuda.alloc(nbytes, managed=self.spec.managed))
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
            self._write_evaluation(force=True)
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
        self._write_evaluation(force=True)
        if self._work_complete:
            phases = " ".join(f"{name}={seconds:.3f}" for name, seconds in self.phase_s.items())
            self._say(f"phases {phases}")
            self._say(f"done {os.getpid()} {self.work_done_s:.3f}")
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
