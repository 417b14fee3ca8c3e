"""`gpuwatch agent`: the node daemon (sampler + exporter, plus probes, enforcer, webhook).

Everything optional degrades with one line that says what the user loses. Shutdown on
SIGTERM/SIGINT goes through one path that stops the sampler, detaches the probes and
thaws whatever the enforcer froze. SIGHUP reloads the policy.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from gpuwatch.cli.addresses import parse_listen
from gpuwatch.cli.envvars import with_env_options
from gpuwatch.cli.runtime_roots import bundle_roots_from, runtime_root_options

log = logging.getLogger("gpuwatch.agent")


def _regex(text: str | None) -> str | None:
    if text is None:
        return None
    import re

    try:
        re.compile(text)
    except re.error as err:
        raise click.BadParameter(f"{text!r} is not a regular expression: {err}",
                                 param_hint="--network-exclude") from err
    return text


def _xid_list(text: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError as err:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of Xid numbers (e.g. 13,31,43)",
                                 param_hint="--health-ignore-xids") from err


@with_env_options
@click.command("agent")
@click.option("--listen", default="127.0.0.1:9400", show_default=True, metavar="HOST:PORT",
              help="Where /metrics is served. The DaemonSet uses 0.0.0.0:9400 (read-only endpoint). On a "
                   "loopback address it also serves /snapshot.json (for `gpuwatch top --agent`).")
@click.option("--snapshot-remote", is_flag=True,
              help="Serve /snapshot.json on a non-loopback --listen too. Off by default: it shows host pids, "
                   "process names, cgroup paths and pod UIDs to anyone who can reach the port, so an "
                   "exposed --listen serves metrics only (403 for /snapshot.json).")
@click.option("--node", default=None, help="Node name label (default: hostname).")
@click.option("--interval", "interval_s", type=click.FloatRange(0.05, 3600), default=1.0,
              show_default=True, help="Sample interval in seconds.")
@click.option("--nvml-library", envvar="GPUWATCH_NVML_LIBRARY", default=None, metavar="PATH",
              help="Load this libnvidia-ml.so.1 (e.g. the simulated node's).")
@click.option("--proc-root", default="/proc", show_default=True,
              help="Host /proc (in a container: the host's /proc mounted e.g. at /host/proc).")
@click.option("--probes/--no-probes", "probes", default=None,
              help="Kernel probes (BPF). Default: on when available, with a message when not.")
@click.option("--device-prefix", default="/dev/nvidia", show_default=True,
              help="Device node prefix the ioctl probes track (the simulation uses its own).")
@click.option("--launch-uprobes", is_flag=True,
              help="Count kernel launches with uprobes on libcuda (costs ~0.5-17 us per launch).")
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False), default=None,
              help="Enforcement policy (YAML, see gpuwatch/policy/SCHEMA.md). Without it: no enforcement.")
@click.option("--dry-run", is_flag=True, help="Evaluate the policy and audit decisions, act on nothing.")
@click.option("--audit-log", default="/var/log/gpuwatch/audit.jsonl", show_default=True,
              help="Append-only JSON-lines audit log of every enforcement decision.")
@click.option("--webhook-listen", default=None, metavar="HOST:PORT",
              help="Serve the Alertmanager webhook (acting endpoint) here, e.g. 127.0.0.1:9401.")
@click.option("--webhook-token-file", default=None, type=click.Path(dir_okay=False),
              help="Bearer token for the webhook (file mode 600, >= 16 chars). Required with "
                   "--webhook-listen; env GPUWATCH_WEBHOOK_TOKEN also works.")
@click.option("--webhook-allow-remote", is_flag=True,
              help="Allow a non-loopback --webhook-listen address (token still required).")
@click.option("--state-file", default="/run/gpuwatch/frozen.json", show_default=True,
              help="Journal of what the enforcer froze (the cgroups carry a freeze marker too); a "
                   "restarted agent thaws it after a crash. A broken file is moved aside to FILE.bad.")
@click.option("--lock-file", default="/run/gpuwatch/agent.lock", show_default=True, envvar="GPUWATCH_LOCK_FILE",
              help="One agent per node: a second agent exits at once, naming the holder's pid. Give "
                   "each simulated node on one machine its own.")
@click.option("--kmsg", "kmsg_path", default="/dev/kmsg", show_default=True, metavar="PATH|none",
              help="Kernel log to read the driver's Xid lines from (per-pod Xid counts). The simulated "
                   "node writes its own: <sim root>/kmsg. 'none' turns it off.")
@click.option("--nfd-features-file", default=None, metavar="PATH",
              help="Write Node Feature Discovery labels (gpuwatch.io/*) to this local-source feature file, "
                   "e.g. /etc/kubernetes/node-feature-discovery/features.d/gpuwatch. Off when not given.")
@click.option("--health-ignore-xids", default=None, metavar="LIST",
              help="Comma-separated Xids that keep a GPU healthy (application errors). Default: "
                   "13,31,43,45,63,68,92,109.")
@click.option("--health-nvml-error-sweeps", type=click.IntRange(1, 1000), default=3, show_default=True,
              help="Sweeps in a row NVML may fail to read a GPU before it is reported unhealthy.")
@click.option("--network/--no-network", default=True, show_default=True,
              help="Read the node's NICs, RDMA ports and the network bytes of containers that use a GPU.")
@click.option("--network-exclude", default=None, metavar="REGEX",
              help="NIC names left out of the node's network metrics (full match). Default: lo, pods' veths "
                   "and CNI devices, bridges, tunnels, ifb. '' keeps every NIC.")
@click.option("--health-stall-intervals", type=click.IntRange(2, 10000), default=10, show_default=True,
              help="/healthz (the liveness probe) fails when the sampling loop finished no cycle for this many "
                   "intervals (at least 5 s); /readyz is ok once the first cycle is done.")
@click.option("--idle-without-gpus/--no-idle-without-gpus", default=True, show_default=True,
              help="On a node without NVIDIA device nodes (<device-prefix>ctl, <device-prefix>N) start nothing "
                   "but /metrics, /healthz and /readyz, and look again every 30 s (an all-nodes DaemonSet). "
                   "Not with --nvml-library.")
@runtime_root_options
@click.option("-v", "--verbose", count=True, help="More logging (-v info is the default, -vv debug).")
def agent(listen: str, snapshot_remote: bool, node: str | None, interval_s: float, nvml_library: str | None,
          proc_root: str, probes: bool | None, device_prefix: str, launch_uprobes: bool,
          policy_path: str | None, dry_run: bool, audit_log: str, webhook_listen: str | None,
          webhook_token_file: str | None, webhook_allow_remote: bool, state_file: str, lock_file: str,
          kmsg_path: str, nfd_features_file: str | None, health_ignore_xids: str | None,
          health_nvml_error_sweeps: int, network: bool, network_exclude: str | None,
          health_stall_intervals: int, idle_without_gpus: bool,
          containerd_roots: tuple[str, ...], docker_roots: tuple[str, ...], runc_roots: tuple[str, ...],
          verbose: int) -> None:
    """Run the node agent until SIGTERM/SIGINT.

    Samples NVML (and the kernel probes) every --interval, attributes GPU memory and kernel
    time to containers/pods/namespaces, serves Prometheus metrics on --listen, and with
    --policy enforces limits (alert, throttle, pause, checkpoint-then-kill, kill).
    For schedulers it exports GPU health (with the reason), per-pod Xids, GPU topology,
    network and node rollups, and with --nfd-features-file keeps NFD labels up to date.

    Every option can be set from the environment too, as GPUWATCH_AGENT_<OPTION> (the
    variable is named with each option below); an argument wins over the environment.
    """
    from gpuwatch.agent.daemon import AgentConfig

    host, port = parse_listen(listen, "--listen")
    webhook = parse_listen(webhook_listen, "--webhook-listen") if webhook_listen else None
    config = AgentConfig(
        listen_host=host, listen_port=port, snapshot_remote=snapshot_remote, node=node, interval_s=interval_s,
        nvml_library=nvml_library, proc_root=proc_root, probes=probes,
        device_prefix=device_prefix, launch_uprobes=launch_uprobes, policy_path=policy_path,
        dry_run=dry_run, audit_log=audit_log, webhook=webhook,
        webhook_token_file=webhook_token_file, webhook_allow_remote=webhook_allow_remote,
        frozen_state_path=state_file, lock_path=lock_file,
        kmsg_path=None if kmsg_path.strip().lower() in ("", "none", "off") else kmsg_path,
        nfd_features_file=nfd_features_file,
        ignored_xids=_xid_list(health_ignore_xids) if health_ignore_xids is not None else None,
        nvml_error_sweeps=health_nvml_error_sweeps, network=network, network_exclude=_regex(network_exclude),
        bundle_roots=bundle_roots_from(containerd_roots, docker_roots, runc_roots),
        health_stall_intervals=health_stall_intervals, idle_without_gpus=idle_without_gpus,
    )
    from gpuwatch.agent.daemon import REEXEC_ENV, exec_daemon, run_until_signalled

    if _is_the_cli_process() and os.environ.get(REEXEC_ENV, "1") != "0":
        try:
            exec_daemon(config, verbose, sys.argv[1:])  # the daemon without click: see gpuwatch.agent.daemon
        except OSError as err:
            log.warning("cannot start the lean daemon interpreter (%s): the agent runs in the CLI's", err)
    run_until_signalled(config, verbose)


def _is_the_cli_process() -> bool:
    """Whether this process is the `gpuwatch` command (script or `python -m gpuwatch`), which the
    agent may replace by exec; not when the command is invoked inside another program (tests)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) == "gpuwatch.__main__" or os.path.basename(sys.argv[0]) == "gpuwatch"
