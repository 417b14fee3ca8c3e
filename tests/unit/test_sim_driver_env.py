"""driver_env: the environment that picks a process's driver traffic on the simulated node."""

from __future__ import annotations

import pytest

from gpuwatch.core.errors import SimError
from gpuwatch.sim.node import driver_env


def test_defaults_are_real_cudas() -> None:
    """What the H100 recording shows (tests/system/test_sim_real_shape.py): RM_ALLOC with
    paramsSize 0, allocations below 2 MiB carved from 2 MiB objects, a 518 MiB context."""
    assert driver_env() == {
        "GPUWATCH_SIM_ALLOC_PATH": "rm-alloc",
        "GPUWATCH_SIM_SUBALLOC_MIB": "2",
        "GPUWATCH_SIM_CONTEXT_MIB": "518",
        "GPUWATCH_SIM_RM_PARAMS_SIZE": "zero",
    }


def test_every_choice_reaches_the_environment() -> None:
    env = driver_env(
        alloc_path="vid-heap", suballoc_mib=64, context_mib=6, ctx_teardown="close-fd", rm_params_size="class"
    )
    assert env == {
        "GPUWATCH_SIM_ALLOC_PATH": "vid-heap",
        "GPUWATCH_SIM_SUBALLOC_MIB": "64",
        "GPUWATCH_SIM_CONTEXT_MIB": "6",
        "GPUWATCH_SIM_RM_PARAMS_SIZE": "class",
        "GPUWATCH_SIM_CTX_TEARDOWN": "close-fd",
    }


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"alloc_path": "rm-free"}, "rm-alloc, vid-heap"),
        ({"ctx_teardown": "exit"}, "free-device, free-client, close-fd"),
        ({"suballoc_mib": -1}, "0 to 1048576"),
        ({"context_mib": 1 << 21}, "0 to 1048576"),
        ({"rm_params_size": "64"}, "zero, class"),
    ],
)
def test_invalid_choices_say_what_is_allowed(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(SimError) as err:
        driver_env(**kwargs)  # type: ignore[arg-type]
    assert words in str(err.value) + str(getattr(err.value, "fix", ""))
