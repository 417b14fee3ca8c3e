"""benchmarks/sharing_bound.py, the fluid model of what an ideal scheduler reaches on
bench_sharing's mixes: checked on cases small enough to work out by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_sharing import STARTUP_S, Job, mixes
from sharing_bound import FluidNode, alone_s, bounds, main, progress_95_work_s


def job(name: str, memory_mib: int = 1536, work_s: float = 2.0, duty: float = 0.5, arrival_s: float = 0.0,
        pause_every_s: float = 0.0, pause_s: float = 0.0, curve: str = "exp", rate: float = 0.5) -> Job:
    return Job(name, memory_mib, 3, work_s, curve, rate, duty, pause_every_s, pause_s, arrival_s=arrival_s)


@pytest.mark.parametrize("policy", ["slicing", "oracle", "learners"])
@pytest.mark.parametrize("placement", ["arrival", "late"])
def test_a_job_alone_takes_its_start_its_work_at_its_duty_and_its_pauses(policy: str, placement: str) -> None:
    one = job("a", work_s=3.2, duty=0.4, pause_every_s=1.5, pause_s=0.3)
    result = FluidNode([one], policy, placement, gpus=1).run()
    assert alone_s(one) == pytest.approx(STARTUP_S + 3.2 / 0.4 + 2 * 0.3)
    assert result.completion_s["a"] == pytest.approx(alone_s(one))


@pytest.mark.parametrize("policy", ["slicing", "oracle", "learners"])
def test_jobs_whose_duties_fit_in_one_gpu_do_not_slow_each_other(policy: str) -> None:
    jobs = [job("a", duty=0.6), job("b", duty=0.4, arrival_s=0.3)]
    result = FluidNode(jobs, policy, "arrival", gpus=1).run()
    assert result.completion_s == pytest.approx({"a": alone_s(jobs[0]), "b": alone_s(jobs[1])})


def test_a_saturated_gpu_shares_its_time_equally_under_slicing_and_by_remaining_work_under_the_oracle() -> None:
    jobs = [job("long", work_s=3.0, duty=1.0), job("short", work_s=1.0, duty=1.0)]
    sliced = FluidNode(jobs, "slicing", "arrival", gpus=1).run()
    # both at 1/2 until short's 1 GPU-s is done at 2 s, then long alone for its last 2 GPU-s
    assert sliced.completion_s == pytest.approx({"short": STARTUP_S + 2.0, "long": STARTUP_S + 4.0})
    oracle = FluidNode(jobs, "oracle", "arrival", gpus=1).run()
    assert oracle.completion_s == pytest.approx({"short": STARTUP_S + 1.0, "long": STARTUP_S + 4.0})
    assert oracle.avg_completion_s < sliced.avg_completion_s
    assert oracle.makespan_s == pytest.approx(sliced.makespan_s)  # work-conserving both


def test_the_95_percent_point_follows_the_loss_curve() -> None:
    linear = job("linear", work_s=2.0, curve="linear", rate=0.4)  # loss 1.0 -> 0.2: 95 % of 0.8 at 1.9 GPU-s
    assert progress_95_work_s(linear) == pytest.approx(1.9)
    fast = job("fast", work_s=2.0, curve="exp", rate=3.0)  # 1 - e^-3w = 0.95 (1 - e^-6)
    assert progress_95_work_s(fast) == pytest.approx(-math.log(1 - 0.95 * (1 - math.exp(-6.0))) / 3.0)


def test_learners_first_gives_the_gpu_to_the_job_still_learning_once_the_other_has_plateaued() -> None:
    learner = job("learner", work_s=2.0, duty=1.0, curve="linear", rate=0.4)
    plateaued = job("plateaued", work_s=2.0, duty=1.0, curve="exp", rate=3.0)
    w95 = progress_95_work_s(plateaued)
    sliced = FluidNode([learner, plateaued], "slicing", "arrival", gpus=1).run()
    # half the GPU each all along: the learner's 1.9 GPU-s take 3.8 s
    assert sliced.t95_s["learner"] == pytest.approx(STARTUP_S + 3.8)
    assert sliced.t95_s["plateaued"] == pytest.approx(STARTUP_S + 2 * w95)
    first = FluidNode([learner, plateaued], "learners", "arrival", gpus=1).run()
    # halves until the plateaued job's 95 % point, then the learner alone up to its own
    assert first.t95_s["plateaued"] == pytest.approx(STARTUP_S + 2 * w95)
    assert first.t95_s["learner"] == pytest.approx(STARTUP_S + 2 * w95 + (1.9 - w95))
    assert first.avg_t95_s < sliced.avg_t95_s
    assert first.makespan_s == pytest.approx(sliced.makespan_s)  # the same work, still work-conserving


def test_a_job_that_does_not_fit_beside_another_holds_its_context_and_waits_for_its_memory() -> None:
    first, second = job("first", memory_mib=5120, work_s=1.0), job("second", memory_mib=5120, work_s=1.0, arrival_s=0.5)
    result = FluidNode([first, second], "slicing", "arrival", gpus=1).run()
    # second started (its context fits) at 0.5, is ready at 1.5, admitted when first ends at 3.0
    assert result.completion_s["first"] == pytest.approx(STARTUP_S + 2.0)
    assert result.completion_s["second"] == pytest.approx(3.0 + 2.0 - 0.5)


def test_late_placement_sends_a_job_to_whichever_gpu_has_room_and_the_least_duty() -> None:
    jobs = [job("big", memory_mib=7000, duty=0.9), job("small", memory_mib=1000, duty=0.2, arrival_s=0.1)]
    late = FluidNode(jobs, "slicing", "late", gpus=2)
    late.run()
    assert {fj.job.name: fj.gpu for fj in late.jobs} == {"big": 0, "small": 1}


@pytest.mark.parametrize("mix", ["heterogeneous", "memory-heavy", "long-tail"])
def test_on_every_mix_no_sharing_scheduler_beats_each_job_alone_and_the_gpus_do_all_the_work(mix: str) -> None:
    jobs = mixes(True, 2)[mix]
    results = bounds(jobs)
    alone = results.pop("alone")
    assert len(results) == 5
    total_work_s = sum(j.work_s for j in jobs)
    for label, bound in results.items():
        assert bound.avg_completion_s > alone.avg_completion_s, label
        assert bound.makespan_s is not None and bound.makespan_s >= total_work_s / 4, label
        assert bound.avg_t95_s is not None and bound.avg_t95_s < bound.avg_completion_s, label


def test_the_command_prints_every_mix_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    assert main(["--quick", "--mixes", "long-tail,memory-heavy"], out=lines.append) == 0
    assert [line for line in lines if line.endswith(":")] == ["long-tail:", "memory-heavy:"]
    assert sum("oracle / late" in line for line in lines) == 2
    with pytest.raises(SystemExit) as refused:
        main(["--mixes", "nosuch"])
    assert refused.value.code == 2
    assert "unknown mix nosuch" in capsys.readouterr().err
