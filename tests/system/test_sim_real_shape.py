"""The simulated node speaks like real CUDA by default (issue 16, item 3).

cuda_exercise (gpuwatch/sim/csrc/cuda_exercise.c) runs on the simulated node with the
stub's default settings under the ioctl recorder, and the trace is compared with the one
the same program left on a real H100 (driver 580.159.04, CUDA 13.0; committed under
tests/fixtures/traces/real/, described in ../shared/real-gpu/README.md section 1),
step by step -- a step being the calls between two checkpoints, named by the checkpoint
that ends it:

* every RM_ALLOC is NVOS64 (48 bytes) with paramsSize 0, in both traces;
* the class-0x40 (video memory) RM_ALLOCs of every step are as many as the real ones: the
  context's 17, one for the 1 KiB cuMemAlloc (a 2 MiB object) and none for the 1 MiB one
  carved from it, one each for 2 MiB and 1 GiB, none for managed memory (no RM_ALLOC at
  all there), one for each pool allocation and for cuMemCreate; class 0x3E (the pool's
  system memory) likewise outside context creation;
* NVML's per-process number at every checkpoint, by name, equals the real one (518 MiB
  after each context, 520 after the 1 KiB allocation, ...), and in the sim it is the sum of
  the class-0x40 objects the trace shows alive (sizes from the captured parameters, freed
  by handle or with their parent), context memory included.

Not compared, because the sim does not issue them (gpuwatch/sim/README.md "Driver
traffic"): the context's other objects (the real context makes 97 RM_ALLOCs on nvidiactl --
channels, copy engines, 26 class-0x3E system-memory objects, ... -- and 8 on nvidia0), its
RM_CONTROLs, nvidia-uvm range traffic, handle values, pointers, and the device's used
memory (the real GPU had other tenants). The real trace holds no allocation sizes (its
recorder followed paramsSize 0), so sizes are checked in the sim's trace only.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuwatch.sim import sim_env
from gpuwatch.sim.node import DEFAULT_CONTEXT_MIB, driver_env
from gpuwatch.sim.tracefile import Checkpoint, Ioctl, Trace, read_trace, rm_allocs_in
from tests.system.sim_helpers import MIB, private_node
from tests.system.test_recorder import Programs, programs, recorder_env  # noqa: F401 (fixture)

REAL = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "traces"
    / "real"
    / "580.159.04-nvidia-h100-80gb-hbm3"
    / "cuda_exercise.jsonl"
)
MEMORY_LOCAL_USER = 0x40
MEMORY_SYSTEM = 0x3E
NVOS64_BYTES = 48
RM_FREE_NR = 0x29
CONTEXT_STEPS = ("context", "second-context")  # steps that create a context


@dataclass
class Step:
    """The RM traffic between two checkpoints, and the checkpoint that ends it."""

    name: str
    nvml_process_bytes: int | None  # GPU 0 (None: NVML does not list the process)
    classes: list[int] = field(default_factory=list)  # hClass of each RM_ALLOC
    params: list[tuple[int, int]] = field(default_factory=list)  # (NVOS bytes, paramsSize) of each
    live_video_bytes: int = 0  # sum of the live class-0x40 objects at the checkpoint (sizes captured)


def steps_of(trace: Trace) -> list[Step]:
    """The trace cut at its checkpoints; live class-0x40 objects followed through RM_ALLOC
    (size NV_MEMORY_ALLOCATION_PARAMS.size@64 of the captured block's after image, when
    captured) and RM_FREE (of the object or of an ancestor)."""
    steps: list[Step] = []
    current = Step(name="", nvml_process_bytes=None)
    parent: dict[int, int] = {}
    video: dict[int, int] = {}  # handle -> bytes
    for event in trace.events:
        if isinstance(event, Checkpoint):
            current.name = event.name
            current.nvml_process_bytes = event.nvml[0]["process_used_bytes"]
            current.live_video_bytes = sum(video.values())
            steps.append(current)
            current = Step(name="", nvml_process_bytes=None)
            continue
        if not isinstance(event, Ioctl):
            continue
        for alloc in rm_allocs_in(event):
            image = event.params.before or event.params.after
            h_parent, h_new = int.from_bytes(image[4:8], "little"), int.from_bytes(image[8:12], "little")
            current.classes.append(alloc.hclass)
            current.params.append((len(event.params.after), alloc.params_size))
            parent[h_new] = h_parent
            if alloc.hclass == MEMORY_LOCAL_USER and alloc.status == 0 and alloc.params is not None:
                video[h_new] = int.from_bytes(alloc.params.after[64:72], "little")
        if (event.cmd >> 8) & 0xFF == 0x46 and event.cmd & 0xFF == RM_FREE_NR:
            freed = int.from_bytes((event.params.before or event.params.after)[8:12], "little")
            for handle in list(video):
                h = handle
                while h in parent and h != freed:
                    h = parent[h] if parent[h] != h else -1
                if h == freed:
                    del video[handle]
    return steps


@pytest.fixture(scope="module")
def real_steps() -> list[Step]:
    return steps_of(read_trace(REAL))


@pytest.fixture(scope="module")
def sim_trace(tmp_path_factory: pytest.TempPathFactory, programs: Programs) -> Trace:  # noqa: F811
    """cuda_exercise on a one-GPU simulated node, the stub's defaults, under the recorder."""
    tmp_path = tmp_path_factory.mktemp("real-shape")
    with private_node(tmp_path, devices=1) as node:
        env = sim_env(node, dict(os.environ))
        for name in driver_env():  # the stub's own defaults: nothing chosen by the environment
            env.pop(name, None)
        env.pop("GPUWATCH_SIM_CTX_TEARDOWN", None)
        trace_dir = tmp_path / "traces"
        env = recorder_env(env, programs, trace_dir, f"{node.root}/dev/nvidia")
        proc = subprocess.run([str(programs.exercise), "--device", "0"], env=env, capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skip" not in proc.stdout, proc.stdout  # the stub implements every step the real run made
    (trace,) = trace_dir.glob("*.jsonl")
    return read_trace(trace)


@pytest.fixture(scope="module")
def sim_steps(sim_trace: Trace) -> list[Step]:
    return steps_of(sim_trace)


def test_same_checkpoints(real_steps: list[Step], sim_steps: list[Step]) -> None:
    assert [s.name for s in sim_steps] == [s.name for s in real_steps]
    assert len(real_steps) == 22


def test_every_rm_alloc_is_nvos64_with_params_size_zero(real_steps: list[Step], sim_steps: list[Step]) -> None:
    for steps in (real_steps, sim_steps):
        params = {p for s in steps for p in s.params}
        assert params == {(NVOS64_BYTES, 0)}, params


def test_nvml_per_process_bytes_equal_the_real_ones_at_every_checkpoint(
    real_steps: list[Step], sim_steps: list[Step]
) -> None:
    real = {s.name: s.nvml_process_bytes for s in real_steps}
    sim = {s.name: s.nvml_process_bytes for s in sim_steps}
    assert sim == real
    # the numbers the issue names, in MiB
    mib = {name: None if b is None else b // MIB for name, b in sim.items()}
    assert (mib["init"], mib["context"], mib["alloc-1k"], mib["alloc-1m"], mib["alloc-2m"], mib["alloc-1g"]) == (
        None, 518, 520, 520, 522, 1546)
    assert (mib["free-1k"], mib["free-1m"], mib["free-1g"], mib["managed-64m"], mib["second-context"]) == (
        1546, 1544, 518, 518, 518)


def test_video_memory_objects_per_step_are_the_real_ones(real_steps: list[Step], sim_steps: list[Step]) -> None:
    for real, sim in zip(real_steps, sim_steps, strict=True):
        assert sim.classes.count(MEMORY_LOCAL_USER) == real.classes.count(MEMORY_LOCAL_USER), real.name
        if real.name not in CONTEXT_STEPS:  # the context's own system memory is not simulated
            assert sim.classes.count(MEMORY_SYSTEM) == real.classes.count(MEMORY_SYSTEM), real.name
    by_name = {s.name: s for s in sim_steps}
    one, none = [MEMORY_LOCAL_USER], []
    assert [c for c in by_name["alloc-1k"].classes if c == MEMORY_LOCAL_USER] == one
    assert by_name["alloc-1m"].classes == none  # carved from the 1 KiB allocation's 2 MiB object
    assert by_name["alloc-2m"].classes == one and by_name["alloc-1g"].classes == one
    assert by_name["managed-64m"].classes == none  # nvidia-uvm only
    assert sorted(by_name["async-32m"].classes) == [MEMORY_SYSTEM, MEMORY_LOCAL_USER]
    assert by_name["vmm-created"].classes == one and by_name["vmm-mapped"].classes == none
    assert by_name["context"].classes.count(MEMORY_LOCAL_USER) == 17


def test_nvml_is_the_sum_of_the_live_video_memory_objects(sim_steps: list[Step]) -> None:
    for step in sim_steps:
        assert (step.nvml_process_bytes or 0) == step.live_video_bytes, step.name
    by_name = {s.name: s for s in sim_steps}
    assert by_name["context"].live_video_bytes == DEFAULT_CONTEXT_MIB * MIB
    assert by_name["second-context"].live_video_bytes == DEFAULT_CONTEXT_MIB * MIB
