"""Policy loading: every bad file in policy_cases/ gives its precise error (line + text),
all errors are collected, and good files load into the expected model."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from gpuwatch.core.errors import PolicyError
from gpuwatch.core.units import parse_duration_s, parse_ratio, parse_size
from gpuwatch.policy.loader import check_policy_text, load_policy
from gpuwatch.policy.rules import ActionKind, LimitKind

CASES = Path(__file__).parent / "policy_cases"
REPO = Path(__file__).resolve().parents[2]
BAD_FILES = sorted(CASES.glob("bad_*.yaml"))
EXPECT = re.compile(r"^# expect: (\d+): (.+)$")


def expectations(path: Path) -> list[tuple[int, str]]:
    found = [EXPECT.match(line) for line in path.read_text().splitlines()]
    return [(int(m.group(1)), m.group(2)) for m in found if m]


def test_there_are_at_least_20_bad_files() -> None:
    assert len(BAD_FILES) >= 20
    assert all(expectations(p) for p in BAD_FILES), "every bad file declares `# expect: LINE: text`"


@pytest.mark.parametrize("path", BAD_FILES, ids=lambda p: p.stem)
def test_bad_policy_reports_precise_error(path: Path) -> None:
    policy, issues = check_policy_text(path.read_text(), str(path))
    assert policy is None
    rendered = [str(i) for i in issues]
    for line, text in expectations(path):
        hits = [r for r in rendered if r.startswith(f"{path}:{line}: ") and text in r]
        assert hits, f"expected line {line}: {text!r}; got:\n" + "\n".join(rendered)
    assert all("; fix: " in r for r in rendered), rendered


@pytest.mark.parametrize("path", BAD_FILES, ids=lambda p: p.stem)
def test_load_policy_raises_with_every_issue(path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    for line, text in expectations(path):
        assert f"{path}:{line}: " in info.value.message and text in info.value.message


def test_all_errors_are_collected_not_only_the_first() -> None:
    path = CASES / "bad_31_many_errors.yaml"
    _, issues = check_policy_text(path.read_text(), str(path))
    assert [i.line for i in issues] == [7, 9, 10]


def test_missing_file_is_a_policy_error_with_fix(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "nope.yaml")
    assert "cannot read policy file" in str(info.value) and info.value.fix


def test_example_policy_loads() -> None:
    policy = load_policy(REPO / "deploy/policies/example.yaml")
    names = [r.name for r in policy.rules]
    assert names == ["inference-critical", "training", "everyone-else"]
    training = policy.rules[1]
    assert training.priority == 10
    assert training.limits.gpu_memory is not None and training.limits.gpu_memory.bytes == 8 * 2**30
    assert training.limits.gpu_time_share == 0.5
    assert training.limits.devices == (0, 1)
    assert [s.kind for s in training.actions] == [
        ActionKind.ALERT,
        ActionKind.THROTTLE,
        ActionKind.CHECKPOINT_KILL,
    ]
    assert training.actions[1].on == (LimitKind.GPU_TIME,)
    assert training.actions[2].for_s == 60.0 and training.actions[2].signal == signal.SIGUSR1
    assert policy.protected_namespaces == ("kube-system", "gpu-operator")
    assert policy.namespace_quotas[0].limits.gpu_time_share == 1.5
    assert policy.fair_share.enabled


@pytest.mark.parametrize("path", sorted((REPO / "deploy/policies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_policy_is_valid(path: Path) -> None:
    _, issues = check_policy_text(path.read_text(), str(path))
    assert issues == []


def test_defaults_when_sections_are_absent() -> None:
    policy, issues = check_policy_text(
        "rules:\n  - name: a\n    match: {namespace: x}\n    limits: {gpu_memory: 1GiB}\n"
    )
    assert issues == [] and policy is not None
    assert policy.protected_namespaces == ("kube-system",)
    assert [s.kind for s in policy.rules[0].actions] == [ActionKind.ALERT]


def test_rule_without_limits_is_an_exemption() -> None:
    policy, issues = check_policy_text("rules:\n  - name: exempt\n    match: {namespace: x}\n")
    assert issues == [] and policy is not None and policy.rules[0].actions == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        ("2GB", 2 * 10**9),
        (1000, 1000),
        ("1000", 1000),
    ],
)
def test_parse_size_bytes(text: object, expected: int) -> None:
    assert parse_size(text).bytes == expected


def test_parse_size_percent_resolves_against_device() -> None:
    amount = parse_size("50%")
    assert amount.bytes is None and amount.resolve_bytes(16 * 2**30) == 8 * 2**30
    assert amount.resolve_bytes(None) is None


@pytest.mark.parametrize(
    ("text", "seconds"), [("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0), (5, 5.0), ("7", 7.0)]
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("bad", ["-1s", "ten", True, [1], "5 parsecs"])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration_s(bad)


@pytest.mark.parametrize(("text", "ratio"), [("90%", 0.9), (0.25, 0.25), ("150%", 1.5)])
def test_parse_ratio(text: object, ratio: float) -> None:
    assert parse_ratio(text) == pytest.approx(ratio)


@pytest.mark.parametrize("bad", ["0%", -0.5, "abc", "2000%"])
def test_parse_ratio_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_ratio(bad)
