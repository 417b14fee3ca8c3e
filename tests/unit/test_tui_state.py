"""Pure view state of `gpuwatch top`: rows, sorting, filtering, selection and keys."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatch.core.model import ContainerIdentity, Snapshot
from gpuwatch.tui.view_state import (
    ContainerRow,
    GpuRow,
    MessageRow,
    ProcessRow,
    Row,
    SortKey,
    ViewState,
    apply_key,
    build_rows,
    container_labels,
    filter_snapshot,
    reconcile,
    selected_row,
    step_interval,
)
from tests.unit.test_tui_samples import (
    GIB,
    NOTEBOOK,
    SERVER,
    T0,
    TRAINER,
    device,
    ident,
    sample_snapshot,
    usage,
)


def names(rows: list[Row]) -> list[str]:
    return [r.container for r in rows if isinstance(r, ContainerRow)]


def press(state: ViewState, snapshot: Snapshot, *keys: str) -> ViewState:
    """Press keys as the screen does: rows rebuilt and selection reconciled before each key."""
    for key in keys:
        rows = build_rows(snapshot, state)
        state = reconcile(state, rows)
        state = apply_key(state, key, rows)
    return reconcile(state, build_rows(snapshot, state))


def select_key(state: ViewState, snapshot: Snapshot, key: str) -> ViewState:
    rows = build_rows(snapshot, state)
    index = [r.key for r in rows].index(key)
    return dataclasses.replace(state, selected=index, selected_key=key)


# --------------------------------------------------------------------------- rows


def test_rows_group_containers_under_their_gpu() -> None:
    rows = build_rows(sample_snapshot(), ViewState())
    kinds = [(type(r).__name__, getattr(r, "gpu_index", None)) for r in rows]
    assert kinds == [("GpuRow", 0), ("ContainerRow", 0), ("ContainerRow", 0),
                     ("GpuRow", 1), ("ContainerRow", 1), ("ContainerRow", 1)]


def test_gpu_row_has_memory_bar_util_temp_power() -> None:
    row = build_rows(sample_snapshot(), ViewState())[0]
    assert isinstance(row, GpuRow)
    assert row.memory_text == "10.0 GiB / 40.0 GiB"
    assert row.memory_ratio == pytest.approx(0.25)
    assert row.memory_bar.startswith("[#####.") and row.memory_bar.endswith("]")
    assert (row.util_text, row.temp_text, row.power_text) == ("50%", "61C", "120/300 W")
    assert row.containers == 2


def test_container_row_fields() -> None:
    rows = build_rows(sample_snapshot(), ViewState())
    trainer = next(r for r in rows if isinstance(r, ContainerRow) and r.container == "trainer")
    assert (trainer.namespace, trainer.pod) == ("team-a", "train-0")
    assert trainer.memory_text == "8.0 GiB"
    assert trainer.sm_text == "70%"
    assert trainer.kernel_text == "50.0"
    assert trainer.pids_text == "4321/1,4322/7"
    assert trainer.probe_text == "ioctl 12.3k alloc 34 launch 5600"
    server = next(r for r in rows if isinstance(r, ContainerRow) and r.container == "server")
    assert server.probe_text == ""


def test_host_processes_are_labelled_host() -> None:
    rows = build_rows(sample_snapshot(), ViewState())
    host = [r for r in rows if isinstance(r, ContainerRow) and r.is_host]
    assert len(host) == 1
    assert (host[0].namespace, host[0].pod, host[0].container) == ("-", "-", "(host)")
    assert host[0].pids_text == "777/-"


def test_raw_cgroup_without_container_is_shown_with_runtime_and_path() -> None:
    raw = ContainerIdentity(runtime="systemd", cgroup_path="/system.slice/render.service")
    labels = container_labels(usage(raw, 0, GIB, 0.1, 1.0))
    assert labels == ("-", "-", "(systemd) /system.slice/render.service")


def test_many_pids_are_abbreviated() -> None:
    pids = tuple((1000 + i, i + 1, "w", GIB) for i in range(5))
    snap = Snapshot(T0, "n", (device(0),), (usage(TRAINER, 0, 5 * GIB, 0.5, 1.0, pids),))
    row = build_rows(snap, ViewState())[1]
    assert isinstance(row, ContainerRow)
    assert row.pids_text == "1000/1,1001/2,+3"
    assert row.processes == 5


# --------------------------------------------------------------------------- sorting


@pytest.mark.parametrize(
    ("key", "expected_gpu0", "expected_gpu1"),
    [
        (SortKey.MEMORY, ["trainer", "server"], ["jupyter", "(host)"]),
        (SortKey.SM, ["server", "trainer"], ["jupyter", "(host)"]),
        (SortKey.KERNEL, ["trainer", "server"], ["jupyter", "(host)"]),
        (SortKey.NAME, ["server", "trainer"], ["(host)", "jupyter"]),
    ],
)
def test_sort_keys_within_each_gpu(key: SortKey, expected_gpu0: list[str], expected_gpu1: list[str]) -> None:
    rows = build_rows(sample_snapshot(), ViewState(sort_key=key))
    gpu0 = [r.container for r in rows if isinstance(r, ContainerRow) and r.gpu_index == 0]
    gpu1 = [r.container for r in rows if isinstance(r, ContainerRow) and r.gpu_index == 1]
    assert (gpu0, gpu1) == (expected_gpu0, expected_gpu1)


def test_flat_list_sorts_across_gpus() -> None:
    state = ViewState(group_by_gpu=False)
    assert names(build_rows(sample_snapshot(), state)) == ["trainer", "jupyter", "server", "(host)"]
    state = dataclasses.replace(state, sort_key=SortKey.KERNEL)
    assert names(build_rows(sample_snapshot(), state)) == ["jupyter", "trainer", "server", "(host)"]
    state = dataclasses.replace(state, sort_key=SortKey.SM)
    assert names(build_rows(sample_snapshot(), state)) == ["server", "trainer", "jupyter", "(host)"]
    state = dataclasses.replace(state, sort_key=SortKey.GPU)
    assert [r.gpu_index for r in build_rows(sample_snapshot(), state) if isinstance(r, ContainerRow)] == [
        0, 0, 1, 1]


def test_flat_list_puts_all_gpu_headers_first() -> None:
    rows = build_rows(sample_snapshot(), ViewState(group_by_gpu=False))
    assert [type(r) for r in rows[:2]] == [GpuRow, GpuRow]
    assert all(isinstance(r, ContainerRow) for r in rows[2:])


def test_reverse_flips_the_order() -> None:
    state = ViewState(group_by_gpu=False)
    forward = names(build_rows(sample_snapshot(), state))
    backward = names(build_rows(sample_snapshot(), dataclasses.replace(state, reverse=True)))
    assert backward == list(reversed(forward))


def test_equal_values_sort_deterministically_by_name() -> None:
    a = usage(ident("ns", "p", "bbb", "id-b"), 0, GIB, 0.5, 1.0)
    b = usage(ident("ns", "p", "aaa", "id-a"), 0, GIB, 0.5, 1.0)
    for order in ((a, b), (b, a)):
        snap = Snapshot(T0, "n", (device(0),), order)
        assert names(build_rows(snap, ViewState())) == ["aaa", "bbb"]


def test_nan_utilisation_sorts_last_instead_of_scrambling() -> None:
    good = usage(ident("ns", "p", "good", "id-g"), 0, GIB, 0.5, 1.0)
    nan = usage(ident("ns", "p", "nan", "id-n"), 0, GIB, float("nan"), float("nan"))
    other = usage(ident("ns", "p", "zzz", "id-z"), 0, GIB, 0.9, 2.0)
    snap = Snapshot(T0, "n", (device(0),), (nan, good, other))
    assert names(build_rows(snap, ViewState(sort_key=SortKey.SM))) == ["zzz", "good", "nan"]
    rows = build_rows(snap, ViewState(sort_key=SortKey.KERNEL))
    assert [r.kernel_text for r in rows if isinstance(r, ContainerRow)] == ["2.0", "1.0", "N/A"]


# --------------------------------------------------------------------------- filtering


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("research", ["jupyter"]),          # namespace
        ("SERVE", ["server"]),              # pod, case-insensitive
        ("trainer", ["trainer"]),           # container name
        ("dddd3333", ["server"]),           # container id
        ("team-a", ["trainer", "server"]),  # namespace, two containers
        ("host", ["(host)"]),               # the host bucket
        ("no-such-thing", []),
        ("", ["trainer", "server", "jupyter", "(host)"]),
    ],
)
def test_filter_matches_namespace_pod_container_and_id(text: str, expected: list[str]) -> None:
    rows = build_rows(sample_snapshot(), ViewState(filter_text=text))
    assert sorted(names(rows)) == sorted(expected)


def test_filter_keeps_gpu_headers_and_says_nothing_matched() -> None:
    rows = build_rows(sample_snapshot(), ViewState(filter_text="research"))
    assert [type(r) for r in rows] == [GpuRow, MessageRow, GpuRow, ContainerRow]
    assert isinstance(rows[1], MessageRow) and "no matching" in rows[1].text


def test_filter_snapshot_drops_other_containers_pods_and_namespaces() -> None:
    snap = filter_snapshot(sample_snapshot(), "research")
    assert [c.identity.container_name for c in snap.containers] == ["jupyter"]
    assert [p.pod for p in snap.pods] == ["nb-7"]
    assert [n.namespace for n in snap.namespaces] == ["research"]
    assert snap.devices == sample_snapshot().devices
    assert filter_snapshot(sample_snapshot(), "  ") == sample_snapshot()


# --------------------------------------------------------------------------- expand / collapse


def test_enter_expands_container_to_processes_with_host_and_container_pids() -> None:
    snap = sample_snapshot()
    state = select_key(ViewState(), snap, f"c:0:{TRAINER.key}")
    state = press(state, snap, "\n")
    rows = build_rows(snap, state)
    procs = [r for r in rows if isinstance(r, ProcessRow)]
    assert [(p.pid_text, p.container_pid_text, p.comm, p.memory_text) for p in procs] == [
        ("4321", "1", "python3", "6.0 GiB"), ("4322", "7", "worker", "2.0 GiB")]
    index = [r.key for r in rows].index(f"c:0:{TRAINER.key}")
    assert rows[index + 1] is procs[0]
    container = rows[index]
    assert isinstance(container, ContainerRow) and container.expanded


def test_space_toggles_and_enter_on_process_collapses_parent() -> None:
    snap = sample_snapshot()
    state = select_key(ViewState(), snap, f"c:0:{TRAINER.key}")
    state = press(state, snap, " ", "j")  # expand, move onto the first process
    assert isinstance(selected_row(state, build_rows(snap, state)), ProcessRow)
    state = press(state, snap, "\n")
    rows = build_rows(snap, state)
    assert not any(isinstance(r, ProcessRow) for r in rows)
    assert state.selected_key == f"c:0:{TRAINER.key}"
    assert rows[state.selected].key == f"c:0:{TRAINER.key}"


def test_host_process_row_has_no_container_pid() -> None:
    snap = sample_snapshot()
    host_key = next(r.key for r in build_rows(snap, ViewState()) if isinstance(r, ContainerRow) and r.is_host)
    state = press(select_key(ViewState(), snap, host_key), snap, "\n")
    procs = [r for r in build_rows(snap, state) if isinstance(r, ProcessRow)]
    assert [(p.pid_text, p.container_pid_text, p.comm) for p in procs] == [("777", "-", "Xorg")]


def test_expanded_container_without_processes_says_so() -> None:
    snap = Snapshot(T0, "n", (device(0),), (usage(TRAINER, 0, GIB, 0.1, 1.0),))
    state = press(select_key(ViewState(), snap, f"c:0:{TRAINER.key}"), snap, "\n")
    rows = build_rows(snap, state)
    assert isinstance(rows[-1], MessageRow) and "no processes" in rows[-1].text


def test_enter_on_gpu_header_folds_its_containers() -> None:
    snap = sample_snapshot()
    state = press(ViewState(), snap, "\n")  # selection starts on GPU 0
    rows = build_rows(snap, state)
    assert [type(r) for r in rows] == [GpuRow, GpuRow, ContainerRow, ContainerRow]
    assert isinstance(rows[0], GpuRow) and rows[0].collapsed
    state = press(state, snap, "\n")
    assert len(build_rows(snap, state)) == 6


# --------------------------------------------------------------------------- selection


def test_arrows_and_jk_move_and_stop_at_the_ends() -> None:
    snap = sample_snapshot()
    state = press(ViewState(), snap, "k", "k")
    assert state.selected == 0
    state = press(state, snap, "j", "KEY_DOWN")
    assert state.selected == 2
    state = press(state, snap, *["j"] * 20)
    assert state.selected == 5
    state = press(state, snap, "KEY_UP")
    assert state.selected == 4
    state = press(state, snap, "KEY_HOME")
    assert state.selected == 0
    state = press(state, snap, "G")
    assert state.selected == 5


def test_page_keys_move_by_page() -> None:
    snap = sample_snapshot()
    rows = build_rows(snap, ViewState())
    state = apply_key(ViewState(), "KEY_NPAGE", rows, page_rows=3)
    assert state.selected == 3
    assert apply_key(state, "KEY_PPAGE", rows, page_rows=3).selected == 0


def test_selection_follows_its_container_when_the_sort_changes() -> None:
    snap = sample_snapshot()
    key = f"c:0:{SERVER.key}"
    state = select_key(ViewState(), snap, key)
    before = state.selected
    state = press(state, snap, "s")  # memory -> SM: server moves above trainer
    assert state.sort_key is SortKey.SM
    assert state.selected_key == key
    assert build_rows(snap, state)[state.selected].key == key
    assert state.selected != before


def test_selection_is_clamped_when_rows_vanish() -> None:
    snap = sample_snapshot()
    state = press(ViewState(), snap, *["j"] * 5)
    assert state.selected == 5
    smaller = dataclasses.replace(snap, containers=snap.containers[:1])
    state = reconcile(state, build_rows(smaller, state))
    rows = build_rows(smaller, state)
    assert state.selected == len(rows) - 1
    assert state.selected_key == rows[-1].key
    empty = reconcile(state, [])
    assert (empty.selected, empty.selected_key) == (0, None)
    assert selected_row(empty, []) is None


def test_selection_survives_its_container_disappearing_and_moves_on() -> None:
    snap = sample_snapshot()
    state = select_key(ViewState(), snap, f"c:1:{NOTEBOOK.key}")
    gone = dataclasses.replace(snap, containers=tuple(c for c in snap.containers if c.identity != NOTEBOOK))
    state = reconcile(state, build_rows(gone, state))
    rows = build_rows(gone, state)
    assert 0 <= state.selected < len(rows)
    assert state.selected_key == rows[state.selected].key


def test_moving_on_empty_rows_does_not_crash() -> None:
    state = apply_key(ViewState(), "j", [])
    assert state.selected == 0 and state.selected_key is None
    assert apply_key(ViewState(), "\n", []) == ViewState()


# --------------------------------------------------------------------------- keys


def test_s_cycles_every_sort_key_and_r_reverses() -> None:
    state = ViewState()
    seen = []
    for _ in range(5):
        seen.append(state.sort_key)
        state = apply_key(state, "s", [])
    assert seen == list(SortKey)
    assert state.sort_key is SortKey.MEMORY
    assert state.descending
    state = apply_key(state, "r", [])
    assert state.reverse and not state.descending
    assert apply_key(state, "s", []).reverse is False  # a new key starts in its natural order


def test_name_sort_is_ascending_by_default() -> None:
    assert not ViewState(sort_key=SortKey.NAME).descending
    assert ViewState(sort_key=SortKey.NAME, reverse=True).descending


def test_filter_typing_enter_and_escape() -> None:
    snap = sample_snapshot()
    state = press(ViewState(), snap, "/", "r", "e", "s", "x", "KEY_BACKSPACE")
    assert state.filter_editing and state.filter_text == "res"
    assert names(build_rows(snap, state)) == ["jupyter"]  # applied live while typing
    assert state.sort_key is SortKey.MEMORY and not state.reverse  # 'r' and 's' were text
    state = press(state, snap, "\n")
    assert not state.filter_editing and state.filter_text == "res"
    state = press(state, snap, "/", "z", "z", "\x1b")
    assert not state.filter_editing and state.filter_text == "res"  # esc restores
    state = press(state, snap, "\x1b")
    assert state.filter_text == ""  # esc outside the prompt clears the filter


def test_filter_ignores_special_keys_and_ctrl_u_clears() -> None:
    state = apply_key(ViewState(filter_editing=True, filter_text="ab"), "KEY_UP", [])
    assert state.filter_text == "ab"
    assert apply_key(state, "\x15", []).filter_text == ""
    assert apply_key(state, "é", []).filter_text == "abé"
    assert apply_key(state, "q", []).quit is False


def test_q_quits_and_help_toggles() -> None:
    assert apply_key(ViewState(), "q", []).quit
    state = apply_key(ViewState(), "h", [])
    assert state.show_help
    assert not apply_key(state, "x", []).show_help
    assert apply_key(state, "q", []).quit


def test_g_toggles_grouping() -> None:
    state = apply_key(ViewState(), "g", [])
    assert not state.group_by_gpu
    assert apply_key(state, "g", []).group_by_gpu


def test_plus_minus_step_the_interval_within_bounds() -> None:
    state = ViewState(interval_s=1.0)
    assert apply_key(state, "+", []).interval_s == 2.0
    assert apply_key(state, "-", []).interval_s == 0.5
    assert step_interval(1.5, +1) == 2.0 and step_interval(1.5, -1) == 1.0
    assert step_interval(0.2, -1) == 0.2
    assert step_interval(60.0, +1) == 60.0


def test_unknown_keys_change_nothing() -> None:
    rows = build_rows(sample_snapshot(), ViewState())
    for key in ("x", "KEY_F5", "KEY_RESIZE", "\x00"):
        assert apply_key(ViewState(), key, rows) == ViewState()


# --------------------------------------------------------------------------- edge cases


def test_empty_node_has_a_message_row() -> None:
    rows = build_rows(Snapshot(T0, "n", (), ()), ViewState())
    assert len(rows) == 1 and isinstance(rows[0], MessageRow) and rows[0].text == "no GPUs found"
    down = build_rows(Snapshot(T0, "n", (), (), gpu_up=False, gpu_error="x"), ViewState())
    assert isinstance(down[0], MessageRow) and "NVML is down" in down[0].text


def test_gpu_without_containers_says_so() -> None:
    rows = build_rows(Snapshot(T0, "n", (device(0),), ()), ViewState())
    assert isinstance(rows[1], MessageRow) and rows[1].text == "no processes on this GPU"


def test_unreadable_fields_are_na() -> None:
    dev = device(0, used_bytes=None, total_bytes=None, utilization_gpu_ratio=None, temperature_celsius=None,
                 power_watts=None, power_limit_watts=None)
    row = build_rows(Snapshot(T0, "n", (dev,), ()), ViewState())[0]
    assert isinstance(row, GpuRow)
    assert row.memory_text == "N/A / N/A"
    assert "N/A" in row.memory_bar and row.memory_ratio is None
    assert (row.util_text, row.temp_text, row.power_text) == ("N/A", "N/A", "N/A")


def test_zero_byte_device_does_not_divide_by_zero() -> None:
    row = build_rows(Snapshot(T0, "n", (device(0, used_bytes=0, total_bytes=0),), ()), ViewState())[0]
    assert isinstance(row, GpuRow)
    assert row.memory_ratio is None and row.memory_text == "0 B / 0 B"


def test_huge_numbers_stay_readable() -> None:
    huge = 2**70
    snap = Snapshot(T0, "n", (device(0, used_bytes=huge, total_bytes=huge),),
                    (usage(TRAINER, 0, huge, 1.0, 1e12, ((2**31 - 1, 2**31 - 1, "big", huge),)),))
    rows = build_rows(snap, press(select_key(ViewState(), snap, f"c:0:{TRAINER.key}"), snap, "\n"))
    gpu, container, proc = rows
    assert isinstance(gpu, GpuRow) and gpu.memory_text == "1024.0 EiB / 1024.0 EiB"
    assert isinstance(container, ContainerRow)
    assert container.memory_text == "1024.0 EiB" and container.kernel_text == "11574074.1d"
    assert isinstance(proc, ProcessRow) and proc.pid_text == "2147483647"


def test_unicode_names_are_kept_and_filterable() -> None:
    uni = ident("équipe-ü", "训练-0", "модель", "id-uni")
    snap = Snapshot(T0, "n", (device(0),), (usage(uni, 0, GIB, 0.3, 3.0),))
    rows = build_rows(snap, ViewState(filter_text="训练"))
    row = rows[1]
    assert isinstance(row, ContainerRow)
    assert (row.namespace, row.pod, row.container) == ("équipe-ü", "训练-0", "модель")
    assert names(build_rows(snap, ViewState(filter_text="ÉQUIPE"))) == ["модель"]


def test_lost_gpu_still_shows_its_containers() -> None:
    """A container still names GPU 1 after NVML stopped reporting it."""
    snap = Snapshot(T0, "n", (device(0),), (usage(TRAINER, 1, GIB, 0.1, 4.0),))
    rows = build_rows(snap, ViewState())
    lost = rows[2]
    assert isinstance(lost, GpuRow) and lost.gpu_index == 1 and lost.lost and "lost" in lost.name
    assert isinstance(rows[3], ContainerRow) and rows[3].container == "trainer"


def test_unhealthy_gpu_is_flagged() -> None:
    rows = build_rows(Snapshot(T0, "n", (device(0, healthy=False),), ()), ViewState())
    assert isinstance(rows[0], GpuRow) and rows[0].lost and not rows[0].healthy
