"""Contract test: what gpuwatch.sim.runc lays out is what gpuwatch.containers resolves.

A k8s-style and a docker-style container started by the lab are resolved from their host
PID alone (the path the sampler takes), with the lab's roots given to the resolver.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.containers.metadata import BundleRoots
from gpuwatch.containers.resolver import IdentityResolver
from gpuwatch.sim.runc import ContainerLab, ContainerSpec
from tests.system.sim_helpers import tmp_container_lab

SLEEP = ["/bin/sleep", "30"]


@pytest.fixture
def lab(tmp_path: Path, runc_required: str) -> Iterator[ContainerLab]:
    with tmp_container_lab(tmp_path) as container_lab:
        yield container_lab


def _resolver(lab: ContainerLab) -> IdentityResolver:
    roots = BundleRoots(containerd_tasks=(str(lab.bundle_root),), crio_containers=(),
                        runc_state=(str(lab.runc_root),),
                        docker_containers=(str(lab.docker_root / "containers"),))
    return IdentityResolver(bundle_roots=roots)


def test_k8s_container_resolves_to_its_pod(lab: ContainerLab) -> None:
    container = lab.run(ContainerSpec(name="trainer", argv=SLEEP, namespace="ml", pod="job-7",
                                      qos="besteffort"))
    found = _resolver(lab).resolve_pid(container.host_pid)
    assert found is not None
    assert found.container_pid == 1
    identity = found.identity
    assert identity.container_id == container.id
    assert identity.cgroup_path == container.cgroup_path
    assert identity.container_name == "trainer"
    assert identity.pod_name == "job-7"
    assert identity.pod_namespace == "ml"
    assert identity.pod_uid == container.pod_uid
    assert identity.qos_class.lower() == "besteffort"


def test_docker_container_resolves_to_its_name(lab: ContainerLab) -> None:
    container = lab.run(ContainerSpec(name="web", argv=SLEEP, runtime="docker"))
    found = _resolver(lab).resolve_pid(container.host_pid)
    assert found is not None
    assert found.identity.container_id == container.id
    assert found.identity.container_name == "web"
    assert found.identity.runtime == "docker"
