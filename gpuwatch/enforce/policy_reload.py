"""Reading and parsing a policy file off the agent's main loop.

PyYAML composes a 1 MiB policy in seconds; done on the main loop that would stall
enforcement (and, before the reads were bounded, a FIFO or /dev/zero hung or flooded it).
`PolicyLoad` reads (policy.loader.read_policy_text: regular files only, 1 MiB cap, never
blocks) and validates in a daemon thread; the enforcer keeps its cadence and the running
policy, and swaps in the new one on a later snapshot only once it is valid. A load that is
still running when the agent stops is simply abandoned (daemon thread).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpuwatch.core.errors import PolicyError
from gpuwatch.policy.loader import load_policy
from gpuwatch.policy.rules import Policy

PolicyStat = tuple[float, int, int] | None
log = logging.getLogger(__name__)


def policy_stat(path: str | Path) -> PolicyStat:
    """(mtime, size, inode) of the file the path names now (symlinks followed), None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime, st.st_size, st.st_ino)


class PolicyLoad:
    """One read + validation of a policy file, in a daemon thread started at construction."""

    def __init__(self, path: str | Path, load: Callable[[str | Path], Policy] | None = None) -> None:
        self.path = Path(path)
        self.stat = policy_stat(path)  # before reading: a change while parsing is seen next time
        self.started_s = time.monotonic()
        self.policy: Policy | None = None
        self.error: PolicyError | None = None
        self._load = load or load_policy
        self._done = threading.Event()
        threading.Thread(target=self._run, name="policy-load", daemon=True).start()

    def _run(self) -> None:
        try:
            self.policy = self._load(self.path)
        except PolicyError as err:
            self.error = err
        except (RecursionError, MemoryError) as err:  # deeply nested / huge YAML: the file's fault
            self.error = PolicyError(f"policy file {self.path} cannot be parsed: {type(err).__name__}",
                                     fix="simplify the file (nesting depth, size)")
        except Exception as err:  # a bug must not leave the enforcer waiting on a dead worker
            log.exception("reading policy file %s failed unexpectedly", self.path)
            self.error = PolicyError(f"policy file {self.path} could not be loaded: {type(err).__name__}: {err}",
                                     fix="see the agent log; the running policy stays")
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None) -> bool:
        """True once finished (policy or error set)."""
        return self._done.wait(timeout_s)

    def result(self) -> Policy:
        """The policy (after wait()); raises the PolicyError if the file was refused or invalid."""
        if self.error is not None:
            raise self.error
        if self.policy is None:
            raise PolicyError(f"policy file {self.path} is still being read", fix="wait() first")
        return self.policy


class PolicyHolder:
    """The running policy and its file: the first read, reloads on request (SIGHUP) or when
    the file changes, each read and checked in a worker (PolicyLoad). An invalid or refused
    file keeps the running policy (logged, counted through `count_reload`) and is not read
    again until it changes or a reload is asked for."""

    def __init__(self, path: str | Path, count_reload: Callable[[bool], None], reload_wait_s: float = 0.1,
                 initial: PolicyLoad | None = None) -> None:
        self.path = Path(path)
        self.count_reload = count_reload
        self.reload_wait_s = reload_wait_s
        self.reload_requested = False
        self.last_error = ""
        self.loaded_s = 0.0
        """time.time() when the running policy was read (0: never)."""
        self._pending: PolicyLoad | None = None
        self._loaded_stat: PolicyStat = None
        self.policy = self._first(initial)

    def _first(self, load: PolicyLoad | None) -> Policy:
        if load is None:
            load = PolicyLoad(self.path)
        load.wait(None)
        policy = load.result()  # PolicyError: the agent does not start on a bad policy
        self._loaded_stat = load.stat
        self.count_reload(True)
        self.loaded_s = time.time()
        return policy

    def reload(self) -> bool:
        """Re-read the policy file now (waits for the parse); False when it was refused."""
        self.reload_requested = False
        self._pending = None
        load = PolicyLoad(self.path)
        load.wait(None)
        return self._apply(load)

    def check(self) -> bool | None:
        """Reload if asked to or the file changed: returns the load's result once it is in
        (applied when valid), None while nothing changed or the worker is still at it (the
        running policy stays meanwhile)."""
        load = self._pending
        if load is None:
            if not (self.reload_requested or policy_stat(self.path) != self._loaded_stat):
                return None
            self.reload_requested = False
            load = self._pending = PolicyLoad(self.path)
        if not load.wait(self.reload_wait_s):
            return None
        self._pending = None
        return self._apply(load)

    def _apply(self, load: PolicyLoad) -> bool:
        if load.error is not None:
            self._loaded_stat = load.stat  # do not retry the same broken file every interval
            self.last_error = str(load.error)
            self.count_reload(False)
            text = self.last_error
            log.error("policy reload failed; keeping the running policy: %s",
                      text if len(text) <= 4000 else text[:4000] + f"... ({len(text)} characters)")
            return False
        self.policy = load.result()
        self._loaded_stat = load.stat
        self.last_error = ""
        self.count_reload(True)
        self.loaded_s = time.time()
        log.info("policy reloaded from %s (%d rules, read and checked in %.2f s)", self.path,
                 len(self.policy.rules), time.monotonic() - load.started_s)
        return True
