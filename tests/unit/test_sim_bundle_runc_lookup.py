"""Unit test: a host without runc gets an error that names the Debian package."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.core.errors import SimError
from gpuwatch.sim.runc import find_runc


def test_missing_runc_names_the_package(tmp_path: Path) -> None:
    with pytest.raises(SimError, match="runc not found") as raised:
        find_runc(search_path=str(tmp_path))
    assert raised.value.fix == "apt-get install runc"


def test_runc_is_found_in_a_search_path(tmp_path: Path) -> None:
    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_runc(search_path=str(tmp_path)) == str(fake)
