"""`gpuwatch sim`: a simulated GPU node for tests, benchmarks and demos.

Imports of the sim package happen inside the commands so `gpuwatch --help` stays fast.
"""

from __future__ import annotations

import os
import signal as signal_mod
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

_NODE_OPTION = click.option(
    "--name",
    "name",
    default="default",
    show_default=True,
    help="Node name; several simulated nodes can be up at once.",
)


def _shown(flag: str, default: object, help_text: str, param_type: click.ParamType | None = None) -> _Decorator:
    """An option whose default `--help` shows (most of `sim up` and `sim run`)."""
    return click.option(flag, default=default, show_default=True, type=param_type, help=help_text)


def _choice(flag: str, choices: list[str], help_text: str) -> _Decorator:
    """A choice option whose default, shown in `--help`, is the first choice."""
    return click.option(flag, type=click.Choice(choices), default=choices[0], show_default=True, help=help_text)


def _parse_size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError as err:
        raise click.BadParameter(f"{text!r} is not a size (examples: 80GiB, 512MiB, 1073741824)") from err


@click.group("sim")
def sim() -> None:
    """Simulated GPU node (clearly labelled "gpuwatch-sim") for tests, benchmarks, demos.

    A fake libnvidia-ml.so.1 and a stub libcuda.so.1 share one state file in /dev/shm:
    workloads allocate memory and run "kernels" (CPU burns) through the stub, and every
    NVML tool pointed at the fake sees exactly that. Kernels on one GPU contend for it:
    one context at a time, time-sliced (or up to N at once with `sim up --mps N`). Device nodes named like NVIDIA's
    (nvidiactl, nvidia0.., nvidia-uvm) live under the sim root and receive real-encoded
    driver ioctls, so the kernel probes work too.

    \b
    gpuwatch sim up --devices 2            # two simulated H100s
    gpuwatch sim run --mib-per-step 4096 --duty 0.5 &
    gpuwatch sim run --duty 0.8 --work-s 30 --progress-curve exp --progress-rate 0.2 \\
        --progress-file /tmp/loss &    # a job with 30 GPU-seconds of work and a loss curve
    gpuwatch sim status
    eval "$(gpuwatch sim env)"             # point NVML tools (nvitop, pynvml) at it
    gpuwatch sim fault xid --gpu 0 --code 79 --pid 1234
    gpuwatch sim down
    """


@sim.command("up")
@_NODE_OPTION
@_shown("--devices", 2, "Number of GPUs.", click.IntRange(1, 8))
@_shown("--model", "H100 80GB HBM3", 'Model name (devices are named "gpuwatch-sim <model>").')
@_shown("--memory", "80GiB", "Memory per device.")
@_choice("--rm-alloc-params", ["nvos64", "nvos21"], "Parameter layout of the RM_ALLOC ioctls the stub issues.")
@click.option(
    "--rm-device-handles",
    is_flag=True,
    help="Kept for compatibility: contexts always allocate the client, device, subdevice and VA space now.",
)
@_choice("--topology", ["pcie", "nvlink-pairs", "nvswitch"],
         "GPU interconnect: PCIe only, NVLink bridges between GPU pairs, or NVSwitches.")
@_shown("--mps", 1, "Contexts whose kernels run at once on one GPU: 1 = time-sliced, N > 1 = MPS-like.",
        click.IntRange(1, 8))
@_shown("--timeslice-ms", 2.0, "Run time after which a kernel yields the GPU to a waiting context.",
        click.FloatRange(0.1, 1000))
@click.option(
    "--sample-period-ms",
    default=1000.0 / 6,
    show_default="166.7 (1/6 s)",
    type=click.FloatRange(10, 1000),
    help="NVML process-utilisation sample period (NVML documents 1/6 s to 1 s); the ring holds 72.",
)
@_choice("--nvml-cost", ["off", "h100-580"],
         "CPU each fake NVML call burns in the caller: off, or what the call took on an H100 with driver 580.")
@_choice("--kernel-host", ["spin", "sleep"],
         "What a running kernel does to its host thread: spin (one host CPU per busy GPU) or sleep (the GPU's "
         "work costs the host nothing, as on a node with enough cores per GPU).")
def up_cmd(
    name: str,
    devices: int,
    model: str,
    memory: str,
    rm_alloc_params: str,
    rm_device_handles: bool,
    topology: str,
    mps: int,
    timeslice_ms: float,
    sample_period_ms: float,
    nvml_cost: str,
    kernel_host: str,
) -> None:
    """Bring a simulated node up (re-creating it resets its ledger and kernel log).

    Kernels launched on one simulated GPU contend for it: one context runs at a time and
    co-tenants take turns every --timeslice-ms of run time (waiting is not busy time, so
    a GPU's utilisation never exceeds 100%); with --mps N up to N contexts run at once.
    NVML's per-process samples follow the real driver's: one per --sample-period-ms period a
    process ran in, a ring of 72; --nvml-cost h100-580 makes every NVML call cost its real CPU.
    A running kernel spins its host thread (--kernel-host spin: one host CPU per busy GPU) or
    sleeps (sleep: for many busy GPUs on a machine with few cores)."""
    from gpuwatch.sim import node as simnode

    n = simnode.up(
        devices=devices,
        model=model,
        memory_bytes=_parse_size(memory),
        name=name,
        rm_alloc_params=rm_alloc_params,
        rm_device_handles=rm_device_handles,
        topology=topology,
        mps=mps,
        timeslice_ms=timeslice_ms,
        sample_period_ms=sample_period_ms,
        nvml_cost=nvml_cost,
        kernel_host=kernel_host,
    )
    sharing = f"MPS-like, {mps} contexts at once" if mps > 1 else f"time-sliced every {n.timeslice_ms:g} ms"
    click.echo(f"sim node {n.name!r} up: {n.device_count} x gpuwatch-sim {model}, {memory} each, {topology}, "
               f"{sharing}")
    click.echo(f"  nvml samples every {n.sample_period_ms:.1f} ms (ring of 72), call cost model: {n.nvml_cost}, "
               f"kernels {n.kernel_host} on the host")
    click.echo(f"  state  {n.state_path}")
    click.echo(f"  root   {n.root}  (device nodes in {n.dev_dir})")
    click.echo(f"  kmsg   {n.kmsg_path}  (Xid kernel-log records)")
    click.echo(f"  libs   {n.libraries.lib_dir}")
    click.echo(f"  nvml   {n.libraries.nvml_path}")
    click.echo(f'use it:  eval "$(gpuwatch sim env --name {n.name})"')


@sim.command("down")
@_NODE_OPTION
def down_cmd(name: str) -> None:
    """Remove a simulated node (state file and sim root)."""
    from gpuwatch.sim import node as simnode

    if simnode.down(name):
        click.echo(f"sim node {name!r} down")
    else:
        click.echo(f"sim node {name!r} was not up")


@sim.command("status")
@_NODE_OPTION
def status_cmd(name: str) -> None:
    """Devices and the per-process memory ledger of a simulated node."""
    from gpuwatch.sim import node as simnode

    node = simnode.get_node(name)
    st = simnode.status(node)
    gib = 1024**3
    sharing = f"MPS-like ({node.mps} contexts at once)" if node.mps > 1 else \
        f"time-sliced ({node.timeslice_ms:g} ms)"
    click.echo(f"topology {st.node.topology}, {sharing}, kernel log {st.node.kmsg_path}")
    for d in st.devices:
        flags = (" LOST" if d.lost else "") + (" ROW-REMAP-FAILURE" if d.row_remap_failure else "")
        eng = simnode.engine(node, d.index)
        click.echo(
            f"GPU {d.index}  {d.name}  {d.uuid}  {d.memory_used_bytes / gib:.2f} / "
            f"{d.memory_total_bytes / gib:.2f} GiB  util {d.utilization_percent}%{flags}  "
            f"engine: {len(eng.holder_pids)} running, {eng.waiters} waiting, {eng.yields_total} hand-overs, "
            f"{eng.steals_total} taken from stopped holders"
        )
        for p in (p for p in st.processes if p.device == d.index):
            ns = f" (pid {p.ns_pid} in its namespace)" if p.ns_pid != p.host_pid else ""
            click.echo(
                f"  pid {p.host_pid}{ns}  {p.memory_bytes / 2**20:.0f} MiB ({p.rm_objects} driver objects, "
                f"{p.context_bytes / 2**20:.0f} MiB context, {p.managed_bytes / 2**20:.0f} MiB managed; "
                f"{p.requested_bytes / 2**20:.1f} MiB asked for) in {p.allocations} allocations, "
                f"{p.kernel_launches} kernels, {p.busy_seconds_total:.1f} s busy, "
                f"{p.engine_wait_seconds_total:.1f} s waiting for the GPU"
            )


@sim.command("replay-nvml")
@_NODE_OPTION
@click.argument("recording", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_shown("--delay-s", 0.0, "Start the replay this many seconds from now.")
@click.option("--stop", is_flag=True, help="Stop a replay: the node's own processes answer again.")
def replay_nvml_cmd(name: str, recording: Path | None, delay_s: float, stop: bool) -> None:
    """Answer NVML's per-process calls from a recording (`gpuwatch sim record-nvml`).

    The recorded GPUs' process samples, process lists and utilisation replace the node's own,
    time-shifted so the recording starts now (+ --delay-s); see gpuwatch/sim/RECORDING.md."""
    import time

    from gpuwatch.sim import node as simnode
    from gpuwatch.sim import nvml_replay

    node = simnode.get_node(name)
    if stop or recording is None:
        simnode.set_nvml_replay(node, None)
        click.echo(f"sim node {name!r}: NVML replay stopped")
        return
    compiled = node.root / "nvml-replay.bin"
    info = nvml_replay.compile_recording(recording, compiled)
    simnode.set_nvml_replay(node, compiled, time.time() + delay_s)
    click.echo(f"sim node {name!r}: replaying {recording} ({info.devices} GPUs, {info.samples} samples, "
               f"{info.duration_s:.1f} s) from {delay_s:g} s from now")


@sim.command("record-nvml", context_settings={"ignore_unknown_options": True})
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="JSON-lines file to write.")
@_shown("--interval-s", 0.5, "Seconds between reads (the driver's ring holds 12 s at 1/6 s).",
        click.FloatRange(0.05, 6.0))
@click.option("--nvml-library", default=None, help="libnvidia-ml.so.1 to load (default: the system's).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def record_nvml_cmd(out: Path, interval_s: float, nvml_library: str | None, command: tuple[str, ...]) -> None:
    """Record NVML's raw per-process answers while COMMAND runs (GPU hosts; pynvml only).

    Same program as gpuwatch/sim/nvml_record.py (runs on its own with pynvml): every --interval-s, per GPU,
    nvmlDeviceGetProcessUtilization (all samples newer than the last seen),
    nvmlDeviceGetComputeRunningProcesses and nvmlDeviceGetUtilizationRates, with wall times."""
    from gpuwatch.sim import nvml_record

    sys.exit(nvml_record.record(out, list(command), interval_s=interval_s, library=nvml_library))


@sim.command("env")
@_NODE_OPTION
def env_cmd(name: str) -> None:
    """Print shell exports that point CUDA/NVML programs at the simulated node."""
    from gpuwatch.sim import node as simnode

    n = simnode.get_node(name)
    for key, value in simnode.sim_env(n, {"LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", "")}).items():
        click.echo(f"export {key}='{value}'")


@sim.command("fault")
@_NODE_OPTION
@click.argument("kind", type=click.Choice(["xid", "lost", "ecc", "row-remap-failure", "clear"]))
@click.option("--gpu", required=True, type=int, help="Device index.")
@click.option("--code", "--xid", "code", default=79, show_default=True, help="Xid code (kind xid).")
@click.option(
    "--pid",
    type=click.IntRange(min=1),
    default=None,
    help="Process the kernel-log Xid record names (default: pid='<unknown>').",
)
@_shown("--count", 1, "ECC error count (kind ecc).")
@click.option("--uncorrected", is_flag=True, help="ECC errors are uncorrectable (double bit).")
def fault_cmd(name: str, kind: str, gpu: int, code: int, pid: int | None, count: int, uncorrected: bool) -> None:
    """Inject a fault: xid (NVML XID event + kernel-log record), lost (GPU falls off the
    bus, Xid 79), ecc, row-remap-failure, or clear (a GPU reset)."""
    from gpuwatch.sim import node as simnode

    simnode.inject_fault(
        simnode.get_node(name), kind, gpu, xid=code, count=count, uncorrected=uncorrected, pid=pid
    )
    click.echo(f"injected {kind} on GPU {gpu} of sim node {name!r}")


def _signal_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        pass
    key = text.upper() if text.upper().startswith("SIG") else f"SIG{text.upper()}"
    sig = getattr(signal_mod, key, None)
    if not isinstance(sig, signal_mod.Signals):
        raise click.BadParameter(f"unknown signal {text!r}")
    return int(sig)


@sim.command("run")
@_NODE_OPTION
@_shown("--gpu", 0, "CUDA device ordinal (after CUDA_VISIBLE_DEVICES).")
@_shown("--mib-per-step", 1024.0, "MiB allocated per step.")
@_shown("--steps", 1, "Allocation steps (0: unlimited for leak/free).")
@_shown("--interval-s", 1.0, "Seconds between steps.")
@click.option("--hold", "pattern", flag_value="hold", default=True, help="Allocate the steps, then hold (default).")
@click.option("--leak", "pattern", flag_value="leak", help="Keep allocating every interval (until OOM or steps).")
@click.option("--free", "pattern", flag_value="free", help="Allocate, hold one interval, free; repeat.")
@_shown("--duty", 0.0, "Fraction of time running kernels.", click.FloatRange(0, 1))
@_shown("--kernel-ms", 10.0, "Length of one kernel.")
@_shown("--lifetime-s", 0.0, "Exit after this long (0: run until killed).")
@_shown("--checkpoint-signal", "SIGUSR1", "Signal that asks the workload to checkpoint.")
@click.option(
    "--checkpoint-marker",
    type=click.Path(path_type=Path),
    default=None,
    help="File written on checkpoint (content: the progress count).",
)
@click.option("--keep-running-after-checkpoint", is_flag=True, help="Do not exit after writing the marker.")
@_shown("--work-s", 0.0, "GPU-seconds of kernel work the job has; it exits 0 when they are done (0: no end).",
        click.FloatRange(min=0))
@click.option(
    "--progress-curve",
    type=click.Choice(["exp", "linear", "log"]),
    default=None,
    help="Evaluation function of the work done w: exp V0*e^(-Kw), linear V0-Kw, log V0-K*ln(1+w).",
)
@_shown("--progress-rate", 1.0, "K of the curve.")
@_shown("--progress-start", 1.0, "V0 of the curve.")
@_choice("--progress-goal", ["minimize", "maximize"],
         "minimize writes the loss; maximize writes V0 - loss (a score rising from 0).")
@click.option(
    "--progress-file",
    type=click.Path(path_type=Path),
    default=None,
    help="File the evaluation value is rewritten to (atomically, one line), as the job sees it.",
)
@_shown("--progress-interval-s", 0.2, "How often at most the progress file is rewritten.", click.FloatRange(min=0.01))
@_choice("--alloc-path", ["rm-alloc", "vid-heap"],
         "Driver call that creates memory objects: RM_ALLOC (class 0x40) or VID_HEAP_CONTROL (ALLOC_SIZE).")
@_shown("--suballoc-mib", 2,
        "N: cuMemAllocs below N MiB carved from N-MiB chunks (2: real CUDA); 0: one driver allocation per cuMemAlloc.",
        click.IntRange(0, 1 << 20))
@_shown("--context-mib", 518,
        "Memory the context allocates for itself as class-0x40 objects (518: a real H100 context; 0: none).",
        click.IntRange(0, 1 << 20))
@_choice("--rm-params-size", ["zero", "class"],
         "RM_ALLOC paramsSize: zero (real libcuda: RM sizes the parameters by class) or the class's size.")
@click.option("--managed", is_flag=True, help="Allocate with cuMemAllocManaged (nvidia-uvm) instead of cuMemAlloc.")
@_shown("--pause-every-s", 0.0,
        "GPU-seconds of work between GPU-idle pauses (a checkpoint save, an evaluation; 0: none).",
        click.FloatRange(min=0))
@_shown("--pause-s", 0.0, "Wall seconds each pause lasts.", click.FloatRange(min=0))
def run_cmd(
    name: str,
    gpu: int,
    mib_per_step: float,
    steps: int,
    interval_s: float,
    pattern: str,
    duty: float,
    kernel_ms: float,
    lifetime_s: float,
    checkpoint_signal: str,
    checkpoint_marker: Path | None,
    keep_running_after_checkpoint: bool,
    work_s: float,
    progress_curve: str | None,
    progress_rate: float,
    progress_start: float,
    progress_goal: str,
    progress_file: Path | None,
    progress_interval_s: float,
    alloc_path: str,
    suballoc_mib: int,
    context_mib: int,
    rm_params_size: str,
    managed: bool,
    pause_every_s: float,
    pause_s: float,
) -> None:
    """Run a GPU workload on the simulated node in this process.

    Prints "ready <pid> <bytes>" once its memory is allocated, "progress <n>" once a
    second, "checkpoint <n>" on the checkpoint signal and "oom <pid> <bytes>" when the
    device is full (exit status 2). Progress also goes to <sim root>/progress/<pid>.

    With --work-s the job has that many GPU-seconds of kernels (kernel time, not wall
    time: on a shared GPU it takes longer) and exits 0 after printing "done <pid> <s>".
    With --progress-curve it evaluates a loss-like function of the work done, writes it
    to --progress-file and prints "evaluation <value> <work done s>" once a second.
    A training step's GPU-idle parts: --duty (input wait, the CPU's part of a step) and
    --pause-every-s / --pause-s (a checkpoint save or evaluation every so many GPU-seconds);
    "phases gpu=<s> input=<s> pause=<s>" is printed before "done".

    --alloc-path, --suballoc-mib, --context-mib and --rm-params-size choose the driver
    traffic the stub libcuda issues (and so what NVML counts: the driver's objects at their
    rounded sizes); the defaults are real CUDA's, see gpuwatch/sim/README.md "Driver traffic".
    """
    from gpuwatch.sim import node as simnode
    from gpuwatch.sim import workload

    if progress_file is not None and progress_curve is None:
        raise click.UsageError("--progress-file needs an evaluation function: pass --progress-curve")
    if work_s > 0 and duty <= 0:
        raise click.UsageError("a job with --work-s runs kernels: pass --duty > 0")
    if "GPUWATCH_SIM_STATE" not in os.environ or name != "default":
        n = simnode.get_node(name)
        os.environ.update(simnode.sim_env(n, {}))
    elif not Path(os.environ["GPUWATCH_SIM_STATE"]).exists():
        raise click.ClickException("sim is not up: run `gpuwatch sim up`")
    if "GPUWATCH_SIM_LIBCUDA" not in os.environ:
        os.environ["GPUWATCH_SIM_LIBCUDA"] = str(simnode.get_node(name).libraries.cuda_path)
    os.environ.update(
        simnode.driver_env(
            alloc_path=alloc_path, suballoc_mib=suballoc_mib, context_mib=context_mib, rm_params_size=rm_params_size
        )
    )
    model = None
    if progress_curve is not None:
        model = workload.ProgressModel(
            curve=progress_curve, rate=progress_rate, start=progress_start, goal=progress_goal
        )
    spec = workload.WorkloadSpec(
        gpu=gpu,
        mib_per_step=mib_per_step,
        steps=steps,
        interval_s=interval_s,
        pattern=pattern,
        duty=duty,
        kernel_ms=kernel_ms,
        lifetime_s=lifetime_s,
        progress_file=workload.default_progress_file(),
        checkpoint_signal=_signal_number(checkpoint_signal),
        checkpoint_marker=checkpoint_marker,
        exit_on_checkpoint=not keep_running_after_checkpoint,
        work_s=work_s,
        progress=model,
        evaluation_file=progress_file,
        evaluation_interval_s=progress_interval_s,
        managed=managed,
        pause_every_s=pause_every_s,
        pause_s=pause_s,
    )
    sys.exit(workload.run_workload(spec))


def _register_replay() -> None:
    from gpuwatch.cli.sim_replay import replay_cmd  # click only: the sim package loads in the command

    sim.add_command(replay_cmd)


_register_replay()
