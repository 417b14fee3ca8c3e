"""Large and hostile policy files cost bounded memory and never a traceback (issue 20, item 6).

A 1 MiB file of ~11.5k bad rules took the agent from 34 to 165 MiB: every rule's YAML node
tree was alive at once (composed whole, then kept by the constructor's cache) and every one
of ~23k problems was kept. Now rules are parsed one at a time as they are composed and at
most MAX_KEPT_ISSUES problems are kept (the rest counted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from gpuwatch.cli.policy import policy
from gpuwatch.policy.loader import MAX_KEPT_ISSUES, check_policy_text, total_problems

GOOD_RULE = "  - {name: r%d, match: {namespace: ns%d}, limits: {gpu_memory: 1Gi}, actions: [{do: alert}]}"
BAD_RULE = "  - {name: r%d, match: {namespace: ns%d}, limits: {gpu_memory: lots%d}, action: zap}"

MEASURE = """
import sys
from gpuwatch.core.errors import PolicyError
from gpuwatch.policy.loader import load_policy
def rss(key):  # VmHWM: the peak of this program (ru_maxrss would carry pytest's over the exec)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) // 1024
before = rss("VmRSS")
try:
    load_policy(sys.argv[1])
    print("loaded")
except PolicyError as err:
    print(str(err).splitlines()[0], str(err).splitlines()[-1])
print(before, rss("VmHWM"))
"""


def big_policy(path: Path, rule: str) -> Path:
    lines, size, i = ["version: 1", "rules:"], 0, 0
    while size < (1 << 20) - 200:
        line = rule % ((i,) * rule.count("%d"))
        lines.append(line)
        size, i = size + len(line) + 1, i + 1
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_1mib_policy_of_bad_rules_stays_small(tmp_path: Path) -> None:
    path = big_policy(tmp_path / "bad.yaml", BAD_RULE)
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, check=True,
                         timeout=120).stdout.splitlines()
    before, peak = map(int, out[-1].split())
    assert out[0].startswith("23016 problem(s)") and "more" in out[0], out  # all counted, the first listed
    # was +106 MiB (peak 121 MiB for the loader alone); the agent's budget is 60 MiB at ~34 MiB idle
    assert peak - before < 12, (before, peak)


def test_issues_are_capped_and_counted() -> None:
    text = "rules:\n" + "\n".join(BAD_RULE % (i, i, i) for i in range(300)) + "\n"
    policy_, issues = check_policy_text(text, "p.yaml")
    assert policy_ is None and len(issues) == MAX_KEPT_ISSUES + 1
    assert issues[-1].more == total_problems(issues) - MAX_KEPT_ISSUES and total_problems(issues) == 600
    text = "rules:\n" + "\n".join(GOOD_RULE % (i, i) for i in range(300)) + "\n"
    policy_, issues = check_policy_text(text, "p.yaml")
    assert issues == [] and policy_ is not None and len(policy_.rules) == 300
    assert [r.line for r in policy_.rules[:2]] == [2, 3]


def test_deeply_nested_yaml_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    for text in ("a: " + "[" * 20000 + "]" * 20000 + "\n",
                 "rules:\n  - name: x\n    match: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"):
        path = tmp_path / "nested.yaml"
        path.write_text(text)
        result = CliRunner().invoke(policy, ["check", str(path)])
        assert result.exit_code == 1, result.output
        assert "nested too deeply" in result.output and "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
