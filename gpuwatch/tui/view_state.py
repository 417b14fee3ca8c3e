"""Pure view state of `gpuwatch top`: what is sorted, filtered, selected and expanded.

Nothing here touches a terminal. `ViewState` is a frozen value; `apply_key` returns the
next state for one key press; `build_rows` turns a Snapshot plus a state into the list of
rows the screen (or the plain `--once` table) shows. The curses screen is a thin loop over
these functions, so the behaviour is unit-tested without a terminal (the bpftop model).

Keys are strings: single characters as typed ("q", "j", "/", "\\n") and curses key names
for special keys ("KEY_UP", "KEY_DOWN", "KEY_ENTER", "KEY_BACKSPACE", "KEY_RESIZE", ...).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import StrEnum

from gpuwatch.core.model import (
    ContainerEnforcement,
    ContainerProgress,
    ContainerUsage,
    DeviceInfo,
    ProcessUsage,
    Snapshot,
)
from gpuwatch.tui import fmt
from gpuwatch.tui.cluster_view import is_cluster, node_parts


class SortKey(StrEnum):
    """Container sort keys, in the order `s` cycles through them."""

    MEMORY = "memory"
    SM = "sm"
    KERNEL = "kernel"
    NAME = "name"
    GPU = "gpu"


SORT_CYCLE: tuple[SortKey, ...] = tuple(SortKey)

# Keys whose natural order is "biggest first"; `reverse` flips the natural order.
_DESCENDING_BY_DEFAULT = frozenset({SortKey.MEMORY, SortKey.SM, SortKey.KERNEL})

INTERVAL_STEPS_S: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)

MEMORY_BAR_CELLS = 22


@dataclass(frozen=True)
class ViewState:
    """Everything the user changed with keys; the Snapshot supplies the data.

    `selected` is a row index; `selected_key` pins the selection to a row's key so it
    follows the same container across refreshes (re-sorting moves rows). `expanded` holds
    container row keys whose processes are shown, `collapsed_gpus` the keys of GPU rows
    whose containers are folded away. `filter_editing` is true while the user
    types after `/`; `filter_before_edit` restores the old filter on Escape.
    """

    sort_key: SortKey = SortKey.MEMORY
    reverse: bool = False
    filter_text: str = ""
    filter_editing: bool = False
    filter_before_edit: str = ""
    selected: int = 0
    selected_key: str | None = None
    expanded: frozenset[str] = frozenset()
    collapsed_gpus: frozenset[str] = frozenset()
    group_by_gpu: bool = True
    show_help: bool = False
    interval_s: float = 1.0
    quit: bool = False

    @property
    def descending(self) -> bool:
        """Whether the current sort shows the largest value (or last name) first."""
        return (self.sort_key in _DESCENDING_BY_DEFAULT) != self.reverse


class RowKind(StrEnum):
    GPU = "gpu"
    CONTAINER = "container"
    PROCESS = "process"
    MESSAGE = "message"


@dataclass(frozen=True)
class GpuRow:
    """A GPU header: one per device (or per GPU index containers mention but NVML lost).

    ``node`` is set in the cluster view only (rows of all nodes in one list), as on the
    container and process rows.
    """

    key: str
    gpu_index: int
    name: str
    uuid: str
    memory_text: str
    memory_bar: str
    memory_ratio: float | None
    util_text: str
    temp_text: str
    power_text: str
    containers: int
    healthy: bool
    lost: bool
    collapsed: bool
    is_mig: bool
    node: str = ""
    kind: RowKind = RowKind.GPU


@dataclass(frozen=True)
class ContainerRow:
    """One container's use of one GPU."""

    key: str
    gpu_index: int
    namespace: str
    pod: str
    container: str
    container_id: str
    is_host: bool
    pids_text: str
    processes: int
    memory_text: str
    sm_text: str
    kernel_text: str
    probe_text: str
    expanded: bool
    node: str = ""
    kind: RowKind = RowKind.CONTAINER
    sharing: bool = False
    """The snapshot carries sharing data (the enforcer's view, progress): the LIMIT, SHARE,
    STATE and PROGRESS columns are shown."""
    limit_text: str = ""
    share_text: str = ""
    state_text: str = ""
    progress_text: str = ""


@dataclass(frozen=True)
class ProcessRow:
    """One process of an expanded container."""

    key: str
    gpu_index: int
    container_key: str
    pid_text: str
    container_pid_text: str
    comm: str
    memory_text: str
    sm_text: str
    node: str = ""
    kind: RowKind = RowKind.PROCESS


@dataclass(frozen=True)
class MessageRow:
    """A line of text in the body ("no containers on this GPU", "no GPUs found")."""

    key: str
    text: str
    kind: RowKind = RowKind.MESSAGE


Row = GpuRow | ContainerRow | ProcessRow | MessageRow


# --------------------------------------------------------------------------- identity


def container_labels(usage: ContainerUsage) -> tuple[str, str, str]:
    """(namespace, pod, container) as shown; host and raw cgroups are labelled as such."""
    ident = usage.identity
    if ident.is_container:
        name = ident.container_name or ident.container_id[:12]
        return ident.pod_namespace or "-", ident.pod_name or "-", name
    if ident.runtime == "host" and ident.cgroup_path in ("", "/"):
        return "-", "-", "(host)"
    return "-", "-", f"({ident.runtime or 'unknown'}) {ident.cgroup_path or '/'}"


def container_row_key(usage: ContainerUsage, node: str = "") -> str:
    """The row key of a container on a GPU (`node` in the cluster view, where indices repeat)."""
    if node:
        return f"c:{node}:{usage.gpu_index}:{usage.identity.key}"
    return f"c:{usage.gpu_index}:{usage.identity.key}"


def gpu_row_key(gpu_index: int, node: str = "") -> str:
    return f"g:{node}:{gpu_index}" if node else f"g:{gpu_index}"


def matches_filter(usage: ContainerUsage, text: str) -> bool:
    """Case-insensitive substring match on namespace, pod, container name, id or cgroup."""
    needle = text.strip().casefold()
    if not needle:
        return True
    ident = usage.identity
    haystack = (ident.pod_namespace, ident.pod_name, ident.container_name, ident.container_id,
                ident.cgroup_path, ident.runtime, " ".join(container_labels(usage)))
    return any(needle in field.casefold() for field in haystack)


def _entry_matches(node: str, usage: ContainerUsage, text: str) -> bool:
    """`matches_filter`, and in the cluster view the node name too."""
    return matches_filter(usage, text) or (bool(node) and text.strip().casefold() in node.casefold())


def filter_snapshot(snapshot: Snapshot, text: str) -> Snapshot:
    """The same Snapshot with only the containers matching `text` (pods/namespaces too)."""
    if not text.strip():
        return snapshot
    kept = tuple(c for c in snapshot.containers if matches_filter(c, text))
    pods = {(c.identity.pod_namespace, c.identity.pod_name) for c in kept}
    namespaces = {c.identity.pod_namespace for c in kept}
    return dataclasses.replace(
        snapshot,
        containers=kept,
        pods=tuple(p for p in snapshot.pods if (p.namespace, p.pod) in pods),
        namespaces=tuple(n for n in snapshot.namespaces if n.namespace in namespaces),
    )


# --------------------------------------------------------------------------- sorting


def _name_key(usage: ContainerUsage) -> tuple[str, str, str, str]:
    ns, pod, name = container_labels(usage)
    return ns.casefold(), pod.casefold(), name.casefold(), usage.identity.key


def sort_containers(containers: list[ContainerUsage], state: ViewState) -> list[ContainerUsage]:
    """Sort by the state's key and direction; ties break by name then GPU (deterministic)."""
    return [usage for _, usage in _sort_entries([("", c) for c in containers], state)]


Entry = tuple[str, ContainerUsage]  # (node name, "" in the local view; a container on one GPU)


def _sort_entries(entries: list[Entry], state: ViewState) -> list[Entry]:
    """`sort_containers` over (node, container): ties break by name, node, GPU; the GPU
    key sorts by node, then GPU index."""
    # First a stable tie-break order, then a stable sort by the primary key.
    ordered = sorted(entries, key=lambda e: (_name_key(e[1]), e[0], e[1].gpu_index))
    key = state.sort_key
    if key is SortKey.NAME:
        return sorted(ordered, key=lambda e: _name_key(e[1]), reverse=state.descending)
    if key is SortKey.GPU:
        return sorted(ordered, key=lambda e: (e[0], e[1].gpu_index), reverse=state.descending)
    return sorted(ordered, key=lambda e: _numeric_sort_value(e[1], key), reverse=state.descending)


def _numeric_sort_value(usage: ContainerUsage, key: SortKey) -> int | float:
    if key is SortKey.MEMORY:
        return usage.memory_bytes  # int: exact order even for huge values
    value = usage.sm_utilization_ratio if key is SortKey.SM else usage.kernel_seconds_total
    return value if math.isfinite(value) else -math.inf  # NaN would make the order arbitrary


# --------------------------------------------------------------------------- rows


def _pids_text(processes: tuple[ProcessUsage, ...]) -> str:
    parts = [f"{p.pid}/{p.container_pid if p.container_pid is not None else '-'}" for p in processes]
    if len(parts) > 2:
        return ",".join(parts[:2]) + f",+{len(parts) - 2}"
    return ",".join(parts) or "-"


def probe_text(usage: ContainerUsage) -> str:
    """Probe-derived counts ('ioctl 1.2k alloc 34 launch 5.6k'), '' without probes."""
    probe = usage.probe
    if probe is None:
        return ""
    parts = [f"ioctl {fmt.count_text(sum(n for _, n in probe.ioctl_calls_by_op))}",
             f"alloc {fmt.count_text(probe.allocations_total)}"]
    if probe.allocation_failures_total:
        parts.append(f"allocfail {fmt.count_text(probe.allocation_failures_total)}")
    if probe.launches_total is not None:
        parts.append(f"launch {fmt.count_text(probe.launches_total)}")
    return " ".join(parts)


def _gpu_row(device: DeviceInfo | None, gpu_index: int, containers: int, collapsed: bool,
             node: str = "") -> GpuRow:
    key = gpu_row_key(gpu_index, node)
    if device is None:  # containers still name a GPU that the backend no longer reports
        return GpuRow(key=key, gpu_index=gpu_index, name="(GPU not reported: lost?)",
                      uuid="", memory_text=fmt.NA, memory_bar=fmt.bar_text(None, MEMORY_BAR_CELLS),
                      memory_ratio=None, util_text=fmt.NA, temp_text=fmt.NA, power_text=fmt.NA,
                      containers=containers, healthy=False, lost=True, collapsed=collapsed,
                      is_mig=False, node=node)
    ratio = fmt.memory_ratio(device.memory_used_bytes, device.memory_total_bytes)
    memory_text = (f"{fmt.bytes_text(device.memory_used_bytes)} / "
                   f"{fmt.bytes_text(device.memory_total_bytes)}")
    return GpuRow(
        key=key, gpu_index=gpu_index, name=device.name, uuid=device.uuid,
        memory_text=memory_text, memory_bar=fmt.bar_text(ratio, MEMORY_BAR_CELLS),
        memory_ratio=ratio, util_text=fmt.ratio_percent_text(device.utilization_gpu_ratio),
        temp_text=fmt.celsius_text(device.temperature_celsius),
        power_text=fmt.power_text(device.power_watts, device.power_limit_watts),
        containers=containers, healthy=device.healthy, lost=not device.healthy,
        collapsed=collapsed, is_mig=device.is_mig, node=node,
    )


PLATEAU_EFFICIENCY = 0.05
"""Below this growth efficiency the PROGRESS column says "plateau" (elastic.plateau's default)."""


@dataclass(frozen=True)
class SharingInfo:
    """The enforcer's view and the progress input, by container key (None: no such data)."""

    enforcement: dict[str, ContainerEnforcement]
    progress: dict[str, ContainerProgress]

    @staticmethod
    def of(snapshot: Snapshot) -> SharingInfo | None:
        enforcement = {e.identity.key: e for e in getattr(snapshot, "enforcement", ())}
        progress = {p.identity.key: p for p in getattr(snapshot, "progress", ())}
        return SharingInfo(enforcement, progress) if enforcement or progress else None


def state_text(item: ContainerEnforcement | None) -> str:
    """'throttled to 35%', 'paused', 'waiting for memory 12s (+2.0 GiB)', 'checkpointing',
    'running'; the elastic role in brackets where it explains the share."""
    if item is None:
        return "-"
    if item.state == "throttled" and item.time_share is not None:
        text = f"throttled to {item.time_share:.0%}"
    elif item.state == "waiting-memory":
        waited = f" {item.waiting_s:.0f}s" if item.waiting_s is not None else ""
        more = f" (+{fmt.bytes_text(item.pending_bytes)})" if item.pending_bytes else ""
        text = f"waiting for memory{waited}{more}"
    else:
        text = item.state or "running"
    if item.elastic_role in ("gaining", "yielding", "plateaued") and item.state in ("running", "throttled"):
        text += f" ({item.elastic_role})"
    elif item.elastic_role == "queue" and item.state == "running":
        text += " (memory queue)"  # elastic division held off while others wait for memory
    return text


def share_text(item: ContainerEnforcement | None) -> str:
    """The GPU time share it is given: the throttle's target, else its elastic share."""
    if item is None:
        return "-"
    if item.time_share is not None:
        return fmt.ratio_percent_text(item.time_share)
    if item.elastic_share is not None:
        return fmt.ratio_percent_text(item.elastic_share)
    return "-"


def limit_text(item: ContainerEnforcement | None) -> str:
    """Its GPU memory limit (rule limit or fair-share allowance), '-' without one."""
    if item is None or item.memory_limit_bytes is None:
        return "-"
    return fmt.bytes_text(item.memory_limit_bytes)


def progress_text(progress: ContainerProgress | None, item: ContainerEnforcement | None) -> str:
    """'0.412 ↓ 45%': the evaluation value, its direction, and its growth efficiency (progress
    per GPU-second as a share of the job's early rate; 'plateau' when ~0). '-' without input."""
    if progress is None or progress.value is None:
        if progress is not None and progress.last_error:
            return f"? ({progress.last_error})"
        return "-"
    value = f"{progress.value:.4g}"
    rate = progress.rate_per_gpu_second
    arrow = ""
    if rate is not None and math.isfinite(rate) and rate != 0.0:
        improving = rate > 0
        rising = improving == (progress.goal == "maximize")
        arrow = " ↑" if rising else " ↓"
    efficiency = item.growth_efficiency if item is not None else None
    if efficiency is not None and efficiency < PLATEAU_EFFICIENCY:
        trend = " plateau"
    elif efficiency is not None:
        trend = f" {efficiency:.0%}"
    elif rate is not None and math.isfinite(rate) and rate <= 0.0:
        trend = " flat"
    else:
        trend = ""
    stale = " (read error)" if progress.last_error else ""
    return value + arrow + trend + stale


def _container_rows(usage: ContainerUsage, state: ViewState, node: str = "",
                    sharing: SharingInfo | None = None) -> list[Row]:
    key = container_row_key(usage, node)
    ns, pod, name = container_labels(usage)
    expanded = key in state.expanded
    texts = ("", "", "", "")
    if sharing is not None:
        item = sharing.enforcement.get(usage.identity.key)
        texts = (limit_text(item), share_text(item), state_text(item),
                 progress_text(sharing.progress.get(usage.identity.key), item))
    rows: list[Row] = [ContainerRow(
        key=key, gpu_index=usage.gpu_index, namespace=ns, pod=pod, container=name,
        container_id=usage.identity.container_id, is_host=not usage.identity.is_container,
        pids_text=_pids_text(usage.processes), processes=len(usage.processes),
        memory_text=fmt.bytes_text(usage.memory_bytes),
        sm_text=fmt.ratio_percent_text(usage.sm_utilization_ratio),
        kernel_text=fmt.seconds_text(usage.kernel_seconds_total),
        probe_text=probe_text(usage), expanded=expanded, node=node, sharing=sharing is not None,
        limit_text=texts[0], share_text=texts[1], state_text=texts[2], progress_text=texts[3],
    )]
    if expanded:
        if not usage.processes and not node:  # the cluster view has no per-process data at all
            rows.append(MessageRow(key=f"{key}:none", text="no processes right now"))
        for proc in sorted(usage.processes, key=lambda p: (-(p.memory_bytes or 0), p.pid)):
            rows.append(ProcessRow(
                key=f"{key}:p:{proc.pid}", gpu_index=usage.gpu_index, container_key=key,
                pid_text=str(proc.pid),
                container_pid_text=str(proc.container_pid) if proc.container_pid is not None else "-",
                comm=proc.comm or "?", memory_text=fmt.bytes_text(proc.memory_bytes),
                sm_text=fmt.ratio_percent_text(proc.sm_utilization_ratio), node=node,
            ))
    return rows


def build_rows(snapshot: Snapshot, state: ViewState) -> list[Row]:
    """The body rows for `snapshot` under `state` (filter, sort, grouping, expansion).

    A cluster snapshot (`gpuwatch top --prometheus`) gives one GPU section per node and
    GPU, nodes in name order; sorting and the flat list span every node.
    """
    parts = node_parts(snapshot)
    sharing = None if is_cluster(snapshot) else SharingInfo.of(snapshot)
    devices = {(node, d.index): d for node, part in parts for d in part.devices}
    entries: list[Entry] = [(node, c) for node, part in parts for c in part.containers]
    visible = _sort_entries([e for e in entries if _entry_matches(e[0], e[1], state.filter_text)], state)
    gpu_keys = sorted(set(devices) | {(node, c.gpu_index) for node, c in entries})
    rows: list[Row] = []
    if not gpu_keys:
        if is_cluster(snapshot):
            text = "no GPUs in Prometheus for this view"
        else:
            text = "no GPUs found" if snapshot.gpu_up else "no GPU data (NVML is down)"
        return [MessageRow(key="m:nogpu", text=text)]
    per_gpu: dict[tuple[str, int], list[ContainerUsage]] = {key: [] for key in gpu_keys}
    for node, usage in visible:
        per_gpu[(node, usage.gpu_index)].append(usage)
    for node, index in gpu_keys:
        containers = per_gpu[(node, index)]
        collapsed = state.group_by_gpu and gpu_row_key(index, node) in state.collapsed_gpus
        rows.append(_gpu_row(devices.get((node, index)), index, len(containers), collapsed, node))
        if not state.group_by_gpu or collapsed:
            continue
        if not containers:
            idle = "no containers on this GPU" if node else "no processes on this GPU"
            text = "no matching containers" if state.filter_text.strip() else idle
            suffix = f":{node}" if node else ""
            rows.append(MessageRow(key=f"m:empty{suffix}:{index}", text=text))
        for usage in containers:
            rows.extend(_container_rows(usage, state, node, sharing))
    if not state.group_by_gpu:
        if not visible:
            text = "no matching containers" if state.filter_text.strip() else "no GPU processes"
            rows.append(MessageRow(key="m:empty", text=text))
        for node, usage in visible:
            rows.extend(_container_rows(usage, state, node, sharing))
    return rows


def rows_key(state: ViewState) -> tuple[object, ...]:
    """The parts of a state that `build_rows` depends on: moving the selection or opening the
    help does not change the rows, so a screen can reuse them (1600 rows take ~50 ms)."""
    return (state.sort_key, state.reverse, state.filter_text, state.expanded, state.collapsed_gpus,
            state.group_by_gpu)


# --------------------------------------------------------------------------- selection


def reconcile(state: ViewState, rows: list[Row]) -> ViewState:
    """Keep the selection on the same row key after a refresh; clamp when rows vanish."""
    if not rows:
        return dataclasses.replace(state, selected=0, selected_key=None)
    if state.selected_key is not None:
        for i, row in enumerate(rows):
            if row.key == state.selected_key:
                return dataclasses.replace(state, selected=i)
    index = min(max(state.selected, 0), len(rows) - 1)
    return dataclasses.replace(state, selected=index, selected_key=rows[index].key)


def _select(state: ViewState, rows: list[Row], index: int) -> ViewState:
    if not rows:
        return dataclasses.replace(state, selected=0, selected_key=None)
    index = min(max(index, 0), len(rows) - 1)
    return dataclasses.replace(state, selected=index, selected_key=rows[index].key)


def selected_row(state: ViewState, rows: list[Row]) -> Row | None:
    if not rows:
        return None
    return rows[min(max(state.selected, 0), len(rows) - 1)]


# --------------------------------------------------------------------------- keys

ENTER_KEYS = frozenset({"\n", "\r", "KEY_ENTER", " "})
BACKSPACE_KEYS = frozenset({"KEY_BACKSPACE", "\x7f", "\b"})
ESCAPE = "\x1b"


def _toggle_expand(state: ViewState, rows: list[Row]) -> ViewState:
    row = selected_row(state, rows)
    if isinstance(row, ContainerRow):
        expanded = state.expanded ^ {row.key}
        return dataclasses.replace(state, expanded=frozenset(expanded))
    if isinstance(row, ProcessRow):  # collapse the parent and move the selection onto it
        return dataclasses.replace(state, expanded=state.expanded - {row.container_key},
                                   selected_key=row.container_key)
    if isinstance(row, GpuRow) and state.group_by_gpu:
        return dataclasses.replace(state, collapsed_gpus=state.collapsed_gpus ^ {row.key})
    return state


def step_interval(interval_s: float, direction: int) -> float:
    """Next larger (direction > 0) or smaller refresh interval from INTERVAL_STEPS_S."""
    if direction > 0:
        larger = [s for s in INTERVAL_STEPS_S if s > interval_s + 1e-9]
        return larger[0] if larger else INTERVAL_STEPS_S[-1]
    smaller = [s for s in INTERVAL_STEPS_S if s < interval_s - 1e-9]
    return smaller[-1] if smaller else INTERVAL_STEPS_S[0]


def _filter_key(state: ViewState, key: str) -> ViewState:
    if key in ENTER_KEYS - {" "}:
        return dataclasses.replace(state, filter_editing=False)
    if key == ESCAPE:
        return dataclasses.replace(state, filter_editing=False, filter_text=state.filter_before_edit)
    if key in BACKSPACE_KEYS:
        return dataclasses.replace(state, filter_text=state.filter_text[:-1])
    if key == "\x15":  # Ctrl-U clears the line, as in a shell
        return dataclasses.replace(state, filter_text="")
    if len(key) == 1 and key.isprintable():
        return dataclasses.replace(state, filter_text=state.filter_text + key)
    return state  # arrows and other special keys are ignored while typing


def apply_key(state: ViewState, key: str, rows: list[Row], page_rows: int = 10) -> ViewState:
    """The state after pressing `key` while `rows` are shown. Pure; unknown keys are no-ops."""
    if state.filter_editing:
        return _filter_key(state, key)
    if key in ("q", "Q"):
        return dataclasses.replace(state, quit=True)
    if state.show_help:  # any other key closes the help
        return dataclasses.replace(state, show_help=False)
    if key in ("h", "?", "KEY_F1"):
        return dataclasses.replace(state, show_help=True)
    moves = {"KEY_UP": -1, "k": -1, "KEY_DOWN": 1, "j": 1,
             "KEY_PPAGE": -max(page_rows, 1), "KEY_NPAGE": max(page_rows, 1)}
    if key in moves:
        return _select(state, rows, min(max(state.selected, 0), max(len(rows) - 1, 0)) + moves[key])
    if key == "KEY_HOME":
        return _select(state, rows, 0)
    if key in ("KEY_END", "G"):
        return _select(state, rows, len(rows) - 1)
    if key in ENTER_KEYS:
        return _toggle_expand(state, rows)
    if key == "s":
        next_key = SORT_CYCLE[(SORT_CYCLE.index(state.sort_key) + 1) % len(SORT_CYCLE)]
        return dataclasses.replace(state, sort_key=next_key, reverse=False)
    if key == "r":
        return dataclasses.replace(state, reverse=not state.reverse)
    if key == "/":
        return dataclasses.replace(state, filter_editing=True, filter_before_edit=state.filter_text)
    if key == ESCAPE and state.filter_text:
        return dataclasses.replace(state, filter_text="")
    if key == "g":
        return dataclasses.replace(state, group_by_gpu=not state.group_by_gpu)
    if key in ("+", "="):
        return dataclasses.replace(state, interval_s=step_interval(state.interval_s, +1))
    if key in ("-", "_"):
        return dataclasses.replace(state, interval_s=step_interval(state.interval_s, -1))
    return state
