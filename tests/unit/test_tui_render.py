"""Text of `gpuwatch top`: quantity formatting, the plain `--once` table and screen lines."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatch.core.model import Snapshot
from gpuwatch.tui import fmt
from gpuwatch.tui.render import (
    NVML_FIX,
    SIM_BANNER,
    ScreenLine,
    Style,
    plain_table,
    screen_lines,
    scroll_top,
)
from gpuwatch.tui.view_state import SortKey, ViewState, build_rows
from tests.unit.test_tui_samples import GIB, T0, TRAINER, device, ident, sample_snapshot, usage

# --------------------------------------------------------------------------- fmt


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "N/A"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (8 * GIB, "8.0 GiB"),
     (2**80, "1048576.0 EiB"), (-2048, "-2.0 KiB")],
)
def test_bytes_text(value: int | None, text: str) -> None:
    assert fmt.bytes_text(value) == text


def test_other_quantities() -> None:
    assert fmt.ratio_percent_text(0.531) == "53%"
    assert fmt.ratio_percent_text(float("nan")) == "N/A"
    assert fmt.celsius_text(61.4) == "61C"
    assert fmt.power_text(120.2, None) == "120 W"
    assert fmt.power_text(None, 300.0) == "N/A"
    assert fmt.seconds_text(12.34) == "12.3"
    assert fmt.seconds_text(7200 * 3) == "6.0h"
    assert fmt.seconds_text(86400 * 10) == "10.0d"
    assert fmt.count_text(999) == "999" and fmt.count_text(12345) == "12.3k"
    assert fmt.count_text(3_400_000) == "3.4M" and fmt.count_text(None) == "N/A"


def test_bar_fills_in_proportion_and_handles_unknown() -> None:
    assert fmt.bar_text(0.5, 12) == "[#####.....]"
    assert fmt.bar_text(0.0, 6) == "[....]"
    assert fmt.bar_text(1.0, 6) == "[####]"
    assert fmt.bar_text(7.0, 6) == "[####]"
    assert fmt.bar_text(None, 9) == "[  N/A  ]"
    assert fmt.memory_ratio(5, 0) is None and fmt.memory_ratio(None, 5) is None
    assert fmt.memory_ratio(1, 4) == 0.25


def test_fit_uses_display_width_for_wide_characters() -> None:
    assert fmt.display_width("训练") == 4
    assert fmt.fit("训练-0", 6) == "训练-0"
    assert fmt.fit("训练-0", 4) == "训…" + " "  # a wide char never straddles the edge
    assert fmt.display_width(fmt.fit("训练-0", 4)) == 4
    assert fmt.fit("abc", 5, align_right=True) == "  abc"
    assert fmt.fit("abcdef", 4) == "abc…"
    assert fmt.fit("x", 0) == ""
    assert fmt.clip("训练", 3) == "训"


def test_control_characters_are_neutralised() -> None:
    assert fmt.clean("evil\x1b[2Jname\n") == "evil?[2Jname?"


# --------------------------------------------------------------------------- plain table


def test_plain_table_has_one_section_per_gpu_with_its_containers() -> None:
    text = plain_table(sample_snapshot())
    lines = text.splitlines()
    assert lines[0].startswith("gpuwatch top  node sim-node-1")
    assert SIM_BANNER in text
    gpu0 = next(i for i, line in enumerate(lines) if line.startswith("GPU 0"))
    gpu1 = next(i for i, line in enumerate(lines) if line.startswith("GPU 1"))
    assert "MEM 10.0 GiB / 40.0 GiB" in lines[gpu0] and "UTIL 50%" in lines[gpu0]
    assert "TEMP 61C" in lines[gpu0] and "POWER 120/300 W" in lines[gpu0]
    for header in ("NAMESPACE", "POD", "CONTAINER", "PIDS(host/ctr)", "MEMORY", "SM%", "KERNEL-S"):
        assert header in lines[gpu0 + 1]
    section0 = "\n".join(lines[gpu0:gpu1])
    section1 = "\n".join(lines[gpu1:])
    assert "trainer" in section0 and "server" in section0 and "jupyter" not in section0
    assert "jupyter" in section1 and "(host)" in section1


def test_plain_table_lists_processes_with_host_and_container_pids() -> None:
    lines = plain_table(sample_snapshot()).splitlines()
    trainer = next(i for i, line in enumerate(lines) if " trainer " in line)
    assert lines[trainer].split()[:3] == ["team-a", "train-0", "trainer"]
    assert "8.0 GiB" in lines[trainer] and "70%" in lines[trainer] and "50.0" in lines[trainer]
    assert lines[trainer + 1].split()[:7] == ["└", "host", "pid", "4321", "ctr", "pid", "1"]
    assert "python3" in lines[trainer + 1] and "6.0 GiB" in lines[trainer + 1]
    assert "4322" in lines[trainer + 2] and "worker" in lines[trainer + 2]
    xorg = next(line for line in lines if "Xorg" in line)
    assert xorg.split()[:7] == ["└", "host", "pid", "777", "ctr", "pid", "-"]


def test_plain_table_columns_line_up() -> None:
    lines = plain_table(sample_snapshot()).splitlines()
    header = next(line for line in lines if "NAMESPACE" in line)
    rows = [line for line in lines if line.startswith("  team-a") or line.startswith("  research")]
    column = header.index("CONTAINER")
    assert {row[column:].split()[0] for row in rows} == {"trainer", "server", "jupyter"}


def test_plain_table_applies_filter_sort_and_flat() -> None:
    snap = sample_snapshot()
    filtered = plain_table(snap, ViewState(filter_text="research"))
    assert "jupyter" in filtered and "trainer" not in filtered and "no matching containers" in filtered
    flat = plain_table(snap, ViewState(group_by_gpu=False, sort_key=SortKey.KERNEL))
    names = [line.split()[2] for line in flat.splitlines() if line.startswith("  ") and "GiB" in line
             and "host pid" not in line]
    assert names[:3] == ["jupyter", "trainer", "server"]
    assert flat.count("NAMESPACE") == 1


def test_plain_table_real_node_has_no_banner_and_nvml_down_says_how_to_fix() -> None:
    real = plain_table(sample_snapshot(simulated=False))
    assert SIM_BANNER not in real
    down = plain_table(dataclasses.replace(sample_snapshot(simulated=False), gpu_up=False,
                                           gpu_error="NVML_ERROR_LIBRARY_NOT_FOUND"))
    assert "NVML DOWN: NVML_ERROR_LIBRARY_NOT_FOUND" in down and "gpuwatch sim up" in down


def test_plain_table_empty_node() -> None:
    text = plain_table(Snapshot(T0, "empty", (), ()))
    assert "no GPUs found" in text


def test_plain_table_with_unicode_names_keeps_columns_aligned() -> None:
    snap = Snapshot(T0, "n", (device(0),), (usage(ident("ns", "训练-0", "模型", "id1"), 0, GIB, 0.2, 1.0),
                                            usage(ident("ns", "ascii-pod", "c", "id2"), 0, GIB, 0.1, 1.0)))
    lines = [line for line in plain_table(snap).splitlines() if "GiB" in line and line.startswith("  ns")]
    header = next(line for line in plain_table(snap).splitlines() if "NAMESPACE" in line)
    widths = {fmt.display_width(line[: line.index("1.0 GiB")]) for line in lines}
    assert len(widths) == 1
    assert fmt.display_width(header[: header.index("MEMORY")]) < widths.pop() + len("1.0 GiB")


# --------------------------------------------------------------------------- screen lines


def lines_for(snap: Snapshot, state: ViewState, width: int, height: int) -> list[ScreenLine]:
    lines, _ = screen_lines(snap, state, build_rows(snap, state), width, height)
    return lines


def test_screen_has_title_banner_columns_rows_and_status() -> None:
    lines = lines_for(sample_snapshot(), ViewState(), 120, 30)
    assert len(lines) == 30
    assert lines[0].style is Style.TITLE
    assert "node sim-node-1" in lines[0].text and "every 1s" in lines[0].text
    assert lines[1].style is Style.BANNER and SIM_BANNER in lines[1].text
    assert any(line.style is Style.COLUMNS and "NAMESPACE" in line.text for line in lines)
    assert any("trainer" in line.text for line in lines)
    assert lines[-1].style is Style.STATUS and "q quit" in lines[-1].text
    selected = [line for line in lines if line.style is Style.SELECTED]
    assert len(selected) == 1 and selected[0].text.startswith("GPU 0")


def test_screen_title_shows_sort_filter_and_interval() -> None:
    state = ViewState(sort_key=SortKey.KERNEL, reverse=True, filter_text="team", interval_s=2.0)
    title = lines_for(sample_snapshot(), state, 200, 30)[0].text
    assert "sort KERNEL-S asc" in title and "filter 'team'" in title and "every 2s" in title


def test_screen_nvml_down_line_and_no_banner_on_real_node() -> None:
    snap = dataclasses.replace(sample_snapshot(simulated=False), gpu_up=False, gpu_error="GPU is lost")
    lines = lines_for(snap, ViewState(), 200, 30)
    assert not any(SIM_BANNER in line.text for line in lines)
    alert = [line for line in lines if line.style is Style.ALERT]
    assert len(alert) == 1 and "NVML DOWN: GPU is lost" in alert[0].text


def test_screen_filter_prompt_and_help() -> None:
    lines = lines_for(sample_snapshot(), ViewState(filter_editing=True, filter_text="tea"), 120, 30)
    assert lines[-1].text.startswith("/ filter: tea_")
    help_lines = lines_for(sample_snapshot(), ViewState(show_help=True), 120, 30)
    assert any("cycle the sort key" in line.text for line in help_lines)
    assert not any("trainer" in line.text for line in help_lines)


@pytest.mark.parametrize("width", [0, 1, 2, 5, 10, 17, 30, 80, 500])
@pytest.mark.parametrize("height", [0, 1, 2, 3, 4, 6, 10, 50])
def test_screen_fits_any_terminal_size(width: int, height: int) -> None:
    snap = sample_snapshot()
    state = ViewState(selected=3)
    lines = lines_for(snap, state, width, height)
    assert len(lines) <= max(height, 0)
    assert all(fmt.display_width(line.text) <= max(width - 1, 0) for line in lines)
    if height >= 1 and width >= 2:
        assert lines, "something is always shown"
    if height >= 1 and width >= 35:
        assert any(SIM_BANNER in line.text for line in lines), "the simulation is always labelled"


def test_tiny_terminal_says_too_small() -> None:
    lines = lines_for(sample_snapshot(simulated=False), ViewState(), 12, 10)
    assert [line.text for line in lines] == ["gpuwatch: t"]


def test_selection_scrolls_into_view() -> None:
    many = tuple(usage(ident("ns", f"pod-{i:02d}", f"c{i:02d}", f"id{i}"), 0, (100 - i) * GIB, 0.1, 1.0)
                 for i in range(40))
    snap = Snapshot(T0, "n", (device(0),), many)
    state = ViewState(selected=35)
    rows = build_rows(snap, state)
    lines, top = screen_lines(snap, state, rows, 120, 15, top=0)
    assert top > 0
    selected = [line for line in lines if line.style is Style.SELECTED]
    assert len(selected) == 1 and "c34" in selected[0].text
    back = dataclasses.replace(state, selected=top)  # moving up to the first visible row keeps the view
    _, same_top = screen_lines(snap, back, rows, 120, 15, top=top)
    assert same_top == top


def test_scroll_top_moves_as_little_as_possible() -> None:
    assert scroll_top(selected=0, top=0, body_rows=10, total_rows=50) == 0
    assert scroll_top(selected=12, top=0, body_rows=10, total_rows=50) == 3
    assert scroll_top(selected=5, top=3, body_rows=10, total_rows=50) == 3
    assert scroll_top(selected=2, top=3, body_rows=10, total_rows=50) == 2
    assert scroll_top(selected=4, top=40, body_rows=10, total_rows=8) == 0  # rows vanished
    assert scroll_top(selected=0, top=5, body_rows=0, total_rows=8) == 0


def test_expanded_container_shows_a_minus_marker_and_processes() -> None:
    snap = sample_snapshot()
    state = ViewState(expanded=frozenset({f"c:0:{TRAINER.key}"}))
    texts = [line.text for line in lines_for(snap, state, 120, 30)]
    trainer = next(i for i, t in enumerate(texts) if "trainer" in t)
    assert texts[trainer].startswith("- ")
    assert "host pid    4321" in texts[trainer + 1] and "ctr pid      1" in texts[trainer + 1]
    server = next(t for t in texts if " server " in t)
    assert server.startswith("+ ")


def test_nvml_down_text_adds_the_fix_only_when_the_error_has_none() -> None:
    from gpuwatch.tui.render import nvml_down_text

    bare = dataclasses.replace(sample_snapshot(), gpu_up=False, gpu_error="driver gone")
    assert nvml_down_text(bare) == f"NVML DOWN: driver gone (fix: {NVML_FIX})"
    typed = dataclasses.replace(bare, gpu_error="NVML not found (fix: install the driver)")
    assert nvml_down_text(typed) == "NVML DOWN: NVML not found (fix: install the driver)"
    assert nvml_down_text(dataclasses.replace(bare, gpu_error=None)).startswith("NVML DOWN: NVML is not answering")


def test_monotonic_snapshot_time_is_shown_as_wall_clock() -> None:
    import time as _time

    before = _time.strftime("%H:%M", _time.localtime())
    snap = dataclasses.replace(sample_snapshot(), timestamp_s=_time.monotonic())
    title = lines_for(snap, ViewState(), 200, 10)[0].text
    after = _time.strftime("%H:%M", _time.localtime())
    assert before in title or after in title  # either side of a minute boundary
    assert "1970" not in plain_table(snap).splitlines()[0]
    assert _time.strftime("%Y-%m-%d", _time.gmtime()) in plain_table(snap).splitlines()[0]
