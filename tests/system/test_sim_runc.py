"""System tests for gpuwatch.sim.runc: real runc containers and real cgroups on this host.

Each test builds its own ContainerLab with bundle, docker and runc roots under tmp_path,
so nothing collides with a real containerd/docker/runc or with other tests.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.core.errors import SimError
from gpuwatch.sim import cgroups
from gpuwatch.sim.runc import ContainerLab, ContainerSpec, RunningContainer
from tests.conftest import need
from tests.system.sim_helpers import tmp_container_lab

MOUNTS = cgroups.detect()
SLEEP = ["/bin/sleep", "30"]


@pytest.fixture
def lab(tmp_path: Path, runc_required: str) -> Iterator[ContainerLab]:
    with tmp_container_lab(tmp_path) as container_lab:
        yield container_lab


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _settle(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Give an asynchronous kernel state change a moment; not an assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def _v2_line(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"no v2 line in /proc/{pid}/cgroup")


def _nspid(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError("no NSpid line")


def _assert_gone(container: RunningContainer, runc_root: Path, pids: list[int]) -> None:
    """No cgroup dir in any hierarchy, no pod dir, no runc state, no bundle, no process."""
    for directory in MOUNTS.all_dirs(container.cgroup_path):
        assert not directory.exists(), directory
    if container.pod_uid is not None:
        pod_dir = str(Path(container.cgroup_path).parent)
        for directory in MOUNTS.all_dirs(pod_dir):
            assert not directory.exists(), directory
    assert not (runc_root / container.id).exists()
    assert not container.bundle_dir.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"pid {pid} still exists"


def test_k8s_container_identity_namespaces_and_binds(lab: ContainerLab, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "in.txt").write_text("from-host\n")
    script = (f"echo mypid=$$; cat {shared}/in.txt; echo from-container > {shared}/out.txt; "
              "echo ready; exec sleep 30")
    spec = ContainerSpec(name="trainer", argv=["/bin/sh", "-c", script], namespace="ml", pod="job-0",
                         extra_binds=[str(shared)], annotations={"gpuwatch.io/policy": "strict"})
    container = lab.run(spec)
    _wait_for(lambda: "ready" in container.logs())

    assert len(container.id) == 64
    assert container.cgroup_path == f"/kubepods/burstable/pod{container.pod_uid}/{container.id}"
    assert _v2_line(container.host_pid) == container.cgroup_path
    assert container.host_pid in container.pids()
    for directory in MOUNTS.all_dirs(container.cgroup_path):  # runc made it in every hierarchy
        assert container.host_pid in cgroups.read_pids(directory), directory
    assert _nspid(container.host_pid) == [container.host_pid, 1]

    logs = container.logs()
    assert "mypid=1\n" in logs
    assert "from-host" in logs
    assert (shared / "out.txt").read_text() == "from-container\n"

    config_path = tmp_path / "bundles" / "k8s.io" / container.id / "config.json"
    assert container.bundle_dir == config_path.parent
    config = json.loads(config_path.read_text())
    notes = config["annotations"]
    assert notes["io.kubernetes.pod.name"] == "job-0"
    assert notes["io.kubernetes.pod.namespace"] == "ml"
    assert notes["io.kubernetes.pod.uid"] == container.pod_uid
    assert notes["io.kubernetes.container.name"] == "trainer"
    assert notes["io.kubernetes.cri.container-type"] == "container"
    assert len(notes["io.kubernetes.cri.sandbox-id"]) == 64
    assert notes["gpuwatch.io/policy"] == "strict"
    assert config["linux"]["cgroupsPath"] == container.cgroup_path


def test_rootfs_and_system_binds_are_read_only(lab: ContainerLab) -> None:
    script = ("touch /usr/gpuwatch-probe 2>/dev/null && echo usr-writable; "
              "touch /x 2>/dev/null && echo root-writable; echo done")
    container = lab.run(ContainerSpec(name="ro", argv=["/bin/sh", "-c", script]))
    assert container.wait(5) == 0
    assert container.logs() == "done\n"
    assert not Path("/usr/gpuwatch-probe").exists()


def test_guaranteed_pod_sits_directly_under_kubepods(lab: ContainerLab) -> None:
    container = lab.run(ContainerSpec(name="g", argv=SLEEP, qos="guaranteed"))
    assert _v2_line(container.host_pid) == f"/kubepods/pod{container.pod_uid}/{container.id}"


def test_exit_status_and_logs(lab: ContainerLab) -> None:
    container = lab.run(ContainerSpec(name="exit3", argv=["/bin/sh", "-c", "echo out; echo err >&2; exit 3"]))
    assert container.wait(5) == 3
    assert "out" in container.logs() and "err" in container.logs()
    pending = lab.run(ContainerSpec(name="long", argv=SLEEP))
    assert pending.wait(0.2) is None


def test_venv_and_repo_are_bind_mounted(lab: ContainerLab) -> None:
    container = lab.run(ContainerSpec(name="ver", argv=[sys.executable, "-m", "gpuwatch", "version"]))
    assert container.wait(8) == 0, container.logs()
    assert container.logs().startswith("gpuwatch ")


def test_docker_style_container(lab: ContainerLab, tmp_path: Path) -> None:
    container = lab.run(ContainerSpec(name="web", argv=SLEEP, runtime="docker", annotations={"team": "ml"}))
    assert container.cgroup_path == f"/docker/{container.id}"
    assert _v2_line(container.host_pid) == container.cgroup_path
    assert container.bundle_dir == tmp_path / "bundles" / "moby" / container.id
    document = json.loads((tmp_path / "docker" / "containers" / container.id / "config.v2.json").read_text())
    assert document["ID"] == container.id
    assert document["Name"] == "/web"
    assert document["Config"]["Labels"] == {"team": "ml"}
    assert document["State"]["Pid"] == container.host_pid
    container.stop()
    assert not (tmp_path / "docker" / "containers" / container.id).exists()


def test_plain_cgroup_child_is_in_the_cgroup_from_its_first_instruction(lab: ContainerLab) -> None:
    path = f"/gpuwatch-test/first-{os.getpid()}"
    # the very first thing the command does is print its cgroup; sh forks cat, so this
    # also shows children inherit it
    container = lab.run(ContainerSpec(name="first", argv=["/bin/sh", "-c", "cat /proc/self/cgroup"],
                                      runtime="cgroup", cgroup_path=path))
    assert container.wait(5) == 0
    lines = container.logs().splitlines()
    assert f"0::{path}" in lines
    if MOUNTS.v1_controller("freezer") is not None:
        assert any(line.endswith(f":freezer:{path}") for line in lines), lines
    container.stop()
    for directory in MOUNTS.all_dirs(path):
        assert not directory.exists()


def test_plain_cgroup_pids_and_default_path(lab: ContainerLab) -> None:
    name = f"plain-{os.getpid()}"
    argv = ["/bin/sh", "-c", "sleep 30 & exec sleep 30"]
    container = lab.run(ContainerSpec(name=name, argv=argv, runtime="cgroup"))
    assert container.cgroup_path == f"/gpuwatch-test/{name}"
    _wait_for(lambda: len(container.pids()) == 2)
    assert container.host_pid in container.pids()
    assert _v2_line(container.host_pid) == container.cgroup_path
    pids = container.pids()
    container.stop()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()
    assert not MOUNTS.v2_dir(container.cgroup_path).exists()


def test_stop_leaves_nothing_and_is_idempotent(lab: ContainerLab, tmp_path: Path) -> None:
    container = lab.run(ContainerSpec(name="bg", argv=["/bin/sh", "-c", "sleep 30 & sleep 31 & wait"]))
    _wait_for(lambda: len(container.pids()) == 3)
    pids = container.pids()
    container.stop()
    _assert_gone(container, tmp_path / "runc", pids)
    container.stop()
    assert lab.containers == []


def test_three_containers_at_once_two_in_one_pod(lab: ContainerLab, tmp_path: Path) -> None:
    a = lab.run(ContainerSpec(name="a", argv=SLEEP, pod="pair"))
    b = lab.run(ContainerSpec(name="b", argv=SLEEP, pod="pair"))
    c = lab.run(ContainerSpec(name="c", argv=SLEEP, pod="solo", qos="besteffort"))
    assert a.pod_uid == b.pod_uid != c.pod_uid
    assert len({a.id, b.id, c.id}) == 3
    for container in (a, b, c):
        assert _v2_line(container.host_pid) == container.cgroup_path
        assert container.pids() == [container.host_pid]
    pod_dir = MOUNTS.v2_dir(str(Path(a.cgroup_path).parent))
    a.stop()
    assert pod_dir.is_dir()  # b still runs in the pod
    assert _v2_line(b.host_pid) == b.cgroup_path
    pids = [b.host_pid, c.host_pid]
    b.stop()
    c.stop()
    for container in (a, b, c):
        _assert_gone(container, tmp_path / "runc", pids)


def test_exception_inside_the_lab_still_cleans_up(tmp_path: Path, runc_required: str) -> None:
    started: list[RunningContainer] = []
    with pytest.raises(RuntimeError, match="boom"), \
            ContainerLab(tmp_path / "w", bundle_root=tmp_path / "b", runc_root=tmp_path / "r",
                         docker_root=tmp_path / "d") as lab:
        started.append(lab.run(ContainerSpec(name="k", argv=SLEEP)))
        started.append(lab.run(ContainerSpec(name="d", argv=SLEEP, runtime="docker")))
        started.append(lab.run(ContainerSpec(name=f"p{os.getpid()}", argv=SLEEP, runtime="cgroup")))
        raise RuntimeError("boom")
    for container in started:
        _assert_gone(container, tmp_path / "r", [container.host_pid])
    assert not (tmp_path / "d" / "containers").exists()
    assert not (tmp_path / "b" / "k8s.io").exists()


def test_a_failing_start_cleans_up_and_says_why(lab: ContainerLab, tmp_path: Path) -> None:
    with pytest.raises(SimError, match="no-such-binary"):
        lab.run(ContainerSpec(name="bad", argv=["/no-such-binary"]))
    assert lab.containers == []
    assert list((tmp_path / "bundles" / "k8s.io").iterdir()) == []


def test_missing_bind_source_is_refused(lab: ContainerLab, tmp_path: Path) -> None:
    with pytest.raises(SimError, match="does not exist"):
        lab.run(ContainerSpec(name="x", argv=SLEEP, extra_binds=[str(tmp_path / "nope")]))


def test_sim_device_nodes_in_a_bound_dir_open_inside(lab: ContainerLab, tmp_path: Path) -> None:
    """The sim's device nodes (char 1:3 named like nvidiactl) are usable in a container."""
    sim_root = tmp_path / "simroot"
    sim_root.mkdir()
    os.mknod(sim_root / "nvidiactl", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    script = f"echo probe > {sim_root}/nvidiactl && echo opened"
    spec = ContainerSpec(name="dev", argv=["/bin/sh", "-c", script], extra_binds=[str(sim_root)])
    container = lab.run(spec)
    assert container.wait(5) == 0, container.logs()
    assert container.logs() == "opened\n"


def test_ro_binds_are_readable_not_writable(lab: ContainerLab, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "lib.txt").write_text("built\n")
    script = f"cat {cache}/lib.txt; touch {cache}/new 2>/dev/null && echo writable; true"
    container = lab.run(ContainerSpec(name="ro2", argv=["/bin/sh", "-c", script], ro_binds=[str(cache)]))
    assert container.wait(5) == 0
    assert container.logs() == "built\n"
    assert not (cache / "new").exists()


@pytest.mark.parametrize("runtime", ["k8s", "cgroup"])
@pytest.mark.parametrize("freezer", ["v1", "v2"])
def test_stop_kills_a_frozen_container(lab: ContainerLab, tmp_path: Path, runtime: str, freezer: str) -> None:
    """An enforcer may leave a container paused; stop() must still remove it."""
    container = lab.run(ContainerSpec(name=f"frozen-{runtime}-{os.getpid()}", argv=SLEEP, runtime=runtime))
    if freezer == "v1":
        mount = MOUNTS.v1_controller("freezer")
        need(mount is not None, "needs the v1 freezer hierarchy (hybrid cgroup host)")
        assert mount is not None
        state = mount / container.cgroup_path.lstrip("/") / "freezer.state"
        state.write_text("FROZEN")
        # FREEZING or FROZEN: either way SIGKILL is held until thawed (FROZEN may take a
        # while on a loaded host; stop() must cope with both)
        assert state.read_text().strip() in ("FREEZING", "FROZEN")
        _settle(lambda: state.read_text().strip() == "FROZEN")
    else:
        freeze = MOUNTS.v2_dir(container.cgroup_path) / "cgroup.freeze"
        freeze.write_text("1")
        assert freeze.read_text().strip() == "1"
        events = MOUNTS.v2_dir(container.cgroup_path) / "cgroup.events"
        _settle(lambda: "frozen 1" in events.read_text())
    pid = container.host_pid
    container.stop(timeout_s=3)
    _assert_gone(container, tmp_path / "runc", [pid])


def test_plain_cgroup_start_failure_removes_its_cgroups(lab: ContainerLab) -> None:
    path = f"/gpuwatch-test/fail-{os.getpid()}"
    with pytest.raises(FileNotFoundError):
        lab.run(ContainerSpec(name="nobin", argv=["/no-such-binary"], runtime="cgroup", cgroup_path=path))
    for directory in MOUNTS.all_dirs(path):
        assert not directory.exists()
    assert lab.containers == []


def test_labs_in_parallel_share_parent_cgroups_safely(tmp_path: Path, runc_required: str) -> None:
    """Two labs start and stop containers under the same /kubepods/besteffort at once:
    one lab's parent removal must never pull the parent out from under the other's runc."""
    errors: list[BaseException] = []

    def churn(index: int) -> None:
        root = tmp_path / f"lab{index}"
        try:
            with ContainerLab(root / "w", bundle_root=root / "b", runc_root=root / "r") as lab:
                for round_index in range(6):
                    container = lab.run(ContainerSpec(name=f"c{index}-{round_index}", argv=SLEEP,
                                                      qos="besteffort"))
                    container.stop()
        except BaseException as err:  # collected and re-raised in the test thread
            errors.append(err)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert all(not thread.is_alive() for thread in threads)


def test_the_last_lab_out_removes_parents_another_lab_made(tmp_path: Path, root_required: None) -> None:
    """Lab 1 makes the parent cgroup, lab 2 joins it, lab 1 leaves first: lab 2 must
    remove the parent (marked as lab-made), which it did not create itself."""
    top = f"/gpuwatch-test-shared-{os.getpid()}"
    first = ContainerLab(tmp_path / "1")
    second = ContainerLab(tmp_path / "2")
    with first:
        first.run(ContainerSpec(name="a", argv=SLEEP, runtime="cgroup", cgroup_path=f"{top}/p/a"))
        with second:
            second.run(ContainerSpec(name="b", argv=SLEEP, runtime="cgroup", cgroup_path=f"{top}/p/b"))
            first.close()
            assert MOUNTS.v2_dir(f"{top}/p").is_dir()  # b still uses it
        for directory in MOUNTS.all_dirs(top):
            assert not directory.exists(), directory


def test_parents_made_by_someone_else_are_left_alone(lab: ContainerLab, root_required: None) -> None:
    top = f"/gpuwatch-test-foreign-{os.getpid()}"
    foreign = MOUNTS.v2_dir(top)
    foreign.mkdir()
    try:
        container = lab.run(ContainerSpec(name="f", argv=SLEEP, runtime="cgroup", cgroup_path=f"{top}/c"))
        container.stop()
        assert foreign.is_dir()
        assert not MOUNTS.v2_dir(f"{top}/c").exists()
    finally:
        foreign.rmdir()


def test_a_lab_left_open_is_cleaned_up_at_interpreter_exit(tmp_path: Path, runc_required: str) -> None:
    """A script that forgets to close its lab still leaves nothing behind (atexit)."""
    script = f"""
from gpuwatch.sim.runc import ContainerLab, ContainerSpec
lab = ContainerLab({str(tmp_path / "w")!r}, bundle_root={str(tmp_path / "b")!r},
                   runc_root={str(tmp_path / "r")!r})
k = lab.run(ContainerSpec(name="k", argv=["/bin/sleep", "30"]))
c = lab.run(ContainerSpec(name="c{os.getpid()}", argv=["/bin/sleep", "30"], runtime="cgroup"))
print(k.host_pid, k.cgroup_path, k.bundle_dir, c.host_pid, c.cgroup_path, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    assert "cleanup failed" not in done.stderr
    k_pid, k_cgroup, k_bundle, c_pid, c_cgroup = done.stdout.split()
    for pid in (k_pid, c_pid):
        _wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), timeout_s=3)
    for cgroup_path in (k_cgroup, c_cgroup):
        for directory in MOUNTS.all_dirs(cgroup_path):
            assert not directory.exists(), directory
    assert not Path(k_bundle).exists()
    assert not (tmp_path / "r" / Path(k_bundle).name).exists()
