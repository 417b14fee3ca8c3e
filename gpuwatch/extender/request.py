"""What a pod asks of the GPUs, from its spec and annotations (pure; no I/O).

A pod asks through:

* `resources.limits["nvidia.com/gpu"]` (summed over containers; init containers count as
  their max): whole GPUs, the device plugin's resource;
* annotation `gpuwatch.io/gpu-memory: 8Gi`: GPU memory per GPU, a Kubernetes quantity
  (8Gi, 8G, 8589934592, 1.5Gi);
* annotation `gpuwatch.io/gpu-share: "0.5"` (or "50%"): a time share of one GPU, in (0, 1];
* annotation `gpuwatch.io/sharing: exclusive|shared|auto`: exclusive = GPUs nobody else
  uses; shared = may co-locate; auto = the extender picks (see placement.py);
* annotation `gpuwatch.io/remote-gpu: "true"`: the pod uses GPUs over the network
  (rCUDA-style): placed by network headroom, takes no local GPU.

Defaults: whole GPUs with no memory or share annotation are `exclusive` (what the device
plugin gives them anyway); a memory or share annotation alone means one `shared` GPU.
A pod with none of these asks for no GPU: the extender passes it through untouched.
Bad values raise `BadRequest` naming the annotation and what a valid value looks like --
never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

from gpuwatch.core.annotations import (
    GPU_MEMORY_ANNOTATION,
    GPU_SHARE_ANNOTATION,
    REMOTE_GPU_ANNOTATION,
    SHARING_ANNOTATION,
    parse_gpu_share,
    parse_sharing_mode,
)
from gpuwatch.core.errors import GpuwatchError

GPU_RESOURCE = "nvidia.com/gpu"
ANN_MEMORY = GPU_MEMORY_ANNOTATION  # the node reads the same annotations (core/annotations.py)
ANN_SHARE = GPU_SHARE_ANNOTATION
ANN_SHARING = SHARING_ANNOTATION
ANN_REMOTE = REMOTE_GPU_ANNOTATION
MAX_GPUS = 64

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
            "E": Decimal(10**18)}
_QUANTITY_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?\d+))?$",
                          re.ASCII)
MAX_QUANTITY_CHARS = 64
"""Longer text is no quantity anyone means (Kubernetes' own limit on a quantity's digits is 63)."""
MAX_QUANTITY_EXPONENT = 30
"""|exponent| of the e-notation: 1e30 bytes is far past any GPU; 1e1000000 would be computed exactly
(or overflow the Decimal context) before any range check saw it."""


class BadRequest(GpuwatchError):
    """The pod's GPU request cannot be understood (a bad annotation or limit)."""


class Sharing(StrEnum):
    EXCLUSIVE = "exclusive"
    SHARED = "shared"
    AUTO = "auto"


@dataclass(frozen=True)
class GpuRequest:
    """One pod's GPU request."""

    namespace: str
    name: str
    uid: str
    gpus: int  # GPUs wanted (0: the pod asks for no GPU)
    memory_bytes: int | None  # per GPU; None: not stated (whole GPUs)
    share: float | None  # time share of each GPU; None: not stated
    sharing: Sharing
    remote: bool = False

    @property
    def wants_gpu(self) -> bool:
        return self.gpus > 0 or self.remote

    @property
    def total_memory_bytes(self) -> int:
        return (self.memory_bytes or 0) * self.gpus

    def describe(self) -> str:
        parts = [f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"]
        if self.memory_bytes is not None:
            parts.append(f"{format_bytes(self.memory_bytes)} each")
        if self.share is not None:
            parts.append(f"share {self.share:g}")
        parts.append(self.sharing.value)
        if self.remote:
            parts.append("remote")
        return ", ".join(parts)


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes resource quantity ("8Gi", "1.5G", "1e9", "500m") as a Decimal; ValueError if not one.

    Bounded before any arithmetic: at most MAX_QUANTITY_CHARS characters and an e-notation
    exponent within +-MAX_QUANTITY_EXPONENT, so no text (``1e1000000``) can overflow the
    Decimal context or make the parse expensive."""
    stripped = text.strip()
    if len(stripped) > MAX_QUANTITY_CHARS:
        raise ValueError(f"{text[:20]!r}... ({len(text)} characters) is not a Kubernetes quantity")
    match = _QUANTITY_RE.match(stripped)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, suffix, exponent = match.groups()
    value = Decimal(number)
    if exponent is not None:
        power = int(exponent)
        if abs(power) > MAX_QUANTITY_EXPONENT:
            raise ValueError(f"{text!r}: exponent {power} is out of range (at most +-{MAX_QUANTITY_EXPONENT})")
        return value.scaleb(power)
    if suffix in _BINARY:
        return value * _BINARY[suffix]
    return value * _DECIMAL[suffix or ""]


def format_bytes(value: float) -> str:
    """8589934592 -> "8 GiB", 6.1 GiB -> "6.1 GiB" (for failure reasons people read)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{value:.0f} B"


def _dict(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be an object, got {type(value).__name__}")
    return value


def _gpu_limit(container: Any, where: str) -> int:
    resources = _dict(_dict(container, where).get("resources"), f"{where}.resources")
    limits = _dict(resources.get("limits"), f"{where}.resources.limits")
    requests = _dict(resources.get("requests"), f"{where}.resources.requests")
    raw = limits.get(GPU_RESOURCE, requests.get(GPU_RESOURCE))
    if raw is None:
        return 0
    try:
        value = parse_quantity(str(raw))
    except (ValueError, ArithmeticError) as err:  # InvalidOperation, Overflow: never a 500
        raise BadRequest(f"{where} {GPU_RESOURCE}: {err}", fix="use a whole number of GPUs, e.g. 1") from err
    if value != value.to_integral_value() or value < 0 or value > MAX_GPUS:
        raise BadRequest(f"{where} {GPU_RESOURCE} must be a whole number 0..{MAX_GPUS}, got {str(raw)[:80]!r}",
                         fix="ask for whole GPUs; use gpuwatch.io/gpu-share for a part of one")
    return int(value)


def parse_pod(pod: Any) -> GpuRequest:
    """The GPU request of a v1.Pod object (as kube-scheduler sends it). Raises BadRequest.

    Whatever a pod says, the answer is a request or BadRequest (which filter turns into
    FailedAndUnresolvableNodes with the reason): a parse error that slipped past the checks
    below must not become an HTTP 500, which an `ignorable` extender's caller would skip."""
    try:
        return _parse_pod(pod)
    except (ValueError, TypeError, ArithmeticError) as err:
        raise BadRequest(f"unreadable GPU request: {type(err).__name__}: {str(err)[:120]}",
                         fix="check the pod's nvidia.com/gpu limits and gpuwatch.io annotations") from err


def _parse_pod(pod: Any) -> GpuRequest:
    pod = _dict(pod, "Pod")
    meta = _dict(pod.get("metadata"), "Pod.metadata")
    spec = _dict(pod.get("spec"), "Pod.spec")
    annotations = _dict(meta.get("annotations"), "Pod.metadata.annotations")
    containers = spec.get("containers") or []
    init_containers = spec.get("initContainers") or []
    if not isinstance(containers, list) or not isinstance(init_containers, list):
        raise BadRequest("Pod.spec.containers and initContainers must be lists")
    gpus = sum(_gpu_limit(c, f"container {i}") for i, c in enumerate(containers))
    init = max((_gpu_limit(c, f"init container {i}") for i, c in enumerate(init_containers)), default=0)
    gpus = min(max(gpus, init), MAX_GPUS)

    memory = _memory(annotations.get(ANN_MEMORY))
    share = _share(annotations.get(ANN_SHARE))
    remote = _flag(annotations.get(ANN_REMOTE), ANN_REMOTE)
    sharing_text = annotations.get(ANN_SHARING)
    if sharing_text is None:
        sharing = Sharing.SHARED if (memory is not None or share is not None) else Sharing.EXCLUSIVE
    else:
        mode = parse_sharing_mode(str(sharing_text))
        if mode is None:
            raise BadRequest(f"annotation {ANN_SHARING}: {str(sharing_text)[:80]!r} is not one of exclusive, "
                             "shared, auto",
                             fix=f"set {ANN_SHARING} to exclusive, shared or auto")
        sharing = Sharing(mode)
    if gpus == 0 and (memory is not None or share is not None or sharing_text is not None):
        gpus = 1  # an annotation alone asks for (part of) one GPU
    if share is not None and sharing is Sharing.EXCLUSIVE:
        raise BadRequest(f"{ANN_SHARE} {share:g} with {ANN_SHARING}: exclusive asks for a part of a GPU "
                         "nobody else may use", fix=f"drop {ANN_SHARE} or use {ANN_SHARING}: shared")
    return GpuRequest(namespace=str(meta.get("namespace") or "default"), name=str(meta.get("name") or ""),
                      uid=str(meta.get("uid") or ""), gpus=gpus, memory_bytes=memory, share=share,
                      sharing=sharing, remote=remote)


def _memory(raw: Any) -> int | None:
    if raw is None:
        return None
    try:
        value = parse_quantity(str(raw))
    except (ValueError, ArithmeticError) as err:  # InvalidOperation, Overflow: never a 500
        raise BadRequest(f"annotation {ANN_MEMORY}: {str(raw)[:80]!r} is not a quantity ({err})",
                         fix=f"write e.g. {ANN_MEMORY}: 8Gi (Ki, Mi, Gi, Ti or plain bytes)") from err
    if value < 1 or value > 2**50:
        raise BadRequest(f"annotation {ANN_MEMORY}: {str(raw)[:80]!r} is out of range",
                         fix="use a size between 1 and 1Pi")
    return int(value)


def _share(raw: Any) -> float | None:
    if raw is None:
        return None
    value = parse_gpu_share(str(raw))
    if value is None:
        raise BadRequest(f"annotation {ANN_SHARE}: {str(raw)[:80]!r} is not a share of one GPU in (0, 1]",
                         fix=f'write e.g. {ANN_SHARE}: "0.5" or "50%" (a fraction of one GPU\'s time)')
    return value


def _flag(raw: Any, name: str) -> bool:
    if raw is None:
        return False
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise BadRequest(f"annotation {name}: {str(raw)[:80]!r} is not true or false", fix=f'write {name}: "true"')
