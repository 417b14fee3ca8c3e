"""The live curses screen of `gpuwatch top`: a thin loop around the pure state and layout.

Loop: take a Snapshot when the refresh interval has passed, build rows, paint
`render.screen_lines`, wait for a key (at most until the next refresh), apply it. All
decisions live in state.py/render.py; this module only talks to curses.

curses (stdlib) rather than rich: no extra dependency or import cost (top starts fast and
stays small on a node), real key handling (arrows, resize) and a full-screen alternate
buffer that is restored on exit. `curses.wrapper` restores the terminal on every exit path
(return, exception, Ctrl-C); SIGTERM is turned into SystemExit so it takes the same path.
"""

from __future__ import annotations

import contextlib
import curses
import dataclasses
import locale
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.model import EMPTY_SNAPSHOT, Snapshot
from gpuwatch.tui import render
from gpuwatch.tui.cluster_view import is_cluster
from gpuwatch.tui.render import Style
from gpuwatch.tui.sources import SnapshotSource
from gpuwatch.tui.view_state import Row, ViewState, apply_key, build_rows, reconcile, rows_key

Clock = Callable[[], float]


def key_name(key: int | str) -> str:
    """A curses get_wch() result as the key strings state.apply_key understands."""
    if isinstance(key, str):
        return key
    if key in (curses.KEY_ENTER, 10, 13):
        return "\n"
    name = curses.keyname(key).decode("ascii", "replace")
    return name if name.startswith("KEY_") else chr(key) if 0 <= key < 0x110000 else name


class _RowCache:
    """The last rows and column widths, reused while the snapshot, the row-shaping parts of
    the state and the width are unchanged (a key press that only moves the selection)."""

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None  # held, so identity comparison is sound
        self._key: tuple[object, ...] | None = None
        self._rows: list[Row] = []
        self._widths: list[int] = []

    def get(self, snapshot: Snapshot, state: ViewState, width: int) -> tuple[list[Row], list[int]]:
        key = (rows_key(state), width)
        if snapshot is not self._snapshot or key != self._key:
            self._rows = build_rows(snapshot, state)
            self._widths = render.column_widths(self._rows, not state.group_by_gpu, width - 1, is_cluster(snapshot))
            self._snapshot, self._key = snapshot, key
        return self._rows, self._widths


def _styles() -> dict[Style, int]:
    """curses attributes per Style; colours only where the terminal has them."""
    attrs = {style: curses.A_NORMAL for style in Style}
    attrs.update({Style.TITLE: curses.A_BOLD, Style.BANNER: curses.A_REVERSE | curses.A_BOLD,
                  Style.ALERT: curses.A_BOLD, Style.COLUMNS: curses.A_UNDERLINE,
                  Style.GPU: curses.A_BOLD, Style.GPU_LOST: curses.A_BOLD,
                  Style.SELECTED: curses.A_REVERSE, Style.STATUS: curses.A_DIM,
                  Style.HOST: curses.A_DIM})
    if curses.has_colors():
        with contextlib.suppress(curses.error):
            curses.start_color()
            curses.use_default_colors()
            pairs = {Style.BANNER: (1, curses.COLOR_BLACK, curses.COLOR_YELLOW),
                     Style.ALERT: (2, curses.COLOR_RED, -1), Style.GPU_LOST: (2, curses.COLOR_RED, -1),
                     Style.GPU: (3, curses.COLOR_CYAN, -1), Style.NOTE: (4, curses.COLOR_YELLOW, -1)}
            for style, (pair, fg, bg) in pairs.items():
                curses.init_pair(pair, fg, bg)
                attrs[style] |= curses.color_pair(pair)
    return attrs


def _paint(stdscr: curses.window, lines: list[render.ScreenLine], attrs: dict[Style, int]) -> None:
    stdscr.erase()
    for y, line in enumerate(lines):
        # screen_lines never fills the last column, so addstr cannot hit the bottom-right cell;
        # a terminal shrinking between getmaxyx and here can still refuse a write.
        with contextlib.suppress(curses.error):
            stdscr.addstr(y, 0, line.text, attrs[line.style])
    stdscr.refresh()


def _follow_terminal_size(stdscr: curses.window) -> tuple[int, int]:
    """The screen size, resizing curses if the terminal changed without a KEY_RESIZE.

    A SIGWINCH can be lost (it arrived before curses installed its handler, or the signal
    is ignored in this process); asking the tty each frame costs one ioctl.
    """
    height, width = stdscr.getmaxyx()
    try:
        actual = os.get_terminal_size(sys.__stdout__.fileno() if sys.__stdout__ else 1)
    except (OSError, ValueError):
        return height, width
    if (actual.lines, actual.columns) != (height, width) and actual.lines > 0 and actual.columns > 0:
        with contextlib.suppress(curses.error):
            curses.resizeterm(actual.lines, actual.columns)
        height, width = stdscr.getmaxyx()
    return height, width


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit, so curses.wrapper's cleanup restores the terminal."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _loop(stdscr: curses.window, source: SnapshotSource, state: ViewState, clock: Clock) -> ViewState:
    with contextlib.suppress(curses.error):  # not every terminal can hide the cursor
        curses.curs_set(0)
    curses.set_escdelay(25)  # Esc (cancel filter) answers at once, not after 1 s
    stdscr.keypad(True)
    attrs = _styles()
    snapshot: Snapshot = dataclasses.replace(EMPTY_SNAPSHOT, notes=("waiting for the first sample...",))
    error: str | None = None
    shown = snapshot
    cache = _RowCache()
    next_sample = 0.0
    top = 0
    while not state.quit:
        now = clock()
        if now >= next_sample:
            try:
                snapshot = source.next_snapshot()
                error = None
            except GpuwatchError as err:  # keep the last view; say what failed
                error = str(err)
            next_sample = now + state.interval_s
            shown = snapshot if error is None else dataclasses.replace(
                snapshot, notes=(f"refresh failed: {error}", *snapshot.notes))
        height, width = _follow_terminal_size(stdscr)
        rows, widths = cache.get(shown, state, width)
        state = reconcile(state, rows)
        lines, top = render.screen_lines(shown, state, rows, width, height, top, widths)
        _paint(stdscr, lines, attrs)
        stdscr.timeout(max(int((next_sample - clock()) * 1000), 0))
        try:
            key = stdscr.get_wch()
        except curses.error:  # timeout: no key before the next refresh
            continue
        name = key_name(key)
        if name == "KEY_RESIZE":
            curses.update_lines_cols()
            continue
        interval_before = state.interval_s
        body_rows = max(height - 6, 1)
        state = apply_key(state, name, rows, page_rows=body_rows)
        if state.interval_s != interval_before:
            next_sample = min(next_sample, clock() + state.interval_s)
    return state


def run_screen(source: SnapshotSource, state: ViewState, clock: Clock = time.monotonic) -> ViewState:
    """Show the live view until the user quits; returns the final view state.

    The terminal is restored on every exit path; Ctrl-C ends the view quietly.
    """
    locale.setlocale(locale.LC_ALL, "")  # so curses writes UTF-8 names and the └ marker
    with _sigterm_as_exit():
        try:
            return curses.wrapper(_loop, source, state, clock)
        except KeyboardInterrupt:
            return dataclasses.replace(state, quit=True)
