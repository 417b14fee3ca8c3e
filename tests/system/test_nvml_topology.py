"""NvmlBackend's topology and health inputs against the simulated node's fake NVML.

The backend runs in a fresh interpreter per case (pynvml keeps the first NVML library it
loaded for the life of a process); faults are injected between its sweeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.sim import SimNode, sim_env
from tests.system.sim_helpers import GIB, private_node

SCRIPT = textwrap.dedent("""
    import dataclasses, json, os, sys
    from pathlib import Path
    from gpuwatch.gpu.nvml import NvmlBackend
    from gpuwatch.sim import get_node, inject_fault
    node = get_node(sys.argv[2], state_path=Path(os.environ["GPUWATCH_SIM_STATE"]))
    backend = NvmlBackend(library_path=sys.argv[1])
    out = []
    for faults in json.loads(sys.argv[3]):  # per sweep: [[kind, gpu, {kwargs}], ...] injected before it
        for kind, gpu, kwargs in faults:
            inject_fault(node, kind, gpu, **kwargs)
        out.append(dataclasses.asdict(backend.sweep()))
    out.append({"errors_total": backend.errors_total})
    backend.close()
    print(json.dumps(out))
""")


def sweeps(node: SimNode, faults: list[list[Any]]) -> list[dict[str, Any]]:
    env = sim_env(node, dict(os.environ))
    env.pop("LD_LIBRARY_PATH")  # the backend preloads the library itself
    env.pop("GPUWATCH_NVML_LIBRARY", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(node.libraries.nvml_path), node.name,
                             json.dumps(faults)], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def links_of(sweep: dict[str, Any]) -> dict[tuple[int, int], tuple[int | None, int]]:
    return {(link["gpu_index"], link["peer_index"]): (link["level"], link["nvlinks"])
            for link in sweep["topology"]["links"]}


def level(i: int, j: int, n: int) -> int:
    half = (n + 1) // 2
    return 10 if i // 2 == j // 2 else 40 if (i < half) == (j < half) else 50


@pytest.mark.parametrize("topology", ["pcie", "nvlink-pairs", "nvswitch"])
def test_topology_is_read_once_into_every_sweep(tmp_path: Path, topology: str) -> None:
    n = 8
    with private_node(tmp_path, devices=n, memory_bytes=GIB, topology=topology) as node:
        first, second, totals = sweeps(node, [[], []])
    assert first["topology"] == second["topology"]
    assert totals["errors_total"] == 0 and first["errors"] == []
    topo = first["topology"]
    assert topo["nvlink_supported"] is (topology != "pcie")
    assert topo["nvswitch"] is (topology == "nvswitch")
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    expected_links = {
        "pcie": lambda i, j: 0,
        "nvlink-pairs": lambda i, j: 4 if i // 2 == j // 2 else 0,
        "nvswitch": lambda i, j: 18,
    }[topology]
    assert links_of(first) == {(i, j): (level(i, j, n), expected_links(i, j)) for i, j in pairs}


def test_health_inputs_follow_faults_between_sweeps(tmp_path: Path) -> None:
    xid = [["xid", 1, {"xid": 13}], ["xid", 0, {"xid": 31}], ["xid", 1, {"xid": 48, "pid": os.getpid()}]]
    ecc = [["ecc", 0, {"count": 2, "uncorrected": True}], ["ecc", 1, {"count": 5}]]
    with private_node(tmp_path, devices=2, memory_bytes=GIB) as node:
        result = sweeps(node, [
            [],
            xid + ecc,
            [["row-remap-failure", 1, {}]],
            [["lost", 0, {}]],
            [["clear", 0, {}], ["clear", 1, {}]],
        ])
    calm, faulty, remap, lost, cleared, totals = result

    def view(sweep: dict[str, Any], key: str) -> list[Any]:
        return [d[key] for d in sweep["devices"]]

    assert view(calm, "compute_capability") == [[9, 0], [9, 0]]
    assert view(calm, "ecc_uncorrected_volatile") == [0, 0]
    assert view(calm, "row_remap_failure") == [False, False]
    assert view(calm, "xid_events") == [[], []] and view(calm, "lost") == [False, False]

    assert view(faulty, "xid_events") == [[31], [13, 48]]  # drained in delivery order
    assert view(faulty, "ecc_uncorrected_volatile") == [2, 0]  # corrected errors are not counted here
    assert view(faulty, "healthy") == [True, False]  # the existing rule: Xid 48 is fatal

    assert view(remap, "xid_events") == [[], []]  # each Xid is reported in one sweep only
    assert view(remap, "row_remap_failure") == [False, True]

    assert view(lost, "lost") == [True, False]
    assert view(lost, "xid_events") == [[79], []]
    assert lost["devices"][0]["ecc_uncorrected_volatile"] is None  # a lost GPU answers nothing
    assert view(lost, "compute_capability") == [[9, 0], [9, 0]]  # static

    assert view(cleared, "lost") == [False, False]
    assert view(cleared, "ecc_uncorrected_volatile") == [0, 0]  # volatile: zero after the reset
    assert view(cleared, "row_remap_failure") == [False, False]
    assert totals["errors_total"] == 1  # the loss, counted once
