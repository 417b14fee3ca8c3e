"""The progress model of `gpuwatch sim run`: curves, validation, work accounting (fake CUDA)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch.cli.sim import sim
from gpuwatch.core.errors import SimError
from gpuwatch.sim.workload import ProgressModel, StubCuda, Workload, WorkloadSpec


@pytest.mark.parametrize(
    ("curve", "work", "loss"),
    [
        ("exp", 0.0, 2.0),
        ("exp", 1.0, 2.0 * math.exp(-0.5)),
        ("linear", 1.0, 1.5),
        ("linear", 10.0, 0.0),  # never below 0
        ("log", math.e - 1, 1.5),
        ("log", 1e9, 0.0),
    ],
)
def test_curves_are_functions_of_the_work_done(curve: str, work: float, loss: float) -> None:
    model = ProgressModel(curve=curve, rate=0.5, start=2.0)
    assert model.value(work) == pytest.approx(loss)
    assert ProgressModel(curve=curve, rate=0.5, start=2.0, goal="maximize").value(work) == pytest.approx(2.0 - loss)


def test_loss_falls_and_score_rises_monotonically() -> None:
    for curve in ("exp", "linear", "log"):
        loss = [ProgressModel(curve=curve, rate=0.3).value(w / 4) for w in range(20)]
        score = [ProgressModel(curve=curve, rate=0.3, goal="maximize").value(w / 4) for w in range(20)]
        assert loss == sorted(loss, reverse=True) and loss[0] > loss[-1]
        assert score == sorted(score) and score[0] < score[-1]


@pytest.mark.parametrize(
    "spec",
    [
        WorkloadSpec(duty=0.5, progress=ProgressModel(curve="cubic")),
        WorkloadSpec(duty=0.5, progress=ProgressModel(rate=0)),
        WorkloadSpec(duty=0.5, progress=ProgressModel(start=-1)),
        WorkloadSpec(duty=0.5, progress=ProgressModel(goal="sideways")),
        WorkloadSpec(duty=0.5, evaluation_file=Path("/tmp/x")),  # a file without a curve
        WorkloadSpec(duty=0.0, work_s=10),  # work that never gets done
        WorkloadSpec(duty=0.5, work_s=-1),
        WorkloadSpec(duty=0.5, work_s=math.inf),
    ],
)
def test_invalid_progress_specs_are_rejected_with_a_fix(spec: WorkloadSpec) -> None:
    with pytest.raises(SimError) as err:
        spec.validate()
    assert err.value.fix


class FakeCuda(StubCuda):
    """Records kernels instead of running them (the workload's only driver calls)."""

    def __init__(self) -> None:
        self.kernels: list[int] = []

    def open_device(self, gpu: int) -> None:
        pass

    def alloc(self, nbytes: int) -> int:
        return 0x1000

    def free(self, ptr: int) -> None:
        pass

    def kernel(self, duration_us: int) -> None:
        self.kernels.append(duration_us)


def test_job_runs_its_work_writes_the_curve_and_says_done(tmp_path: Path) -> None:
    out = io.StringIO()
    loss_file = tmp_path / "loss"
    model = ProgressModel(curve="linear", rate=2.0, start=1.0)
    spec = WorkloadSpec(mib_per_step=0, duty=1.0, kernel_ms=10, work_s=0.055, progress=model,
                        evaluation_file=loss_file)
    cuda = FakeCuda()
    assert Workload(spec, cuda, out=out).run() == 0
    assert cuda.kernels == [10_000] * 5 + [5_000]  # the last kernel is what is left of the work
    assert float(loss_file.read_text()) == pytest.approx(1.0 - 2.0 * 0.055)
    assert loss_file.read_text().endswith("\n")
    assert not (tmp_path / ".loss.tmp").exists()
    lines = out.getvalue().splitlines()
    assert lines[-1].split()[0] == "done" and float(lines[-1].split()[2]) == pytest.approx(0.055)
    assert any(line.startswith("evaluation ") for line in lines)


def test_job_without_work_limit_stops_at_its_lifetime_without_done(tmp_path: Path) -> None:
    out = io.StringIO()
    spec = WorkloadSpec(mib_per_step=0, duty=1.0, kernel_ms=1, lifetime_s=0.05,
                        progress=ProgressModel(), evaluation_file=tmp_path / "loss")
    assert Workload(spec, FakeCuda(), out=out).run() == 0
    assert "done" not in out.getvalue()
    assert 0 < float((tmp_path / "loss").read_text()) < 1.0


def test_cli_refuses_inconsistent_progress_options_before_touching_the_node() -> None:
    result = CliRunner().invoke(sim, ["run", "--name", "no-such-node", "--progress-file", "/tmp/x", "--duty", "0.5"])
    assert result.exit_code == 2 and "--progress-curve" in result.output
    result = CliRunner().invoke(sim, ["run", "--name", "no-such-node", "--work-s", "5"])
    assert result.exit_code == 2 and "--duty" in result.output


def test_cli_help_names_the_progress_options() -> None:
    result = CliRunner().invoke(sim, ["run", "--help"])
    for option in ("--work-s", "--progress-curve", "--progress-rate", "--progress-file", "--progress-goal"):
        assert option in result.output
    up_help = CliRunner().invoke(sim, ["up", "--help"]).output
    assert "--mps" in up_help and "--timeslice-ms" in up_help
