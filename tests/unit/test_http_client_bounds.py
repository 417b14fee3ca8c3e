"""Every HTTP client against a hostile server: bounded bytes, one deadline, bounded depth.

Issue 20, item 1: an endless 200 body took the extender to 6 GiB and `top --agent` to
13.6 GiB; a byte a second had no overall deadline; nested JSON gave a RecursionError
traceback. Each client here (the shared BoundedHttpClient, the Prometheus reader the
extender, its worker and `top --prometheus` use, the extender's cluster source, `top
--agent`) meets the endless, slow, slow-header and nested server of tests/hostile_server.py.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from gpuwatch.cli.main import cli
from gpuwatch.cluster.prometheus import PrometheusReader, PrometheusResponseError, PrometheusTimeout
from gpuwatch.cluster.source import PrometheusCluster
from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.httpclient import BoundedHttpClient, ByteBudget, HttpBadAnswer, HttpTimeout, HttpTooLarge
from gpuwatch.tui.sources import AgentSource
from tests.hostile_server import HostileServer

CAP = 1 << 20
TIMEOUT_S = 1.0


@pytest.fixture
def hostile(request: pytest.FixtureRequest) -> Iterator[HostileServer]:
    with HostileServer(request.param, slow_interval_s=0.05) as server:
        yield server


def _bounded_call(fn: object) -> tuple[BaseException, float, int]:
    tracemalloc.start()
    started = time.monotonic()
    try:
        fn()  # type: ignore[operator]
    except BaseException as err:
        raised: BaseException = err
    else:
        raise AssertionError("no error from a hostile server")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return raised, time.monotonic() - started, peak


@pytest.mark.parametrize("hostile", ["endless"], indirect=True)
def test_endless_body_stops_at_the_byte_cap(hostile: HostileServer) -> None:
    client = BoundedHttpClient(hostile.url, timeout_s=10, max_bytes=CAP)
    err, elapsed, peak = _bounded_call(lambda: client.request("GET", "/"))
    assert isinstance(err, HttpTooLarge), err
    assert "1048576-byte limit" in str(err)
    assert elapsed < 5 and peak < 4 * CAP


@pytest.mark.parametrize("hostile", ["slow", "slow-headers"], indirect=True)
def test_a_byte_at_a_time_is_cut_at_the_deadline(hostile: HostileServer) -> None:
    client = BoundedHttpClient(hostile.url, timeout_s=TIMEOUT_S, max_bytes=CAP)
    err, elapsed, _ = _bounded_call(lambda: client.request("GET", "/"))
    assert isinstance(err, HttpTimeout), err
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 0.5


@pytest.mark.parametrize("hostile", ["huge-length"], indirect=True)
def test_a_content_length_over_the_cap_is_refused_before_reading(hostile: HostileServer) -> None:
    client = BoundedHttpClient(hostile.url, timeout_s=10, max_bytes=CAP)
    err, elapsed, _ = _bounded_call(lambda: client.request("GET", "/"))
    assert isinstance(err, HttpTooLarge) and elapsed < 1


@pytest.mark.parametrize("hostile", ["nested"], indirect=True)
def test_nested_json_is_a_typed_error(hostile: HostileServer) -> None:
    client = BoundedHttpClient(hostile.url, timeout_s=5, max_bytes=CAP)
    err, _, _ = _bounded_call(lambda: client.get_json("/"))
    assert isinstance(err, HttpBadAnswer) and "nested deeper" in str(err)


def test_a_batch_budget_is_shared() -> None:
    budget = ByteBudget(10)
    assert budget.take(6) and not budget.take(6) and budget.take(4)
    budget.give(10)
    assert budget.used == 0


@pytest.mark.parametrize(("hostile", "error", "needle"), [
    ("endless", PrometheusResponseError, "too much"),
    ("slow", PrometheusTimeout, "within 1s"),
    ("slow-headers", PrometheusTimeout, "within 1s"),
    ("nested", PrometheusResponseError, "non-JSON"),
], indirect=["hostile"])
def test_prometheus_reader(hostile: HostileServer, error: type[Exception], needle: str) -> None:
    with PrometheusReader(hostile.url, timeout_s=TIMEOUT_S, cache_s=0, max_bytes=CAP) as reader:
        err, elapsed, peak = _bounded_call(lambda: reader.query_batch({"a": "up", "b": "up", "c": "up"}))
    assert isinstance(err, error) and needle in str(err), err
    assert elapsed < TIMEOUT_S + 1
    assert peak < 8 * CAP  # three concurrent answers, under the batch budget of 2 x CAP


@pytest.mark.parametrize("hostile", ["endless", "slow"], indirect=True)
def test_extender_cluster_source_in_process(hostile: HostileServer) -> None:
    source = PrometheusCluster(hostile.url, timeout_s=TIMEOUT_S, worker_process=False, max_bytes=CAP)
    try:
        err, elapsed, _ = _bounded_call(source.state)
    finally:
        source.close()
    assert isinstance(err, GpuwatchError) and elapsed < TIMEOUT_S + 1


@pytest.mark.parametrize(("hostile", "needle"), [
    ("endless", "byte limit"), ("slow", "within 1s"), ("nested", "nested deeper"),
], indirect=["hostile"])
def test_top_agent_source(hostile: HostileServer, needle: str) -> None:
    source = AgentSource(hostile.url, timeout_s=TIMEOUT_S, max_bytes=CAP)
    err, elapsed, peak = _bounded_call(source.next_snapshot)
    source.close()
    assert isinstance(err, GpuwatchError) and needle in str(err), err
    assert elapsed < TIMEOUT_S + 1 and peak < 4 * CAP


@pytest.mark.parametrize("hostile", ["nested"], indirect=True)
def test_top_once_agent_on_nested_json_has_no_traceback(hostile: HostileServer) -> None:
    result = CliRunner().invoke(cli, ["top", "--once", "--agent", hostile.url])
    assert result.exit_code != 0
    assert "Traceback" not in result.output and not isinstance(result.exception, RecursionError)
    assert "nested deeper" in result.output


def test_top_once_snapshot_file_with_nested_json(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "nested.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    result = CliRunner().invoke(cli, ["top", "--once", "--snapshot-file", str(path)])
    assert result.exit_code != 0 and not isinstance(result.exception, RecursionError)
    assert "nested deeper" in result.output
