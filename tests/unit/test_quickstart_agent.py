"""What the quick start says about its kernel probes, from the agent's snapshot and log lines."""

from __future__ import annotations

from gpuwatch.cli.quickstart_agent import probes_note, probes_summary
from gpuwatch.core.model import Snapshot

AGENT_WARNING = ("BPF unavailable: per-container ioctl/allocation counts and in-kernel enforcement are off; "
                 "NVML attribution continues (BPF probes off: BCC is not importable (No module named 'bcc') "
                 "(fix: apt-get install python3-bpfcc))")


def _snapshot(probes_up: bool) -> Snapshot:
    return Snapshot(timestamp_s=1.0, node="n", devices=(), containers=(), gpu_up=True, probes_up=probes_up)


def test_probes_on_points_at_trace() -> None:
    assert "ON" in probes_summary(_snapshot(True), []) and "gpuwatch trace" in probes_summary(_snapshot(True), [])
    assert probes_note(_snapshot(True), []).startswith("kernel probes ON")


def test_probes_off_gives_the_agents_reason() -> None:
    lines = ["kernel probes attached? no", AGENT_WARNING]
    assert probes_summary(_snapshot(False), lines) == f"kernel probes: OFF -- {AGENT_WARNING}"
    assert probes_note(_snapshot(False), lines) == (
        "kernel probes OFF: BCC is not importable (No module named 'bcc') (gpuwatch doctor says how to fix it)")
    not_root = "BPF unavailable: x (BPF probes off: not running as root; counts are lost (fix: sudo))"
    assert probes_note(_snapshot(False), [not_root]).startswith("kernel probes OFF: not running as root (")


def test_probes_off_without_a_reason_says_where_to_look() -> None:
    assert probes_note(_snapshot(False), []) == "kernel probes OFF (gpuwatch doctor says why)"
