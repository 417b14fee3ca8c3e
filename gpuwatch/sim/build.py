"""Compile the simulated node's C (fake NVML, stub libcuda, simworker) on demand.

The sources in gpuwatch/sim/csrc are compiled with the system C compiler into a cache
directory keyed by a hash of the sources and flags, so a changed source rebuilds and
an unchanged one is reused. Builds go to a temporary directory that is renamed into
place, so concurrent callers (parallel tests, several agents) never see a half-built
library: the first rename wins, later builders discard their copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.core.errors import SimError

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("simstate.h", "simstate.c", "nvml.c", "cuda.c", "simworker.c")
# -fno-omit-frame-pointer: every exported function starts with `push %rbp`, which
# uprobes emulate instead of single-stepping (single steps are slow under hypervisors).
_CFLAGS = (
    "-O2",
    "-g",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-omit-frame-pointer",
    "-std=gnu11",
)
_APT_FIX = "apt-get install gcc libc6-dev"


@dataclass(frozen=True)
class SimLibraries:
    """Paths of one build of the simulated node's native parts."""

    lib_dir: Path
    nvml_path: Path
    cuda_path: Path
    worker_path: Path


def default_cache_root() -> Path:
    """Where builds are cached: GPUWATCH_SIM_CACHE, else /var/cache (root) or ~/.cache."""
    env = os.environ.get("GPUWATCH_SIM_CACHE")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/gpuwatch/sim")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "gpuwatch" / "sim"


def _compiler() -> str:
    wanted = os.environ.get("CC")
    cc = shutil.which(wanted) if wanted else shutil.which("cc") or shutil.which("gcc")
    if not cc:
        what = f"the C compiler CC={wanted!r}" if wanted else "a C compiler (cc)"
        raise SimError(f"cannot build the simulated GPU libraries: {what} is not installed", fix=_APT_FIX)
    return cc


def sources_digest(cc: str = "") -> str:
    """Hash of the C sources, the flags and the compiler: the cache key."""
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((CSRC_DIR / name).read_bytes())
    h.update(" ".join(_CFLAGS).encode())
    h.update(cc.encode())
    return h.hexdigest()[:16]


def _libraries_in(lib_dir: Path) -> SimLibraries:
    return SimLibraries(
        lib_dir=lib_dir,
        nvml_path=lib_dir / "libnvidia-ml.so.1",
        cuda_path=lib_dir / "libcuda.so.1",
        worker_path=lib_dir / "simworker",
    )


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [line for line in detail if "error" in line]
        last = (errors or detail or [f"exit {proc.returncode}"])[0]
        fix = _APT_FIX if "stdio.h" in proc.stderr or "crt1.o" in proc.stderr else "report this build error"
        raise SimError(f"building the simulated GPU libraries failed: {last}", fix=fix)


def _compile_into(cc: str, out: Path) -> None:
    src = CSRC_DIR
    flags = list(_CFLAGS)
    _run(
        [
            cc,
            *flags,
            "-shared",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            str(out / "libnvidia-ml.so.1"),
            str(src / "nvml.c"),
            str(src / "simstate.c"),
            "-lpthread",
        ]
    )
    _run(
        [
            cc,
            *flags,
            "-shared",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out / "libcuda.so.1"),
            str(src / "cuda.c"),
            str(src / "simstate.c"),
            "-lpthread",
        ]
    )
    _run(
        [
            cc,
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fno-omit-frame-pointer",
            "-o",
            str(out / "simworker"),
            str(src / "simworker.c"),
            f"-L{out}",
            "-l:libcuda.so.1",
            "-Wl,-rpath,$ORIGIN",
        ]
    )
    # unversioned names for programs that dlopen("libcuda.so") / ("libnvidia-ml.so")
    (out / "libcuda.so").symlink_to("libcuda.so.1")
    (out / "libnvidia-ml.so").symlink_to("libnvidia-ml.so.1")
    for path in out.iterdir():
        if not path.is_symlink():
            path.chmod(0o755)
    out.chmod(0o755)


def build_sim_libraries(cache_root: Path | None = None) -> SimLibraries:
    """Return a build of the sim libraries for the current sources, compiling if needed."""
    cc = _compiler()
    root = cache_root or default_cache_root()
    final = root / sources_digest(cc)
    libs = _libraries_in(final)
    if libs.worker_path.exists() and libs.nvml_path.exists() and libs.cuda_path.exists():
        return libs
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SimError(
            f"cannot create the sim build cache {root}: {err}",
            fix="set GPUWATCH_SIM_CACHE to a writable directory",
        ) from err
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _compile_into(cc, tmp)
        try:
            tmp.rename(final)
        except OSError:
            # another builder won the race; its result is identical
            if not libs.worker_path.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return libs
