"""The simulated node's GPU topologies as nvidia-ml-py's own functions see them.

Layout (gpuwatch/sim/README.md): pairs (0,1), (2,3).. share a PCIe switch (SINGLE), the
two halves of the node hang off two CPUs (NODE within a half, SYSTEM across); NVLink is
absent (pcie), bridges GPU pairs with 4 links (nvlink-pairs) or runs all 18 links of
every GPU to NVSwitches (nvswitch).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.sim import get_node, sim_env
from tests.system.sim_helpers import GIB, private_node, run_nvml

# Every answer of a call as a value or "E<NVML error code>", so one script serves all cases.
PROBE = """
def ask(fn, *args):
    try:
        value = fn(*args)
    except pynvml.NVMLError as err:
        return "E%d" % err.value
    return getattr(value, "busId", value)

n = pynvml.nvmlDeviceGetCount()
hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
out = dict(
    bus=[pynvml.nvmlDeviceGetPciInfo(h).busId for h in hs],
    level=[[pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b) for b in hs] for a in hs],
    state=[[ask(pynvml.nvmlDeviceGetNvLinkState, h, link) for link in range(19)] for h in hs],
    remote=[[ask(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link) for link in range(19)] for h in hs],
    type=[[ask(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, link) for link in range(19)] for h in hs],
    version=[ask(pynvml.nvmlDeviceGetNvLinkVersion, h, 0) for h in hs],
    p2p=[ask(pynvml.nvmlDeviceGetNvLinkCapability, h, 0, pynvml.NVML_NVLINK_CAP_P2P_SUPPORTED) for h in hs],
    sysmem=ask(pynvml.nvmlDeviceGetNvLinkCapability, hs[0], 0, pynvml.NVML_NVLINK_CAP_SYSMEM_ACCESS),
    bad_cap=ask(pynvml.nvmlDeviceGetNvLinkCapability, hs[0], 0, 99),
    link_count=[f.value.uiVal for f in pynvml.nvmlDeviceGetFieldValues(hs[0], [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])],
)
print(json.dumps(out))
"""

NOT_SUPPORTED = f"E{3}"
INVALID_ARGUMENT = f"E{2}"
GPU_IS_LOST = f"E{15}"


def expected_level(i: int, j: int, n: int) -> int:
    half = (n + 1) // 2
    if i == j:
        return 0
    if i // 2 == j // 2:
        return 10  # NVML_TOPOLOGY_SINGLE
    if (i < half) == (j < half):
        return 40  # NVML_TOPOLOGY_NODE
    return 50  # NVML_TOPOLOGY_SYSTEM


def probe(tmp_path: Path, topology: str, devices: int) -> dict:  # type: ignore[type-arg]
    with private_node(tmp_path, devices=devices, memory_bytes=GIB, topology=topology) as node:
        assert node.topology == topology
        assert get_node(node.name, state_path=node.state_path).topology == topology
        return run_nvml(node, PROBE)  # type: ignore[no-any-return]


@pytest.mark.parametrize("topology", ["pcie", "nvlink-pairs", "nvswitch"])
def test_pcie_common_ancestors_are_the_same_in_every_topology(tmp_path: Path, topology: str) -> None:
    out = probe(tmp_path, topology, 8)
    assert out["level"] == [[expected_level(i, j, 8) for j in range(8)] for i in range(8)]
    assert {out["level"][0][2], out["level"][0][4]} == {40, 50}  # all of SINGLE, NODE, SYSTEM occur


def test_pcie_node_has_no_nvlink(tmp_path: Path) -> None:
    out = probe(tmp_path, "pcie", 3)
    for gpu in range(3):
        for what in ("state", "remote", "type"):
            assert out[what][gpu][:18] == [NOT_SUPPORTED] * 18, (what, gpu)
            assert out[what][gpu][18] == INVALID_ARGUMENT  # NVML_NVLINK_MAX_LINKS is 18
    assert out["version"] == out["p2p"] == [NOT_SUPPORTED] * 3
    assert out["link_count"] == [0]


def test_nvlink_pairs_bridge_gpu_2k_to_2k_plus_1(tmp_path: Path) -> None:
    out = probe(tmp_path, "nvlink-pairs", 5)  # odd count: GPU 4 has no peer
    bus = out["bus"]
    for gpu in range(5):
        peer = gpu ^ 1
        paired = peer < 5
        assert out["state"][gpu][:18] == [1 if paired and link < 4 else 0 for link in range(18)], gpu
        assert out["state"][gpu][18] == out["remote"][gpu][18] == out["type"][gpu][18] == INVALID_ARGUMENT
        for link in range(18):
            if paired and link < 4:
                assert out["remote"][gpu][link] == bus[peer]
                assert out["type"][gpu][link] == 0  # NVML_NVLINK_DEVICE_TYPE_GPU
            else:  # the far end of an inactive link
                assert out["remote"][gpu][link] == out["type"][gpu][link] == NOT_SUPPORTED
    assert out["version"] == [6] * 5  # NVML_NVLINK_VERSION_4_0 (Hopper)
    assert out["p2p"] == [1] * 5 and out["sysmem"] == 0 and out["bad_cap"] == INVALID_ARGUMENT
    assert out["link_count"] == [18]


def test_nvswitch_every_link_ends_on_a_switch(tmp_path: Path) -> None:
    out = probe(tmp_path, "nvswitch", 8)
    gpu_buses = set(out["bus"])
    switches: set[str] = set()
    for gpu in range(8):
        assert out["state"][gpu][:18] == [1] * 18
        assert out["type"][gpu][:18] == [2] * 18  # NVML_NVLINK_DEVICE_TYPE_SWITCH
        assert out["state"][gpu][18] == INVALID_ARGUMENT
        remote = out["remote"][gpu][:18]
        assert not gpu_buses & set(remote)  # a switch is not a GPU
        assert remote == out["remote"][0][:18]  # link n of every GPU goes to the same switch
        switches |= set(remote)
    assert len(switches) == 4
    assert all(bus.startswith("00000000:") and bus.endswith(":00.0") for bus in switches)
    assert out["link_count"] == [18]


def test_unversioned_remote_pci_info_fills_the_old_struct(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB, topology="nvlink-pairs") as node:
        out = run_nvml(
            node,
            """
class OldPci(ctypes.Structure):  # nvmlPciInfo_v2_t: busId[16], ids, 4 reserved words
    _fields_ = [("busId", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("reserved", ctypes.c_uint * 4)]
fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetNvLinkRemotePciInfo")
pci = OldPci()
rc = fn(pynvml.nvmlDeviceGetHandleByIndex(0), ctypes.c_uint(1), ctypes.byref(pci))
peer = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(1))
print(json.dumps([rc, pci.busId.decode(), pci.bus, peer.bus]))
""",
        )
    rc, bus_id, bus, peer_bus = out
    assert rc == 0 and bus == peer_bus
    assert bus_id == f"0000:{peer_bus:02X}:00.0"


def test_lost_gpu_answers_gpu_is_lost_to_nvlink_calls(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=GIB, topology="nvswitch") as node:
        out = run_nvml(
            node,
            f"""
from pathlib import Path
from gpuwatch.sim import get_node, inject_fault
h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
inject_fault(get_node({node.name!r}, state_path=Path({str(node.state_path)!r})), "lost", 1)
def ask(fn, *args):
    try:
        fn(*args)
        return "ok"
    except pynvml.NVMLError as err:
        return "E%d" % err.value
print(json.dumps([ask(pynvml.nvmlDeviceGetNvLinkState, h1, 0),
                  ask(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, h1, 0),
                  ask(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, h1, 0),
                  ask(pynvml.nvmlDeviceGetNvLinkVersion, h1, 0),
                  ask(pynvml.nvmlDeviceGetRemappedRows, h1),
                  ask(pynvml.nvmlDeviceGetHandleByIndex, 1),
                  ask(pynvml.nvmlDeviceGetNvLinkState, h0, 0)]))
""",
        )
    assert out == [GPU_IS_LOST] * 6 + ["ok"]


def test_cli_up_topology_and_status(tmp_path: Path) -> None:
    name = f"topo{os.getpid()}"
    env = dict(os.environ)
    env.pop("GPUWATCH_SIM_STATE", None)
    env["GPUWATCH_SIM_ROOT"] = str(tmp_path / "root")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpuwatch", "sim", *args, "--name", name],
                              capture_output=True, text=True, timeout=60, env=env, check=False)

    up = cli("up", "--devices", "2", "--memory", "1GiB", "--topology", "nvlink-pairs")
    try:
        assert up.returncode == 0, up.stderr
        assert "nvlink-pairs" in up.stdout and "kmsg" in up.stdout
        node = get_node(name)
        assert node.topology == "nvlink-pairs"
        out = run_nvml(node, "h = pynvml.nvmlDeviceGetHandleByIndex(0)\nprint(pynvml.nvmlDeviceGetNvLinkState(h, 0))")
        assert out == 1
        status = cli("status")
        assert status.returncode == 0 and "topology nvlink-pairs" in status.stdout, status.stderr
        bad = cli("up", "--topology", "torus")
        assert bad.returncode != 0 and "torus" in bad.stderr
        env_cli = sim_env(node, dict(os.environ))
        assert env_cli["GPUWATCH_SIM_ROOT"] == str(node.root)
    finally:
        cli("down")
