"""The NFD feature file's staging directory is made safely (issue 20, item 6 d).

`features.d/.<name>.tmp.d` used to be made with mkdir (FileExistsError ignored) and then used
by path: a symlink planted there was followed, temp files were created (and stale-looking
ones deleted) in its target. Now the directory is opened O_DIRECTORY|O_NOFOLLOW and must be a
real directory owned by the agent's euid without group/other write bits; anything else is
refused with a clear error, counted, and nothing is created or deleted through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.signals.nfd import FeatureFileWriter
from tests.nfd_rules import check_feature_file

P = "gpuwatch.io/"
NOW = 1_790_000_000.0


def clock() -> float:
    return NOW


def writer_for(features_dir: Path) -> FeatureFileWriter:
    return FeatureFileWriter(features_dir / "gpuwatch", interval_s=1.0, clock=clock)


def dir_state(path: Path) -> tuple[list[str], int, int]:
    st = os.stat(path)
    return sorted(p.name for p in path.iterdir()), st.st_mtime_ns, st.st_ctime_ns


def test_nothing_planted_is_unchanged(features_dir: Path) -> None:
    writer = writer_for(features_dir)
    assert writer.update({P + "a": "1"})
    staging = features_dir / ".gpuwatch.tmp.d"
    assert staging.is_dir() and not staging.is_symlink()
    assert os.stat(staging).st_mode & 0o777 == 0o700
    assert list(staging.iterdir()) == []
    assert check_feature_file(features_dir / "gpuwatch", now=NOW) == {P + "a": "1"}
    assert writer.update({P + "a": "2"}) and writer.errors_total == 0


def test_planted_symlink_is_refused_and_never_followed(features_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    (target / ".gpuwatch.4242.tmp").write_text("the victim's file, named like a stale temp")
    (features_dir / ".gpuwatch.tmp.d").symlink_to(target)
    before = dir_state(target)
    writer = writer_for(features_dir)
    assert not writer.update({P + "a": "1"})
    assert dir_state(target) == before  # nothing created, renamed or deleted there
    assert (target / ".gpuwatch.4242.tmp").read_text().startswith("the victim's")
    assert writer.errors_total == 1 and writer.last_error is not None
    assert "symbolic link" in writer.last_error and ".gpuwatch.tmp.d" in writer.last_error
    assert not (features_dir / "gpuwatch").exists()
    assert not writer.remove()  # remove() does not follow it either
    assert dir_state(target) == before


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_group_or_world_writable_directory_is_refused(features_dir: Path, mode: int) -> None:
    staging = features_dir / ".gpuwatch.tmp.d"
    staging.mkdir()
    staging.chmod(mode)
    (staging / ".gpuwatch.4242.tmp").write_text("x")
    writer = writer_for(features_dir)
    assert not writer.update({P + "a": "1"})
    assert writer.last_error is not None and "writable by group or others" in writer.last_error
    assert sorted(p.name for p in staging.iterdir()) == [".gpuwatch.4242.tmp"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_directory_of_another_user_is_refused(features_dir: Path) -> None:
    staging = features_dir / ".gpuwatch.tmp.d"
    staging.mkdir(mode=0o700)
    os.chown(staging, 65534, 65534)
    writer = writer_for(features_dir)
    assert not writer.update({P + "a": "1"})
    assert writer.last_error is not None and "owned by uid 65534" in writer.last_error
    assert list(staging.iterdir()) == []


def test_a_regular_file_in_its_place_is_refused(features_dir: Path) -> None:
    (features_dir / ".gpuwatch.tmp.d").write_text("not a dir")
    writer = writer_for(features_dir)
    assert not writer.update({P + "a": "1"})
    assert writer.last_error is not None and "not a directory" in writer.last_error


def test_works_again_once_the_plant_is_removed(features_dir: Path, tmp_path: Path) -> None:
    (features_dir / ".gpuwatch.tmp.d").symlink_to(tmp_path)
    writer = writer_for(features_dir)
    assert not writer.update({P + "a": "1"})
    (features_dir / ".gpuwatch.tmp.d").unlink()
    assert writer.update({P + "a": "1"})
    assert check_feature_file(features_dir / "gpuwatch", now=NOW) == {P + "a": "1"}
