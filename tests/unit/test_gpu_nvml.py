"""NvmlBackend unit tests.

Where NVML cannot be had: one clear typed error with the fix, no traceback. These run in
a fresh interpreter: pynvml keeps the first library it loaded for the life of a process,
and other tests in this session may load the simulated one.

Topology and health inputs: over a scripted pynvml (tests.unit.gpu_fakes.FakeNvml,
monkeypatched in; no library is loaded), including the ways real drivers say "no".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pynvml
import pytest

from gpuwatch.core.model import GpuTopology, TopologyLevel
from gpuwatch.gpu.backend import GpuBackend
from tests.unit.gpu_fakes import FakeNvml


def _run(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "GPUWATCH_NVML_LIBRARY"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=env)


def test_missing_library_path_is_a_typed_error_with_a_fix() -> None:
    result = _run("""
        from gpuwatch.core.errors import NvmlUnavailable
        from gpuwatch.gpu.nvml import NvmlBackend
        try:
            NvmlBackend(library_path="/nonexistent/libnvidia-ml.so.1")
        except NvmlUnavailable as err:
            print("OK", err.message, "|", err.fix)
    """)
    assert result.stdout.startswith("OK NVML library /nonexistent/libnvidia-ml.so.1 does not exist"), \
        result.stdout + result.stderr
    assert "gpuwatch sim up" in result.stdout


# opens the NVML backend in a fresh interpreter; prints "OK <error>" for the typed error
OPEN_BACKEND = """
        from gpuwatch.core.errors import NvmlUnavailable
        from gpuwatch.gpu.nvml import NvmlBackend
        try:
            NvmlBackend()
        except NvmlUnavailable as err:
            print("OK", err)
    """


def test_env_library_that_is_not_a_library_is_a_typed_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    junk = tmp_path / "libnvidia-ml.so.1"
    junk.write_text("not an ELF file")
    result = _run(OPEN_BACKEND, {"GPUWATCH_NVML_LIBRARY": str(junk)})
    assert result.stdout.startswith("OK cannot load NVML library"), result.stdout + result.stderr


def test_no_driver_on_this_host_gives_one_clear_message() -> None:
    probe = _run("import ctypes; ctypes.CDLL('libnvidia-ml.so.1'); print('present')")
    if "present" in probe.stdout:
        return  # a host with a real driver: this case cannot happen here (tests/gpu covers it)
    result = _run(OPEN_BACKEND)
    assert result.stdout.startswith("OK NVML (libnvidia-ml.so.1) not found"), result.stdout + result.stderr
    assert "install the NVIDIA driver" in result.stdout


def test_fakes_and_nvml_backend_satisfy_the_protocol() -> None:
    from gpuwatch.gpu.nvml import NvmlBackend
    from tests.unit.gpu_fakes import FakeBackend, FakeWorld

    assert isinstance(FakeBackend(FakeWorld()), GpuBackend)
    assert callable(NvmlBackend.sweep) and callable(NvmlBackend.close)


# ---- NvmlBackend over a scripted pynvml (tests.unit.gpu_fakes.FakeNvml) ----------------


def _backend(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from gpuwatch.gpu.nvml import NvmlBackend

    fake.install(monkeypatch)
    return NvmlBackend()


def _nvlinks(topology: GpuTopology | None) -> dict[tuple[int, int], int]:
    assert topology is not None
    return {(link.gpu_index, link.peer_index): link.nvlinks for link in topology.links}


def test_topology_on_a_pcie_node_or_vm_degrades_to_no_nvlink(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=4)
    fake.levels = {(0, 1): 10, (2, 3): 10, (0, 2): 40, (1, 3): 40}
    fake.errors["nvmlDeviceGetNvLinkState"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    backend = _backend(fake, monkeypatch)
    sweep = backend.sweep()
    topo = sweep.topology
    assert topo is not None and not topo.nvlink_supported and not topo.nvswitch
    assert len(topo.links) == 12  # both orders of every pair
    levels = {(link.gpu_index, link.peer_index): link.level for link in topo.links}
    assert levels[(0, 1)] == levels[(1, 0)] == TopologyLevel.SINGLE
    assert levels[(0, 2)] == TopologyLevel.NODE and levels[(0, 3)] == TopologyLevel.SYSTEM
    assert set(_nvlinks(topo).values()) == {0}
    assert fake.count("nvmlDeviceGetNvLinkState") == 4  # link 0 once per GPU, then asked no more
    assert fake.count("nvmlDeviceGetTopologyCommonAncestor") == 6  # once per pair
    assert backend.errors_total == 0 and sweep.errors == ()
    backend.sweep()
    assert fake.count("nvmlDeviceGetNvLinkState") == 4  # read once per backend
    assert backend.sweep().topology == topo


def test_topology_without_nvlink_functions_in_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=2)
    fake.missing.add("nvmlDeviceGetNvLinkState")
    backend = _backend(fake, monkeypatch)
    topo = backend.sweep().topology
    assert topo == GpuTopology(links=topo.links, nvswitch=False, nvlink_supported=False)  # type: ignore[union-attr]
    assert _nvlinks(topo) == {(0, 1): 0, (1, 0): 0}
    assert backend.errors_total == 0


def test_nvlink_pairs_match_peers_by_normalised_bus_id(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=4)
    for a, b in ((0, 1), (2, 3)):
        for link in range(4):
            fake.links[(a, link)] = ("gpu", b)
            fake.links[(b, link)] = ("gpu", a)
    fake.links[(0, 10)] = ("gpu", 2)  # one more, to another GPU
    fake.remote_bus_format = "{:04x}:{:02x}:00.0"  # short, lower-case form: same bus
    fake.missing.add("nvmlDeviceGetNvLinkRemoteDeviceType")  # old driver: every remote is a GPU
    backend = _backend(fake, monkeypatch)
    topo = backend.sweep().topology
    assert topo is not None and topo.nvlink_supported and not topo.nvswitch
    links = _nvlinks(topo)
    assert links[(0, 1)] == links[(1, 0)] == links[(2, 3)] == links[(3, 2)] == 4
    assert links[(0, 2)] == 1 and links[(2, 0)] == 0  # counted from each side's own links
    assert links[(1, 2)] == links[(0, 3)] == 0
    assert fake.count("nvmlDeviceGetNvLinkRemoteDeviceType") == 1  # missing: not asked again
    assert fake.count("nvmlDeviceGetNvLinkState") == 4 * 18
    assert backend.errors_total == 0


def test_nvswitch_pairs_get_the_smaller_switch_link_count(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=3)
    for gpu, count in ((0, 18), (1, 12), (2, 18)):
        for link in range(count):
            fake.links[(gpu, link)] = ("switch", link % 4)
    backend = _backend(fake, monkeypatch)
    topo = backend.sweep().topology
    assert topo is not None and topo.nvswitch and topo.nvlink_supported
    links = _nvlinks(topo)
    assert links[(0, 2)] == links[(2, 0)] == 18
    assert links[(0, 1)] == links[(1, 0)] == links[(1, 2)] == 12
    assert fake.count("nvmlDeviceGetNvLinkRemotePciInfo") == 0  # switch links need no PCI lookup


def test_topology_errors_never_fail_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=2)
    fake.errors["nvmlDeviceGetTopologyCommonAncestor"] = pynvml.NVML_ERROR_UNKNOWN
    fake.errors["nvmlDeviceGetNvLinkState"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    backend = _backend(fake, monkeypatch)
    sweep = backend.sweep()
    assert sweep.topology is not None
    assert {link.level for link in sweep.topology.links} == {None}
    assert set(_nvlinks(sweep.topology).values()) == {0}
    assert backend.errors_total >= 2  # counted, not raised
    assert [d.index for d in sweep.devices] == [0, 1]


def test_health_inputs_per_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=2)
    backend = _backend(fake, monkeypatch)
    first = backend.sweep()
    assert [(d.lost, d.xid_events, d.ecc_uncorrected_volatile, d.row_remap_failure, d.compute_capability)
            for d in first.devices] == [(False, (), 0, False, (9, 0))] * 2
    fake.events += [(1, 13), (0, 94), (1, 48)]
    fake.ecc_uncorrected[0] = 3
    fake.remap_failure[1] = 1
    second = backend.sweep()
    assert [d.xid_events for d in second.devices] == [(94,), (13, 48)]
    assert [d.ecc_uncorrected_volatile for d in second.devices] == [3, 0]
    assert [d.row_remap_failure for d in second.devices] == [False, True]
    assert [d.healthy for d in second.devices] == [False, False]  # unchanged rule: fatal Xid -> unhealthy
    third = backend.sweep()
    assert [d.xid_events for d in third.devices] == [(), ()]  # drained once
    assert [d.xid_errors_total for d in third.devices] == [1, 2]
    assert fake.count("nvmlDeviceGetCudaComputeCapability") == 2  # static
    assert fake.count("nvmlDeviceGetTotalEccErrors") == fake.count("nvmlDeviceGetRemappedRows") == 6


def test_unsupported_ecc_and_row_remapping_are_none_and_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=1)
    fake.errors["nvmlDeviceGetTotalEccErrors"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.missing.add("nvmlDeviceGetRemappedRows")
    fake.missing.add("nvmlDeviceGetCudaComputeCapability")
    backend = _backend(fake, monkeypatch)
    for _ in range(3):
        (dev,) = backend.sweep().devices
        assert (dev.ecc_uncorrected_volatile, dev.row_remap_failure, dev.compute_capability) == (None, None, None)
    assert fake.count("nvmlDeviceGetTotalEccErrors") == fake.count("nvmlDeviceGetRemappedRows") == 1
    assert backend.errors_total == 0
    assert set(backend.unsupported_fields()["GPU-fake-0"]) >= {"ecc_uncorrected_volatile", "remapped_rows"}


def test_a_lost_gpu_is_flagged_and_asked_nothing_more_in_that_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(gpus=2)
    backend = _backend(fake, monkeypatch)
    backend.sweep()
    fake.lost.add(1)
    fake.events.append((1, 79))
    sweep = backend.sweep()
    assert [(d.lost, d.xid_events) for d in sweep.devices] == [(False, ()), (True, (79,))]
    assert sweep.devices[1].ecc_uncorrected_volatile is None
    assert fake.count("nvmlDeviceGetTotalEccErrors") == 3  # not asked of the lost GPU
    fake.lost.clear()
    back = backend.sweep()
    assert [(d.lost, d.healthy) for d in back.devices] == [(False, True), (False, True)]
