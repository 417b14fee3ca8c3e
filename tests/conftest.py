"""Shared test helpers.

System tests need root, runc, BCC or Prometheus. They are skipped with the reason when
those are truly missing; with GPUWATCH_REQUIRE_SYSTEM_TESTS=1 (set by .ci/run) a missing
requirement is a failure instead, so CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_SYSTEM = os.environ.get("GPUWATCH_REQUIRE_SYSTEM_TESTS") == "1"


def need(condition: bool, reason: str) -> None:
    """Skip (or fail under CI) when a system requirement is missing."""
    if condition:
        return
    if REQUIRE_SYSTEM:
        pytest.fail(f"system requirement missing in CI: {reason}")
    pytest.skip(reason)


def need_root() -> None:
    need(os.geteuid() == 0, "needs root (cgroups, BPF, runc)")


def need_binary(name: str, package: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    need(path is not None, f"needs `{name}` (apt-get install {package})")
    assert path is not None
    return path


def need_bcc() -> None:
    need_root()
    try:
        import bcc  # noqa: F401
    except ImportError:
        need(False, "needs BCC (apt-get install python3-bpfcc; venv with --system-site-packages)")


@pytest.fixture
def root_required() -> None:
    need_root()


@pytest.fixture
def runc_required() -> str:
    need_root()
    return need_binary("runc", "runc")


@pytest.fixture
def bcc_required() -> None:
    need_bcc()
