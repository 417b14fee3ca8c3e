"""Typed errors. Each carries a message that says what went wrong and how to fix it;
the CLI turns them into a one-line ClickException instead of a traceback."""

from __future__ import annotations


class GpuwatchError(Exception):
    """Base class: `str(err)` is the user-facing message, `fix` the suggested remedy."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.fix})" if self.fix else self.message

    def __reduce__(self) -> tuple[type[GpuwatchError], tuple[str, str]]:
        # pickled whole (message and fix): errors cross process boundaries (the extender's
        # cluster-view worker); subclasses keep the (message, fix) positional signature
        return self.__class__, (self.message, self.fix)


class NvmlUnavailable(GpuwatchError):
    """libnvidia-ml could not be loaded or initialised."""


class NvmlCallFailed(GpuwatchError):
    """One NVML call failed; callers usually turn this into N/A for one field."""


class ProbesUnavailable(GpuwatchError):
    """BPF probes cannot be loaded (not root, BCC missing, no kernel headers...)."""


class SimError(GpuwatchError):
    """The simulated GPU node could not be built, started or used."""


class PolicyError(GpuwatchError):
    """A policy file is invalid; the message names the line and the fix."""


class EnforcementError(GpuwatchError):
    """An enforcement action could not be carried out."""


class UnsafeConfiguration(GpuwatchError):
    """The agent refuses to start with this configuration (e.g. open endpoint, no token)."""


class ReasonError(Exception):
    """A failure counted by kind: `reason` is a short fixed word (a metric label), `detail` says
    what happened; the message is "reason: detail"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
