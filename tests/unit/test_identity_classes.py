"""Whole /proc/<pid>/cgroup files -> identity for the classes issue 18 names: Slurm jobs,
containerd namespace/name cgroups, bare ids at the top, the colon form in cgroupfs paths,
nested clusters (kind, minikube), podman under a systemd service, libvirt-lxc, ECS Fargate
1.4 and Cloud Foundry Garden.

Shapes as public test suites and runtime docs show them (slurm's cgroup plugins, container-id
parsers of tracing clients, Kepler, neuvector); the ids, names and uids are our own. The
v1 Slurm shape with one controller and a ``slurm_<node>`` top is what Debian's slurm-wlm
22.05 wrote on this project's CI machine (proctrack/cgroup on a hybrid host).
"""

from __future__ import annotations

import pytest

from gpuwatch.containers.pidcgroup import identity_of_cgroup_file
from gpuwatch.containers.procfs import parse_uid
from gpuwatch.core.model import ContainerIdentity

CID = "7c1e0d2f4a5b6c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f"
OUTER = "e2d3c4b5a6978877665544332211ffeeddccbbaa99887766554433221100ffee"
UID = "0b7e4c3a-9d21-4f6e-8a5b-3c2d1e0f9a8b"
UID_ = UID.replace("-", "_")
TASK = "4d3c2b1a0f9e8d7c6b5a49382716a5b4"
GARDEN_ID = "2f3e4d5c-6b7a-4981-a2b3-c4d5"
HYBRID_V1 = ("name=systemd", "pids", "memory", "devices", "cpu,cpuacct", "freezer")


def v1(path: str, controllers: tuple[str, ...] = HYBRID_V1, rest: str = "/") -> str:
    """A hybrid host's file: the v1 controllers at `path` (others at `rest`), and 0::/."""
    ids = {"name=systemd": 12, "pids": 10, "memory": 8, "devices": 6, "cpu,cpuacct": 4, "freezer": 3,
           "cpuset": 2, "blkio": 7}
    lines = [f"{ids[c]}:{c}:{path if c in controllers else rest}\n" for c in ids]
    return "".join(lines) + "0::/\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


# (case, file, runtime, container id, namespace, pod, container name)
CASES: list[tuple[str, str, str, str, str, str, str]] = [
    # --- Slurm -----------------------------------------------------------------------------
    ("slurm v2 task", v2("/system.slice/slurmstepd.scope/job_4711/step_0/user/task_0"),
     "slurm", "4711.0", "slurm", "job-4711", "step-0"),
    ("slurm v2 task without the user level", v2("/system.slice/slurmstepd.scope/job_4711/step_3/task_1"),
     "slurm", "4711.3", "slurm", "job-4711", "step-3"),
    ("slurm v2 batch step", v2("/system.slice/slurmstepd.scope/job_4711/step_batch/user/task_0"),
     "slurm", "4711.batch", "slurm", "job-4711", "step-batch"),
    ("slurm v2 extern step (pam_slurm_adopt)",
     v2("/system.slice/slurmstepd.scope/job_4711/step_extern/user/task_special"),
     "slurm", "4711.extern", "slurm", "job-4711", "step-extern"),
    ("slurm v2 interactive step", v2("/system.slice/slurmstepd.scope/job_4711/step_interactive/user/task_0"),
     "slurm", "4711.interactive", "slurm", "job-4711", "step-interactive"),
    ("slurm v2 multiple-slurmd scope", v2("/system.slice/node7_slurmstepd.scope/job_9/step_0/user/task_2"),
     "slurm", "9.0", "slurm", "job-9", "step-0"),
    ("slurm v2 node without systemd", v2("/slurmstepd.scope/job_9/step_1/user/task_0"),
     "slurm", "9.1", "slurm", "job-9", "step-1"),
    ("slurm v2 step's slurmstepd is not the step", v2("/system.slice/slurmstepd.scope/job_4711/step_0/slurm"),
     "slurm", "", "slurm", "job-4711", ""),
    ("slurm v2 job level", v2("/system.slice/slurmstepd.scope/job_4711"), "slurm", "", "slurm", "job-4711", ""),
    ("slurm v2 daemons are a systemd unit", v2("/system.slice/slurmstepd.scope/system"),
     "systemd", "", "", "", "slurmstepd"),
    ("slurmd itself is a service", v2("/system.slice/slurmd.service"), "systemd", "", "", "", "slurmd"),
    ("slurm v1 task, every controller", v1("/slurm/uid_1000/job_77/step_0/task_0"),
     "slurm", "77.0", "slurm", "job-77", "step-0"),
    ("slurm v1 batch step", v1("/slurm/uid_1000/job_77/step_batch/task_0"),
     "slurm", "77.batch", "slurm", "job-77", "step-batch"),
    ("slurm v1 extern step", v1("/slurm/uid_1000/job_77/step_extern/task_0"),
     "slurm", "77.extern", "slurm", "job-77", "step-extern"),
    ("slurm v1 freezer only, slurm_<node> top (Debian slurm-wlm 22.05, proctrack/cgroup)",
     v1("/slurm_vm/uid_0/job_3/step_0", ("freezer",)), "slurm", "3.0", "slurm", "job-3", "step-0"),
    ("slurm v1 step level", v1("/slurm/uid_1000/job_77/step_2"), "slurm", "77.2", "slurm", "job-77", "step-2"),
    ("a job_<n> directory elsewhere is not slurm", v2("/system.slice/ci.service/job_12/step_0"),
     "systemd", "", "", "", "ci"),
    ("slurm inside a docker test cluster: the step, not the node container",
     v1(f"/docker/{OUTER}/slurm/uid_0/job_5/step_0/task_0"), "slurm", "5.0", "slurm", "job-5", "step-0"),
    # --- containerd namespace / name (ctr run, nerdctl, cgroupfs driver) ------------------------
    ("ctr run in the default namespace", v2("/default/trainer-1"), "containerd", "trainer-1", "", "", "trainer-1"),
    ("ctr run in k8s.io", v2("/k8s.io/bench_a.2"), "containerd", "bench_a.2", "", "", "bench_a.2"),
    ("nerdctl cgroupfs, 64-hex id", v2(f"/default/{CID}"), "containerd", CID, "", "", ""),
    ("ctr run on a v1 host", v1("/default/trainer-1"), "containerd", "trainer-1", "", "", "trainer-1"),
    # --- a bare 64-hex directory at the top -------------------------------------------------------
    ("bare id at the top (docker, private cgroupns on some hosts)", v2(f"/{CID}"), "unknown", CID, "", "", ""),
    ("bare id at the top on v1", v1(f"/{CID}"), "unknown", CID, "", "", ""),
    ("CI job container", v2(f"/actions_job/{CID}"), "docker", CID, "", "", ""),
    ("CI job container on v1", v1(f"/actions_job/{CID}"), "docker", CID, "", "", ""),
    # --- the colon form inside a cgroupfs-driver path -------------------------------------------
    ("colon form under containerd.service",
     v1(f"/system.slice/containerd.service/kubepods-burstable-pod{UID_}.slice:cri-containerd:{CID}"),
     "containerd", CID, "", "", ""),
    ("colon form below kubepods/<qos>/pod<uid>",
     v2(f"/kubepods/besteffort/pod{UID}/kubepods-besteffort-pod{UID_}.slice:cri-containerd:{CID}"),
     "containerd", CID, "", "", ""),
    ("colon form, crio", v2(f"/system.slice/crio.service/kubepods-pod{UID_}.slice:crio:{CID}"),
     "crio", CID, "", "", ""),
    # --- nested clusters: the innermost pod/container wins, the node container is a label -------
    ("kind, systemd driver inside the node container",
     v2(f"/system.slice/docker-{OUTER}.scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"), "containerd", CID, "", "", ""),
    ("kind, cgroupfs docker on v1", v1(f"/docker/{OUTER}/kubepods/besteffort/pod{UID}/{CID}"),
     "kubepods", CID, "", "", ""),
    ("minikube (docker driver), burstable", v1(f"/docker/{OUTER}/kubepods/burstable/pod{UID}/{CID}"),
     "kubepods", CID, "", "", ""),
    ("kind pod-level cgroup",
     v2(f"/system.slice/docker-{OUTER}.scope/kubelet.slice/kubelet-kubepods.slice/"
        f"kubelet-kubepods-pod{UID_}.slice"), "kubepods", "", "", "", ""),
    ("kind node's own containerd is the node container",
     v2(f"/system.slice/docker-{OUTER}.scope/system.slice/containerd.service"), "docker", OUTER, "", "", ""),
    # --- podman started by a systemd service ----------------------------------------------------
    ("podman payload scope in a service", v2(f"/system.slice/trainer.service/libpod-payload-{CID}.scope"),
     "podman", CID, "", "", ""),
    ("podman payload in a user service",
     v2(f"/user.slice/user-1000.slice/user@1000.service/app.slice/job.service/libpod-payload-{CID}"),
     "podman", CID, "", "", ""),
    ("podman's supervisor (conmon) in the service", v2("/system.slice/trainer.service/supervisor"),
     "systemd", "", "", "", "trainer"),
    ("podman v2 container sub-cgroup", v2(f"/machine.slice/libpod-{CID}.scope/container"), "podman", CID, "", "", ""),
    # --- libvirt-lxc --------------------------------------------------------------------------------
    ("libvirt-lxc machine scope", v2("/machine.slice/machine-lxc\\x2d4242\\x2dgpu\\x2dbox.scope"),
     "libvirt-lxc", "gpu-box", "", "", "gpu-box"),
    ("libvirt-lxc, older scope name, v1", v1("/machine.slice/machine-lxc\\x2dweb01.scope"),
     "libvirt-lxc", "web01", "", "", "web01"),
    ("libvirt-lxc without systemd", v1("/machine/web01.libvirt-lxc"), "libvirt-lxc", "web01", "", "", "web01"),
    ("a unit inside the lxc domain is still the domain",
     v2("/machine.slice/machine-lxc\\x2d4242\\x2dgpu\\x2dbox.scope/system.slice/sshd.service"),
     "libvirt-lxc", "gpu-box", "", "", "gpu-box"),
    ("a qemu VM's scope is not a container", v2("/machine.slice/machine-qemu\\x2d1\\x2dvm1.scope"),
     "systemd", "", "", "", "machine-qemu\\x2d1\\x2dvm1"),
    # --- ECS Fargate 1.4 (containerd underneath) -----------------------------------------------------
    ("Fargate 1.4 on v1", v1(f"/ecs/{TASK}/{TASK}-3551862214"), "ecs", f"{TASK}-3551862214", "", "", ""),
    ("Fargate 1.4 on v2", v2(f"/ecs/{TASK}/{TASK}-3551862214"), "ecs", f"{TASK}-3551862214", "", "", ""),
    ("ECS on EC2 (docker under the task)", v1(f"/ecs/{UID}/{CID}"), "docker", CID, "", "", ""),
    # --- Cloud Foundry Garden -----------------------------------------------------------------------
    ("Garden on v1", v1(f"/system.slice/garden.service/garden/{GARDEN_ID}"), "garden", GARDEN_ID, "", "", ""),
    ("Garden on v2", v2(f"/system.slice/garden.service/garden/{GARDEN_ID}"), "garden", GARDEN_ID, "", "", ""),
    ("Garden at the top", v1(f"/garden/{GARDEN_ID}"), "garden", GARDEN_ID, "", "", ""),
    # --- not containers ---------------------------------------------------------------------------
    ("a system service stays a service", v2("/system.slice/cron.service"), "systemd", "", "", "", "cron"),
    ("a slice stays a slice", v2("/system.slice/default.slice"), "systemd", "", "", "", "default"),
    ("the host", v1("/"), "host", "", "", "", ""),
    ("a top-level 'default' directory alone is not a container", v2("/default"), "unknown", "", "", "", ""),
]


def _of(text: str) -> ContainerIdentity:
    return identity_of_cgroup_file(text)


@pytest.mark.parametrize(("name", "text", "runtime", "cid", "ns", "pod", "container"), CASES,
                         ids=[c[0] for c in CASES])
def test_identity_class(name: str, text: str, runtime: str, cid: str, ns: str, pod: str, container: str) -> None:
    ident = _of(text)
    assert (ident.runtime, ident.container_id, ident.pod_namespace, ident.pod_name, ident.container_name) == (
        runtime, cid, ns, pod, container)


def test_every_class_has_cases() -> None:
    runtimes = {c[2] for c in CASES}
    assert runtimes >= {"slurm", "containerd", "docker", "unknown", "crio", "kubepods", "podman", "libvirt-lxc",
                        "ecs", "garden", "systemd", "host"}


def test_slurm_labels_carry_job_step_and_v1_uid() -> None:
    labels = dict(_of(v1("/slurm/uid_1000/job_77/step_batch/task_0")).labels)
    assert labels == {"slurm_job": "77", "slurm_step": "batch", "slurm_uid": "1000"}
    v2_labels = dict(_of(v2("/system.slice/slurmstepd.scope/job_4711/step_0/user/task_3")).labels)
    assert v2_labels == {"slurm_job": "4711", "slurm_step": "0"}  # the resolver adds the user


def test_tasks_of_one_step_are_one_container() -> None:
    a = _of(v2("/system.slice/slurmstepd.scope/job_4711/step_0/user/task_0"))
    b = _of(v2("/system.slice/slurmstepd.scope/job_4711/step_0/user/task_1"))
    assert a.key == b.key == "4711.0" and a.labels == b.labels


def test_slurm_stepd_is_the_runtime_helper() -> None:
    ident = _of(v2("/system.slice/slurmstepd.scope/job_4711/step_0/slurm"))
    assert ("role", "monitor") in ident.labels and not ident.is_container


def test_nested_cluster_names_the_outer_container_as_a_label() -> None:
    kind = _of(v1(f"/docker/{OUTER}/kubepods/besteffort/pod{UID}/{CID}"))
    assert kind.pod_uid == UID and ("outer_container_id", OUTER) in kind.labels
    slurm_in_docker = _of(v1(f"/docker/{OUTER}/slurm/uid_0/job_5/step_0/task_0"))
    assert ("outer_container_id", OUTER) in slurm_in_docker.labels
    plain = _of(v2(f"/system.slice/docker-{CID}.scope"))
    assert not any(k == "outer_container_id" for k, _ in plain.labels)


def test_context_labels() -> None:
    assert ("containerd_namespace", "k8s.io") in _of(v2("/k8s.io/bench")).labels
    assert ("systemd_unit", "trainer.service") in _of(
        v2(f"/system.slice/trainer.service/libpod-payload-{CID}.scope")).labels


def test_uid_from_status() -> None:
    assert parse_uid("Name:\tpython\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\n") == 1000
    assert parse_uid("Name:\tx\n") is None


def test_policies_match_a_slurm_job_or_user() -> None:
    from dataclasses import replace

    from gpuwatch.policy.loader import check_policy_text
    from gpuwatch.policy.match import select_rule

    policy, issues = check_policy_text(
        "rules:\n"
        "  - name: job-42\n    match: {namespace: slurm, pod: job-42}\n    limits: {gpu_memory: 10GiB}\n"
        "  - name: alice\n    match: {namespace: slurm, labels: {slurm_user: alice}}\n"
        "    limits: {gpu_memory: 20GiB}\n")
    assert policy is not None and not issues
    step = _of(v2("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0"))
    assert select_rule(policy, step).rule.name == "job-42"  # type: ignore[union-attr]
    other = replace(_of(v2("/system.slice/slurmstepd.scope/job_43/step_0/user/task_0")),
                    labels=(("slurm_job", "43"), ("slurm_step", "0"), ("slurm_user", "alice")))
    assert select_rule(policy, other).rule.name == "alice"  # type: ignore[union-attr]
    bob = replace(other, labels=(("slurm_user", "bob"),))
    assert select_rule(policy, bob).rule is None


def test_top_shows_the_job_and_step() -> None:
    from gpuwatch.core.model import ContainerUsage
    from gpuwatch.tui.view_state import container_labels

    step = _of(v2("/system.slice/slurmstepd.scope/job_42/step_batch/user/task_0"))
    usage = ContainerUsage(identity=step, gpu_index=0, gpu_uuid="GPU-0", memory_bytes=1, sm_utilization_ratio=0.0,
                           kernel_seconds_total=0.0)
    assert container_labels(usage) == ("slurm", "job-42", "step-batch")
