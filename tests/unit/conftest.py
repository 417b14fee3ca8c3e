"""Fixtures shared by the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def features_dir(tmp_path: Path) -> Path:
    """An empty features.d directory, as node-feature-discovery's local source reads it."""
    directory = tmp_path / "features.d"
    directory.mkdir()
    return directory
