"""Validation of workload specs and CLI parsing helpers (no simulated node needed)."""

from __future__ import annotations

import pytest

from gpuwatch.cli.sim import _parse_size, _signal_number
from gpuwatch.core.errors import SimError
from gpuwatch.sim.workload import WorkloadSpec


@pytest.mark.parametrize(
    "spec",
    [
        WorkloadSpec(pattern="spiky"),
        WorkloadSpec(duty=1.5),
        WorkloadSpec(duty=-0.1),
        WorkloadSpec(kernel_ms=0),
        WorkloadSpec(steps=-1),
    ],
)
def test_invalid_specs_are_rejected_with_a_fix(spec: WorkloadSpec) -> None:
    with pytest.raises(SimError) as err:
        spec.validate()
    assert err.value.fix


def test_default_spec_is_valid() -> None:
    WorkloadSpec().validate()


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("80GiB", 80 * 1024**3), ("512MiB", 512 * 1024**2), ("1g", 1024**3), ("1073741824", 1024**3)],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert _parse_size(text) == nbytes


def test_signal_names_and_numbers() -> None:
    assert _signal_number("SIGUSR1") == _signal_number("usr1") == 10
    assert _signal_number("15") == 15
