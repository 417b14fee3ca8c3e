"""Run commands (usually simulated GPU workloads) inside real containers.

Three variants, all real kernel objects, so gpuwatch's identity, probe and enforcement
code is tested against what it meets on a node:

* "k8s": runc with a generated OCI bundle laid out where containerd keeps bundles
  (`<bundle_root>/k8s.io/<id>/config.json`, with the CRI annotations) and a kubepods
  cgroup path (`/kubepods[/<qos>]/pod<uid>/<id>`, cgroupfs driver).
* "docker": runc with cgroup `/docker/<id>`, bundle under `<bundle_root>/moby/<id>` and
  Docker's `<docker_root>/containers/<id>/config.v2.json` (name, labels).
* "cgroup": no runtime; a cgroup made directly (v2, plus the v1 freezer on hybrid hosts)
  and the process put into it before it executes its first instruction.

The container's network namespace is the host's (like a hostNetwork pod); pid, mount,
ipc and uts namespaces are new. `runc run` stays in the foreground as our child (stdio to
a log file in the bundle dir, `--pid-file` for the host PID), so the exit status is the
container's and nothing is left to reap. `ContainerLab` stops everything it started on
every exit path (context manager and atexit).

Parent cgroups (/kubepods/<qos>, /docker, /gpuwatch-test) are shared by labs, also across
processes: starting holds a shared flock on the cgroup mount root and removing parents an
exclusive one, and parents a lab caused carry an xattr so whichever lab leaves last
removes them, while parents made by anyone else are never touched.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import gpuwatch
from gpuwatch.core.errors import SimError
from gpuwatch.sim import bundle as oci
from gpuwatch.sim import cgroups

RUNTIMES = ("k8s", "docker", "cgroup")
DEFAULT_CGROUP_PARENT = "/gpuwatch-test"
LOG_NAME = "stdio.log"
PID_FILE_NAME = "init.pid"
START_TIMEOUT_S = 15.0
SBIN_DIRS = "/usr/local/sbin:/usr/sbin:/sbin"


@dataclass
class ContainerSpec:
    """What to run and under which identity.

    `extra_binds` are host paths bind-mounted read-write at the same path inside.
    `runtime` is "k8s", "docker" or "cgroup". `annotations` are added to the generated
    ones (k8s: config.json annotations; docker: labels). `cgroup_path` is only for the
    "cgroup" runtime (default /gpuwatch-test/<name>). `ro_binds` are host paths mounted
    read-only at the same path (e.g. the sim's C build cache). `device_rules` are OCI device
    cgroup rules added to config.json (runc runtimes only; see bundle.build_config).
    `new_network` gives the container its own network namespace (runc runtimes only).
    """

    name: str
    argv: list[str]
    namespace: str = "default"
    pod: str | None = None
    qos: str = "burstable"
    env: dict[str, str] = field(default_factory=dict)
    extra_binds: list[str] = field(default_factory=list)
    runtime: str = "k8s"
    annotations: dict[str, str] = field(default_factory=dict)
    cgroup_path: str | None = None
    ro_binds: list[str] = field(default_factory=list)
    device_rules: list[dict[str, Any]] = field(default_factory=list)
    new_network: bool = False  # its own network namespace (only lo, as a pod before its CNI runs)


def find_runc(search_path: str | None = None) -> str:
    """Absolute path of the runc binary, or a SimError naming the Debian package.

    Looks in $PATH and the sbin dirs (root's PATH may lack them), or only in `search_path`.
    """
    path = shutil.which("runc", path=search_path or f"{os.environ.get('PATH', '')}:{SBIN_DIRS}")
    if path is None:
        raise SimError("runc not found", fix="apt-get install runc")
    return path


def repo_root() -> Path:
    """The directory holding the `gpuwatch` package (the checkout for an editable install)."""
    return Path(gpuwatch.__file__).resolve().parent.parent


def _covered(path: str, binds: list[str]) -> bool:
    """True when `path` is one of `binds` or lies inside one of them."""
    return any(Path(path) == Path(b) or Path(b) in Path(path).parents for b in binds)


def _exit_status(returncode: int) -> int:
    """Popen's return code as a shell reports it (128+N for death by signal N), as runc does."""
    return 128 - returncode if returncode < 0 else returncode


class RunningContainer:
    """One started container. `stop()` is idempotent and removes everything it made."""

    def __init__(
        self,
        *,
        lab: ContainerLab,
        container_id: str,
        spec: ContainerSpec,
        cgroup_path: str,
        pod_uid: str | None,
        pod: str | None,
        bundle_dir: Path,
        process: subprocess.Popen[bytes],
        host_pid: int,
        docker_dir: Path | None = None,
    ) -> None:
        self.id = container_id
        self.name = spec.name
        self.runtime = spec.runtime
        self.cgroup_path = cgroup_path
        self.host_pid = host_pid
        self.pod_uid = pod_uid
        self.pod = pod
        self.namespace = spec.namespace
        self.bundle_dir = bundle_dir
        self.docker_dir = docker_dir
        self._lab = lab
        self._process = process
        self._log_path = bundle_dir / LOG_NAME
        self._logs_after_stop: str | None = None
        self._stopped = False

    def __repr__(self) -> str:
        return (
            f"RunningContainer(name={self.name!r}, runtime={self.runtime!r}, id={self.id[:12]}, "
            f"host_pid={self.host_pid}, cgroup={self.cgroup_path!r})"
        )

    @property
    def v2_dir(self) -> Path:
        """The container's directory in the cgroup v2 tree."""
        return self._lab.mounts.v2_dir(self.cgroup_path)

    def pids(self) -> list[int]:
        """Host pids in the container's v2 cgroup (cgroup.procs)."""
        return cgroups.read_pids(self.v2_dir)

    def running(self) -> bool:
        """True while the container's init process has not exited."""
        return self._process.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        """Wait for the container's init to exit; its exit status, or None on timeout."""
        try:
            return _exit_status(self._process.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to the container's init process (host pid), e.g. a checkpoint signal."""
        if self.running():
            os.kill(self.host_pid, sig)

    def logs(self) -> str:
        """Everything the container wrote to stdout and stderr (runc's errors included)."""
        if self._logs_after_stop is not None:
            return self._logs_after_stop
        try:
            return self._log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 5) -> None:
        """Kill every process, delete the runc container, remove its cgroups and bundle.

        Safe to call more than once. Raises SimError when processes survive `timeout_s`
        (nothing is removed then, so the state can be inspected).
        """
        if self._stopped:
            return
        members = self.pids()
        cgroups.thaw(self._lab.mounts, self.cgroup_path)
        if self.runtime == "cgroup":
            self._kill_cgroup(timeout_s)
        else:
            self._kill_runc(timeout_s)
        self._wait_cgroup_empty(timeout_s)
        _wait_reaped(members, timeout_s)
        for directory in self._lab.mounts.all_dirs(self.cgroup_path):
            if not cgroups.remove_dir(directory):
                raise SimError(
                    f"cgroup {directory} of container {self.name} could not be removed",
                    fix=f"check `cat {directory}/cgroup.procs` and child cgroups",
                )
        self._lab._release_parents(self.cgroup_path)
        self._logs_after_stop = self.logs()
        if self.bundle_dir.exists():
            shutil.rmtree(self.bundle_dir)
        if self.docker_dir is not None and self.docker_dir.exists():
            shutil.rmtree(self.docker_dir)
        self._stopped = True
        self._lab._forget(self)

    def _kill_runc(self, timeout_s: float) -> None:
        lab = self._lab
        if self._process.poll() is None:
            # --all: every process of the container, not only init. Failure is fine when
            # the container exited meanwhile; survivors are caught below.
            subprocess.run(
                [lab.runc, "--root", str(lab.runc_root), "kill", "--all", self.id, "KILL"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
            )
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            cgroups.kill_all(self.v2_dir)
            self._process.kill()  # runc itself; the container dies with its init
            self._wait_killed(timeout_s, f"runc for container {self.name} did not exit {2 * timeout_s} s after SIGKILL",
                              self._process.pid)
        if (lab.runc_root / self.id).exists():
            result = subprocess.run(
                [lab.runc, "--root", str(lab.runc_root), "delete", "--force", self.id],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0 and (lab.runc_root / self.id).exists():
                raise SimError(
                    f"runc delete {self.id[:12]} failed: {result.stderr.strip()}",
                    fix=f"runc --root {lab.runc_root} delete --force {self.id}",
                )

    def _kill_cgroup(self, timeout_s: float) -> None:
        if not cgroups.kill_all(self.v2_dir):
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
        if self._process.poll() is None:
            self._process.kill()
        self._wait_killed(timeout_s, f"process {self.host_pid} of {self.name} survived SIGKILL for {timeout_s} s",
                          self.host_pid)

    def _wait_killed(self, timeout_s: float, failure: str, pid: int) -> None:
        """Reap our process after a SIGKILL; SimError(`failure`, pointing at pid's status) if it
        outlives `timeout_s`."""
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise SimError(failure, fix=f"inspect /proc/{pid}/status") from err

    def _wait_cgroup_empty(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := self.pids()) and time.monotonic() < deadline:
            cgroups.kill_all(self.v2_dir)
            time.sleep(0.02)
        if left:
            raise SimError(
                f"processes {left} of container {self.name} survived {timeout_s} s",
                fix=f"echo 1 > {self.v2_dir}/cgroup.kill",
            )

    def __enter__(self) -> RunningContainer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ContainerLab:
    """Starts containers under one work dir and stops all of them on exit (any exit).

    `bundle_root` is containerd's task bundle root (default
    /run/containerd/io.containerd.runtime.v2.task; the identity resolver takes the same
    root), `docker_root` Docker's data root (default /var/lib/docker) and `runc_root` the
    runc state dir (default `<work_dir>/runc`, so tests never collide with a real runc).
    """

    def __init__(
        self,
        work_dir: str | Path,
        bundle_root: str | Path | None = None,
        docker_root: str | Path | None = None,
        runc_root: str | Path | None = None,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.bundle_root = Path(bundle_root) if bundle_root is not None else oci.DEFAULT_BUNDLE_ROOT
        self.docker_root = Path(docker_root) if docker_root is not None else oci.DEFAULT_DOCKER_ROOT
        self.runc_root = Path(runc_root) if runc_root is not None else self.work_dir / "runc"
        self.mounts = cgroups.detect()
        self._runc: str | None = None
        self._containers: list[RunningContainer] = []
        self._pod_uids: dict[tuple[str, str], str] = {}
        self._owned_parents: set[Path] = set()  # parent cgroup dirs this lab caused
        self._owned_dirs: list[Path] = []  # bundle/docker parent dirs this lab created
        self._atexit: Callable[[], None] | None = None

    @property
    def runc(self) -> str:
        """The runc binary (looked up once, on first use)."""
        if self._runc is None:
            self._runc = find_runc()
        return self._runc

    @property
    def containers(self) -> list[RunningContainer]:
        """Containers started and not yet stopped."""
        return list(self._containers)

    def __enter__(self) -> ContainerLab:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        errors = self._stop_all()
        if errors and exc is not None:
            for error in errors:
                exc.add_note(f"cleanup also failed: {error}")
        elif errors:
            raise errors[0]

    def close(self) -> None:
        """Stop every container; raise the first cleanup error after trying them all."""
        errors = self._stop_all()
        if errors:
            raise errors[0]

    def run(self, spec: ContainerSpec) -> RunningContainer:
        """Start `spec` and return once its init process runs (host PID known)."""
        if spec.runtime not in RUNTIMES:
            raise SimError(f"unknown runtime {spec.runtime!r}", fix=f"use one of {', '.join(RUNTIMES)}")
        if not spec.argv:
            raise SimError(f"container {spec.name!r} has an empty argv", fix="give the command to run")
        for path in spec.extra_binds + spec.ro_binds:
            if not Path(path).is_absolute() or not Path(path).exists():
                raise SimError(
                    f"bind source {path!r} does not exist or is not absolute",
                    fix="create the directory first and pass an absolute path",
                )
        if self._atexit is None:
            self._atexit = self._stop_all_quietly
            atexit.register(self._atexit)
        if spec.runtime == "cgroup":
            return self._run_cgroup(spec)
        return self._run_runc(spec)

    # -- runc variants ---------------------------------------------------------------

    def _run_runc(self, spec: ContainerSpec) -> RunningContainer:
        runc = self.runc
        container_id = secrets.token_hex(32)
        pod: str | None = None
        pod_uid: str | None = None
        if spec.runtime == "k8s":
            pod = spec.pod or spec.name
            pod_uid = self._pod_uids.setdefault((spec.namespace, pod), str(uuid.uuid4()))
            cgroup_path = oci.kubepods_cgroup_path(spec.qos, pod_uid, container_id)
            annotations = oci.k8s_annotations(
                container_name=spec.name,
                pod=pod,
                namespace=spec.namespace,
                pod_uid=pod_uid,
                sandbox_id=oci.sandbox_id_for(pod_uid),
            )
            bundle_parent = self.bundle_root / oci.K8S_CONTAINERD_NAMESPACE
            hostname = pod[:63]
        else:
            cgroup_path = oci.docker_cgroup_path(container_id)
            annotations = {}
            bundle_parent = self.bundle_root / oci.DOCKER_CONTAINERD_NAMESPACE
            hostname = container_id[:12]
        annotations.update(spec.annotations)
        self._make_owned_dirs(bundle_parent)
        bundle_dir = bundle_parent / container_id
        rootfs = bundle_dir / "rootfs"
        rootfs.mkdir(parents=True)
        try:
            ro_binds = self._system_binds(rootfs)
            ro_binds += [p for p in spec.ro_binds if not _covered(p, ro_binds)]
            config = oci.build_config(
                argv=spec.argv,
                env=spec.env,
                cgroups_path=cgroup_path,
                hostname=hostname,
                ro_binds=ro_binds,
                rw_binds=list(spec.extra_binds),
                annotations=annotations,
                device_rules=list(spec.device_rules),
                new_network=spec.new_network,
            )
            _write_json(bundle_dir / "config.json", config)
            self.runc_root.mkdir(parents=True, exist_ok=True)
        except BaseException:
            shutil.rmtree(bundle_dir)
            raise
        pid_file = bundle_dir / PID_FILE_NAME
        # Shared tree lock from noting the parents until runc has made the cgroups, so a
        # lab in another process does not rmdir a parent runc is about to create under.
        with cgroups.tree_lock(self.mounts, exclusive=False):
            absent = self._absent_parents(cgroup_path)
            try:
                with open(bundle_dir / LOG_NAME, "wb") as log:
                    process = subprocess.Popen(
                        [
                            runc,
                            "--root",
                            str(self.runc_root),
                            "run",
                            "--bundle",
                            str(bundle_dir),
                            "--pid-file",
                            str(pid_file),
                            container_id,
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            except BaseException:
                shutil.rmtree(bundle_dir)  # runc did not start: nothing but the bundle to undo
                raise
            container = RunningContainer(
                lab=self,
                container_id=container_id,
                spec=spec,
                cgroup_path=cgroup_path,
                pod_uid=pod_uid,
                pod=pod,
                bundle_dir=bundle_dir,
                process=process,
                host_pid=0,
            )
            self._containers.append(container)
            host_pid = _wait_pid_file(process, pid_file)
            self._claim_parents(absent)
        if host_pid is None:
            failure = (
                f"runc exited with status {process.returncode}"
                if process.poll() is not None
                else f"runc did not start the container in {START_TIMEOUT_S} s"
            )
            log_text = container.logs().strip()
            container.stop()
            raise SimError(
                f"container {container.name!r}: {failure}: {log_text[-2000:]}",
                fix="check the bind paths and argv; run the runc command by hand with the bundle",
            )
        container.host_pid = host_pid
        if spec.runtime == "docker":
            container.docker_dir = self._write_docker_config(container, spec, hostname)
        return container

    def _system_binds(self, rootfs: Path) -> list[str]:
        """Host dirs mounted read-only: the system dirs, the gpuwatch checkout, the venv
        and the Python it was made from (usually /usr, already bound).

        A system dir that is a symlink on the host (merged /usr: /bin -> usr/bin) becomes
        the same symlink in the rootfs instead of a second mount.
        """
        binds: list[str] = []
        for directory in oci.SYSTEM_DIRS:
            host = Path(directory)
            if host.is_symlink():
                (rootfs / directory.lstrip("/")).symlink_to(os.readlink(host))
            elif host.is_dir():
                binds.append(directory)
        for extra in (str(repo_root()), str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve())):
            if not _covered(extra, binds):
                binds.append(extra)
        return binds

    def _absent_parents(self, cgroup_path: str) -> list[Path]:
        """Parent cgroup dirs of `cgroup_path`, in any hierarchy, that do not exist yet."""
        parents = [str(p) for p in Path(cgroup_path).parents if str(p) != "/"]
        return [d for p in parents for d in self.mounts.all_dirs(p) if not d.is_dir()]

    def _claim_parents(self, created: list[Path]) -> None:
        """Record parent dirs this lab caused, here and (xattr) for labs in other processes."""
        for directory in created:
            if directory.is_dir():
                self._owned_parents.add(directory)
                cgroups.mark_created(directory)

    def _release_parents(self, cgroup_path: str) -> None:
        """rmdir the empty parents of `cgroup_path` that a lab caused, deepest first."""
        self._release_upwards(str(Path(cgroup_path).parent))

    def _release_upwards(self, cgroup_path: str) -> None:
        """rmdir `cgroup_path` and then its parents, in each hierarchy, while they are empty
        and a lab caused them; stops at the first one still in use or made by someone else."""
        paths = [cgroup_path] + [str(p) for p in Path(cgroup_path).parents if str(p) != "/"]
        with cgroups.tree_lock(self.mounts, exclusive=True):
            for root in self.mounts.roots:
                for directory in (root / p.lstrip("/") for p in paths):
                    if not directory.exists():
                        self._owned_parents.discard(directory)
                        continue
                    if directory not in self._owned_parents and not cgroups.is_marked_created(directory):
                        break
                    if not cgroups.remove_dir(directory, timeout_s=0.2):
                        break
                    self._owned_parents.discard(directory)

    def _write_docker_config(self, container: RunningContainer, spec: ContainerSpec, hostname: str) -> Path:
        containers_dir = self.docker_root / "containers"
        self._make_owned_dirs(containers_dir)
        docker_dir = containers_dir / container.id
        docker_dir.mkdir()
        document = oci.docker_config_v2(
            container_id=container.id,
            name=spec.name,
            argv=spec.argv,
            env=spec.env,
            labels=spec.annotations,
            host_pid=container.host_pid,
            hostname=hostname,
        )
        _write_json(docker_dir / "config.v2.json", document)
        return docker_dir

    # -- plain cgroup variant ----------------------------------------------------------

    def _run_cgroup(self, spec: ContainerSpec) -> RunningContainer:
        container_id = secrets.token_hex(32)
        cgroup_path = "/" + (spec.cgroup_path or f"{DEFAULT_CGROUP_PARENT}/{spec.name}").strip("/")
        if cgroup_path == "/" or ".." in Path(cgroup_path).parts:
            raise SimError(
                f"refusing cgroup path {cgroup_path!r}", fix="name a sub-cgroup like /gpuwatch-test/x"
            )
        v2_dir = self.mounts.v2_dir(cgroup_path)
        if v2_dir.exists():
            raise SimError(
                f"cgroup {v2_dir} already exists",
                fix="pick another container name or stop the container using it",
            )
        dirs = [v2_dir]
        freezer = self.mounts.v1_controller("freezer")
        if freezer is not None:
            dirs.append(freezer / cgroup_path.lstrip("/"))
        bundle_dir = self.work_dir / "cgroup" / container_id
        bundle_dir.mkdir(parents=True)
        procs_files = [os.fsencode(d / "cgroup.procs") for d in dirs]

        def enter_cgroup() -> None:
            # Runs in the child between fork and exec: raw syscalls only.
            pid = str(os.getpid()).encode()
            for procs in procs_files:
                fd = os.open(procs, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

        env = {"PATH": oci.DEFAULT_PATH, "PYTHONUNBUFFERED": "1", "HOME": "/root", **spec.env}
        try:
            with cgroups.tree_lock(self.mounts, exclusive=False), open(bundle_dir / LOG_NAME, "wb") as log:
                absent = self._absent_parents(cgroup_path)
                for directory in dirs:
                    cgroups.make_dirs(directory)
                self._claim_parents(absent)
                process = subprocess.Popen(
                    spec.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd="/",
                    start_new_session=True,
                    preexec_fn=enter_cgroup,
                )
        except BaseException:
            # not started: undo the cgroups and the log dir (the lock is released by now)
            for directory in dirs:
                cgroups.remove_dir(directory)
            self._release_parents(cgroup_path)
            shutil.rmtree(bundle_dir)
            raise
        container = RunningContainer(
            lab=self,
            container_id=container_id,
            spec=spec,
            cgroup_path=cgroup_path,
            pod_uid=None,
            pod=spec.pod,
            bundle_dir=bundle_dir,
            process=process,
            host_pid=process.pid,
        )
        self._containers.append(container)
        return container

    # -- bookkeeping -------------------------------------------------------------------

    def _make_owned_dirs(self, directory: Path) -> None:
        created = cgroups.make_dirs(directory)
        self._owned_dirs.extend(p for p in created if p not in self._owned_dirs)

    def _mount_root(self, directory: Path) -> Path:
        """The hierarchy mount point `directory` lies in."""
        return next(root for root in self.mounts.roots if root in directory.parents)

    def _forget(self, container: RunningContainer) -> None:
        if container in self._containers:
            self._containers.remove(container)

    def _stop_all(self) -> list[SimError]:
        errors: list[SimError] = []
        for container in reversed(self.containers):
            try:
                container.stop()
            except SimError as err:
                errors.append(err)
            except OSError as err:  # e.g. a bundle file that cannot be removed: go on with the rest
                errors.append(SimError(f"stopping {container.name} failed: {err}",
                                       fix=f"remove {container.bundle_dir} by hand"))
        for parent in sorted(self._owned_parents, key=lambda p: len(p.parts), reverse=True):
            self._release_upwards("/" + str(parent.relative_to(self._mount_root(parent))))
        for directory in sorted(self._owned_dirs, key=lambda p: len(p.parts), reverse=True):
            try:
                directory.rmdir()
            except FileNotFoundError:
                continue
            except OSError as err:
                if err.errno == errno.ENOTEMPTY:
                    continue  # another lab's bundles still live there
                errors.append(SimError(f"could not remove {directory}: {err}", fix=f"rm -r {directory}"))
        self._owned_dirs.clear()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        return errors

    def _stop_all_quietly(self) -> None:
        """atexit hook: best effort, report on stderr rather than raise during shutdown."""
        for error in self._stop_all():
            print(f"gpuwatch sim: cleanup failed: {error}", file=sys.stderr)


def _wait_pid_file(process: subprocess.Popen[bytes], pid_file: Path) -> int | None:
    """The host pid runc writes once the container runs; None if runc exits or times out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if pid_file.exists():
            text = pid_file.read_text().strip()
            if text:
                return int(text)
        if process.poll() is not None:
            return None
        time.sleep(0.01)
    return None


def _wait_reaped(pids: list[int], timeout_s: float) -> None:
    """Wait until `pids` are gone from /proc, not only from the cgroup.

    Orphans of a plain-cgroup workload are reaped by the host's init, a moment after they
    died; a pid still a zombie after `timeout_s` is left to init (it runs nothing).
    """
    deadline = time.monotonic() + timeout_s
    pending = list(pids)
    while pending and time.monotonic() < deadline:
        pending = [pid for pid in pending if _state(pid) is not None]
        if pending:
            time.sleep(0.01)
    alive = [pid for pid in pending if _state(pid) not in (None, "Z", "X")]
    if alive:
        raise SimError(
            f"processes {alive} still run after their cgroup was killed",
            fix=f"inspect /proc/{alive[0]}/status",
        )


def _state(pid: int) -> str | None:
    """One-letter process state from /proc/<pid>/stat, None when the pid is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split(" ", 1)[0]


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")
