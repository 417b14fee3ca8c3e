"""The architecture as contracts on imports, checked on the code (every import, deferred ones
inside functions included): README.md "Architecture" states the same table.

Floors, from the bottom up (a floor may import those below it, never those above):

* core -- shared ground (model, errors, bounded I/O, annotations, label names, units);
* policy -- pure rules and decisions: core only, and no I/O modules;
* sources -- gpu, probes, containers, signals: core, policy and each other;
* pipeline -- the node pipeline (sampler, attribution): sources, policy, core;
* consumers -- exporter, enforce, tui, extender, cluster: what they read, never the
  sources' machinery, never each other except the cluster client;
* agent -- the one composition root that wires probes, resolver, enforcer and exporter;
* cli -- the commands; sim -- the simulated GPU node, a tool beside the product.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gpuwatch"
SOURCES = {"gpu", "probes", "containers", "signals"}
CONSUMERS = {"exporter", "enforce", "tui", "extender", "cluster"}

ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "policy": {"core"},
    "gpu": {"core"},
    "containers": {"core"},
    "signals": {"core"},
    "probes": {"core", "containers"},
    "pipeline": {"core", "policy"} | SOURCES,
    "cluster": {"core", "policy"},
    "exporter": {"core", "policy", "signals"},
    "enforce": {"core", "policy", "containers.cgroupfs", "containers.cgroup_path"},
    "tui": {"core", "cluster"},
    "extender": {"core", "policy", "cluster"},
    "agent": {"core", "policy", "pipeline", "enforce", "exporter"} | SOURCES,
    "sim": {"core", "containers", "probes"},
    "cli": {"core", "policy", "pipeline", "agent", "sim"} | SOURCES | CONSUMERS,
}
"""Per floor: the packages (or single modules, as `package.module`) it may import. The
package's own modules and the version string are always allowed."""

IO_MODULES = {"os", "io", "subprocess", "socket", "shutil", "threading", "ctypes", "urllib", "http", "time",
              "tempfile", "select", "fcntl", "mmap"}
POLICY_FILE_READERS = {"loader.py": {"pathlib"}}
"""The policy floor does no I/O; its loader names the one file it is asked to read (a Path,
read through core.safeio)."""


def modules() -> Iterator[tuple[Path, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        floor = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else "(root)"
        yield path, floor


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every import in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from gpuwatch.x import y` names module x.y where y is one
                full = f"{node.module}.{alias.name}"
                yield node.lineno, full if is_module(full) else node.module


def is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if name.startswith("gpuwatch.") else None
    return rel is not None and ((PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists())


def gpuwatch_target(name: str) -> tuple[str, str] | None:
    """`gpuwatch.enforce.audit` -> ("enforce", "enforce.audit"); None for other modules and the
    package itself (`from gpuwatch import __version__`)."""
    parts = name.split(".")
    if parts[0] != "gpuwatch" or len(parts) < 2 or parts[1].startswith("__"):
        return None
    return parts[1], ".".join(parts[1:3])


def allowed(floor: str, target: tuple[str, str]) -> bool:
    package, module = target
    rules = ALLOWED[floor]
    return package == floor or package in rules or module in rules


def test_every_floor_has_a_contract() -> None:
    floors = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert floors == set(ALLOWED), "a new package needs its line in ALLOWED (and in README's Architecture)"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == [], f"modules belong in a floor, not at the package root: {loose}"


def test_every_directory_of_modules_is_a_package() -> None:
    missing = sorted(str(d.relative_to(PACKAGE)) for d in {p.parent for p in PACKAGE.rglob("*.py")}
                     if not (d / "__init__.py").exists())
    assert missing == []


def test_imports_keep_to_the_floors() -> None:
    broken = []
    for path, floor in modules():
        if floor == "(root)":
            continue
        for line, name in imports(path):
            target = gpuwatch_target(name)
            if target is not None and not allowed(floor, target):
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({floor}) imports gpuwatch.{target[1]}")
    assert broken == [], "\n".join(broken)


def test_policy_does_no_io() -> None:
    broken = []
    for path in sorted((PACKAGE / "policy").glob("*.py")):
        permitted = POLICY_FILE_READERS.get(path.name, set())
        for line, name in imports(path):
            top = name.split(".")[0]
            if (top in IO_MODULES or top == "pathlib") and top not in permitted:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert broken == [], "\n".join(broken)


def test_one_composition_root() -> None:
    """Only the agent (and the CLI that starts it) imports the agent; nothing but the CLI
    imports the CLI or the simulator."""
    broken = []
    for path, floor in modules():
        for line, name in imports(path):
            target = gpuwatch_target(name)
            if target is None or target[0] == floor:
                continue
            wires = target[0] == "agent" and floor != "cli"
            tools = target[0] in ("cli", "sim") and floor not in ("cli", "(root)")
            if wires or tools:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({floor}) imports gpuwatch.{target[1]}")
    assert broken == [], "\n".join(broken)


@pytest.mark.parametrize("floor", sorted(SOURCES))
def test_sources_never_import_consumers(floor: str) -> None:
    """Spelled out for the rule a reader looks for first (ALLOWED already implies it)."""
    bad = [f"{path.name}:{line} {name}" for path, f in modules() if f == floor for line, name in imports(path)
           if (t := gpuwatch_target(name)) is not None and t[0] in CONSUMERS | {"pipeline", "agent", "cli", "sim"}]
    assert bad == []


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The contracts can fail: a source importing a consumer, a deferred import included."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from gpuwatch.enforce.enforcer import Enforcer\n    return Enforcer\n")
    targets = [t for _, name in imports(bad) if (t := gpuwatch_target(name)) is not None]
    assert ("enforce", "enforce.enforcer") in targets
    assert not allowed("probes", ("enforce", "enforce.enforcer"))
    assert allowed("enforce", ("containers", "containers.cgroupfs"))
    assert not allowed("enforce", ("containers", "containers.resolver"))
