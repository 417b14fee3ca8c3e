"""`gpuwatch policy check|explain` through the real CLI entry point."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from gpuwatch.cli.main import cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "deploy/policies/example.yaml")
MANY = str(Path(__file__).parent / "policy_cases/bad_31_many_errors.yaml")


def test_check_ok() -> None:
    result = CliRunner().invoke(cli, ["policy", "check", EXAMPLE])
    assert result.exit_code == 0 and "OK — 3 rule(s)" in result.output


def test_check_lists_every_error_and_exits_1() -> None:
    result = CliRunner().invoke(cli, ["policy", "check", MANY])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.startswith(MANY + ":")]
    assert [line.split(":")[1] for line in lines[:3]] == ["7", "9", "10"]
    assert all("; fix: " in line for line in lines[:3])
    assert "3 problem(s)" in result.output


def test_check_missing_file() -> None:
    result = CliRunner().invoke(cli, ["policy", "check", "/nonexistent/policy.yaml"])
    assert result.exit_code == 1 and "cannot read" in result.output


def test_explain_first_match_and_reasons() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "policy",
            "explain",
            EXAMPLE,
            "--namespace",
            "serving",
            "--pod",
            "web",
            "--container",
            "api",
            "--label",
            "tier=critical",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "rule 'inference-critical' (line 22): MATCHES" in result.output
    assert "label tier = 'critical' matches 'critical'" in result.output
    assert "=> rule 'inference-critical' applies" in result.output
    assert "step 0: alert at 90%" in result.output


def test_explain_falls_through_to_default() -> None:
    result = CliRunner().invoke(cli, ["policy", "explain", EXAMPLE, "--namespace", "web", "--container", "x"])
    assert "namespace 'web' does not match 'ml-*'" in result.output
    assert "=> rule 'everyone-else' applies" in result.output


def test_explain_protected_namespace() -> None:
    result = CliRunner().invoke(
        cli, ["policy", "explain", EXAMPLE, "--namespace", "kube-system", "--container", "coredns"]
    )
    assert "is protected" in result.output and "=> no rule applies" in result.output


def test_explain_bad_label_syntax() -> None:
    result = CliRunner().invoke(cli, ["policy", "explain", EXAMPLE, "--label", "novalue"])
    assert result.exit_code == 2 and "KEY=VALUE" in result.output


def test_explain_invalid_policy_is_one_line_error() -> None:
    result = CliRunner().invoke(cli, ["policy", "explain", MANY, "--container", "x"])
    assert result.exit_code == 1 and "3 problem(s)" in result.output
