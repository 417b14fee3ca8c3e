"""StateFileLock (issue 20, item 6 e): one agent per --state-file, whatever its --lock-file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.agent.nodelock import NodeLock, StateFileInUse, StateFileLock


def test_second_holder_of_one_state_file_is_refused_naming_it(tmp_path: Path) -> None:
    state = tmp_path / "frozen.json"
    # the second has its own node lock (another simulated node), the same state file
    with NodeLock(tmp_path / "a.lock"), StateFileLock(state), NodeLock(tmp_path / "b.lock"), \
            pytest.raises(StateFileInUse) as info:
        StateFileLock(state).acquire()
    err = info.value
    assert str(state) in err.message and f"pid {os.getpid()}" in err.message
    assert "--state-file" in err.fix
    assert not state.exists()  # the journal itself is never created or touched by the lock
    with StateFileLock(state):  # free again once released
        pass


def test_state_lock_sits_beside_the_state_file(tmp_path: Path) -> None:
    lock = StateFileLock(tmp_path / "sub" / "frozen.json")
    assert lock.path == tmp_path / "sub" / "frozen.json.lock"
    with lock:
        assert (tmp_path / "sub" / "frozen.json.lock").read_text().strip() == str(os.getpid())


def test_different_state_files_do_not_conflict(tmp_path: Path) -> None:
    with StateFileLock(tmp_path / "one.json"), StateFileLock(tmp_path / "two.json"):
        pass
