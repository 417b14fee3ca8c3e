"""`gpuwatch sim run --work-s --progress-curve`: a job with a fixed amount of GPU work and a
loss curve of the work done, on a simulated GPU whose kernels contend.

Alone, 1 GPU-second of work at duty 1.0 takes ~1 s; two such jobs on one GPU take ~2 s each
(each gets half); the file the job rewrites follows its curve of the work done."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

from tests.system.sim_helpers import GIB, Workers, private_node, sim_run_argv, workers


class Job:
    """A `gpuwatch sim run` job whose output lines are timestamped as they arrive."""

    def __init__(self, w: Workers, *args: str) -> None:
        self.proc = w.start(argv=sim_run_argv(*args, name=w.node.name))
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.strip()))

    def at(self, word: str) -> tuple[float, list[str]]:
        for t, line in self.lines:
            if line.split()[:1] == [word]:
                return t, line.split()
        raise AssertionError(f"no {word!r} line in {self.lines}")

    def finish(self, timeout_s: float = 30) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code

    def run_time_s(self) -> float:
        return self.at("done")[0] - self.at("ready")[0]


def job_args(tmp_path: Path, name: str, work_s: float = 1.0, rate: float = 1.0) -> list[str]:
    return ["--mib-per-step", "8", "--duty", "1.0", "--kernel-ms", "10", "--work-s", str(work_s),
            "--progress-curve", "exp", "--progress-rate", str(rate), "--progress-file", str(tmp_path / name)]


def test_work_takes_twice_as_long_when_two_jobs_share_a_gpu(tmp_path: Path) -> None:
    # 2 GiB: room for the two jobs' 518 MiB contexts at once
    with private_node(tmp_path, devices=1, memory_bytes=2 * GIB) as node, workers(node) as w:
        alone = Job(w, *job_args(tmp_path, "alone"))
        assert alone.finish() == 0
        pair = [Job(w, *job_args(tmp_path, f"shared{i}", rate=0.5 + i)) for i in range(2)]
        assert [job.finish() for job in pair] == [0, 0]
    alone_s = alone.run_time_s()
    shared_s = [job.run_time_s() for job in pair]
    print(f"\n1 GPU-second of work: alone {alone_s:.2f} s; two on one GPU {shared_s[0]:.2f} s and {shared_s[1]:.2f} s")
    assert 0.95 <= alone_s <= 2.0  # 1 s of kernels + launch gaps (more when the host CPU is busy)
    for t in shared_s:  # half a GPU each: about twice as long (the later starter ends its last part alone)
        assert 1.4 * alone_s <= t <= 2.6 * alone_s
    assert float(alone.at("done")[1][2]) == 1.0
    # the file holds the curve at the work done: exp(-K w) with K = 1, w = 1
    assert abs(float((tmp_path / "alone").read_text()) - math.exp(-1.0)) < 1e-8
    assert abs(float((tmp_path / "shared1").read_text()) - math.exp(-1.5)) < 1e-8


def test_evaluation_lines_follow_the_curve_of_the_work_done(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node, workers(node) as w:
        job = Job(w, *job_args(tmp_path, "loss", work_s=2.5, rate=0.8), "--progress-goal", "maximize")
        assert job.finish() == 0
    points = [(float(words[2]), float(words[1])) for _, line in job.lines
              if (words := line.split())[:1] == ["evaluation"]]
    assert len(points) >= 3
    for work, value in points:
        assert abs(value - (1.0 - math.exp(-0.8 * work))) < 1e-6
    assert [v for _, v in points] == sorted(v for _, v in points)
