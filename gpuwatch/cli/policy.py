"""`gpuwatch policy check|explain|schema`: validate a policy file and show which rule applies.

All work offline: `check` lists every problem of a file (`FILE:LINE: what; fix: how`) and
exits 1; `explain` builds a container identity from the flags and walks the rules in order,
saying why each one does or does not match; `schema` prints the JSON Schema that editors and
CI validators check policy files with.
"""

from __future__ import annotations

import sys

import click

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.policy.loader import check_policy_text, load_policy, read_policy_text, total_problems
from gpuwatch.policy.match import select_rule
from gpuwatch.policy.rules import Rule


@click.group("policy")
def policy() -> None:
    """Check and explain enforcement policy files (schema: gpuwatch/policy/SCHEMA.md)."""


@policy.command("schema")
def schema_cmd() -> None:
    """Print the policy file's JSON Schema (gpuwatch/policy/policy.schema.json) for editors and CI."""
    from gpuwatch.policy.jsonschema import render_schema

    click.echo(render_schema(), nl=False)


@policy.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def check_cmd(file: str) -> None:
    """Validate FILE; print every error with its line and a fix; exit 1 if any."""
    text = read_policy_text(file)  # as the agent reads it: regular files only, 1 MiB, never blocks
    loaded, issues = check_policy_text(text, file)
    if issues or loaded is None:
        for issue in issues:
            click.echo(str(issue), err=True)
        click.echo(f"{file}: {total_problems(issues)} problem(s); the running policy (if any) stays in place", err=True)
        sys.exit(1)
    click.echo(
        f"{file}: OK — {len(loaded.rules)} rule(s), {len(loaded.namespace_quotas)} namespace quota(s), "
        f"protected namespaces: {', '.join(loaded.protected_namespaces) or 'none'}"
    )


def _parse_labels(labels: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--label")
        out.append((key, value))
    return tuple(out)


def _describe_rule(rule: Rule) -> list[str]:
    limits = rule.limits
    parts = []
    if limits.gpu_memory is not None:
        parts.append(f"gpu_memory {limits.gpu_memory.describe()}")
    if limits.gpu_time_share is not None:
        parts.append(f"gpu_time_share {limits.gpu_time_share:.0%} over {limits.window_s:g}s")
    if limits.devices is not None:
        parts.append(f"devices {list(limits.devices)}")
    if limits.max_processes is not None:
        parts.append(f"max_processes {limits.max_processes}")
    lines = [f"limits: {', '.join(parts) or 'none (exempt)'}; priority {rule.priority}"]
    for index, step in enumerate(rule.actions):
        on = f" on {','.join(k.value for k in step.on)}" if step.on else ""
        wait = f" for {step.for_s:g}s" if step.for_s else ""
        lines.append(f"  step {index}: {step.kind.value} at {step.at_ratio:.0%}{on}{wait}")
    return lines


@policy.command("explain")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--namespace", default="", help="Pod namespace of the container.")
@click.option("--pod", default="", help="Pod name.")
@click.option("--container", default="", help="Container name.")
@click.option(
    "--container-id", default="", help="Container id (defaults to the name, so it counts as a container)."
)
@click.option("--cgroup", default="", help="Cgroup path of the container.")
@click.option("--label", "labels", multiple=True, help="Pod label or annotation KEY=VALUE (repeatable).")
def explain_cmd(
    file: str,
    namespace: str,
    pod: str,
    container: str,
    container_id: str,
    cgroup: str,
    labels: tuple[str, ...],
) -> None:
    """Show which rule of FILE applies to the described container, and why."""
    loaded = load_policy(file)
    identity = ContainerIdentity(
        runtime="k8s" if namespace or pod else "container",
        cgroup_path=cgroup or f"/explain/{container_id or container or pod or 'container'}",
        container_id=container_id or container or pod or "explain",
        container_name=container,
        pod_name=pod,
        pod_namespace=namespace,
        labels=_parse_labels(labels),
    )
    click.echo(f"container: {identity.display_name} (cgroup {identity.cgroup_path})")
    match = select_rule(loaded, identity)
    if match.protected:
        click.echo(f"namespace {namespace!r} is protected: only rules naming it literally apply")
    for line in match.explain():
        click.echo(line)
    if match.rule is not None:
        for line in _describe_rule(match.rule):
            click.echo(line)
