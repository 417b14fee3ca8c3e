"""Where `gpuwatch top` gets Snapshots: the live sampler, or a saved JSON document.

Both implement `SnapshotSource`; the screen and `--once` only call `next_snapshot()` and
`close()`. The sampler is imported lazily so `gpuwatch top --snapshot-file` (and
`--help`) work on machines without NVML.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.httpclient import DEFAULT_MAX_BYTES, BoundedHttpClient, HttpClientError
from gpuwatch.core.model import Snapshot
from gpuwatch.core.snapshot_doc import MAX_JSON_DEPTH, SnapshotDocError, loads


class SnapshotSource(Protocol):
    def next_snapshot(self) -> Snapshot:
        """A fresh Snapshot (one sample sweep, or one re-read of a file)."""
        ...

    def close(self) -> None:
        """Release what the source holds (NVML handles, threads). Idempotent."""
        ...


class FileSource:
    """Re-reads a `gpuwatch top --once --json` document on every refresh.

    If the file becomes unreadable after a good read (being rewritten, deleted), the last
    good Snapshot is returned with a note saying so, rather than ending the view.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last: Snapshot | None = None

    def next_snapshot(self) -> Snapshot:
        try:
            snapshot = loads(self.path.read_text(encoding="utf-8"), wall_clock=True)
        except (OSError, UnicodeDecodeError, SnapshotDocError) as err:
            if self._last is None:
                raise SnapshotDocError(f"cannot read snapshot file {self.path}: {err}",
                                       fix="write it with `gpuwatch top --once --json > FILE`") from err
            note = f"snapshot file unreadable, showing the last good read: {err}"
            return dataclasses.replace(self._last, notes=(note, *self._last.notes))
        self._last = snapshot
        return snapshot

    def close(self) -> None:
        return None


class SamplerSource:
    """One sampler sweep per refresh (`run_once`), driven by the view's own interval.

    The view calls it at its refresh interval instead of starting the sampler's thread, so
    `+`/`-` change the interval directly and `top` runs no extra thread.
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self._closed = False

    def next_snapshot(self) -> Snapshot:
        snapshot = self.sampler.run_once()
        if not isinstance(snapshot, Snapshot):
            raise GpuwatchError(f"sampler returned {type(snapshot).__name__}, not a Snapshot")
        return snapshot

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close = getattr(self.sampler, "close", None) or getattr(self.sampler, "stop", None)
        if callable(close):
            close()


class AgentSource:
    """Reads a running agent's /snapshot.json on every refresh (no local NVML needed).

    `gpuwatch top --agent http://127.0.0.1:9400` shows exactly what the agent exports,
    e.g. from inside the agent's pod. The document's monotonic timestamp is replaced by
    its wall time, since the agent's clock origin means nothing here. The answer is read
    through gpuwatch.core.httpclient: at most `max_bytes`, within `timeout_s` from connect to
    the last byte, nested at most snapshot_doc.MAX_JSON_DEPTH deep -- a server that never
    stops answering costs a bounded amount, never the terminal's memory.
    """

    def __init__(self, base_url: str, timeout_s: float = 5.0, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.url = base_url.rstrip("/") + "/snapshot.json"
        self.timeout_s = timeout_s
        try:
            self._http = BoundedHttpClient(base_url, timeout_s, max_bytes=max_bytes, max_depth=MAX_JSON_DEPTH,
                                           pool_size=1)
        except ValueError as err:
            raise GpuwatchError(f"--agent {base_url!r}: {err}", fix="pass the agent's URL, e.g. "
                                "http://127.0.0.1:9400") from None

    def next_snapshot(self) -> Snapshot:
        fix = "check the agent runs and --agent points at its --listen address"
        try:
            answer = self._http.request("GET", "/snapshot.json", headers={"Accept": "application/json"})
        except HttpClientError as err:
            raise GpuwatchError(f"cannot read the agent's snapshot: {err}", fix=fix) from None
        if answer.status != 200:
            raise GpuwatchError(f"cannot read {self.url}: HTTP {answer.status}: {answer.snippet()!r}", fix=fix)
        try:
            text = answer.body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise GpuwatchError(f"cannot read {self.url}: not UTF-8 ({err.reason})", fix=fix) from None
        return loads(text, wall_clock=True)

    def close(self) -> None:
        self._http.close()
