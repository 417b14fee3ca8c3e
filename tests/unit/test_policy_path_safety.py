"""Policy paths resolve only beneath the policy file's directory (issue 20, item 6 b).

A policy path that is a symlink to /etc/shadow (or to any file outside its directory) used
to be followed and the file's lines written into the error log. Now the path is resolved
below its directory (openat2 RESOLVE_BENEATH; a realpath check where openat2 is missing),
typed on an O_PATH fd before anything opens it, and refused with a clear error that carries
none of the target's content. A Kubernetes ConfigMap mount (policy.yaml -> ..data/policy.yaml,
..data -> ..<timestamp>, all inside the directory) still works."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch.cli.main import cli
from gpuwatch.core.errors import PolicyError
from gpuwatch.core.safeio import RefusedFile, read_file_beneath
from gpuwatch.policy.loader import load_policy, read_policy_text
from tests.unit.test_policy_reads import GOOD  # the same one-rule policy

SECRET_LINES = ("root:$6$SECRETHASHxyz:19000:0:99999:7:::", "daemon:*SECRET2abc:19000:0:99999:7:::")
RESOLVERS = ("auto", "realpath")


def outside_secret(tmp_path: Path) -> Path:
    """A shadow-like file in a directory other than the policy's."""
    secret = tmp_path / "etc" / "shadow"
    secret.parent.mkdir()
    secret.write_text("\n".join(SECRET_LINES) + "\n")
    secret.chmod(0o600)
    return secret


def policy_dir(tmp_path: Path) -> Path:
    d = tmp_path / "policy"
    d.mkdir()
    return d


def assert_no_secret(text: str) -> None:
    for line in SECRET_LINES:
        for piece in line.split(":")[:2]:
            if piece and piece != "root" and piece != "daemon":
                assert piece not in text, f"a line of the target leaked: {text!r}"


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_configmap_layout_still_works(tmp_path: Path, resolver: str) -> None:
    d = policy_dir(tmp_path)
    real = d / "..2026_01_01_00_00_00.123" / "policy.yaml"
    real.parent.mkdir()
    real.write_text(GOOD)
    (d / "..data").symlink_to(real.parent.name)
    (d / "policy.yaml").symlink_to("..data/policy.yaml")
    assert read_file_beneath(d / "policy.yaml", 1 << 20, resolver=resolver) == GOOD.encode()
    assert load_policy(d / "policy.yaml").rules[0].name == "first"


def test_symlink_to_shadow_is_refused_without_reading(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = outside_secret(tmp_path)
    d = policy_dir(tmp_path)
    (d / "policy.yaml").symlink_to(secret)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PolicyError) as info:
        load_policy(d / "policy.yaml")
    text = f"{info.value.message} {info.value.fix}"
    assert "outside" in text and str(d) in text
    assert_no_secret(text)
    assert_no_secret(caplog.text)


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_escapes_are_refused(tmp_path: Path, resolver: str) -> None:
    secret = outside_secret(tmp_path)
    d = policy_dir(tmp_path)
    (d / "abs.yaml").symlink_to(secret)  # absolute symlink out
    (d / "rel.yaml").symlink_to("../etc/shadow")  # relative symlink out
    (d / "..data").symlink_to("../etc")  # a ConfigMap-shaped link pointing out
    (d / "cm.yaml").symlink_to("..data/shadow")
    (d / "..abs").symlink_to(secret.parent)  # the same, absolute
    (d / "cm2.yaml").symlink_to("..abs/shadow")
    (d / "dots.yaml").symlink_to("../policy/../etc/shadow")  # back in, then out
    for name in ("abs.yaml", "rel.yaml", "cm.yaml", "cm2.yaml", "dots.yaml"):
        with pytest.raises(RefusedFile) as info:
            read_file_beneath(d / name, 1 << 20, resolver=resolver)
        assert "outside" in str(info.value), name
        assert_no_secret(str(info.value))


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_fifo_inside_is_typed_before_open(tmp_path: Path, resolver: str) -> None:
    d = policy_dir(tmp_path)
    os.mkfifo(d / "real.fifo")
    (d / "policy.yaml").symlink_to("real.fifo")
    out: dict[str, BaseException] = {}

    def run() -> None:
        try:
            read_file_beneath(d / "policy.yaml", 1 << 20, resolver=resolver)
        except BaseException as err:
            out["err"] = err

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - started < 1.0
    assert isinstance(out.get("err"), RefusedFile) and "FIFO" in str(out["err"])


def test_policy_check_cli_does_not_print_the_target(tmp_path: Path) -> None:
    secret = outside_secret(tmp_path)
    d = policy_dir(tmp_path)
    (d / "policy.yaml").symlink_to(secret)
    result = CliRunner().invoke(cli, ["policy", "check", str(d / "policy.yaml")])
    assert result.exit_code != 0
    assert "outside" in result.output
    assert_no_secret(result.output)


def test_plain_file_and_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = policy_dir(tmp_path)
    (d / "policy.yaml").write_text(GOOD)
    monkeypatch.chdir(d)
    assert read_policy_text("policy.yaml") == GOOD


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
@pytest.mark.parametrize("resolver", RESOLVERS)
def test_device_inside_is_typed_not_opened(tmp_path: Path, resolver: str) -> None:
    d = policy_dir(tmp_path)
    os.mknod(d / "zero", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
    (d / "policy.yaml").symlink_to("zero")
    with pytest.raises(RefusedFile, match="character device, not a regular file"):
        read_file_beneath(d / "policy.yaml", 1 << 20, resolver=resolver)
