"""Label sets and label values shared by every gpuwatch metric family."""

from __future__ import annotations

from gpuwatch.core.model import ContainerIdentity, DeviceInfo

GPU_LABELS = ["node", "gpu", "uuid", "model"]
CONTAINER_LABELS = [*GPU_LABELS, "namespace", "pod", "pod_uid", "container", "container_id"]
PROBE_LABELS = ["node", "namespace", "pod", "pod_uid", "container", "container_id"]
POD_LABELS = ["node", "namespace", "pod", "pod_uid"]
NAMESPACE_LABELS = ["node", "namespace"]


def gpu_label(device: DeviceInfo) -> str:
    """The `gpu` label: the index, or "<index>/mig<slot>" for a MIG instance."""
    return f"{device.index}/mig{device.mig_index}" if device.mig_index is not None else str(device.index)


def identity_labels(identity: ContainerIdentity) -> list[str]:
    """namespace, pod, pod_uid, container, container_id for one identity."""
    container = identity.container_name or (identity.container_id[:12] if identity.container_id
                                            else identity.cgroup_path or "/")
    return [identity.pod_namespace, identity.pod_name, identity.pod_uid, container, identity.container_id]
