"""The curses screen's row cache (the loop itself is driven through tmux in tests/system)."""

from __future__ import annotations

import dataclasses

from gpuwatch.tui.screen import _RowCache
from gpuwatch.tui.view_state import ContainerRow, SortKey, ViewState, build_rows
from tests.unit.test_tui_samples import sample_snapshot


def test_rows_are_reused_when_only_the_selection_moves() -> None:
    cache = _RowCache()
    snap = sample_snapshot()
    rows, widths = cache.get(snap, ViewState(), 120)
    again, widths_again = cache.get(snap, ViewState(selected=3, selected_key="x", show_help=True), 120)
    assert again is rows and widths_again is widths
    assert rows == build_rows(snap, ViewState())


def test_rows_are_rebuilt_for_a_new_snapshot_sort_filter_expand_or_width() -> None:
    cache = _RowCache()
    snap = sample_snapshot()
    rows, _ = cache.get(snap, ViewState(), 120)
    changed = dataclasses.replace(snap, containers=snap.containers[:1])
    assert len(cache.get(changed, ViewState(), 120)[0]) < len(rows)
    equal_but_new = dataclasses.replace(snap)
    assert cache.get(equal_but_new, ViewState(), 120)[0] is not rows
    base, _ = cache.get(equal_but_new, ViewState(), 120)
    for state in (ViewState(sort_key=SortKey.SM), ViewState(filter_text="nb"), ViewState(reverse=True),
                  ViewState(group_by_gpu=False), ViewState(expanded=frozenset({base[1].key}))):
        got, _ = cache.get(equal_but_new, state, 120)
        assert got == build_rows(equal_but_new, state)
    _, narrow = cache.get(equal_but_new, ViewState(), 40)
    _, wide = cache.get(equal_but_new, ViewState(), 200)
    assert sum(narrow) < sum(wide)
    assert any(isinstance(r, ContainerRow) for r in base)
