"""Shared CLI options for where container runtimes keep their per-container metadata.

The defaults cover containerd, CRI-O, runc and Docker at their standard paths; these
options add more (e.g. a node's non-default containerd state dir, or the simulated
node's bundle root) without losing the defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def runtime_root_options(func: F) -> F:
    options = [
        click.option("--containerd-root", "containerd_roots", multiple=True, metavar="DIR",
                     help="Extra containerd task bundle root (holds <namespace>/<id>/config.json)."),
        click.option("--docker-root", "docker_roots", multiple=True, metavar="DIR",
                     help="Extra Docker containers dir (holds <id>/config.v2.json)."),
        click.option("--runc-root", "runc_roots", multiple=True, metavar="DIR",
                     help="Extra runc state dir (holds <id>/state.json)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def bundle_roots_from(containerd_roots: tuple[str, ...], docker_roots: tuple[str, ...],
                      runc_roots: tuple[str, ...]) -> Any:
    """BundleRoots with the defaults plus the given extra dirs (None when none were given)."""
    if not (containerd_roots or docker_roots or runc_roots):
        return None
    from gpuwatch.containers import BundleRoots

    base = BundleRoots()
    return BundleRoots(containerd_tasks=(*base.containerd_tasks, *containerd_roots),
                       crio_containers=base.crio_containers,
                       runc_state=(*base.runc_state, *runc_roots),
                       docker_containers=(*base.docker_containers, *docker_roots))
