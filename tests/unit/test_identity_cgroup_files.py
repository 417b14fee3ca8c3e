"""Whole /proc/<pid>/cgroup files -> identity, over the layouts issue 12 found wrong.

Every row is a complete file as the kernel prints it (all hierarchies), in the shapes public
sources show for each runtime and host layout (container-tagging test suites of tracing
clients, Kepler's and neuvector's cgroup tests, runtime docs); the ids and uids are our own.
The identity is chosen from every line, not the unified one alone.
"""

from __future__ import annotations

import pytest

from gpuwatch.containers.cgroupfs import CgroupHierarchy, CgroupMounts
from gpuwatch.containers.pidcgroup import cgroup_choice, identity_of_cgroup_file

CID = "3f0c2d1e5b6a79880a1b2c3d4e5f60718293a4b5c6d7e8f90112233445566778"
OUTER = "9a8b7c6d5e4f30211203f4e5d6c7b8a99a8b7c6d5e4f30211203f4e5d6c7b8a9"
UID = "5e8a1c2d-3b4f-4a6e-9d7c-0f1e2d3c4b5a"
UID_ = UID.replace("-", "_")
STATIC_UID = "d41d8cd98f00b204e9800998ecf8427e"  # a static pod: 32-hex hash of its manifest
TASK = "c1f2e3d4b5a697886f5e4d3c2b1a0f9e"
GARDEN_ID = "6e1a2b3c-4d5e-6f70-8a9b-0c1d"
VTE = "0e4ac1b2-7d3f-4c5a-9b8e-2f1d0c3b4a59"
POD_SLICE = f"kubepods-besteffort-pod{UID_}.slice"


def v1_lines(path: str, controllers: tuple[str, ...] = ("name=systemd", "pids", "memory", "devices", "cpu,cpuacct")
             ) -> str:
    """A v1 host's lines, every controller at `path` (hierarchy ids from a Debian 11 host)."""
    ids = {"name=systemd": 12, "pids": 9, "memory": 7, "devices": 5, "cpu,cpuacct": 3, "freezer": 2}
    return "".join(f"{ids.get(c, 1)}:{c}:{path}\n" for c in controllers)


# (case name, /proc/<pid>/cgroup text, runtime, container id, pod uid, qos class)
CASES: list[tuple[str, str, str, str, str, str]] = [
    # --- read from a private cgroup namespace (the DaemonSet case): relative to our cgroup ----
    ("ns-relative systemd driver",
     f"0::/../../kubepods-besteffort.slice/{POD_SLICE}/cri-containerd-{CID}.scope\n",
     "containerd", CID, UID, "besteffort"),
    ("ns-relative without the leading slash",
     f"0::../../kubepods-besteffort.slice/{POD_SLICE}/cri-containerd-{CID}.scope\n",
     "containerd", CID, UID, "besteffort"),
    ("ns-relative cgroupfs driver, kubepods and QoS levels cut off",
     f"0::/../../pod{UID}/{CID}\n", "kubepods", CID, UID, "guaranteed"),
    ("ns-relative cgroupfs driver, kubepods cut off above the QoS level",
     f"0::/../../../burstable/pod{UID}/{CID}\n", "kubepods", CID, UID, "burstable"),
    ("a process in our own namespace", f"0::/{CID}\n", "unknown", CID, "", ""),
    # --- static pods: 32-hex uids -------------------------------------------------------------
    ("static pod, cgroupfs driver",
     f"0::/kubepods/burstable/pod{STATIC_UID}/{CID}\n", "kubepods", CID, STATIC_UID, "burstable"),
    ("static pod, namespace cut off the kubepods level",
     f"0::/../../pod{STATIC_UID}/{CID}\n", "kubepods", CID, STATIC_UID, "guaranteed"),
    ("static pod, systemd driver, namespace-relative",
     f"0::/../kubepods-burstable-pod{STATIC_UID}.slice/cri-containerd-{CID}.scope\n",
     "containerd", CID, STATIC_UID, "burstable"),
    # --- hybrid hosts: the unified line names the runtime's service, v1 the container ----------
    ("hybrid, 0:: is containerd.service, v1 names the pod's container",
     v1_lines(f"/kubepods/besteffort/pod{UID}/{CID}") + "0::/system.slice/containerd.service\n",
     "kubepods", CID, UID, "besteffort"),
    ("hybrid, 0:: is the root, v1 names a CRI-O container",
     v1_lines(f"/kubepods.slice/kubepods-besteffort.slice/{POD_SLICE}/crio-{CID}.scope") + "0::/\n",
     "crio", CID, UID, "besteffort"),
    ("hybrid, both name the container: the unified line is kept",
     v1_lines(f"/docker/{CID}") + f"0::/docker/{CID}\n", "docker", CID, "", ""),
    # --- docker -----------------------------------------------------------------------------------
    ("docker-in-docker with bare ids", v1_lines(f"/docker/{OUTER}/{CID}"), "docker", CID, "", ""),
    ("docker-in-docker, inner dockerd under its own /docker",
     v1_lines(f"/docker/{OUTER}/docker/{CID}"), "docker", CID, "", ""),
    ("docker with the systemd driver nested under /docker", f"0::/docker/{CID}.scope\n", "docker", CID, "", ""),
    ("v1 line with an empty controller field", f"13::/docker/{CID}\n0::/\n", "docker", CID, "", ""),
    ("only empty-controller lines", f"13::/docker/{CID}\n", "docker", CID, "", ""),
    # --- runtime helpers are not the container ------------------------------------------------------
    ("CRI-O conmon in the pod",
     f"0::/kubepods.slice/kubepods-besteffort.slice/{POD_SLICE}/crio-conmon-{CID}.scope\n",
     "crio", "", UID, "besteffort"),
    ("podman conmon", f"0::/machine.slice/libpod-conmon-{CID}.scope\n", "podman", "", "", ""),
    ("podman quadlet payload", f"0::/system.slice/webapp.service/libpod-payload-{CID}\n", "podman", CID, "", ""),
    # --- ids that are not 64-hex ------------------------------------------------------------------
    ("ECS Fargate: <task id>-<digits> after the task id",
     v1_lines(f"/ecs/{TASK}/{TASK}-2817163004"), "ecs", f"{TASK}-2817163004", "", ""),
    ("ECS Fargate without the task level", v1_lines(f"/ecs/{TASK}-2817163004"), "ecs", f"{TASK}-2817163004", "", ""),
    ("ECS on EC2: docker container under the task uuid",
     v1_lines(f"/ecs/{UID}/{CID}"), "docker", CID, "", ""),
    ("Cloud Foundry Garden under garden.service",
     v1_lines(f"/system.slice/garden.service/garden/{GARDEN_ID}"), "garden", GARDEN_ID, "", ""),
    ("Garden 8-4-4-4 id right under garden.service",
     f"0::/system.slice/garden.service/{GARDEN_ID[:23]}\n", "garden", GARDEN_ID[:23], "", ""),
    ("an 8-4-4-4 name elsewhere is not a container", f"0::/system.slice/{GARDEN_ID[:23]}\n", "systemd", "", "", ""),
    # --- not containers ----------------------------------------------------------------------------
    (".mount unit naming a containerd task",
     f"0::/system.slice/run-containerd-io.containerd.runtime.v2.task-k8s.io-{CID}-rootfs.mount\n",
     "systemd", "", "", ""),
    (".mount unit of a docker layer", f"0::/system.slice/var-lib-docker-overlay2-{CID}-merged.mount\n",
     "systemd", "", "", ""),
    ("login session", "0::/user.slice/user-1000.slice/session-14.scope\n", "host", "", "", ""),
    ("login session on a v1 host", v1_lines("/user.slice/user-1000.slice/session-2.scope"), "host", "", "", ""),
    ("terminal scope in the user's systemd",
     f"0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-org.gnome.Terminal.slice/vte-spawn-{VTE}.scope\n",
     "host", "", "", ""),
    ("a system service", "0::/system.slice/nvidia-persistenced.service\n", "systemd", "", "", ""),
    ("rootless docker stays a container",
     f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/docker-{CID}.scope\n", "docker", CID, "", ""),
]


@pytest.mark.parametrize(("name", "text", "runtime", "cid", "pod_uid", "qos"), CASES, ids=[c[0] for c in CASES])
def test_identity_from_the_whole_file(name: str, text: str, runtime: str, cid: str, pod_uid: str, qos: str) -> None:
    ident = identity_of_cgroup_file(text)
    assert (ident.runtime, ident.container_id, ident.pod_uid, ident.qos_class) == (runtime, cid, pod_uid, qos)


def test_every_issue_class_is_covered() -> None:
    assert len(CASES) >= 25
    assert {c[2] for c in CASES} >= {"containerd", "kubepods", "crio", "docker", "podman", "ecs", "garden",
                                      "systemd", "host"}


def test_conmon_is_marked_as_the_runtime_helper() -> None:
    ident = identity_of_cgroup_file(f"0::/machine.slice/libpod-conmon-{CID}.scope\n")
    assert ("role", "monitor") in ident.labels and not ident.is_container


def test_fargate_names_its_task() -> None:
    ident = identity_of_cgroup_file(v1_lines(f"/ecs/{TASK}/{TASK}-2817163004"))
    assert ("ecs_task", TASK) in ident.labels


def test_hybrid_choice_says_which_hierarchy_named_the_container() -> None:
    text = v1_lines(f"/kubepods/besteffort/pod{UID}/{CID}") + "0::/system.slice/containerd.service\n"
    choice = cgroup_choice(text, CgroupMounts())
    assert choice.hierarchy == "name=systemd"
    assert choice.unified == "/system.slice/containerd.service"


def test_placed_namespace_gives_hierarchy_paths() -> None:
    """With our namespace root placed (the agent's own pod), other pods' relative paths
    become the host's paths: the kubepods levels the namespace cut off come back."""
    agent = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{OUTER}.scope"
    mounts = CgroupMounts((CgroupHierarchy("/sys/fs/cgroup", (), "/../../../..", agent),))
    text = f"0::/../../../kubepods-besteffort.slice/{POD_SLICE}/cri-containerd-{CID}.scope\n"
    ident = identity_of_cgroup_file(text, mounts)
    assert ident.cgroup_path == f"/kubepods.slice/kubepods-besteffort.slice/{POD_SLICE}/cri-containerd-{CID}.scope"
    assert (ident.container_id, ident.pod_uid) == (CID, UID)
    own = identity_of_cgroup_file("0::/\n", mounts)
    assert own.cgroup_path == agent and own.container_id == OUTER
