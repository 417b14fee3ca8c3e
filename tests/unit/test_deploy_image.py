"""deploy/image/Containerfile documents the image deploy/image/build.sh makes: the same package
list, venv, entrypoint, probe sources and mount points (the Containerfile needs a registry to
build, so it is checked against the script here; the script's image is run in
tests/system/test_image.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
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


def test_probe_sources_come_with_the_wheel_and_are_found_there(tmp_path: Path) -> None:
    """The wheel carries bpf/ (pyproject data-files) and an installed package reads it from
    <prefix>/share/gpuwatch/bpf; the image build checks that instead of copying sources in."""
    repo = IMAGE.parents[1]
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / name, src / name)
    shutil.copytree(repo / "gpuwatch", src / "gpuwatch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo / "bpf", src / "bpf")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "wheels"), str(src)], check=True)
    (wheel,) = (tmp_path / "wheels").glob("gpuwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if "/data/share/gpuwatch/bpf/" in n}
    assert shipped == {p.name for p in (repo / "bpf").iterdir() if p.suffix in (".c", ".h")}
    assert "HEADER_PATH.is_file()" in BUILD_SH
    assert not [args for args in instruction("COPY") if args.startswith("bpf/*")]




def test_both_bundle_the_kernel_headers_where_the_agent_looks() -> None:
    """build.sh (an mmdebstrap hook) and the Containerfile run the one bundling script into
    the path gpuwatch falls back to; the script unpacks the packages instead of installing
    them (installing would pull gcc in); neither the DaemonSet's nor the systemd unit's
    mounts hide the tree (a mount at /opt/gpuwatch/kernel-headers would)."""
    from gpuwatch.probes.bcc_loader import BUNDLED_HEADERS

    script = (IMAGE / "bundle-kernel-headers.sh").read_text()
    assert f"bundled_headers={BUNDLED_HEADERS} " in BUILD_SH
    assert "bundle-kernel-headers.sh" in BUILD_SH and '--customize-hook=' in BUILD_SH
    assert any(f"bash /tmp/bundle-kernel-headers.sh {BUNDLED_HEADERS}" in args for args in instruction("RUN"))
    assert "dpkg-deb --extract" in script and "apt-get install" not in script
    assert "opt/gpuwatch/venv" in bash_array("app_paths"), "the app layer must not copy the base's headers"
    assert "opt/gpuwatch" not in bash_array("app_paths")
    for mount in bash_array("mount_points"):
        assert not BUNDLED_HEADERS.is_relative_to("/" + mount), mount
    unit = (IMAGE.parent / "systemd" / "gpuwatch-agent.service").read_text()
    binds = [item.lstrip("-").split(":")[-1] for line in unit.splitlines()
             if line.startswith(("BindPaths=", "BindReadOnlyPaths=")) for item in line.split("=", 1)[1].split()]
    assert not [b for b in binds if BUNDLED_HEADERS.is_relative_to(b)], binds
