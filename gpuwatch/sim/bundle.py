"""OCI bundle and runtime metadata for simulated containers (pure functions, no I/O).

Builds what a real runtime leaves on a node, so gpuwatch's identity code can be tested
against the real thing: the runc `config.json` (from scratch: empty read-only rootfs plus
read-only binds of the host's system directories), the kubepods cgroup path the kubelet's
cgroupfs driver uses, the annotations containerd's CRI plugin (and CRI-O) write, and
Docker's `config.v2.json`.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

QOS_CLASSES = ("guaranteed", "burstable", "besteffort")

# containerd's default task bundle root; containers of k8s live under the "k8s.io"
# containerd namespace, Docker's under "moby".
DEFAULT_BUNDLE_ROOT = Path("/run/containerd/io.containerd.runtime.v2.task")
DEFAULT_DOCKER_ROOT = Path("/var/lib/docker")
K8S_CONTAINERD_NAMESPACE = "k8s.io"
DOCKER_CONTAINERD_NAMESPACE = "moby"

# Host directories every container gets read-only (those that exist on the host).
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc")

# Docker's default capability set: what an unprivileged container process holds.
DEFAULT_CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def kubepods_cgroup_path(qos: str, pod_uid: str, container_id: str) -> str:
    """The kubelet cgroupfs-driver path of a container: QoS class, then pod, then container.

    Guaranteed pods sit directly under /kubepods; burstable and besteffort pods under
    /kubepods/<qos>.
    """
    qos = qos.lower()
    if qos not in QOS_CLASSES:
        raise ValueError(f"unknown QoS class {qos!r}; use one of {', '.join(QOS_CLASSES)}")
    if qos == "guaranteed":
        return f"/kubepods/pod{pod_uid}/{container_id}"
    return f"/kubepods/{qos}/pod{pod_uid}/{container_id}"


def docker_cgroup_path(container_id: str) -> str:
    """Docker's cgroupfs-driver path of a container."""
    return f"/docker/{container_id}"


def sandbox_id_for(pod_uid: str) -> str:
    """A stable 64-hex sandbox (pause container) id for a pod uid."""
    return hashlib.sha256(f"sandbox:{pod_uid}".encode()).hexdigest()


def k8s_annotations(*, container_name: str, pod: str, namespace: str, pod_uid: str,
                    sandbox_id: str, image: str = "gpuwatch-sim:latest") -> dict[str, str]:
    """The annotations containerd's CRI plugin writes for a workload container, plus the
    io.kubernetes.pod.* / container.name keys CRI-O writes (identity code reads either)."""
    return {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.container-name": container_name,
        "io.kubernetes.cri.image-name": image,
        "io.kubernetes.cri.sandbox-id": sandbox_id,
        "io.kubernetes.cri.sandbox-name": pod,
        "io.kubernetes.cri.sandbox-namespace": namespace,
        "io.kubernetes.cri.sandbox-uid": pod_uid,
        "io.kubernetes.pod.name": pod,
        "io.kubernetes.pod.namespace": namespace,
        "io.kubernetes.pod.uid": pod_uid,
        "io.kubernetes.container.name": container_name,
    }


def _bind(path: str, readonly: bool) -> dict[str, Any]:
    options = ["rbind", "nosuid"] + (["ro"] if readonly else ["rw"])
    return {"destination": path, "type": "bind", "source": path, "options": options}


def build_config(*, argv: list[str], env: dict[str, str], cgroups_path: str, hostname: str,
                 ro_binds: list[str], rw_binds: list[str], annotations: dict[str, str],
                 new_network: bool = False, cwd: str = "/",
                 device_rules: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An OCI runtime-spec 1.0 config.json for runc, built from scratch.

    Rootfs is the bundle's empty `rootfs` dir, read-only. `ro_binds`/`rw_binds` are host
    paths mounted at the same path inside (after the standard /proc, /dev, /sys mounts, so
    a bind of e.g. /dev/shm replaces the container's own tmpfs there). New pid, mount,
    ipc and uts namespaces; the network namespace is the host's unless `new_network`
    (then runc brings up loopback only). `env` entries are `KEY=VALUE` as given, with PATH
    and PYTHONUNBUFFERED=1 added unless the caller set them. `device_rules` are OCI
    `linux.resources.devices` entries added after the deny-all (e.g. `{"allow": True,
    "type": "c", "major": 195, "access": "rwm"}`, what the NVIDIA toolkit adds for GPUs);
    runc adds its default devices (null, zero, tty...) itself.
    """
    full_env = {"PATH": DEFAULT_PATH, "PYTHONUNBUFFERED": "1", "HOME": "/root", **env}
    bind_targets = {p.rstrip("/") or "/" for p in ro_binds + rw_binds}
    standard_mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", "size=65536k"]},
    ]
    mounts = [m for m in standard_mounts if m["destination"] not in bind_targets]
    # Shallow paths first so that a bind inside another bind (the venv inside the repo)
    # lands on top of its parent, not underneath it.
    binds = [_bind(p, True) for p in ro_binds] + [_bind(p, False) for p in rw_binds]
    mounts += sorted(binds, key=lambda m: len(Path(m["destination"]).parts))
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if new_network:
        namespaces.append({"type": "network"})
    caps = list(DEFAULT_CAPABILITIES)
    return {
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(argv),
            "env": [f"{key}={value}" for key, value in full_env.items()],
            "cwd": cwd,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": False,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": hostname,
        "mounts": mounts,
        "annotations": dict(annotations),
        "linux": {
            "cgroupsPath": cgroups_path,
            "resources": {"devices": [{"allow": False, "access": "rwm"}, *(device_rules or [])]},
            "namespaces": namespaces,
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
                            "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                            "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def docker_config_v2(*, container_id: str, name: str, argv: list[str], env: dict[str, str],
                     labels: dict[str, str], host_pid: int, hostname: str,
                     started: datetime | None = None) -> dict[str, Any]:
    """The subset of Docker's `containers/<id>/config.v2.json` identity code reads:
    ID, Name ("/<name>", as Docker stores it), Config.Labels, State.Pid."""
    started_at = (started or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "ID": container_id,
        "Name": f"/{name}",
        "Created": started_at,
        "Path": argv[0],
        "Args": argv[1:],
        "Driver": "overlay2",
        "Config": {
            "Hostname": hostname,
            "Env": [f"{key}={value}" for key, value in env.items()],
            "Cmd": list(argv),
            "Image": "gpuwatch-sim:latest",
            "Labels": dict(labels),
        },
        "State": {"Running": True, "Paused": False, "Pid": host_pid, "ExitCode": 0,
                  "StartedAt": started_at, "Status": "running"},
        "HostConfig": {"CgroupParent": "", "Runtime": "runc"},
    }
