"""Unit tests for gpuwatch.sim.bundle: the OCI config, kubepods paths and runtime metadata
the simulated containers carry (pure functions; the system tests run them under runc)."""

from __future__ import annotations

import re

import pytest

from gpuwatch.sim import bundle

CID = "ab" * 32
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


@pytest.mark.parametrize(("qos", "expected"), [
    ("burstable", f"/kubepods/burstable/pod{UID}/{CID}"),
    ("besteffort", f"/kubepods/besteffort/pod{UID}/{CID}"),
    ("guaranteed", f"/kubepods/pod{UID}/{CID}"),
    ("Burstable", f"/kubepods/burstable/pod{UID}/{CID}"),
])
def test_kubepods_path_follows_the_cgroupfs_driver_layout(qos: str, expected: str) -> None:
    assert bundle.kubepods_cgroup_path(qos, UID, CID) == expected


def test_unknown_qos_class_is_rejected_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="guaranteed, burstable, besteffort"):
        bundle.kubepods_cgroup_path("platinum", UID, CID)


def test_docker_cgroup_path() -> None:
    assert bundle.docker_cgroup_path(CID) == f"/docker/{CID}"


def test_sandbox_id_is_64_hex_and_stable_per_pod() -> None:
    first = bundle.sandbox_id_for(UID)
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    assert bundle.sandbox_id_for(UID) == first
    assert bundle.sandbox_id_for(UID.replace("0f", "ff")) != first


def test_k8s_annotations_carry_cri_and_pod_identity() -> None:
    sandbox = bundle.sandbox_id_for(UID)
    notes = bundle.k8s_annotations(container_name="trainer", pod="job-0", namespace="ml",
                                   pod_uid=UID, sandbox_id=sandbox)
    assert notes["io.kubernetes.pod.name"] == "job-0"
    assert notes["io.kubernetes.pod.namespace"] == "ml"
    assert notes["io.kubernetes.pod.uid"] == UID
    assert notes["io.kubernetes.container.name"] == "trainer"
    assert notes["io.kubernetes.cri.container-type"] == "container"
    assert notes["io.kubernetes.cri.sandbox-id"] == sandbox
    assert notes["io.kubernetes.cri.sandbox-namespace"] == "ml"


def _config(**overrides: object) -> dict:
    arguments: dict = dict(argv=["/bin/true", "x"], env={"A": "1"}, cgroups_path=f"/docker/{CID}",
                           hostname="h", ro_binds=["/usr", "/work/repo/.venv", "/work/repo"],
                           rw_binds=["/tmp/share"], annotations={"k": "v"})
    arguments.update(overrides)
    return bundle.build_config(**arguments)


def test_config_process_env_and_identity() -> None:
    config = _config()
    process = config["process"]
    assert process["args"] == ["/bin/true", "x"]
    env = dict(item.split("=", 1) for item in process["env"])
    assert env["A"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "/usr/bin" in env["PATH"].split(":")
    assert config["annotations"] == {"k": "v"}
    assert config["linux"]["cgroupsPath"] == f"/docker/{CID}"
    assert config["root"] == {"path": "rootfs", "readonly": True}
    assert config["hostname"] == "h"


def test_caller_env_overrides_the_defaults() -> None:
    env = dict(item.split("=", 1) for item in _config(env={"PATH": "/opt/bin"})["process"]["env"])
    assert env["PATH"] == "/opt/bin"


def test_config_namespaces_share_the_host_network_unless_asked() -> None:
    kinds = {ns["type"] for ns in _config()["linux"]["namespaces"]}
    assert kinds == {"pid", "ipc", "uts", "mount"}
    kinds = {ns["type"] for ns in _config(new_network=True)["linux"]["namespaces"]}
    assert "network" in kinds


def test_binds_are_same_path_readonly_or_rw_and_parents_mount_first() -> None:
    mounts = _config()["mounts"]
    binds = [m for m in mounts if m["type"] == "bind"]
    assert all(m["source"] == m["destination"] for m in binds)
    by_dest = {m["destination"]: m for m in binds}
    assert "ro" in by_dest["/usr"]["options"]
    assert "ro" in by_dest["/work/repo"]["options"]
    assert "rw" in by_dest["/tmp/share"]["options"]
    order = [m["destination"] for m in mounts]
    assert order.index("/work/repo") < order.index("/work/repo/.venv")
    # standard mounts come before the binds, so a bind into /tmp lands on the tmpfs
    assert order.index("/tmp") < order.index("/tmp/share")
    assert order.index("/proc") < order.index("/usr")


def test_a_bind_of_dev_shm_replaces_the_private_tmpfs() -> None:
    default = [m for m in _config()["mounts"] if m["destination"] == "/dev/shm"]
    assert [m["type"] for m in default] == ["tmpfs"]
    shared = [m for m in _config(rw_binds=["/dev/shm"])["mounts"] if m["destination"] == "/dev/shm"]
    assert [m["type"] for m in shared] == ["bind"]


def test_docker_config_v2_names_the_container_like_docker() -> None:
    document = bundle.docker_config_v2(container_id=CID, name="web", argv=["/bin/sleep", "9"],
                                       env={"A": "1"}, labels={"team": "ml"}, host_pid=4242, hostname="h")
    assert document["ID"] == CID
    assert document["Name"] == "/web"
    assert document["Config"]["Labels"] == {"team": "ml"}
    assert document["Config"]["Env"] == ["A=1"]
    assert document["State"]["Pid"] == 4242
    assert document["State"]["Running"] is True
