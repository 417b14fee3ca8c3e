"""DCGM's default fields (issue 19 item 2) read by NvmlBackend from the fake libnvidia-ml, and
exported by the collector: clocks, energy, memory temperature, PCIe bytes and replays, NVLink
bytes (NVLink nodes only), encoder/decoder utilisation, remapped rows, the last Xid.

One interpreter per node (pynvml keeps the first NVML library it loaded). A busy worker on
GPU 0 and an idle GPU 1: energy and PCIe counters grow faster on the busy GPU (the fake
integrates the power and traffic it answers), the SM clock is boosted there, NVLink counters
are N/A on a PCIe node and counted once as unsupported, never as errors.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.sim import SimNode, sim_env
from tests.system.sim_helpers import private_node

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys, time
    from gpuwatch.exporter.collector import SnapshotCollector
    from gpuwatch.exporter.exposition import render_text
    from gpuwatch.gpu.nvml import NvmlBackend
    from gpuwatch.core.model import Snapshot
    from prometheus_client import CollectorRegistry
    backend = NvmlBackend(library_path=sys.argv[1])
    first = backend.sweep()
    time.sleep(1.0)
    second = backend.sweep()
    snap = Snapshot(node="n1", timestamp_s=0.0, devices=second.devices, containers=(), gpu_up=True)
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snap, clock=lambda: 0.0))
    print(json.dumps({"first": [dataclasses.asdict(d) for d in first.devices],
                      "second": [dataclasses.asdict(d) for d in second.devices],
                      "unsupported": backend.unsupported_fields(), "errors_total": backend.errors_total,
                      "text": render_text(registry).decode()}))
    backend.close()
""")


def read(node: SimNode) -> dict:  # type: ignore[type-arg]
    env = sim_env(node, dict(os.environ))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(node.libraries.nvml_path)], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def busy_gpu0(root_required: None, tmp_path: Path) -> Iterator[SimNode]:
    with private_node(tmp_path, devices=2, memory_bytes=16 << 30) as node:
        worker = subprocess.Popen([str(node.libraries.worker_path), "--gpu", "0", "--mib-per-step", "64",
                                   "--duty", "1.0", "--kernel-ms", "5"], stdout=subprocess.PIPE, text=True,
                                  env=sim_env(node, dict(os.environ)))
        try:
            assert worker.stdout is not None and worker.stdout.readline().startswith("ready")
            yield node
        finally:
            worker.kill()
            worker.wait()


def test_fields_read_once_per_sweep_move_with_load_and_are_exported(busy_gpu0: SimNode) -> None:
    got = read(busy_gpu0)
    assert got["errors_total"] == 0
    first, second = got["first"], got["second"]
    busy, idle = second[0]["fields"], second[1]["fields"]
    for f in (busy, idle):
        assert f["memory_clock_hertz"] > 1e9 and f["sm_clock_hertz"] > 1e8
        assert f["memory_temperature_celsius"] >= 34 and f["pcie_replays_total"] == 0
        assert f["encoder_utilization_ratio"] == 0.0 and f["decoder_utilization_ratio"] == 0.0
        rows = (f["remapped_rows_correctable"], f["remapped_rows_uncorrectable"], f["row_remap_pending"])
        assert rows == (0, 0, False)
        assert f["nvlink_transmitted_bytes_total"] is None and f["nvlink_received_bytes_total"] is None  # PCIe node
    assert busy["sm_clock_hertz"] > idle["sm_clock_hertz"]  # boosted under load
    # counters grow; over the 1 s between the sweeps the busy GPU used more energy and moved more bytes
    delta = [{k: second[i]["fields"][k] - first[i]["fields"][k]
              for k in ("energy_joules_total", "pcie_transmitted_bytes_total", "pcie_received_bytes_total")}
             for i in (0, 1)]
    assert all(v > 0 for d in delta for v in d.values()), delta
    assert 60 < delta[1]["energy_joules_total"] < 90  # ~70 W idle for ~1 s
    assert delta[0]["energy_joules_total"] > delta[1]["energy_joules_total"] + 50
    assert delta[0]["pcie_received_bytes_total"] > 10 * delta[1]["pcie_received_bytes_total"]
    # NVLink on a PCIe node: N/A, recorded once as unsupported, not an error
    assert all({"nvlink_transmitted_bytes_total", "nvlink_received_bytes_total"} <= set(fields)
               for fields in got["unsupported"].values())
    text = got["text"]
    for name in ("gpuwatch_gpu_sm_clock_hertz", "gpuwatch_gpu_memory_clock_hertz", "gpuwatch_gpu_energy_joules_total",
                 "gpuwatch_gpu_memory_temperature_celsius", "gpuwatch_gpu_pcie_transmitted_bytes_total",
                 "gpuwatch_gpu_pcie_received_bytes_total", "gpuwatch_gpu_pcie_replays_total",
                 "gpuwatch_gpu_encoder_utilization_ratio", "gpuwatch_gpu_decoder_utilization_ratio",
                 "gpuwatch_gpu_remapped_rows_correctable", "gpuwatch_gpu_remapped_rows_uncorrectable",
                 "gpuwatch_gpu_row_remap_pending", "gpuwatch_gpu_row_remap_failure", "gpuwatch_gpu_last_xid"):
        assert re.search(rf'^{name}{{gpu="0",.*node="n1"', text, re.M), name
    assert "gpuwatch_gpu_nvlink_transmitted_bytes_total{" not in text


def test_nvlink_bytes_on_an_nvswitch_node(root_required: None, tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=16 << 30,
                      topology="nvswitch") as node:
        got = read(node)
    assert got["errors_total"] == 0
    for d in got["second"]:
        assert d["fields"]["nvlink_transmitted_bytes_total"] is not None
        assert d["fields"]["nvlink_received_bytes_total"] is not None
    assert re.search(r'^gpuwatch_gpu_nvlink_received_bytes_total\{gpu="1",', got["text"], re.M)
