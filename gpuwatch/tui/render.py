"""Pure text layout for `gpuwatch top`: the plain `--once` table and the lines of the live
screen. No curses here: `screen_lines` returns (text, style) pairs that screen.py paints,
so layout, truncation, scrolling and tiny terminals are unit-tested as plain strings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from gpuwatch.core.model import Snapshot
from gpuwatch.core.snapshot_doc import iso_time, wall_time_s
from gpuwatch.tui import fmt
from gpuwatch.tui.cluster_view import ClusterSnapshot, is_cluster
from gpuwatch.tui.view_state import (
    ContainerRow,
    GpuRow,
    MessageRow,
    ProcessRow,
    Row,
    ViewState,
    build_rows,
    container_row_key,
)

SIM_BANNER = "SIMULATED GPU NODE (gpuwatch sim)"
NVML_FIX = ("install the NVIDIA driver, or run `gpuwatch sim up` and pass --nvml-library "
            "<path printed by sim up> for a simulation")

SORT_LABELS = {"memory": "MEMORY", "sm": "SM%", "kernel": "KERNEL-S", "name": "NAME", "gpu": "GPU"}


class Style(StrEnum):
    TITLE = "title"
    BANNER = "banner"
    ALERT = "alert"
    NOTE = "note"
    COLUMNS = "columns"
    GPU = "gpu"
    GPU_LOST = "gpu_lost"
    ROW = "row"
    HOST = "host"
    PROCESS = "process"
    MESSAGE = "message"
    SELECTED = "selected"
    STATUS = "status"
    HELP = "help"


@dataclass(frozen=True)
class ScreenLine:
    text: str
    style: Style


# --------------------------------------------------------------------------- columns


@dataclass(frozen=True)
class Column:
    header: str
    right: bool
    min_cells: int


NODE_COLUMN = Column("NODE", False, 4)
NAME_COLUMNS = (Column("NAMESPACE", False, 4), Column("POD", False, 4), Column("CONTAINER", False, 4))
GPU_COLUMN = Column("GPU", True, 3)
PIDS_COLUMN = Column("PIDS(host/ctr)", False, 14)
NUMBER_COLUMNS = (PIDS_COLUMN, Column("MEMORY", True, 10), Column("SM%", True, 4), Column("KERNEL-S", True, 8))
PROBE_COLUMN = Column("PROBES", False, 0)
SHARING_COLUMNS = (Column("LIMIT", True, 5), Column("SHARE", True, 5), Column("STATE", False, 7),
                   Column("PROGRESS", False, 8))
GAP = "  "


def _container_cells(row: ContainerRow, flat: bool, cluster: bool = False) -> list[str]:
    """The cells of a container row; the cluster view adds NODE first and has no PIDs
    (Prometheus has no per-process data); with sharing data, LIMIT, SHARE, STATE, PROGRESS."""
    cells = [row.node, row.namespace, row.pod, row.container] if cluster else [row.namespace, row.pod, row.container]
    if flat:
        cells.append(str(row.gpu_index))
    if not cluster:
        cells.append(row.pids_text)
    cells += [row.memory_text, row.sm_text, row.kernel_text]
    if row.sharing:
        cells += [row.limit_text, row.share_text, row.state_text, row.progress_text]
    return [*cells, row.probe_text]


def _columns(flat: bool, cluster: bool = False, sharing: bool = False) -> list[Column]:
    names = [NODE_COLUMN, *NAME_COLUMNS] if cluster else list(NAME_COLUMNS)
    numbers = [c for c in NUMBER_COLUMNS if not (cluster and c is PIDS_COLUMN)]
    extra = list(SHARING_COLUMNS) if sharing else []
    return [*names, *([GPU_COLUMN] if flat else []), *numbers, *extra, PROBE_COLUMN]


def _has_sharing(rows: Sequence[Row]) -> bool:
    return any(isinstance(row, ContainerRow) and row.sharing for row in rows)


def _columns_for(flat: bool, cluster: bool, widths: Sequence[int]) -> list[Column]:
    """The columns that `widths` (from column_widths) were computed for."""
    plain = _columns(flat, cluster)
    return plain if len(widths) == len(plain) else _columns(flat, cluster, sharing=True)


def column_widths(rows: Sequence[Row], flat: bool, width_cells: int | None, cluster: bool = False) -> list[int]:
    """Cell widths per column. Natural widths when `width_cells` is None (plain output);
    otherwise the name columns (node too, in the cluster view) shrink (never below their
    minimum) to fit the terminal."""
    columns = _columns(flat, cluster, _has_sharing(rows))
    natural = [fmt.display_width(c.header) for c in columns]
    has_probe = False
    for row in rows:
        if isinstance(row, ContainerRow):
            for i, cell in enumerate(_container_cells(row, flat, cluster)):
                natural[i] = max(natural[i], fmt.display_width(cell))
            has_probe = has_probe or bool(row.probe_text)
    if not has_probe:
        natural[-1] = 0
    if width_cells is None:
        return natural
    n_names = 4 if cluster else 3
    widths = [max(n, c.min_cells) for n, c in zip(natural, columns, strict=True)]
    widths[:n_names] = [min(w, 40) for w in widths[:n_names]]
    fixed = sum(widths[n_names:-1]) + len(GAP) * (len(columns) - 2)
    room_for_names = width_cells - fixed - len(GAP)  # leading indent
    names = widths[:n_names]
    while sum(names) > room_for_names and any(w > 4 for w in names):
        widest = names.index(max(names))
        names[widest] -= 1
    widths[:n_names] = names
    used = sum(widths[:-1]) + len(GAP) * (len(columns) - 1)
    widths[-1] = max(min(natural[-1], width_cells - used - len(GAP)), 0)
    return widths


def _join(cells: Sequence[str], columns: Sequence[Column], widths: Sequence[int]) -> str:
    parts = [fmt.fit(cell, w, col.right)
             for cell, col, w in zip(cells, columns, widths, strict=True) if w > 0]
    return (GAP + GAP.join(parts)).rstrip()


def header_text(flat: bool, widths: Sequence[int], cluster: bool = False) -> str:
    columns = _columns_for(flat, cluster, widths)
    return _join([c.header for c in columns], columns, widths)


def gpu_text(row: GpuRow) -> str:
    flags = []
    if row.lost:
        flags.append("LOST" if row.name.startswith("(") else "UNHEALTHY")
    if row.is_mig:
        flags.append("MIG")
    if row.collapsed:
        flags.append(f"[{row.containers} hidden]")
    pct = fmt.ratio_percent_text(row.memory_ratio)
    if row.node:  # cluster view: Prometheus has no temperature or power in the cluster queries
        text = (f"{row.node}  GPU {row.gpu_index}  {row.name}  MEM {row.memory_text} {row.memory_bar} {pct}  "
                f"UTIL {row.util_text}")
        return text + ("  " + " ".join(flags) if flags else "")
    text = (f"GPU {row.gpu_index}  {row.name}  MEM {row.memory_text} {row.memory_bar} {pct}  "
            f"UTIL {row.util_text}  TEMP {row.temp_text}  POWER {row.power_text}")
    return text + ("  " + " ".join(flags) if flags else "")


def process_text(row: ProcessRow) -> str:
    return (f"      └ host pid {row.pid_text:>7}  ctr pid {row.container_pid_text:>6}  "
            f"{row.comm:<16} {row.memory_text:>10}  SM {row.sm_text:>4}")


def row_text(row: Row, flat: bool, widths: Sequence[int], cluster: bool = False) -> str:
    """One row as text (not yet fitted to the terminal width)."""
    if isinstance(row, GpuRow):
        return gpu_text(row)
    if isinstance(row, ContainerRow):
        marker = "-" if row.expanded else "+"
        text = _join(_container_cells(row, flat, cluster), _columns_for(flat, cluster, widths), widths)
        return marker + text[1:] if row.processes else text
    if isinstance(row, ProcessRow):
        return process_text(row)
    return f"    {row.text}"


def row_style(row: Row) -> Style:
    if isinstance(row, GpuRow):
        return Style.GPU_LOST if row.lost else Style.GPU
    if isinstance(row, ContainerRow):
        return Style.HOST if row.is_host else Style.ROW
    if isinstance(row, ProcessRow):
        return Style.PROCESS
    return Style.MESSAGE


# --------------------------------------------------------------------------- plain table


def nvml_down_text(snapshot: Snapshot) -> str:
    reason = snapshot.gpu_error or "NVML is not answering"
    if "fix:" in reason:  # the backend's typed error already says how to fix it
        return f"NVML DOWN: {reason}"
    return f"NVML DOWN: {reason} (fix: {NVML_FIX})"


def plain_table(snapshot: Snapshot, state: ViewState | None = None) -> str:
    """The `--once` text: a title, one section per GPU, its containers and their processes.

    Every container is shown expanded (processes with host and container PIDs); the
    state's filter, sort and grouping apply.
    """
    state = state or ViewState()
    cluster = is_cluster(snapshot)
    # the cluster view has no processes to expand
    expand_all = frozenset() if cluster else frozenset(container_row_key(c) for c in snapshot.containers)
    rows = build_rows(snapshot, _with_expanded(state, expand_all))
    flat = not state.group_by_gpu
    widths = column_widths(rows, flat, None, cluster)
    lines = [f"gpuwatch top  {_where(snapshot)}  {iso_time(wall_time_s(snapshot.timestamp_s))}"]
    if snapshot.simulated:
        lines.append(f"*** {SIM_BANNER}: these are simulated GPUs, not real hardware ***")
    if not snapshot.gpu_up:
        lines.append(nvml_down_text(snapshot))
    lines.extend(f"note: {n}" for n in snapshot.notes)
    flat_header_done = False
    for row in rows:
        if isinstance(row, GpuRow):
            lines.append("")
            lines.append(gpu_text(row))
            if state.group_by_gpu:
                lines.append(header_text(flat, widths, cluster))
            continue
        if flat and not flat_header_done and isinstance(row, ContainerRow | MessageRow):
            lines.append("")
            lines.append(header_text(flat, widths, cluster))
            flat_header_done = True
        if isinstance(row, ContainerRow):
            lines.append(_join(_container_cells(row, flat, cluster), _columns_for(flat, cluster, widths), widths))
        else:
            lines.append(row_text(row, flat, widths, cluster))
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _where(snapshot: Snapshot) -> str:
    """'node NAME', or 'cluster URL  nodes N' for the Prometheus view."""
    if isinstance(snapshot, ClusterSnapshot):
        return f"cluster {snapshot.source or '?'}  nodes {len(snapshot.nodes)}"
    return f"node {snapshot.node or '?'}"


def _with_expanded(state: ViewState, keys: frozenset[str]) -> ViewState:
    return dataclasses.replace(state, expanded=keys, collapsed_gpus=frozenset())


# --------------------------------------------------------------------------- live screen

HELP_LINES = (
    "gpuwatch top: keys",
    "",
    "  q            quit",
    "  up/down j/k  move the selection (PgUp/PgDn, Home/End/G)",
    "  enter/space  expand a container (processes with host and container PIDs);",
    "               on a GPU header: fold/unfold its containers",
    "  s            cycle the sort key: memory, SM%, kernel seconds, name, GPU",
    "  r            reverse the sort direction",
    "  /            filter by namespace, pod, container or id (enter keeps, esc cancels)",
    "  esc          clear the filter",
    "  g            group containers under their GPU / one flat list",
    "  + / -        slower / faster refresh",
    "  h or ?       this help (any key closes it)",
    "",
    "Columns: MEMORY = GPU memory the container's processes hold on that GPU;",
    "SM% = its share of the GPU's streaming multiprocessors over the last interval;",
    "KERNEL-S = cumulative seconds of GPU kernel time (never goes backwards);",
    "PIDS(host/ctr) = host PID / PID inside the container.",
    "With an agent's enforcer (top --agent) or progress files: LIMIT = GPU memory it may",
    "hold (rule limit or fair-share allowance); SHARE = GPU time share it is given (throttle",
    "target or elastic share); STATE = running, throttled to x%, paused, waiting for",
    "memory (rescheduling), checkpointing, with the elastic role (gaining, yielding,",
    "plateaued); PROGRESS = its evaluation value, arrow = direction, % = progress per",
    "GPU-second against its own early rate ('plateau' near 0).",
)

CLUSTER_HELP_LINES = (
    "",
    "Cluster view (--prometheus): every node's GPUs and containers as Prometheus last",
    "scraped them; NODE = node name; the filter also matches node names; no PIDs,",
    "temperature or power (run `gpuwatch top` on the node for those).",
)

STATUS_KEYS = "q quit  jk move  enter expand  s sort  r reverse  / filter  g group  +/- interval  h help"


def title_text(snapshot: Snapshot, state: ViewState) -> str:
    arrow = "desc" if state.descending else "asc"
    clock = "--"
    if snapshot.timestamp_s:
        clock = time.strftime("%H:%M:%S", time.localtime(wall_time_s(snapshot.timestamp_s)))
    text = (f"gpuwatch top  {_where(snapshot)}  every {state.interval_s:g}s  {clock}  "
            f"GPUs {len(snapshot.devices)}  containers {len(snapshot.containers)}  "
            f"sort {SORT_LABELS.get(state.sort_key.value, state.sort_key.value)} {arrow}")
    if state.filter_text and not state.filter_editing:
        text += f"  filter '{state.filter_text}'"
    if not state.group_by_gpu:
        text += "  flat"
    return text


def scroll_top(selected: int, top: int, body_rows: int, total_rows: int) -> int:
    """The first visible body row so that `selected` is on screen, moving as little as possible."""
    if body_rows <= 0:
        return 0
    top = min(top, max(total_rows - body_rows, 0))
    if selected < top:
        return max(selected, 0)
    if selected >= top + body_rows:
        return selected - body_rows + 1
    return max(top, 0)


def screen_lines(
    snapshot: Snapshot,
    state: ViewState,
    rows: Sequence[Row],
    width_cells: int,
    height_rows: int,
    top: int = 0,
    widths: Sequence[int] | None = None,
) -> tuple[list[ScreenLine], int]:
    """At most `height_rows` lines, each at most `width_cells - 1` cells, and the new scroll top.

    The last column is never written (curses raises when the bottom-right cell is written),
    so every text is clipped to width - 1. `widths` are `column_widths(rows, ...)` for
    this width when the caller has them cached.
    """
    usable = width_cells - 1
    if usable < 1 or height_rows < 1:
        return [], 0
    if height_rows < 3 or usable < 16:
        text = SIM_BANNER if snapshot.simulated else "gpuwatch: terminal too small"
        return [ScreenLine(fmt.clip(text, usable), Style.BANNER if snapshot.simulated else Style.ALERT)], 0

    header = [ScreenLine(title_text(snapshot, state), Style.TITLE)]
    if snapshot.simulated:
        header.append(ScreenLine(f" {SIM_BANNER}: simulated GPUs, not real hardware ", Style.BANNER))
    if not snapshot.gpu_up:
        header.append(ScreenLine(nvml_down_text(snapshot), Style.ALERT))
    header.extend(ScreenLine(f"note: {n}", Style.NOTE) for n in snapshot.notes[:2])

    if state.filter_editing:
        status = ScreenLine(f"/ filter: {state.filter_text}_   (enter keep, esc cancel)", Style.STATUS)
    else:
        status = ScreenLine(STATUS_KEYS, Style.STATUS)

    flat = not state.group_by_gpu
    cluster = is_cluster(snapshot)
    if widths is None:
        widths = column_widths(rows, flat, usable, cluster)
    columns = ScreenLine(header_text(flat, widths, cluster), Style.COLUMNS)

    # Drop notes, then the column header, before the banner/alert when space is short.
    while len(header) > 1 and len(header) + 3 > height_rows and header[-1].style is Style.NOTE:
        header.pop()
    fixed = [*header, columns]
    if len(fixed) + 2 > height_rows:  # too short: the simulation banner and alerts win
        urgent = sorted(header, key=lambda line: line.style not in (Style.BANNER, Style.ALERT))
        fixed = urgent[: max(height_rows - 2, 1)]
    body_rows = max(height_rows - len(fixed) - 1, 0)

    if state.show_help:
        help_lines = (*HELP_LINES, *CLUSTER_HELP_LINES) if cluster else HELP_LINES
        body = [ScreenLine(text, Style.HELP) for text in help_lines[:body_rows]]
        new_top = top
    else:
        new_top = scroll_top(state.selected, top, body_rows, len(rows))
        body = []
        for index in range(new_top, min(new_top + body_rows, len(rows))):
            row = rows[index]
            style = Style.SELECTED if index == state.selected else row_style(row)
            body.append(ScreenLine(row_text(row, flat, widths, cluster), style))
    lines = [*fixed, *body]
    lines += [ScreenLine("", Style.ROW)] * max(height_rows - len(lines) - 1, 0)
    lines.append(status)
    clipped = [ScreenLine(fmt.clip(fmt.clean(line.text), usable), line.style) for line in lines[:height_rows]]
    return clipped, new_top
