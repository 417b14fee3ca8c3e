"""`gpuwatch top` with the enforcer's view and progress input: LIMIT, SHARE, STATE and
PROGRESS per container (throttled to x%, paused, waiting for memory, plateau), through the
snapshot document like `top --agent` reads it; without such data the table is unchanged."""

from __future__ import annotations

from gpuwatch.core import snapshot_doc
from gpuwatch.core.model import (
    ContainerEnforcement,
    ContainerIdentity,
    ContainerProgress,
    ContainerUsage,
    DeviceInfo,
    Snapshot,
)
from gpuwatch.tui.render import column_widths, header_text, plain_table, screen_lines
from gpuwatch.tui.view_state import ContainerRow, ViewState, build_rows

GIB = 2**30


def ident(name: str) -> ContainerIdentity:
    return ContainerIdentity("k8s", f"/kubepods/pod{name}/{name}", f"id-{name}", name, f"pod-{name}", "ml")


def snapshot(with_sharing: bool = True) -> Snapshot:
    names = ("fast", "flat", "big", "plain")
    rows = tuple(ContainerUsage(ident(n), 0, "GPU-0", GIB, 0.3, 12.0) for n in names)
    device = DeviceInfo(0, "GPU-0", "gpuwatch-sim", None, 8 * GIB, 4 * GIB, 4 * GIB)
    if not with_sharing:
        return Snapshot(100.0, "n", (device,), rows)
    enforcement = (
        ContainerEnforcement(ident("fast"), "running", rule="all", memory_limit_bytes=3 * GIB, elastic_share=0.6,
                             elastic_role="gaining", growth_efficiency=0.92),
        ContainerEnforcement(ident("flat"), "throttled", "plateaued", "elastic", 2 * GIB, time_share=0.1,
                             elastic_share=0.1, elastic_role="plateaued", growth_efficiency=0.01),
        ContainerEnforcement(ident("big"), "waiting-memory", "GPU 0 memory oversubscribed", "fair-share", GIB,
                             2 * GIB, pending_bytes=2 * GIB, waiting_s=12.4),
    )
    progress = (
        ContainerProgress(ident("fast"), "/tmp/loss", "minimize", 0.412, 99.0, rate_per_gpu_second=0.02),
        ContainerProgress(ident("flat"), "/tmp/loss", "minimize", 0.0301, 99.0, rate_per_gpu_second=0.0001),
        ContainerProgress(ident("big"), "/tmp/acc", "maximize", 0.7, 99.0, rate_per_gpu_second=0.01,
                          last_error="garbage"),
    )
    return Snapshot(100.0, "n", (device,), rows, progress=progress, enforcement=enforcement)


def cells(snap: Snapshot) -> dict[str, ContainerRow]:
    return {r.container: r for r in build_rows(snap, ViewState()) if isinstance(r, ContainerRow)}


def test_rows_say_why_a_job_is_slow() -> None:
    rows = cells(snapshot_doc.loads(snapshot_doc.dumps(snapshot())))  # as `top --agent` gets it
    fast, flat, big, plain = rows["fast"], rows["flat"], rows["big"], rows["plain"]
    assert (fast.limit_text, fast.share_text, fast.state_text, fast.progress_text) == (
        "3.0 GiB", "60%", "running (gaining)", "0.412 ↓ 92%")
    assert (flat.share_text, flat.state_text, flat.progress_text) == ("10%", "throttled to 10% (plateaued)",
                                                                      "0.0301 ↓ plateau")
    assert big.state_text == "waiting for memory 12s (+2.0 GiB)" and big.limit_text == "1.0 GiB"
    assert big.progress_text == "0.7 ↑ (read error)"
    assert (plain.limit_text, plain.share_text, plain.state_text, plain.progress_text) == ("-", "-", "-", "-")


def test_plain_table_has_the_sharing_columns_only_with_sharing_data() -> None:
    text = plain_table(snapshot())
    header = next(line for line in text.splitlines() if "NAMESPACE" in line)
    assert header.split()[-4:] == ["LIMIT", "SHARE", "STATE", "PROGRESS"]
    assert "throttled to 10% (plateaued)" in text and "waiting for memory 12s" in text
    without = plain_table(snapshot(with_sharing=False))
    assert "STATE" not in without and "PROGRESS" not in without


def test_live_screen_lines_line_up_with_the_header() -> None:
    snap = snapshot()
    rows = build_rows(snap, ViewState())
    widths = column_widths(rows, False, 199)
    assert "STATE" in header_text(False, widths)
    lines, _ = screen_lines(snap, ViewState(), rows, 200, 30, widths=widths)
    header = next(line.text for line in lines if "STATE" in line.text)
    row = next(line.text for line in lines if "waiting for memory" in line.text)
    assert row.index("waiting for memory") == header.index("STATE")
