"""Building the simulated node's C on demand: cache, reuse, concurrency, errors."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest

from gpuwatch.core.errors import SimError
from gpuwatch.sim.build import SimLibraries, build_sim_libraries, sources_digest


def test_build_produces_loadable_libraries_and_worker(tmp_path: Path) -> None:
    libs = build_sim_libraries(tmp_path)
    assert libs.lib_dir.parent == tmp_path
    for path in (libs.nvml_path, libs.cuda_path, libs.worker_path):
        assert path.is_file()
    nvml = ctypes.CDLL(str(libs.nvml_path))
    cuda = ctypes.CDLL(str(libs.cuda_path))
    for symbol in ("nvmlInitWithFlags", "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlEventSetWait_v2"):
        assert hasattr(nvml, symbol)
    for symbol in ("cuInit", "cuMemAlloc_v2", "cuLaunchKernelEx", "cuGetProcAddress_v2"):
        assert hasattr(cuda, symbol)
    # unimplemented NVML entry points are absent, so callers get "function not found"
    assert not hasattr(nvml, "nvmlDeviceGetVgpuMetadata")
    # internal helpers are not exported
    assert not hasattr(cuda, "sim_open")


def test_second_build_reuses_the_cache(tmp_path: Path) -> None:
    first = build_sim_libraries(tmp_path)
    mtime = first.nvml_path.stat().st_mtime_ns
    second = build_sim_libraries(tmp_path)
    assert second == first
    assert second.nvml_path.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.lib_dir.name]  # no leftover temp dirs


def test_concurrent_builds_agree(tmp_path: Path) -> None:
    results: list[SimLibraries] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(build_sim_libraries(tmp_path))
        except BaseException as err:  # collected and re-raised by the test below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({r.lib_dir for r in results}) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].lib_dir.name]


def test_cache_key_depends_on_compiler() -> None:
    assert sources_digest("/usr/bin/gcc") != sources_digest("/usr/bin/clang")


def test_missing_compiler_names_the_debian_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(SimError) as err:
        build_sim_libraries(tmp_path / "other")
    assert "apt-get install gcc libc6-dev" in str(err.value)
