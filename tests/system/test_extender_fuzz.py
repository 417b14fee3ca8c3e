"""No pod switches the extender off: hostile GPU requests over real HTTP never get a 5xx.

kube-scheduler's extender is configured `ignorable: true`: an extender that answers 5xx is
skipped, so a pod whose annotation made /filter fail would bypass every quota, health and
memory check. Every unreadable request must instead fail every node unresolvably with the
reason (FailedAndUnresolvableNodes). Issue 20, item 2. A few thousand pods, a few seconds.
"""

from __future__ import annotations

import http.client
import json
import random
from typing import Any

import pytest

from gpuwatch.extender.request import BadRequest, parse_pod, parse_quantity
from tests.unit.test_extender_server import post, serving

HOSTILE_VALUES = [
    "1e1000000", "1E+1000000", "1e-1000000", "-1e1000000", "9" * 5000, "0." + "0" * 5000 + "1",
    "1e999999999999999999", "1Ei" * 3, "1e309", "NaN", "Infinity", "-Infinity", "inf", "1e+", ".e5", "1_000",
    "8Gi\n", "\x00", "\uff18Gi", "1" * 100 + "Ei", "1e18Ei", "0x10", "  ", "", "1e-9", "-8Gi", "1.5", "50%", "101%",
    "1e2%", "true", "null", "[]", "{}", "1e1000000%", "0.5e1000000", "9e-999999999",
]


def _hostile_value(rng: random.Random) -> Any:
    choice = rng.random()
    if choice < 0.5:
        return rng.choice(HOSTILE_VALUES)
    if choice < 0.7:
        return f"{rng.choice(['', '-', '+'])}{rng.randint(0, 10**6)}{rng.choice(['e', 'E'])}" \
               f"{rng.choice(['', '+', '-'])}{rng.randint(0, 10**7)}{rng.choice(['', 'Gi', 'm', '%'])}"
    if choice < 0.8:
        return rng.choice([1e308, -1, 0, 2**70, 1.5, True, None, [], {}, "x" * rng.randint(0, 300)])
    return "".join(rng.choice("0123456789eE+-.GiMKm% ") for _ in range(rng.randint(1, 40)))


def hostile_pod(rng: random.Random, i: int) -> dict[str, Any]:
    annotations = {key: _hostile_value(rng) for key in (
        "gpuwatch.io/gpu-memory", "gpuwatch.io/gpu-share", "gpuwatch.io/sharing", "gpuwatch.io/remote-gpu")
        if rng.random() < 0.6}
    limits = {"nvidia.com/gpu": _hostile_value(rng)} if rng.random() < 0.6 else {}
    return {"metadata": {"name": f"fuzz-{i}", "namespace": "ml", "uid": f"uid-{i}", "annotations": annotations},
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits, "requests": limits}}]}}


@pytest.mark.parametrize("text", ["1e1000000", "1E+1000000", "9" * 5000, "1e-1000000", "1e1000000Gi"])
def test_quantities_with_huge_exponents_are_refused_not_overflowed(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


@pytest.mark.parametrize(("annotations", "gpus"), [
    ({"gpuwatch.io/gpu-memory": "1e1000000"}, None),
    ({}, "1E+1000000"),
    ({"gpuwatch.io/gpu-memory": "1E+1000000"}, "1e1000000"),
])
def test_the_reported_pods_fail_every_node_unresolvably(annotations: dict[str, str], gpus: str | None) -> None:
    pod = {"metadata": {"name": "p", "namespace": "ml", "annotations": annotations},
           "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": gpus} if gpus else {}}}]}}
    with pytest.raises(BadRequest):
        parse_pod(pod)
    with serving() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        status, result = post(conn, "/filter", json.dumps({"Pod": pod, "NodeNames": ["gpu-a", "gpu-b"]}))
        assert status == 200, result
        assert result["NodeNames"] == []
        assert set(result["FailedAndUnresolvableNodes"]) == {"gpu-a", "gpu-b"}
        assert "out of range" in result["FailedAndUnresolvableNodes"]["gpu-a"] or \
            "not a" in result["FailedAndUnresolvableNodes"]["gpu-a"]


def test_fuzz_no_5xx_over_thousands_of_hostile_pods() -> None:
    rng = random.Random(20)
    statuses: dict[int, int] = {}
    unresolvable = 0
    total = 3000
    with serving() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        for i in range(total):
            pod = hostile_pod(rng, i)
            verb = "/filter" if i % 3 else "/prioritize"
            status, result = post(conn, verb, json.dumps({"Pod": pod, "NodeNames": ["gpu-a", "gpu-b", "gpu-c"]}))
            statuses[status] = statuses.get(status, 0) + 1
            if verb == "/filter" and status == 200 and result["FailedAndUnresolvableNodes"]:
                unresolvable += 1
    assert all(code < 500 for code in statuses), statuses
    assert statuses.get(200) == total, statuses
    assert unresolvable > total // 10  # most hostile requests are refused with a reason, not guessed
