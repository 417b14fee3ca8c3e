"""Benchmark: the agent's memory beside nvitop-exporter's, on the same simulated node (issue 17, item 5).

    sudo .venv/bin/python benchmarks/bench_rss.py [--scales 8x200x4,2x10x1] [--duration-s 60] [--quick] [--json]

For each scale GPUSxCONTAINERSxPROCS (the shapes of the earlier side-by-side: 8 GPUs x 200
containers x 4 processes = 800 GPU processes, and 2 x 10 x 1 = 10) it brings up a simulated
node, starts CONTAINERS plain cgroups (each in its own network namespace, as pods) running PROCS
native `simworker` processes that hold GPU memory (as benchmarks/bench_pipeline.py does), and
then runs, at the same time and against the same fake libnvidia-ml:

* `gpuwatch agent` as deployed -- the real CLI with its default options, the exporter on
  loopback; only what points it at the simulated node is given (--nvml-library, the sim's
  device prefix and kernel log) plus private lock/state/audit paths. Kernel probes are on
  when this machine allows them (root + BCC + kernel headers: the log says which), as on a node;
* `gpuwatch agent --no-probes` (the same without the BPF side);
* `nvitop-exporter` from PyPI, installed by this benchmark into its own virtual environment
  under the cache directory (never a project dependency), made from the same base interpreter
  as the agent's, so both pay the same interpreter; it finds the fake NVML through
  LD_LIBRARY_PATH (libnvidia-ml.so.1), as any NVML tool on the simulated node does.

Each is scraped over HTTP once a second for DURATION seconds (after all serve); VmRSS and
RssAnon of each process are read from /proc once a second. Reported per scale: VmRSS and
RssAnon, peak (VmHWM for VmRSS, the largest sample for RssAnon) and at the end, and the
agent/nvitop-exporter ratios. Target (issue 17): agent RSS <= 0.8 x nvitop-exporter's at every
scale, for the end VmRSS of the agent as deployed and without probes; exit status 1 when missed.

Both run from byte-compiled modules, as installed packages do: pip compiles nvitop's at
install; the agent's bytecode goes to a cache directory (PYTHONPYCACHEPREFIX) compiled before
the run, because a checkout under PYTHONDONTWRITEBYTECODE (as CI sets) would otherwise compile
every gpuwatch module at each start, which leaves ~1 MiB more RSS than an installed agent has.

`--quick` (CI, < 60 s once nvitop-exporter is cached): the small scale only, 20 s of scrapes.
`--json`: one JSON object on stdout instead of the tables. Needs root (cgroups) and, the first
time, PyPI (pip) to install nvitop-exporter: exit status 3 with the reason when it cannot be
installed, 2 without root. Everything it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGET_RATIO = 0.8  # issue 17: agent RSS <= 0.8 x nvitop-exporter's
NVITOP_EXPORTER = "nvitop-exporter==1.7.2"  # the version of the side-by-side
SCALES = ((8, 200, 4), (2, 10, 1))
QUICK_SCALES = ((2, 10, 1),)
KIB = 1024
START_TIMEOUT_S = 120.0
EXIT_NO_ROOT = 2
EXIT_NO_NVITOP = 3


# ---- nvitop-exporter's environment -------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuwatch" / "bench-rss"


def base_interpreter() -> str:
    """The interpreter the agent's venv was made from (nvitop-exporter's venv is made from it too)."""
    return str(getattr(sys, "_base_executable", None) or sys.executable)


class NvitopUnavailable(RuntimeError):
    """nvitop-exporter could not be installed (no network, no PyPI)."""


def ensure_nvitop_exporter(requirement: str = NVITOP_EXPORTER) -> Path:
    """The nvitop-exporter executable of a venv under the cache directory, installed if needed.

    The venv is keyed by the requirement and the base interpreter; a broken one is remade.
    Raises NvitopUnavailable with pip's last lines when pip cannot install it."""
    tag = re.sub(r"[^A-Za-z0-9.]+", "-", f"{requirement}-py{sys.version_info[0]}.{sys.version_info[1]}")
    venv = cache_dir() / tag
    exe = venv / "bin" / "nvitop-exporter"
    if exe.exists() and subprocess.run([str(exe), "--version"], capture_output=True, timeout=60).returncode == 0:
        return exe
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([base_interpreter(), "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    if made.returncode != 0:
        raise NvitopUnavailable(f"python -m venv {venv} failed: {made.stderr.strip()[-500:]}")
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", requirement],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0 or not exe.exists():
        shutil.rmtree(venv, ignore_errors=True)
        lines = [line for line in (pip.stdout + pip.stderr).splitlines() if not line.startswith("WARNING")]
        raise NvitopUnavailable(f"pip install {requirement} failed (is PyPI reachable?): "
                                + " | ".join(lines[-5:]))
    return exe


def agent_bytecode_env(agent_src: Path | None = None) -> dict[str, str]:
    """Environment for running gpuwatch from bytecode compiled once into the cache (see docstring).

    `agent_src`: another checkout's root whose gpuwatch/ the agent runs instead (a before/after
    comparison against an older commit: `git worktree add /tmp/before <commit>`)."""
    prefix = cache_dir() / "pycache"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(prefix)
    source = (agent_src or ROOT).resolve()
    if agent_src is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source), env.get("PYTHONPATH", "")) if p)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(source / "gpuwatch")], env=env, check=True,
                   capture_output=True, timeout=300)
    return env


# ---- measuring ---------------------------------------------------------------------------

def read_status_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, VmHWM of a process in KiB ({} when it is gone)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    fields[key] = int(value.split()[0])
    except OSError:
        return {}
    return fields


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Exporter:
    """One exporter process under test and what was measured of it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    ready_marker: bytes  # a /metrics body with this is serving the node's GPUs
    proc: subprocess.Popen[bytes] | None = None
    samples: list[dict[str, int]] = field(default_factory=list)
    scrapes_ok: int = 0
    scrapes_failed: int = 0
    exposition_bytes: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self) -> None:
        with self.log_path.open("wb") as out:
            # cwd: not the checkout, whose gpuwatch/ `python -m` would put before PYTHONPATH (--agent-src)
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=self.log_path.parent, start_new_session=True)

    def ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        try:
            body = urllib.request.urlopen(self.url, timeout=5).read()
        except (urllib.error.URLError, OSError):
            return False
        return self.ready_marker in body

    def scrape(self) -> None:
        try:
            body = urllib.request.urlopen(self.url, timeout=10).read()
        except (urllib.error.URLError, OSError):
            self.scrapes_failed += 1
            return
        self.scrapes_ok += 1
        self.exposition_bytes = len(body)

    def sample(self) -> None:
        assert self.proc is not None
        status = read_status_kib(self.proc.pid)
        if status:
            self.samples.append(status)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"name": self.name, "samples": 0}
        end = self.samples[-1]
        return {
            "name": self.name, "samples": len(self.samples),
            "vmrss_end_mib": end["VmRSS"] / KIB, "vmrss_peak_mib": max(s["VmHWM"] for s in self.samples) / KIB,
            "rssanon_end_mib": end["RssAnon"] / KIB,
            "rssanon_peak_mib": max(s["RssAnon"] for s in self.samples) / KIB,
            "rssfile_end_mib": end["RssFile"] / KIB,
            "scrapes_ok": self.scrapes_ok, "scrapes_failed": self.scrapes_failed,
            "exposition_kib": self.exposition_bytes / KIB,
        }


def probes_state(log: str) -> str:
    """What the agent's log says about its kernel probes."""
    if "kernel probes attached" in log:
        return "on"
    if "probes disabled (--no-probes)" in log:
        return "off (--no-probes)"
    match = re.search(r"BPF unavailable: [^(]*\((.*)\)", log)
    return f"off ({match.group(1)[:120]})" if match else "off"


# ---- one scale ---------------------------------------------------------------------------

@contextlib.contextmanager
def simulated_node(gpus: int, containers: int, procs: int, work: Path) -> Iterator[Any]:
    """A simulated node with the containers' GPU processes running; everything stopped after."""
    from bench_pipeline import _stop_workers_first, _wait_for_processes

    from gpuwatch.sim import down, sim_env, up
    from gpuwatch.sim.runc import ContainerLab, ContainerSpec

    name = f"rss{os.getpid()}x{gpus}"
    state = work / "state"
    node = up(devices=gpus, name=name, memory_bytes=80 << 30, state_path=state, root=work / "simroot")
    try:
        env = sim_env(node)
        worker_env = {k: env[k] for k in ("LD_LIBRARY_PATH", "GPUWATCH_SIM_STATE", "GPUWATCH_SIM_ROOT",
                                          "GPUWATCH_SIM_LIBCUDA")}
        with ContainerLab(work / "lab") as lab:
            running = []
            t0 = time.monotonic()
            for c in range(containers):
                duty = 0.02 if c < 8 else 0.0  # a few also run kernels, as in bench_pipeline
                one = (f"{node.libraries.worker_path} --gpu {c % gpus} --mib-per-step 64 --duty {duty} "
                       f"--kernel-ms 2 >/dev/null")
                script = " & ".join([one] * procs) + " & wait"
                running.append(lab.run(ContainerSpec(name=f"rss-{c:03d}", argv=["unshare", "--net", "/bin/sh", "-c",
                                                                               script],
                                                     runtime="cgroup", env=worker_env,
                                                     cgroup_path=f"/{name}/c{c:03d}")))
            total = containers * procs
            ready = _wait_for_processes(node, total, timeout_s=180)
            print(f"  {ready}/{total} GPU processes ready in {time.monotonic() - t0:.1f} s", file=sys.stderr,
                  flush=True)
            try:
                yield node
            finally:
                _stop_workers_first(running)
    finally:
        down(name, state_path=state)


def run_scale(gpus: int, containers: int, procs: int, duration_s: float, nvitop_exe: Path,
              agent_env: dict[str, str]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-bench-rss-"))
    print(f"scale {gpus}x{containers}x{procs}: simulated node, {containers * procs} GPU processes",
          file=sys.stderr, flush=True)
    try:
        with simulated_node(gpus, containers, procs, work) as node:
            lib_dir = str(Path(node.libraries.nvml_path).parent)
            nvml_env = {**agent_env, "LD_LIBRARY_PATH": lib_dir, "GPUWATCH_SIM_STATE": str(node.state_path),
                        "GPUWATCH_SIM_ROOT": str(node.root)}
            exporters = []
            for label, extra in (("gpuwatch agent", []), ("gpuwatch agent --no-probes", ["--no-probes"])):
                tag = "probes" if not extra else "noprobes"
                port = free_port()
                env = {k: v for k, v in agent_env.items() if k != "LD_LIBRARY_PATH"}
                env["GPUWATCH_SIM_STATE"] = str(node.state_path)
                exporters.append(Exporter(
                    label, [sys.executable, "-m", "gpuwatch", "agent", f"--listen=127.0.0.1:{port}",
                            f"--nvml-library={node.libraries.nvml_path}",
                            f"--device-prefix={node.root}/dev/nvidia", f"--kmsg={node.kmsg_path}",
                            f"--lock-file={work}/{tag}.lock", f"--state-file={work}/{tag}-frozen.json",
                            f"--audit-log={work}/{tag}-audit.jsonl", *extra],
                    env, port, work / f"{tag}.log", ready_marker=b"gpuwatch_gpu_memory_used_bytes{"))
            port = free_port()
            nvitop_env = {k: v for k, v in nvml_env.items() if k != "PYTHONPYCACHEPREFIX"}
            exporters.append(Exporter("nvitop-exporter", [str(nvitop_exe), "--bind-address", "127.0.0.1",
                                                          "--port", str(port), "--interval", "1.0"],
                                      nvitop_env, port, work / "nvitop.log", ready_marker=b"gpu_memory_used"))
            try:
                for exporter in exporters:
                    exporter.start()
                deadline = time.monotonic() + START_TIMEOUT_S
                waiting = list(exporters)
                while waiting:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"not serving after {START_TIMEOUT_S:.0f} s: "
                                           + ", ".join(e.name for e in waiting))
                    waiting = [e for e in waiting if not e.ready()]
                    time.sleep(0.5)
                next_at = time.monotonic()
                end_at = next_at + duration_s
                while next_at < end_at:
                    for exporter in exporters:
                        exporter.scrape()
                        exporter.sample()
                    next_at += 1.0
                    time.sleep(max(0.0, next_at - time.monotonic()))
                logs = {e.name: e.log() for e in exporters}
            finally:
                for exporter in exporters:
                    exporter.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    agent, bare, nvitop = (e.summary() for e in exporters)
    agent["probes"] = probes_state(logs["gpuwatch agent"])
    bare["probes"] = probes_state(logs["gpuwatch agent --no-probes"])
    result: dict[str, Any] = {"scale": f"{gpus}x{containers}x{procs}", "gpus": gpus, "containers": containers,
                              "procs_per_container": procs, "gpu_processes": containers * procs,
                              "duration_s": duration_s, "exporters": [agent, bare, nvitop], "ratios": {}}
    for row in (agent, bare):
        if row.get("samples") and nvitop.get("samples"):
            result["ratios"][row["name"]] = {
                key: row[key] / nvitop[key] for key in ("vmrss_end_mib", "vmrss_peak_mib", "rssanon_end_mib",
                                                        "rssanon_peak_mib")}
    return result


# ---- report ------------------------------------------------------------------------------

def verdicts(results: list[dict[str, Any]]) -> list[tuple[str, float, bool]]:
    """(what, ratio, met) for every checked ratio: end VmRSS of both agent variants, every scale."""
    rows = []
    for result in results:
        for name in ("gpuwatch agent", "gpuwatch agent --no-probes"):
            ratio = result["ratios"].get(name, {}).get("vmrss_end_mib")
            if ratio is None:
                rows.append((f"{result['scale']} {name}", float("nan"), False))
            else:
                rows.append((f"{result['scale']} {name}", ratio, ratio <= TARGET_RATIO))
    return rows


def print_report(results: list[dict[str, Any]]) -> None:
    for result in results:
        print(f"\nscale {result['scale']} (GPUs x containers x processes = {result['gpu_processes']} GPU "
              f"processes), {result['duration_s']:.0f} s of 1 Hz scrapes")
        print(f"{'exporter':<30}{'VmRSS end':>10}{'peak':>8}{'RssAnon end':>12}{'peak':>8}"
              f"{'scrapes':>9}{'KiB':>7}  probes")
        for row in result["exporters"]:
            if not row.get("samples"):
                print(f"{row['name']:<30}  (no samples: it exited)")
                continue
            print(f"{row['name']:<30}{row['vmrss_end_mib']:>10.1f}{row['vmrss_peak_mib']:>8.1f}"
                  f"{row['rssanon_end_mib']:>12.1f}{row['rssanon_peak_mib']:>8.1f}"
                  f"{row['scrapes_ok']:>6}/{row['scrapes_ok'] + row['scrapes_failed']:<2}"
                  f"{row['exposition_kib']:>7.0f}  {row.get('probes', '')}")
        for name, ratios in result["ratios"].items():
            print(f"  {name} / nvitop-exporter: VmRSS end {ratios['vmrss_end_mib']:.2f}, peak "
                  f"{ratios['vmrss_peak_mib']:.2f}; RssAnon end {ratios['rssanon_end_mib']:.2f}, peak "
                  f"{ratios['rssanon_peak_mib']:.2f}")
    print(f"\n{'target: agent VmRSS (end) / nvitop-exporter':<58}{'ratio':>7}{'<=':>5}  met")
    for what, ratio, ok in verdicts(results):
        print(f"{what:<58}{ratio:>7.2f}{TARGET_RATIO:>5.1f}  {'yes' if ok else 'NO'}")
    print("MiB throughout (VmRSS peak = VmHWM). Same simulated node, same base interpreter, both from "
          "bytecode; the agent with its default options.")


def parse_scales(text: str) -> list[tuple[int, int, int]]:
    scales = []
    for part in text.split(","):
        numbers = part.strip().lower().split("x")
        if len(numbers) != 3 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise argparse.ArgumentTypeError(f"{part!r} is not GPUSxCONTAINERSxPROCS (e.g. 8x200x4)")
        scales.append((int(numbers[0]), int(numbers[1]), int(numbers[2])))
    return scales


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", type=parse_scales, default=list(SCALES),
                        help="comma-separated GPUSxCONTAINERSxPROCS (default 8x200x4,2x10x1)")
    parser.add_argument("--duration-s", type=float, default=60.0, help="seconds of 1 Hz scrapes per scale")
    parser.add_argument("--nvitop-exporter", default=NVITOP_EXPORTER, help="pip requirement to compare with")
    parser.add_argument("--quick", action="store_true", help="CI: 2x10x1 only, 20 s of scrapes")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout instead of tables")
    parser.add_argument("--agent-src", type=Path, default=None, metavar="DIR",
                        help="run the agent of another checkout (DIR/gpuwatch), e.g. a worktree of an "
                             "older commit for a before/after comparison")
    args = parser.parse_args()
    if args.quick:
        args.scales, args.duration_s = list(QUICK_SCALES), 20.0
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))  # clean up on the way out
    if os.geteuid() != 0:
        print("bench_rss needs root (it makes cgroups)", file=sys.stderr)
        return EXIT_NO_ROOT
    try:
        nvitop_exe = ensure_nvitop_exporter(args.nvitop_exporter)
    except (NvitopUnavailable, subprocess.TimeoutExpired) as err:
        print(f"bench_rss: cannot install nvitop-exporter: {err}", file=sys.stderr)
        return EXIT_NO_NVITOP
    agent_env = agent_bytecode_env(args.agent_src)
    results = [run_scale(g, c, p, args.duration_s, nvitop_exe, agent_env) for g, c, p in args.scales]
    met = all(ok for _, _, ok in verdicts(results))
    if args.json:
        print(json.dumps({"target_ratio": TARGET_RATIO, "met": met, "nvitop_exporter": args.nvitop_exporter,
                          "agent_src": str(args.agent_src or ROOT),
                          "interpreter": base_interpreter(), "results": results}))
    else:
        print_report(results)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
