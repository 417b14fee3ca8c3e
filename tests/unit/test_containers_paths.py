"""cgroup path -> identity over real-world layouts (every runtime, driver, QoS class, nesting).

Each row cites where the layout comes from. Ids are the real ones from those sources where
the source had them, otherwise a distinct made-up 64-hex id in the same position.
"""

from __future__ import annotations

import pytest

from gpuwatch.containers.cgroup_path import normalize_pod_uid, parse_cgroup_path
from gpuwatch.core.model import HOST_IDENTITY

A = "a" * 64
B = "0123456789abcdef" * 4
K1 = "f93ee491b8ed2680d5a909eb098b14a9430173b57ca1c4efedd8768566d67e8e"
K2 = "a09343ca97901516c25036e2b954421254f8c68b384b536064e8999f0c4ed18d"
DOCKER_CENTOS = "9ec39b91f3d70e1beff50a308f77067065ea6be0d91a3378375056cd4422cf3d"
DOCKER_DEBIAN = "4f797c539e6c745de61a93ca3ff892358ecbcaccd8414d5db545c38428142970"
KIND_NODE = "fd9d0ea06257a9780827cbc7fd92e3812a54fca26d63e191b73610d5d48b9cbd"
KIND_CTR = "99f3a16ea25b7724cb56a4f0c0df1113ad9474fbf5545bead97fd5c7f61c13f4"
UID = "11111111-2222-3333-4444-555555555555"
UID_ = UID.replace("-", "_")

# (cgroup path, runtime, container id, pod uid, qos class, container_name/unit name)
CASES: list[tuple[str, str, str, str, str, str]] = [
    # --- docker ------------------------------------------------------------------------
    # docker, cgroupfs driver (`docker run` on a v1 host; dockerd --exec-opt native.cgroupdriver=cgroupfs)
    (f"/docker/{DOCKER_DEBIAN}", "docker", DOCKER_DEBIAN, "", "", ""),
    # docker, systemd driver: neuvector share/system/cgroup_test.go TestDockerIDCentOS
    (f"/system.slice/docker-{DOCKER_CENTOS}.scope", "docker", DOCKER_CENTOS, "", "", ""),
    # docker with --cgroup-parent=/ : neuvector cgroup_test.go TestDockerIDDebian (bare id at the root)
    (f"/{DOCKER_DEBIAN}", "unknown", DOCKER_DEBIAN, "", "", ""),
    # docker without .scope: Kepler internal/resource/container_test.go "Docker container with hyphen"
    (f"/docker-{A}", "docker", A, "", "", ""),
    # rootless docker on cgroup v2 (systemd user instance)
    (f"/user.slice/user-1000.slice/user@1000.service/user.slice/docker-{A}.scope", "docker", A, "", "", ""),
    # --- containerd ----------------------------------------------------------------------
    # containerd CRI, systemd driver, besteffort (EKS / AL2023 style, cgroup v2)
    (
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{A}.scope",
        "containerd",
        A,
        UID,
        "besteffort",
        "",
    ),
    # containerd v1 host, kubelet systemd path but cgroupfs driver -> colon form in one component:
    # Kepler container_test.go "valid path with cgroup systemd" (v1 mount prefix included)
    (
        "/sys/fs/cgroup/systemd/system.slice/containerd.service/"
        "kubepods-burstable-poda3b200c9_db51_40b4_9d2d_53f8fdf80d7f.slice:cri-containerd:"
        "286b15051ec43375190802e1f40562536980a8fd97e75bb89c7f2eec6f995f17",
        "containerd",
        "286b15051ec43375190802e1f40562536980a8fd97e75bb89c7f2eec6f995f17",
        "a3b200c9-db51-40b4-9d2d-53f8fdf80d7f",
        "burstable",
        "",
    ),
    # same, besteffort, from a memory controller line: Kepler "valid path with cgroup 13 and memory"
    (
        "/system.slice/containerd.service/kubepods-besteffort-pod0043435f_1854_4327_b76b_730f681a781d.slice"
        ":cri-containerd:01fd96f7ad292b02a8317cde4ecb8c7ef3cc06ffdd113f13410e0837eb2b2a20",
        "containerd",
        "01fd96f7ad292b02a8317cde4ecb8c7ef3cc06ffdd113f13410e0837eb2b2a20",
        "0043435f-1854-4327-b76b-730f681a781d",
        "besteffort",
        "",
    ),
    # `ctr run` / nerdctl with the cgroupfs driver: containerd's default cgroupsPath /<namespace>/<id>
    (f"/default/{A}", "containerd", A, "", "", ""),
    (f"/k8s.io/{B}", "containerd", B, "", "", ""),
    # nerdctl with the systemd driver
    (f"/system.slice/nerdctl-{A}.scope", "containerd", A, "", "", ""),
    # static pod (uid is a 32-hex config hash, no dashes) under containerd, systemd driver
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod2e7a1bd2d9a9b4ac5f0b6d9c3f4a5e6b.slice"
        f"/cri-containerd-{A}.scope",
        "containerd",
        A,
        "2e7a1bd2d9a9b4ac5f0b6d9c3f4a5e6b",
        "burstable",
        "",
    ),
    # --- CRI-O ---------------------------------------------------------------------------
    # CRI-O, systemd driver, burstable, v1 name=systemd line: Kepler "valid path with cgroup 1"
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podd0511cd2_29d2_4215_be0f_f77bc0609d99.slice/crio-{K1}.scope",
        "crio",
        K1,
        "d0511cd2-29d2-4215-be0f-f77bc0609d99",
        "burstable",
        "",
    ),
    # CRI-O, cgroup v2: Kepler "valid path with cgroup 2"
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod2c9f8a79_5391_454b_88cb_86190881cb96.slice/crio-{K2}.scope",
        "crio",
        K2,
        "2c9f8a79-5391-454b-88cb-86190881cb96",
        "burstable",
        "",
    ),
    # CRI-O guaranteed (no QoS slice): CJLove/rt-operator notes/cgroupv1_notes.md (k8s 1.25 + cri-o)
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{A}.scope", "crio", A, UID, "guaranteed", ""),
    # CRI-O conmon in the pod (conmon_cgroup = "pod"): crio-conmon-<id>.scope
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{A}.scope",
        "crio",
        "",  # conmon is the runtime's helper, not the container: it never carries the container's id
        UID,
        "burstable",
        "",
    ),
    # CRI-O, cgroupfs driver: /kubepods/<qos>/pod<uid>/crio-<id>
    (f"/kubepods/burstable/pod{UID}/crio-{A}", "crio", A, UID, "burstable", ""),
    # CRI-O container outside a pod slice (infra): Kepler pkg/cgroup/test/toppath/system
    (
        "/system.slice/crio-06c17bf4f4f3a0bf2b79887c030f5d826e748bfb30c12b1ff498c83622dd5243.scope",
        "crio",
        "06c17bf4f4f3a0bf2b79887c030f5d826e748bfb30c12b1ff498c83622dd5243",
        "",
        "",
        "",
    ),
    # --- podman --------------------------------------------------------------------------
    # rootful podman, cgroup v2, crun's "container" sub-cgroup: Kepler "podman rootful container"
    (
        "/machine.slice/libpod-06dc5f321aad8726aa26559f16ec203bc099245bc44894b14a89fc02b022d1d5.scope/container",
        "podman",
        "06dc5f321aad8726aa26559f16ec203bc099245bc44894b14a89fc02b022d1d5",
        "",
        "",
        "",
    ),
    # rootless podman: Kepler "podman rootless container"
    (
        "/user.slice/user-1000.slice/user@1000.service/user.slice/"
        "libpod-3f05ee050f82c0145f1d88c94269c39dff0f07dbf8bba20aafd54b3a75dcaecc.scope/container",
        "podman",
        "3f05ee050f82c0145f1d88c94269c39dff0f07dbf8bba20aafd54b3a75dcaecc",
        "",
        "",
        "",
    ),
    # podman quadlet (systemd unit runs the payload): Kepler "podman quadlet"
    (
        "/system.slice/kepler.service/libpod-payload-8e363eb2287da4ccc9f52ffc5de11252ac5fe707e3ddb917a3c0bdf9bb64165b",
        "podman",
        "8e363eb2287da4ccc9f52ffc5de11252ac5fe707e3ddb917a3c0bdf9bb64165b",
        "",
        "",
        "",
    ),
    # podman's conmon
    (f"/machine.slice/libpod-conmon-{A}.scope", "podman", "", "", "", ""),
    # podman with the cgroupfs manager: /libpod_parent/libpod-<id>
    (f"/libpod_parent/libpod-{A}", "podman", A, "", "", ""),
    # podman pod: machine-libpod_pod_<pod id>.slice
    (f"/machine.slice/machine-libpod_pod_{B}.slice/libpod-{A}.scope", "podman", A, "", "", ""),
    # --- plain runc ----------------------------------------------------------------------
    # runc --systemd-cgroup with cgroupsPath "system.slice:runc:mycontainer" (runc docs)
    ("/system.slice/runc-mycontainer.scope", "runc", "mycontainer", "", "", ""),
    # --- kubepods, cgroupfs driver, every QoS class ----------------------------------------
    # guaranteed: CJLove/rt-operator notes (K3S: /kubepods/podXXXX/YYYY)
    (f"/kubepods/pod{UID}/{A}", "kubepods", A, UID, "guaranteed", ""),
    # burstable: Kepler "valid path with cgroup 11 and blkio"
    (
        "/kubepods/burstable/podf6adb0af-0855-4bab-b25b-c853f18d0ce2/"
        "35b97177dada20362ab90d90ac63cd54e8a41cf87bea34f270631b6da17f4a93",
        "kubepods",
        "35b97177dada20362ab90d90ac63cd54e8a41cf87bea34f270631b6da17f4a93",
        "f6adb0af-0855-4bab-b25b-c853f18d0ce2",
        "burstable",
        "",
    ),
    # besteffort (GKE COS): Qard/container-info test/fixtures
    (
        "/kubepods/besteffort/pod74c13223-5a00-11e9-b385-42010a80018d/"
        "34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376",
        "kubepods",
        "34dc0b5e626f2c5c4c5170e34b10e7654ce36f0fcd532739f4445baabea03376",
        "74c13223-5a00-11e9-b385-42010a80018d",
        "besteffort",
        "",
    ),
    # --- kubepods, systemd driver, dockershim ----------------------------------------------
    # k8s 1.23 + docker, guaranteed: CJLove/rt-operator notes
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/docker-{A}.scope", "docker", A, UID, "guaranteed", ""),
    # --- nested (kind-style) clusters ------------------------------------------------------
    # kind on cgroup v2 with a private cgroupns: Kepler "kind containerd"
    (
        "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/"
        "kubelet-kubepods-burstable-pod3cae2e45_052c_4b11_80d3_4d7b2d2d3464.slice/"
        "cri-containerd-2b180104511194aab36fd295d3e217439f3ddb5bc88277f37b4952abee85c40e.scope",
        "containerd",
        "2b180104511194aab36fd295d3e217439f3ddb5bc88277f37b4952abee85c40e",
        "3cae2e45-052c-4b11-80d3-4d7b2d2d3464",
        "burstable",
        "",
    ),
    # kind node as a docker container seen from the host: Kepler "Nested containers ... (in kind cluster)"
    (
        f"/system.slice/docker-{KIND_NODE}.scope/kubelet.slice/kubelet-kubepods.slice/"
        "kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-podeab5a334_93fe_48a8_b139_9e8079c1f163.slice/"
        f"cri-containerd-{KIND_CTR}.scope",
        "containerd",
        KIND_CTR,
        "eab5a334-93fe-48a8-b139-9e8079c1f163",
        "besteffort",
        "",
    ),
    # kind on a v1 host, kubelet --cgroup-root=/kubelet: Kepler "valid path with cgroup kubelet"
    (
        "kubelet/kubepods/besteffort/podbdd4097d-6795-404e-9bd8-6a1383386198/"
        "c79788e0da15a6597263eb2b9c51d05dd1a9a1d08c53c1161dc8c45d2dac6b38",
        "kubepods",
        "c79788e0da15a6597263eb2b9c51d05dd1a9a1d08c53c1161dc8c45d2dac6b38",
        "bdd4097d-6795-404e-9bd8-6a1383386198",
        "besteffort",
        "",
    ),
    # old kind / dind on v1 cgroupfs: /docker/<node id>/kubepods/<qos>/pod<uid>/<id>
    (f"/docker/{KIND_NODE}/kubepods/besteffort/pod{UID}/{A}", "kubepods", A, UID, "besteffort", ""),
    # --- pod-level cgroups, systemd units, host, unknown -----------------------------------
    # the pod cgroup itself (no container below): belongs to the pod
    (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice",
        "kubepods",
        "",
        UID,
        "burstable",
        "",
    ),
    # a kubelet-run pod on a kind node, pod dir only
    (f"/docker/{KIND_NODE}/kubepods/pod{UID}", "kubepods", "", UID, "guaranteed", ""),
    # systemd services; login sessions and a user's own services are host processes (issue 12)
    ("/system.slice/nvidia-persistenced.service", "systemd", "", "", "", "nvidia-persistenced"),
    ("/system.slice/containerd.service", "systemd", "", "", "", "containerd"),
    ("/user.slice/user-1000.slice/session-3.scope", "host", "", "", "", ""),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service", "host", "", "", "", ""),
    ("/init.scope", "systemd", "", "", "", "init"),
    # this build machine's sandbox cgroup (v1 memory only): unknown, raw path kept
    ("/process_api/82a1dc48c19ca99d74bbe6f9cb8c9c0d", "unknown", "", "", "", ""),
    ("/some/random/path", "unknown", "", "", "", ""),
]


@pytest.mark.parametrize(("path", "runtime", "cid", "pod_uid", "qos", "name"), CASES, ids=lambda v: str(v)[:60])
def test_real_world_paths(path: str, runtime: str, cid: str, pod_uid: str, qos: str, name: str) -> None:
    ident = parse_cgroup_path(path)
    assert (ident.runtime, ident.container_id, ident.pod_uid, ident.qos_class, ident.container_name) == (
        runtime,
        cid,
        pod_uid,
        qos,
        name,
    )
    assert ident.cgroup_path == ("/" + path.strip("/"))  # raw path kept, never dropped


def test_at_least_25_real_world_layouts() -> None:
    assert len(CASES) >= 25
    runtimes = {c[1] for c in CASES}
    assert {"docker", "containerd", "crio", "podman", "runc", "kubepods", "systemd", "host", "unknown"} <= runtimes
    assert {c[4] for c in CASES} >= {"guaranteed", "burstable", "besteffort"}


@pytest.mark.parametrize("path", ["/", "", "   ", "//", "/."])
def test_root_is_host(path: str) -> None:
    assert parse_cgroup_path(path) == HOST_IDENTITY


def test_conmon_marked_as_monitor() -> None:
    ident = parse_cgroup_path(f"/machine.slice/libpod-conmon-{A}.scope")
    assert ("role", "monitor") in ident.labels
    assert not ident.is_container
    assert parse_cgroup_path(f"/machine.slice/libpod-{A}.scope").labels == ()


def test_deepest_match_wins_over_node_container() -> None:
    node_only = parse_cgroup_path(f"/system.slice/docker-{KIND_NODE}.scope/kubelet.slice")
    assert node_only.container_id == KIND_NODE and node_only.runtime == "docker"
    inner = parse_cgroup_path(f"/system.slice/docker-{KIND_NODE}.scope/kubepods/pod{UID}/{A}")
    assert inner.container_id == A


@pytest.mark.parametrize(
    "garbage",
    [
        "/kubepods/burstable/podZZZ/xyz",
        "/docker/" + "g" * 64,
        "/crio-" + "a" * 63 + ".scope",
        "/" + "a" * 65,
        "/\x00\xff/../..",
        "/kubepods.slice/kubepods-burstable-pod.slice",
        "x" * 5000,
    ],
)
def test_garbage_never_crashes_and_keeps_path(garbage: str) -> None:
    ident = parse_cgroup_path(garbage)
    assert ident.container_id == ""
    assert ident.cgroup_path.startswith("/")


def test_pod_uid_normalised() -> None:
    assert normalize_pod_uid("D0511CD2_29D2_4215_BE0F_F77BC0609D99") == "d0511cd2-29d2-4215-be0f-f77bc0609d99"
