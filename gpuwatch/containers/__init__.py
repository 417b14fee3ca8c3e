"""Container identity: pid -> cgroup -> container (runtime, id, pod, namespace, name).

`IdentityResolver` is the one entry point; `BundleRoots` says where runtimes keep state.
"""

from gpuwatch.containers.metadata import BundleRoots
from gpuwatch.containers.resolver import IdentityResolver

__all__ = ["BundleRoots", "IdentityResolver"]
