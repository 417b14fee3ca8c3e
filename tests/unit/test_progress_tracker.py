"""ProgressTracker (values, rates, errors, retention), and its way through the metadata
reader, the sampler, the exporter and the snapshot document -- on fixture trees, no root."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuwatch.containers.metadata import metadata_from_annotations, parse_docker_config_v2, parse_oci_config
from gpuwatch.core import snapshot_doc
from gpuwatch.core.model import ContainerIdentity, ContainerProgress, ContainerUsage, ProcessUsage, Snapshot
from gpuwatch.exporter.collector import SnapshotCollector
from gpuwatch.pipeline.sampler import Sampler
from gpuwatch.signals.progress import ProgressTracker, progress_request_of
from tests.unit.gpu_fakes import GIB, FakeResolver, FakeWorld, container, factory_for
from tests.unit.proc_status import write_status
from tests.unit.test_tui_samples import sample_snapshot

FILE, GOAL = "gpuwatch.io/progress-file", "gpuwatch.io/progress-goal"


def declared(identity: ContainerIdentity, path: str = "/out/loss", goal: str = "minimize") -> ContainerIdentity:
    return dataclasses.replace(identity, labels=((FILE, path), (GOAL, goal)))


A = declared(container("aaaa1111aaaa", namespace="ns1", pod="p1", name="trainer", pod_uid="u1"))
M = declared(container("mmmm2222mmmm", namespace="ns1", pod="p2", name="scorer"), "/acc", "maximize")
PLAIN = container("cccc3333cccc", namespace="ns1", pod="p3", name="plain")


class Fixture:
    """A proc root whose pids' roots are container directories."""

    def __init__(self, tmp_path: Path) -> None:
        self.proc = tmp_path / "proc"
        self.base = tmp_path

    def pid(self, pid: int, container: str) -> Path:
        root = self.base / container
        (root / "out").mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid) / "root").symlink_to(root)
        write_status(self.proc / str(pid))
        return root


def usage(identity: ContainerIdentity, kernel_s: float, pids: tuple[int, ...] = (42,), gpu: int = 0
          ) -> ContainerUsage:
    return ContainerUsage(identity=identity, gpu_index=gpu, gpu_uuid=f"GPU-{gpu}", memory_bytes=GIB,
                          sm_utilization_ratio=0.5, kernel_seconds_total=kernel_s,
                          processes=tuple(ProcessUsage(p, 1, "python3", GIB, 0.5) for p in pids))


def test_values_rates_and_errors_over_the_window(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    root = fx.pid(42, "a")
    tracker = ProgressTracker(str(fx.proc), window_s=2.5)
    loss = root / "out" / "loss"
    seq = [(0.0, 0.0, "1.0\n"), (1.0, 0.5, "0.9\n"), (2.0, 1.0, "0.8\n"), (3.0, 1.5, "0.75\n")]
    for t, k, text in seq:
        loss.write_text(text)
        (p,) = tracker.collect([usage(A, k)], t)
    assert p.value == 0.75 and p.goal == "minimize" and p.path == "/out/loss"
    # window 2.5 s at t=3: samples t=0 (the newest at/before the window start is kept) .. 3
    assert p.window_s == pytest.approx(3.0) and p.window_kernel_seconds == pytest.approx(1.5)
    assert p.rate_per_gpu_second == pytest.approx(0.25 / 1.5)  # lost 0.25 of loss in 1.5 GPU-s
    assert p.rate_per_second == pytest.approx(0.25 / 3.0)
    assert (p.first_value, p.first_kernel_seconds) == (1.0, 0.0)
    assert p.reads_total == 4 and p.errors_total == 0 and p.last_error == ""
    # garbage, then a half-written value (this writer ends values with a newline): kept
    loss.write_text("NaN\n")
    (p,) = tracker.collect([usage(A, 2.0)], 4.0)
    loss.write_text("0.7")
    (p,) = tracker.collect([usage(A, 2.5)], 5.0)
    assert p.value == 0.75 and p.updated_s == 3.0
    assert p.errors_by_reason == (("garbage", 1), ("partial", 1)) and p.errors_total == 2
    assert p.last_error.startswith("partial")
    loss.write_text("0.7\n")
    (p,) = tracker.collect([usage(A, 3.0)], 6.0)
    assert p.value == 0.7 and p.last_error == "" and p.reads_total == 7
    # samples older than the window are gone: base is t=3 (0.75, 1.5)
    assert p.rate_per_gpu_second == pytest.approx(0.05 / 1.5)


def test_maximize_counts_rising_values_as_progress_and_rates_are_signed(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    root = fx.pid(7, "m")
    tracker = ProgressTracker(str(fx.proc))
    for t, k, v in [(0, 0.0, 0.1), (1, 1.0, 0.3), (2, 2.0, 0.2)]:
        (root / "acc").write_text(f"{v}\n")
        (p,) = tracker.collect([usage(M, k, pids=(7,))], float(t))
    assert p.direction == 1.0
    assert p.rate_per_gpu_second == pytest.approx(0.05)  # (0.2 - 0.1) / 2 GPU-s
    (root / "acc").write_text("0.05\n")
    (p,) = tracker.collect([usage(M, 3.0, pids=(7,))], 3.0)
    assert p.rate_per_gpu_second == pytest.approx(-0.05 / 3)  # worse than at the start: negative


def test_no_gpu_time_means_no_per_gpu_second_rate(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    (fx.pid(42, "a") / "out" / "loss").write_text("0.5\n")
    tracker = ProgressTracker(str(fx.proc))
    tracker.collect([usage(A, 10.0)], 0.0)
    (p,) = tracker.collect([usage(A, 10.0)], 1.0)  # frozen: no kernel time
    assert p.rate_per_gpu_second is None and p.rate_per_second == 0.0


def test_only_declared_containers_are_read_and_gpus_are_summed(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    (fx.pid(42, "a") / "out" / "loss").write_text("0.5\n")
    tracker = ProgressTracker(str(fx.proc))
    progress = tracker.collect([usage(A, 1.0, gpu=0), usage(PLAIN, 5.0), usage(A, 2.0, gpu=1)], 0.0)
    assert [p.identity.key for p in progress] == [A.key]
    assert progress[0].kernel_seconds_total == 3.0
    assert progress_request_of(PLAIN) is None


def test_the_next_pid_is_tried_when_one_is_gone(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    (fx.pid(43, "a") / "out" / "loss").write_text("0.5\n")
    tracker = ProgressTracker(str(fx.proc))
    (p,) = tracker.collect([usage(A, 1.0, pids=(41, 43))], 0.0)
    assert p.value == 0.5 and p.errors_total == 0
    (p,) = tracker.collect([usage(A, 1.0, pids=(41,))], 1.0)  # every pid gone
    assert p.value == 0.5 and p.errors_by_reason == (("pid_gone", 1),)


def test_history_is_kept_while_away_and_dropped_after_retention(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    loss = fx.pid(42, "a") / "out" / "loss"
    tracker = ProgressTracker(str(fx.proc), retention_s=60.0)
    loss.write_text("1\n")
    tracker.collect([usage(A, 0.0)], 0.0)
    assert tracker.collect([], 30.0) == ()  # not in the snapshot: not reported ...
    loss.write_text("0.5\n")
    (p,) = tracker.collect([usage(A, 1.0)], 31.0)  # ... but back with its history
    assert p.first_value == 1.0 and p.reads_total == 2
    tracker.collect([], 100.0)
    (p,) = tracker.collect([usage(A, 2.0)], 101.0)  # forgotten after retention: starts over
    assert p.first_value == 0.5 and p.reads_total == 1


def test_a_changed_declaration_or_kernel_counter_restarts_the_history(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    root = fx.pid(42, "a")
    (root / "out" / "loss").write_text("1\n")
    (root / "out" / "other").write_text("9\n")
    tracker = ProgressTracker(str(fx.proc))
    tracker.collect([usage(A, 5.0)], 0.0)
    (p,) = tracker.collect([usage(A, 1.0)], 1.0)  # kernel seconds went back
    assert p.rate_per_gpu_second is None and p.window_s == 0.0
    (p,) = tracker.collect([usage(declared(A, "/out/other"), 2.0)], 2.0)
    assert p.value == 9.0 and p.first_value == 9.0 and p.reads_total == 1


def test_metadata_reads_the_progress_annotations_beside_sharing() -> None:
    meta = metadata_from_annotations({"io.kubernetes.pod.name": "p", FILE: "/out//loss", GOAL: "Maximize",
                                      "gpuwatch.io/sharing": "shared"}, "containerd", "cfg.json")
    assert dict(meta.sharing_labels) == {"gpuwatch.io/sharing": "shared", FILE: "/out/loss", GOAL: "maximize"}
    bad = metadata_from_annotations({FILE: "relative/loss", GOAL: "sideways"}, "containerd", "bad.json")
    assert bad.sharing_labels == ()
    crio = metadata_from_annotations({"io.kubernetes.cri-o.Annotations": json.dumps({FILE: "/l"})}, "crio", "c")
    assert dict(crio.sharing_labels) == {FILE: "/l"}
    oci = parse_oci_config(json.dumps({"annotations": {FILE: "/l", GOAL: "minimize"}}), "runc", "x")
    assert oci is not None and progress_request_of(
        dataclasses.replace(PLAIN, labels=oci.sharing_labels)) is not None
    docker = parse_docker_config_v2(json.dumps({"Name": "/x", "Config": {"Labels": {f"annotation.{FILE}": "/l"}}}),
                                    "config.v2.json")
    assert docker is not None and dict(docker.sharing_labels) == {FILE: "/l"}


def test_sampler_publishes_progress_and_the_exporter_serves_it(tmp_path: Path) -> None:
    fx = Fixture(tmp_path)
    loss = fx.pid(10, "a") / "out" / "loss"
    world = FakeWorld(procs={(10, 0): (GIB, 0.5)})
    resolver = FakeResolver()
    resolver.add(10, A, 1)
    sampler = Sampler(factory_for(world), resolver, "node-1", clock=world.clock,
                      progress_source=ProgressTracker(str(fx.proc)))
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(sampler.latest, clock=world.clock))
    for step in range(4):
        loss.write_text(f"{1.0 - 0.1 * step}\n")
        snap = sampler.run_once()
        world.now_s += 1.0
    (p,) = snap.progress
    assert p.value == pytest.approx(0.7)
    assert p.rate_per_gpu_second == pytest.approx(0.3 / 1.5)  # 0.5 of a GPU for 3 s: 1.5 GPU-s
    labels = {"node": "node-1", "namespace": "ns1", "pod": "p1", "pod_uid": "u1", "container": "trainer",
              "container_id": "aaaa1111aaaa"}
    assert registry.get_sample_value("gpuwatch_container_progress", {**labels, "goal": "minimize"}) == \
        pytest.approx(0.7)
    assert registry.get_sample_value("gpuwatch_container_progress_rate", labels) == pytest.approx(0.2)
    assert registry.get_sample_value("gpuwatch_container_progress_wall_rate", labels) == pytest.approx(0.1)
    loss.write_text("junk\n")
    sampler.run_once()
    assert registry.get_sample_value("gpuwatch_container_progress_read_errors_total",
                                     {**labels, "reason": "garbage"}) == 1.0
    assert registry.get_sample_value("gpuwatch_container_progress", {**labels, "goal": "minimize"}) == \
        pytest.approx(0.7)


def test_unknown_values_are_left_out_of_the_metrics() -> None:
    snap = Snapshot(timestamp_s=1.0, node="n", devices=(), containers=(),
                    progress=(ContainerProgress(identity=A, path="/out/loss", errors_by_reason=(("missing", 3),)),))
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(lambda: snap, clock=lambda: 1.0))
    text = "\n".join(f"{m.name} {s.labels}" for m in registry.collect() for s in m.samples
                     if m.name.startswith("gpuwatch_container_progress"))
    assert "reason': 'missing'" in text
    assert "gpuwatch_container_progress {" not in text and "progress_rate {" not in text


def test_snapshot_document_round_trips_progress() -> None:
    progress = (
        ContainerProgress(identity=A, path="/out/loss", value=0.5, updated_s=12.0, rate_per_gpu_second=0.1,
                          rate_per_second=0.05, window_s=30.0, window_kernel_seconds=15.0,
                          kernel_seconds_total=100.0, first_value=2.0, first_kernel_seconds=1.0, reads_total=9,
                          errors_total=2, errors_by_reason=(("empty", 1), ("garbage", 1)), last_error="garbage: x"),
        ContainerProgress(identity=M, path="/acc", goal="maximize"),
    )
    snap = dataclasses.replace(sample_snapshot(), progress=progress)
    again = snapshot_doc.loads(snapshot_doc.dumps(snap))
    assert again == snap
    doc = json.loads(snapshot_doc.dumps(snap))
    assert doc["progress"][0]["rate_per_gpu_second"] == 0.1
    assert doc["progress"][1]["value"] is None
