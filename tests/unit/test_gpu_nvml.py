"""NvmlBackend where NVML cannot be had: one clear typed error with the fix, no traceback.

Run in a fresh interpreter: pynvml keeps the first library it loaded for the life of a
process, and other tests in this session may load the simulated one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from gpuwatch.gpu.backend import GpuBackend


def _run(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "GPUWATCH_NVML_LIBRARY"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=env)


def test_missing_library_path_is_a_typed_error_with_a_fix() -> None:
    result = _run("""
        from gpuwatch.errors import NvmlUnavailable
        from gpuwatch.gpu.nvml import NvmlBackend
        try:
            NvmlBackend(library_path="/nonexistent/libnvidia-ml.so.1")
        except NvmlUnavailable as err:
            print("OK", err.message, "|", err.fix)
    """)
    assert result.stdout.startswith("OK NVML library /nonexistent/libnvidia-ml.so.1 does not exist"), \
        result.stdout + result.stderr
    assert "gpuwatch sim up" in result.stdout


def test_env_library_that_is_not_a_library_is_a_typed_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    junk = tmp_path / "libnvidia-ml.so.1"
    junk.write_text("not an ELF file")
    result = _run("""
        from gpuwatch.errors import NvmlUnavailable
        from gpuwatch.gpu.nvml import NvmlBackend
        try:
            NvmlBackend()
        except NvmlUnavailable as err:
            print("OK", err)
    """, {"GPUWATCH_NVML_LIBRARY": str(junk)})
    assert result.stdout.startswith("OK cannot load NVML library"), result.stdout + result.stderr


def test_no_driver_on_this_host_gives_one_clear_message() -> None:
    probe = _run("import ctypes; ctypes.CDLL('libnvidia-ml.so.1'); print('present')")
    if "present" in probe.stdout:
        return  # a host with a real driver: this case cannot happen here (tests/gpu covers it)
    result = _run("""
        from gpuwatch.errors import NvmlUnavailable
        from gpuwatch.gpu.nvml import NvmlBackend
        try:
            NvmlBackend()
        except NvmlUnavailable as err:
            print("OK", err)
    """)
    assert result.stdout.startswith("OK NVML (libnvidia-ml.so.1) not found"), result.stdout + result.stderr
    assert "install the NVIDIA driver" in result.stdout


def test_fakes_and_nvml_backend_satisfy_the_protocol() -> None:
    from gpuwatch.gpu.nvml import NvmlBackend
    from tests.unit.gpu_fakes import FakeBackend, FakeWorld

    assert isinstance(FakeBackend(FakeWorld()), GpuBackend)
    assert callable(NvmlBackend.sweep) and callable(NvmlBackend.close)
