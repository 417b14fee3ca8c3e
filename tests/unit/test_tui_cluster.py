"""The cluster view of `gpuwatch top --prometheus`: rows per node, NODE column, sorting and
filtering across nodes, the JSON document, and the command against a local fake Prometheus."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwatch.cli.main import cli
from gpuwatch.cluster.prometheus import Sample
from gpuwatch.cluster.queries import CLUSTER_QUERIES, build_state, cluster_queries
from gpuwatch.tui.cluster_view import (
    ClusterSnapshot,
    cluster_document,
    cluster_snapshot,
    filter_namespace,
    node_notes,
)
from gpuwatch.tui.render import plain_table, screen_lines
from gpuwatch.tui.view_state import ContainerRow, GpuRow, SortKey, ViewState, apply_key, build_rows
from tests.unit.test_cluster_prometheus import FakePrometheus, fake_prometheus, vector
from tests.unit.test_cluster_state import NOW, full_results

URL = "http://prom.example:9090"


def state_and_sim() -> tuple[Any, frozenset[str]]:
    return build_state(full_results(), NOW), frozenset({"b"})


def snap() -> ClusterSnapshot:
    state, sim = state_and_sim()
    return cluster_snapshot(state, sim, source=URL)


def containers(rows: list[Any]) -> list[tuple[str, str]]:
    return [(r.node, r.pod) for r in rows if isinstance(r, ContainerRow)]


def test_cluster_snapshot_holds_every_node() -> None:
    s = snap()
    assert [p.node for p in s.nodes] == ["a", "b"]
    assert len(s.devices) == 3 and len(s.containers) == 3
    assert s.simulated and s.gpu_up and s.timestamp_s == NOW and s.source == URL
    assert s.nodes[1].simulated and not s.nodes[0].simulated
    assert "simulated GPU nodes (gpuwatch sim): b" in s.notes
    assert "node a GPU 1: unhealthy (Xid 79)" in s.notes
    a0 = s.nodes[0].devices[0]
    assert (a0.memory_total_bytes, a0.memory_used_bytes, a0.name) == (80 * 2**30, 20 * 2**30, "H100")


def test_notes_for_down_and_stale_nodes() -> None:
    state = build_state({"backend_up": [Sample({"node": "x", "simulated": "false"}, 0.0, NOW)],
                         "last_scrape": [Sample({"node": "x"}, NOW - 600, NOW)]}, NOW)
    notes = node_notes(state)
    assert any("node x: GPU backend (NVML) down" in n for n in notes)
    assert any("node x: data is 600s old" in n for n in notes)


def test_rows_group_by_node_and_gpu() -> None:
    rows = build_rows(snap(), ViewState())
    gpus = [(r.node, r.gpu_index) for r in rows if isinstance(r, GpuRow)]
    assert gpus == [("a", 0), ("a", 1), ("b", 0)]
    assert containers(rows) == [("a", "train"), ("a", "nb"), ("b", "serve")]
    keys = [r.key for r in rows]
    assert len(keys) == len(set(keys))


def test_folding_one_nodes_gpu_leaves_the_other_nodes_gpu_alone() -> None:
    s = snap()
    state = ViewState()
    rows = build_rows(s, state)
    b0 = next(i for i, r in enumerate(rows) if isinstance(r, GpuRow) and r.node == "b")
    state = apply_key(dataclasses.replace(state, selected=b0, selected_key=rows[b0].key), "\n", rows)
    rows = build_rows(s, state)
    assert containers(rows) == [("a", "train"), ("a", "nb")]
    folded = [r for r in rows if isinstance(r, GpuRow) and r.collapsed]
    assert [(r.node, r.gpu_index) for r in folded] == [("b", 0)]


def test_flat_sort_spans_nodes_and_filter_matches_node_names() -> None:
    s = snap()
    flat = ViewState(group_by_gpu=False)
    assert containers(build_rows(s, flat)) == [("a", "train"), ("a", "nb"), ("b", "serve")]
    by_gpu = dataclasses.replace(flat, sort_key=SortKey.GPU)
    assert [n for n, _ in containers(build_rows(s, by_gpu))] == ["a", "a", "b"]
    assert containers(build_rows(s, dataclasses.replace(flat, sort_key=SortKey.SM, reverse=True))) == [
        ("a", "nb"), ("b", "serve"), ("a", "train")]
    renamed = {name: [Sample({**x.labels, "node": {"a": "east-1", "b": "west-2"}[x.labels["node"]]}
                             if "node" in x.labels else x.labels, x.value, x.timestamp_s) for x in samples]
               for name, samples in full_results().items()}
    west = cluster_snapshot(build_state(renamed, NOW))
    assert containers(build_rows(west, dataclasses.replace(flat, filter_text="WEST"))) == [("west-2", "serve")]


def test_expanding_a_cluster_container_adds_no_process_rows() -> None:
    s = snap()
    rows = build_rows(s, ViewState())
    i = next(i for i, r in enumerate(rows) if isinstance(r, ContainerRow))
    state = apply_key(ViewState(selected=i, selected_key=rows[i].key), "\n", rows)
    assert len(build_rows(s, state)) == len(rows)


def test_plain_table_has_the_node_column_and_no_pids() -> None:
    text = plain_table(snap(), ViewState())
    lines = text.splitlines()
    assert lines[0].startswith(f"gpuwatch top  cluster {URL}  nodes 2  ")
    assert "SIMULATED GPU NODE" in text
    assert any(line.startswith("a  GPU 0  H100  MEM 20.0 GiB / 80.0 GiB") for line in lines)
    assert any(line.startswith("b  GPU 0  A100") for line in lines)
    header = next(line for line in lines if "NAMESPACE" in line)
    assert header.split() == ["NODE", "NAMESPACE", "POD", "CONTAINER", "MEMORY", "SM%", "KERNEL-S"]
    serve = next(line for line in lines if "serve" in line)
    assert serve.split() == ["b", "inf", "serve", "main", "1.0", "GiB", "25%", "7.0"]
    assert "TEMP" not in text and "host pid" not in text and "no processes right now" not in text
    assert "no containers on this GPU" in text
    flat = plain_table(snap(), ViewState(group_by_gpu=False)).splitlines()
    assert next(line for line in flat if "NAMESPACE" in line).split()[:5] == [
        "NODE", "NAMESPACE", "POD", "CONTAINER", "GPU"]


def test_screen_lines_in_the_cluster_view() -> None:
    s = snap()
    state = ViewState()
    rows = build_rows(s, state)
    lines, _ = screen_lines(s, state, rows, 120, 30)
    texts = [line.text for line in lines]
    assert texts[0].startswith(f"gpuwatch top  cluster {URL}  nodes 2  every 1s")
    assert any(t.split()[:2] == ["NODE", "NAMESPACE"] for t in texts)
    assert all(len(t) <= 119 for t in texts)
    help_lines, _ = screen_lines(s, dataclasses.replace(state, show_help=True), rows, 120, 40)
    assert any("Cluster view (--prometheus)" in line.text for line in help_lines)


def test_local_view_is_unchanged_by_the_cluster_code() -> None:
    from tests.unit.test_tui_samples import sample_snapshot

    rows = build_rows(sample_snapshot(), ViewState())
    assert all(getattr(r, "node", "") == "" for r in rows)
    assert not any(r.key.startswith(("g:a", "c:a")) for r in rows)
    header = next(line for line in plain_table(sample_snapshot()).splitlines() if "NAMESPACE" in line)
    assert header.split()[0] == "NAMESPACE" and "PIDS(host/ctr)" in header


def test_namespace_filter_keeps_its_gpus_and_nodes() -> None:
    state, _ = state_and_sim()
    ml = filter_namespace(state, "ml")
    assert list(ml.nodes) == ["a"] and [g.index for g in ml.nodes["a"].gpus] == [0]
    assert {c.namespace for c in ml.nodes["a"].containers} == {"ml"}
    assert ml.namespace_memory_bytes == {"ml": 20 * 2**30}
    assert filter_namespace(state, "nobody").nodes == {}
    assert filter_namespace(state, None) is state


def test_cluster_document() -> None:
    state, sim = state_and_sim()
    doc = cluster_document(state, sim, URL)
    json.dumps(doc, allow_nan=False)
    assert doc["format"] == "gpuwatch.cluster/1" and doc["prometheus"] == URL and doc["fetched_at_s"] == NOW
    a, b = doc["nodes"]
    assert (a["name"], a["simulated"], b["simulated"]) == ("a", False, True)
    assert a["age_s"] == 1.5 and a["rdma"] and a["network_speed_bytes"] == 12.5e9
    assert a["gpus"][1] == {"index": 1, "uuid": "GPU-a1", "model": "H100", "memory_total_bytes": 80 * 2**30,
                            "memory_used_bytes": 0.0, "memory_free_bytes": 80 * 2**30, "utilization_ratio": 0.0,
                            "healthy": False, "reason": "xid", "xid": 79, "tenants": 0, "exclusive": False,
                            "outside_pod": []}
    assert a["pair_scores"] == [{"gpu": 0, "peer": 1, "score": 160.0}, {"gpu": 1, "peer": 0, "score": 160.0}]
    assert b["containers"] == [{"gpu": 0, "namespace": "inf", "pod": "serve", "pod_uid": "uid-serve",
                                "container": "main", "container_id": "cid-serve-main", "memory_bytes": 2**30,
                                "sm_utilization_ratio": 0.25, "kernel_seconds_total": 7.0}]
    assert doc["namespaces"] == [{"namespace": "inf", "memory_bytes": 2**30, "quota_bytes": None},
                                 {"namespace": "ml", "memory_bytes": 20 * 2**30, "quota_bytes": 32 * 2**30}]
    only = cluster_document(state, sim, URL, filter_text="train")
    assert [c["pod"] for n in only["nodes"] for c in n["containers"]] == ["train"]


# --------------------------------------------------------------------------- the command


def answer_all(fake: FakePrometheus, queries: dict[str, str], results: dict[str, list[Sample]]) -> None:
    for name, promql in queries.items():
        fake.answers[promql] = vector(*((x.labels, repr(x.value)) for x in results.get(name, [])))


@pytest.fixture
def prom() -> Iterator[FakePrometheus]:
    with fake_prometheus() as fake:
        answer_all(fake, CLUSTER_QUERIES, full_results())
        yield fake


def top(*args: str) -> Any:
    return CliRunner().invoke(cli, ["top", *args])


def test_once_lists_every_node(prom: FakePrometheus) -> None:
    result = top("--prometheus", prom.url, "--once")
    assert result.exit_code == 0, result.output
    assert f"cluster {prom.url}  nodes 2" in result.stdout
    for word in ("train", "nb", "serve", "a  GPU 1  H100", "UNHEALTHY"):
        assert word in result.stdout
    assert len(prom.requests) == len(CLUSTER_QUERIES)  # one batch


def test_json_is_the_cluster_document(prom: FakePrometheus) -> None:
    result = top("--prometheus", prom.url, "--json", "--namespace", "ml")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "gpuwatch.cluster/1"
    assert [(n["name"], [c["pod"] for c in n["containers"]]) for n in doc["nodes"]] == [("a", ["nb", "train"])]


def test_node_option_scopes_the_queries(prom: FakePrometheus) -> None:
    results = {name: [x for x in samples if x.labels.get("node") == "b"] for name, samples in full_results().items()}
    answer_all(prom, cluster_queries("b"), results)
    result = top("--prometheus", prom.url, "--once", "--node", "b")
    assert result.exit_code == 0, result.output
    assert "serve" in result.stdout and "train" not in result.stdout and "nodes 1" in result.stdout
    assert all('node="b"' in r["form"]["query"] for r in prom.requests)
    missing = top("--prometheus", prom.url, "--once", "--node", "nope")
    assert missing.exit_code == 1
    assert "has no gpuwatch data for node 'nope'" in missing.output and "check the node name" in missing.output


def test_no_gpuwatch_data_is_a_clear_error() -> None:
    with fake_prometheus() as empty:
        result = top("--prometheus", empty.url, "--once")
    assert result.exit_code == 1
    assert f"Error: Prometheus at {empty.url} has no gpuwatch data" in result.output
    assert "scrapes the gpuwatch agents" in result.output


def test_prometheus_down_is_a_clear_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = top("--prometheus", f"http://127.0.0.1:{port}", "--once")
    assert result.exit_code == 1
    assert f"Error: Prometheus at http://127.0.0.1:{port} unreachable" in result.output and "fix:" in result.output
    assert "Traceback" not in result.output


def test_bad_url_and_conflicting_options() -> None:
    assert "not an http(s) URL" in top("--prometheus", "prom:9090", "--once").output
    conflict = top("--prometheus", URL, "--agent", "http://127.0.0.1:9400", "--once")
    assert conflict.exit_code == 2 and "drop --agent" in conflict.output
    assert top("--namespace", "ml", "--once").exit_code == 2
