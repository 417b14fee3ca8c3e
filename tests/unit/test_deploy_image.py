"""deploy/image/Containerfile documents the image deploy/image/build.sh makes: the same package
list, venv, entrypoint, probe sources and mount points (the Containerfile needs a registry to
build, so it is checked against the script here; the script's image is run in
tests/system/test_image.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

IMAGE = Path(__file__).resolve().parents[2] / "deploy" / "image"
BUILD_SH = (IMAGE / "build.sh").read_text()
CONTAINERFILE = (IMAGE / "Containerfile").read_text()


def instruction(name: str) -> list[str]:
    """Arguments of every `NAME ...` instruction, continuation lines joined."""
    joined = CONTAINERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def bash_array(name: str) -> list[str]:
    match = re.search(rf"^{name}=\((.*?)\)", BUILD_SH, re.S | re.M)
    assert match, name
    return match.group(1).split()


def test_both_install_the_one_package_list() -> None:
    assert "$here/packages.txt" in BUILD_SH
    assert any("deploy/image/packages.txt" in args for args in instruction("COPY"))
    packages = [line.split("#")[0].strip() for line in (IMAGE / "packages.txt").read_text().splitlines()]
    assert "python3-bpfcc" in packages
    assert not [p for p in packages if p.startswith(("gcc", "clang", "build-essential", "cpp"))]


def test_same_venv_entrypoint_and_command() -> None:
    venv = re.search(r"^venv=(\S+)", BUILD_SH, re.M)
    assert venv
    (entrypoint,) = instruction("ENTRYPOINT")
    (cmd,) = instruction("CMD")
    assert json.loads(entrypoint) == [f"{venv.group(1)}/bin/gpuwatch"]
    assert json.loads(cmd) == ["agent"]
    assert '--config.entrypoint "$venv/bin/gpuwatch" --config.cmd agent' in BUILD_SH
    assert any("venv --system-site-packages /opt/gpuwatch/venv" in args for args in instruction("RUN"))


def test_same_mount_points() -> None:
    mount_points = bash_array("mount_points")
    made = [args for args in instruction("RUN") if args.startswith("mkdir -p /host/proc")]
    assert len(made) == 1
    assert sorted(p.lstrip("/") for p in made[0].split()[2:]) == sorted(mount_points)


def test_probe_sources_go_where_the_installed_package_reads_them() -> None:
    (copy,) = [args for args in instruction("COPY") if args.startswith("bpf/")]
    target = copy.split()[-1]
    # gpuwatch/probes/layout.py: BPF_DIR is <site-packages>/bpf for an installed package
    assert target.rstrip("/").endswith("site-packages/bpf")
    assert "from gpuwatch.probes.layout import BPF_DIR" in BUILD_SH
