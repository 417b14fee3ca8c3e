"""Policy reads that cannot hang or flood (issue 13, item 6): a FIFO, /dev/zero behind a
symlink, a directory and an oversized file are refused at once with a clear error; a
ConfigMap-style symlink chain still works; the enforcer reads and checks a reload in a
worker, keeps the running policy meanwhile and when the new file is refused."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from gpuwatch.core.errors import PolicyError
from gpuwatch.core.model import Snapshot
from gpuwatch.core.safeio import RefusedFile, read_regular_file
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.policy_reload import PolicyLoad
from gpuwatch.policy.loader import MAX_POLICY_BYTES, load_policy
from tests.enforcer_setup import enforcer_on_fake_tree

GOOD = """
rules:
  - name: first
    match: {namespace: ml}
    limits: {gpu_memory: 1GiB}
    actions: [{do: alert, at: 100%}]
"""


def timed_load(path: Path) -> tuple[PolicyError, float]:
    """load_policy in a thread (a hang must fail the test, not block it)."""
    out: dict[str, object] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            load_policy(path)
        except PolicyError as err:
            out["err"] = err
        out["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), f"reading {path} hung"
    assert "err" in out, f"{path} was accepted"
    return out["err"], out["took"]  # type: ignore[return-value]


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    err, took = timed_load(fifo)
    assert "FIFO" in err.message and "not a regular file" in err.message
    assert took < 1.0


def test_symlink_to_dev_zero_is_refused_without_reading(tmp_path: Path) -> None:
    link = tmp_path / "policy.yaml"
    link.symlink_to("/dev/zero")
    err, took = timed_load(link)
    # outside the policy's directory (issue 20, 6 b): refused before its type is even looked at
    assert "/dev/zero" in err.message and "outside its directory" in err.message
    assert took < 1.0


def test_directory_is_refused(tmp_path: Path) -> None:
    err, _ = timed_load(tmp_path)
    assert "directory" in err.message


def test_oversized_file_is_refused_before_reading(tmp_path: Path) -> None:
    big = tmp_path / "policy.yaml"
    big.write_bytes(b"#" * (10 * MAX_POLICY_BYTES))  # 10 MiB
    err, took = timed_load(big)
    assert "more than the 1048576-byte limit" in err.message
    assert took < 0.5


def test_file_growing_past_the_cap_while_read_is_refused() -> None:
    # /proc files report size 0 to fstat: the cap must hold while reading too
    with pytest.raises(RefusedFile, match="grew past the 16-byte limit"):
        read_regular_file("/proc/self/status", 16)


def test_configmap_symlink_chain_is_followed(tmp_path: Path) -> None:
    """Kubernetes mounts a ConfigMap key as policy.yaml -> ..data/policy.yaml, ..data -> ..<ts>."""
    real = tmp_path / "..2024_01_01" / "policy.yaml"
    real.parent.mkdir()
    real.write_text(GOOD)
    (tmp_path / "..data").symlink_to(real.parent.name)
    (tmp_path / "policy.yaml").symlink_to("..data/policy.yaml")
    assert load_policy(tmp_path / "policy.yaml").rules[0].name == "first"


def test_size_cap_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"x" * 100)
    assert read_regular_file(path, 100) == b"x" * 100
    with pytest.raises(RefusedFile):
        read_regular_file(path, 99)


def test_error_lists_at_most_50_problems(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("rules:\n" + "".join(f"  - name: r{i}\n    match: {{bogus: 1}}\n" for i in range(300)))
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert "... and " in info.value.message
    assert info.value.message.count("\n") <= 52


def test_deeply_nested_yaml_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("rules: " + "[" * 5000 + "]" * 5000)
    load = PolicyLoad(path)
    assert load.wait(10)
    assert isinstance(load.error, PolicyError) and "nested too deeply" in load.error.message


# -- the enforcer: reloads off the main loop -------------------------------------------------

def make(tmp_path: Path, **kwargs: object) -> Enforcer:
    return enforcer_on_fake_tree(tmp_path, GOOD, **kwargs)


def snap() -> Snapshot:
    return Snapshot(timestamp_s=time.time(), node="n", devices=(), containers=())


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "10MiB"])
def test_refused_reload_keeps_the_running_policy(tmp_path: Path, kind: str) -> None:
    enforcer = make(tmp_path)
    running = enforcer.policy
    path = tmp_path / "policy.yaml"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"#" * (10 << 20))
    enforcer.reload_requested = True
    started = time.monotonic()
    for _ in range(50):
        enforcer.on_snapshot(snap())
        if enforcer.metrics.reloads["failure"]:
            break
        time.sleep(0.02)
    assert time.monotonic() - started < 2.0
    assert enforcer.metrics.reloads["failure"] == 1
    assert enforcer.policy is running
    assert "refusing to read policy file" in enforcer.last_reload_error
    enforcer.close()


def test_slow_parse_does_not_stall_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that takes 1.5 s to parse: snapshots go on with the running policy (each
    waits at most reload_wait_s), the new one is swapped in once it is valid."""
    enforcer = make(tmp_path, reload_wait_s=0.05)
    import gpuwatch.enforce.policy_reload as policy_reload

    real = policy_reload.load_policy

    def slow(path: str | Path) -> object:
        time.sleep(1.5)
        return real(path)

    monkeypatch.setattr(policy_reload, "load_policy", slow)
    (tmp_path / "policy.yaml").write_text(GOOD.replace("first", "second"))
    enforcer.reload_requested = True
    worst = 0.0
    deadline = time.monotonic() + 10
    while enforcer.policy.rules[0].name == "first" and time.monotonic() < deadline:
        started = time.monotonic()
        enforcer.on_snapshot(snap())
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.05)
    assert enforcer.policy.rules[0].name == "second"
    assert worst < 0.5, f"a snapshot waited {worst:.2f}s for the parse"
    assert enforcer.metrics.reloads["success"] == 2  # the initial load and this one
    enforcer.close()
