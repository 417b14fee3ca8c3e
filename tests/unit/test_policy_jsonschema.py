"""The published policy JSON Schema is the loader's model: generated from its key tuples,
equal to the committed file, accepting every policy the loader accepts and refusing the
shapes and names it refuses; the loader keeps its own line-numbered messages."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from gpuwatch.cli.policy import policy
from gpuwatch.policy.jsonschema import FIELD_TYPES, LOADER_KEYS, policy_json_schema, render_schema
from gpuwatch.policy.loader import check_policy_text

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "gpuwatch" / "policy" / "policy.schema.json"
CASES = Path(__file__).parent / "policy_cases"
VALID_POLICIES = [*sorted((ROOT / "deploy" / "policies").glob("*.yaml")),
                  *sorted(CASES.glob("good_*.yaml"))]


class Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2's booleans (true/false only), as editors' yaml-language-server reads a file:
    the ladder key `on` stays the string "on" (YAML 1.1 would make it True)."""


Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def _load(text: str) -> Any:
    return yaml.load(text, Loader=Yaml12Loader)  # a SafeLoader subclass


def _validator() -> jsonschema.protocols.Validator:
    schema = policy_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_published_file_is_the_generated_schema() -> None:
    assert PUBLISHED.read_text() == render_schema(), (
        "gpuwatch/policy/policy.schema.json is out of date: run "
        "`gpuwatch policy schema > gpuwatch/policy/policy.schema.json`")


def test_cli_prints_the_schema() -> None:
    result = CliRunner().invoke(policy, ["schema"])
    assert result.exit_code == 0 and result.output == render_schema()


def test_every_loader_key_has_a_shape_and_nothing_else() -> None:
    for section, keys in LOADER_KEYS.items():
        assert set(FIELD_TYPES[section]) == set(keys), section
    schema = policy_json_schema()
    assert list(schema["properties"]) == list(LOADER_KEYS["top"])
    for section in set(LOADER_KEYS) - {"top"}:
        assert list(schema["$defs"][section]["properties"]) == list(LOADER_KEYS[section])
        assert schema["$defs"][section]["additionalProperties"] is False


@pytest.mark.parametrize("path", VALID_POLICIES, ids=lambda p: p.name)
def test_policies_the_loader_accepts_validate(path: Path) -> None:
    text = path.read_text()
    loaded, issues = check_policy_text(text, path.name)
    assert loaded is not None, issues
    errors = [e.message for e in _validator().iter_errors(_load(text))]
    assert not errors, errors


def test_configmap_policy_validates() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "base" / "policy-configmap.yaml").read_text())
    _validator().validate(_load(doc["data"]["policy.yaml"]))


BAD: list[tuple[str, dict[str, Any]]] = [
    ("unknown top key", {"rules": [{"name": "a", "match": {"default": True}}], "rulez": []}),
    ("no rules", {"version": 1}),
    ("rule without match", {"rules": [{"name": "a"}]}),
    ("unknown action", {"rules": [{"name": "a", "match": {"default": True}, "limits": {"gpu_memory": "1GiB"},
                                   "actions": [{"do": "explode"}]}]}),
    ("bad size unit", {"rules": [{"name": "a", "match": {"namespace": "x"}, "limits": {"gpu_memory": "8GB2"}}]}),
    ("bad duration", {"rules": [{"name": "a", "match": {"namespace": "x"},
                                 "limits": {"gpu_time_share": "50%", "window": "10 parsecs"}}]}),
    ("signal on alert", {"rules": [{"name": "a", "match": {"namespace": "x"}, "limits": {"gpu_memory": "1GiB"},
                                    "actions": [{"do": "alert", "signal": "SIGUSR1"}]}]}),
    ("quota with devices", {"rules": [{"name": "a", "match": {"default": True}}],
                            "namespace_quotas": [{"namespace": "x", "limits": {"devices": [0]}}]}),
    ("version 2", {"version": 2, "rules": [{"name": "a", "match": {"default": True}}]}),
    ("deadlock alert", {"deadlock": {"action": "alert"}, "rules": [{"name": "a", "match": {"default": True}}]}),
]


@pytest.mark.parametrize(("why", "doc"), BAD, ids=[b[0] for b in BAD])
def test_schema_refuses_what_the_loader_refuses(why: str, doc: dict[str, Any]) -> None:
    assert list(_validator().iter_errors(doc)), why
    loaded, issues = check_policy_text(yaml.safe_dump(doc), "p.yaml")
    assert loaded is None and issues, why
    assert all(str(i).startswith("p.yaml:") and "; fix: " in str(i) for i in issues)  # line-numbered, with a fix
