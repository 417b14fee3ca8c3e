"""Load and validate a policy file, keeping YAML line numbers for every error.

The file is composed (not just parsed) with PyYAML so every node keeps its `start_mark`;
validation walks the nodes and records *every* problem as `FILE:LINE: what; fix: how`
instead of stopping at the first. `load_policy()` raises one PolicyError listing all of
them; `check_policy_text()` returns them for `gpuwatch policy check`. The file itself is
read by `read_policy_text()`: resolved only below its own directory (a symlink to /etc/shadow
is refused unread; a ConfigMap's ..data link works), regular files only, at most 1 MiB, never
blocking (a FIFO, /dev/zero behind a symlink or a directory is refused with a clear error).
"""

from __future__ import annotations

import difflib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import TypeVar

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gpuwatch.core.errors import PolicyError
from gpuwatch.core.safeio import RefusedFile, read_file_beneath
from gpuwatch.core.units import (
    DURATION_FORM,
    RATIO_FORM,
    SIZE_FORM,
    MemoryAmount,
    parse_duration_s,
    parse_ratio,
    parse_size,
)
from gpuwatch.policy.rules import (
    DEFAULT_PROTECTED_NAMESPACES,
    ActionKind,
    ActionStep,
    AdmissionOrder,
    DeadlockSettings,
    ElasticDivide,
    ElasticSettings,
    ElasticThrottle,
    FairShareSettings,
    FairShareSplit,
    LimitKind,
    Limits,
    NamespaceQuota,
    Policy,
    ReschedulingSettings,
    Rule,
    Selector,
    Tuning,
)

T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)

TOP_KEYS = (
    "version",
    "protected_namespaces",
    "tuning",
    "deadlock",
    "fair_share",
    "rescheduling",
    "elastic",
    "rules",
    "namespace_quotas",
)
RULE_KEYS = ("name", "priority", "match", "limits", "actions")
MATCH_KEYS = ("namespace", "pod", "container", "container_id", "cgroup", "labels", "default")
LIMIT_KEYS = ("gpu_memory", "gpu_time_share", "window", "devices", "max_processes")
QUOTA_KEYS = ("namespace", "limits", "actions")
QUOTA_LIMIT_KEYS = ("gpu_memory", "gpu_time_share", "window", "max_processes")
STEP_KEYS = ("do", "at", "for", "on", "signal", "grace", "share", "repeat")
TUNING_KEYS = ("hysteresis", "release_after", "min_hold", "max_actions_per_minute")
DEADLOCK_KEYS = ("enabled", "action", "grace", "signal", "blocked_window")
FAIR_SHARE_KEYS = ("enabled", "split")
RESCHEDULING_KEYS = ("checkpoint_after", "signal", "grace", "gate_new", "demand_from_limit", "order", "headroom")
ELASTIC_KEYS = ("enabled", "window", "floor", "hysteresis", "min_dwell", "plateau", "min_gpu_time", "period",
                "contended", "throttle", "divide", "checkpoint_plateaued")
STEP_ONLY_FOR = {
    "signal": ActionKind.CHECKPOINT_KILL,
    "grace": ActionKind.CHECKPOINT_KILL,
    "share": ActionKind.THROTTLE,
    "repeat": ActionKind.ALERT,
}
MAX_GPU_SHARE = 64.0


@dataclass(frozen=True)
class PolicyIssue:
    """One problem in a policy file, with the 1-based line it is on."""

    file: str
    line: int
    message: str
    fix: str
    more: int = 0  # > 0 only on the closing "N more problem(s)" entry of a capped list

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}; fix: {self.fix}"


MAX_KEPT_ISSUES = 100
"""At most this many problems are kept per check (the rest are only counted): a 1 MiB file of
bad rules must not cost the agent tens of MiB of messages nobody reads."""


def total_problems(issues: list[PolicyIssue]) -> int:
    """How many problems a (possibly capped) issue list stands for."""
    return sum(i.more if i.more else 1 for i in issues)


class _Reader:
    """Walks composed YAML nodes; records issues; returns None for an invalid piece."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.issues: list[PolicyIssue] = []
        self.dropped = 0  # problems found after MAX_KEPT_ISSUES were kept
        self._constructor = SafeConstructor()

    def issue(self, node: Node | None, message: str, fix: str) -> None:
        if len(self.issues) >= MAX_KEPT_ISSUES:
            self.dropped += 1
            return
        line = node.start_mark.line + 1 if node is not None else 1
        self.issues.append(PolicyIssue(self.file, line, message, fix))

    def result(self) -> list[PolicyIssue]:
        """The kept issues by line, and one closing entry counting the dropped ones."""
        issues = sorted(self.issues, key=lambda i: i.line)
        if self.dropped:
            issues.append(PolicyIssue(self.file, issues[-1].line if issues else 1,
                                      f"{self.dropped} more problem(s) not listed (only the first "
                                      f"{MAX_KEPT_ISSUES} are kept)", "fix the ones above and check again",
                                      more=self.dropped))
        return issues

    def scalar(self, node: Node) -> object:
        try:
            return self._constructor.construct_object(node, deep=True)
        finally:  # its node -> object cache would keep every node of the file alive
            self._constructor.constructed_objects.clear()
            self._constructor.recursive_objects.clear()

    def mapping(self, node: Node, what: str, allowed: tuple[str, ...]) -> dict[str, tuple[Node, Node]] | None:
        """Key -> (key node, value node); flags non-mappings, duplicate and unknown keys."""
        if not isinstance(node, MappingNode):
            self.issue(
                node,
                f"{what} must be a mapping (key: value lines), got {_kind(node)}",
                f"write {what} as `key: value` entries; allowed keys: {', '.join(allowed)}",
            )
            return None
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            # Raw text, not the resolved value: YAML 1.1 would turn a key like `on` into True.
            key = key_node.value if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                self.issue(key_node, f"{what}: keys must be strings", f"use one of: {', '.join(allowed)}")
                continue
            if key in out:
                first = out[key][0].start_mark.line + 1
                self.issue(
                    key_node,
                    f"{what}: duplicate key {key!r} (first on line {first})",
                    "keep one of the two entries",
                )
                continue
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
                self.issue(key_node, f"{what}: unknown key {key!r}", hint)
                continue
            out[key] = (key_node, value_node)
        return out

    def sequence(self, node: Node, what: str, example: str) -> list[Node] | None:
        if not isinstance(node, SequenceNode):
            self.issue(node, f"{what} must be a list, got {_kind(node)}", f"write it as a list, e.g. {example}")
            return None
        return list(node.value)

    def string(self, node: Node, what: str) -> str | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, str) or not value.strip():
            self.issue(
                node,
                f"{what} must be a non-empty string, got {_describe(self, node)}",
                f'quote it, e.g. {what.split()[-1]}: "name"',
            )
            return None
        return value

    def boolean(self, node: Node, what: str) -> bool | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, bool):
            self.issue(node, f"{what} must be true or false, got {_describe(self, node)}", "write true or false")
            return None
        return value

    def choice(self, node: Node, what: str, kind: type[E], noun: str, fix: str) -> E | None:
        """One of the string enum `kind`'s values, or None with "<what>: unknown <noun> ..."."""
        raw = self.scalar(node) if isinstance(node, ScalarNode) else None
        try:
            return kind(str(raw))
        except ValueError:
            self.issue(node, f"{what}: unknown {noun} {raw!r}", fix)
            return None

    def integer(self, node: Node, what: str, minimum: int) -> int | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.issue(
                node,
                f"{what} must be an integer >= {minimum}, got {_describe(self, node)}",
                f"write a whole number >= {minimum}",
            )
            return None
        return value

    def parsed(self, node: Node, what: str, parse: Callable[[object], T], form: str) -> T | None:
        if not isinstance(node, ScalarNode):
            self.issue(node, f"{what} must be a single value, got {_kind(node)}", f"write {form}")
            return None
        try:
            return parse(self.scalar(node))
        except ValueError as err:
            self.issue(node, f"{what}: {err}", f"write {form}")
            return None


def _kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return "a scalar"


def _describe(reader: _Reader, node: Node) -> str:
    if isinstance(node, ScalarNode):
        return repr(reader.scalar(node))
    return _kind(node)


def _parse_signal(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value in {int(s) for s in signal.Signals}:
            return value
        raise ValueError(f"{value} is not a signal number on this system")
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
        try:
            return int(signal.Signals[name])
        except KeyError:
            pass
    raise ValueError(f"unknown signal {value!r}")


def _parse_devices(reader: _Reader, node: Node, what: str) -> tuple[int, ...] | None:
    items = reader.sequence(node, what, "[0, 1]")
    if items is None:
        return None
    out: list[int] = []
    for item in items:
        index = reader.integer(item, f"{what} entry (a GPU index)", 0)
        if index is not None:
            out.append(index)
    return tuple(out) if len(out) == len(items) else None


def _parse_limits(
    reader: _Reader, node: Node, what: str, allowed: tuple[str, ...], absolute_memory_only: bool
) -> Limits | None:
    keys = reader.mapping(node, what, allowed)
    if keys is None:
        return None
    ok = True
    memory: MemoryAmount | None = None
    share: float | None = None
    window_s = 30.0
    devices: tuple[int, ...] | None = None
    max_processes: int | None = None
    if "gpu_memory" in keys:
        memory = reader.parsed(keys["gpu_memory"][1], f"{what}.gpu_memory", parse_size, SIZE_FORM)
        ok &= memory is not None
        if memory is not None and absolute_memory_only and memory.bytes is None:
            reader.issue(
                keys["gpu_memory"][1],
                f"{what}.gpu_memory: a namespace quota cannot be a "
                "percentage (its containers may sit on different GPUs)",
                'write bytes, e.g. "16GiB"',
            )
            ok = False
    if "gpu_time_share" in keys:
        share = reader.parsed(
            keys["gpu_time_share"][1],
            f"{what}.gpu_time_share",
            lambda v: parse_ratio(v, maximum=MAX_GPU_SHARE),
            RATIO_FORM + " of one GPU",
        )
        ok &= share is not None
    if "window" in keys:
        window = reader.parsed(keys["window"][1], f"{what}.window", parse_duration_s, DURATION_FORM)
        if window is not None and window < 1.0:
            reader.issue(
                keys["window"][1],
                f"{what}.window must be at least 1s, got {window:g}s",
                'use a window of a few sampling intervals, e.g. "30s"',
            )
            window = None
        ok &= window is not None
        window_s = window if window is not None else window_s
        if share is None and "gpu_time_share" not in keys:
            reader.issue(
                keys["window"][0],
                f"{what}.window has no effect without gpu_time_share",
                "add gpu_time_share or remove window",
            )
            ok = False
    if "devices" in keys:
        devices = _parse_devices(reader, keys["devices"][1], f"{what}.devices")
        ok &= devices is not None
    if "max_processes" in keys:
        max_processes = reader.integer(keys["max_processes"][1], f"{what}.max_processes", 1)
        ok &= max_processes is not None
    if not ok:
        return None
    return Limits(
        gpu_memory=memory,
        gpu_time_share=share,
        window_s=window_s,
        devices=devices,
        max_processes=max_processes,
    )


def _parse_step(reader: _Reader, node: Node, what: str, limits: Limits | None) -> ActionStep | None:
    keys = reader.mapping(node, what, STEP_KEYS)
    if keys is None:
        return None
    ok = True
    if "do" not in keys:
        reader.issue(node, f"{what} has no `do`", f"add `do:` with one of: {', '.join(k.value for k in ActionKind)}")
        return None
    do_node = keys["do"][1]
    do_value = reader.scalar(do_node) if isinstance(do_node, ScalarNode) else None
    try:
        kind = ActionKind(str(do_value))
    except ValueError:
        close = difflib.get_close_matches(str(do_value), [k.value for k in ActionKind], n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(k.value for k in ActionKind)}"
        reader.issue(do_node, f"{what}.do: unknown action {do_value!r}", hint)
        return None
    step: dict[str, object] = {}
    if "at" in keys:
        at = reader.parsed(keys["at"][1], f"{what}.at", lambda v: parse_ratio(v, maximum=10.0), RATIO_FORM)
        ok &= at is not None
        step["at_ratio"] = at
    if "for" in keys:
        for_s = reader.parsed(keys["for"][1], f"{what}.for", parse_duration_s, DURATION_FORM)
        ok &= for_s is not None
        step["for_s"] = for_s
    for key, only in STEP_ONLY_FOR.items():
        if key in keys and kind is not only:
            reader.issue(
                keys[key][0],
                f"{what}: `{key}` only applies to `do: {only.value}`, not {kind.value}",
                f"remove `{key}` from this step",
            )
            ok = False
    if "signal" in keys and kind is ActionKind.CHECKPOINT_KILL:
        sig = reader.parsed(keys["signal"][1], f"{what}.signal", _parse_signal, "a signal name like SIGUSR1 or SIGTERM")
        ok &= sig is not None
        step["signal"] = sig
    if "grace" in keys and kind is ActionKind.CHECKPOINT_KILL:
        grace = reader.parsed(keys["grace"][1], f"{what}.grace", parse_duration_s, DURATION_FORM)
        ok &= grace is not None
        step["grace_s"] = grace
    if "share" in keys and kind is ActionKind.THROTTLE:
        share = reader.parsed(
            keys["share"][1],
            f"{what}.share",
            lambda v: parse_ratio(v, maximum=1.0),
            RATIO_FORM + " (at most 100% of one GPU)",
        )
        ok &= share is not None
        step["share"] = share
    if "repeat" in keys and kind is ActionKind.ALERT:
        repeat = reader.parsed(keys["repeat"][1], f"{what}.repeat", parse_duration_s, DURATION_FORM)
        ok &= repeat is not None
        step["repeat_s"] = repeat
    on: tuple[LimitKind, ...] = ()
    if "on" in keys:
        on_node = keys["on"][1]
        names = [on_node] if isinstance(on_node, ScalarNode) else reader.sequence(on_node, f"{what}.on", "[gpu_memory]")
        parsed_on: list[LimitKind] = []
        for name_node in names or []:
            name = reader.scalar(name_node) if isinstance(name_node, ScalarNode) else None
            try:
                limit_kind = LimitKind(str(name))
            except ValueError:
                reader.issue(
                    name_node,
                    f"{what}.on: unknown limit {name!r}",
                    f"use one of: {', '.join(k.value for k in LimitKind)}",
                )
                ok = False
                continue
            if limits is not None and limit_kind not in limits.kinds():
                reader.issue(
                    name_node,
                    f"{what}.on: {limit_kind.value} is watched but the rule sets no such limit",
                    f"add limits.{limit_kind.value} or remove it from `on`",
                )
                ok = False
            parsed_on.append(limit_kind)
        on = tuple(parsed_on)
        ok &= names is not None
    if kind is ActionKind.THROTTLE and limits is not None:
        if "share" not in step and limits.gpu_time_share is None:
            reader.issue(
                do_node,
                f"{what}: throttle needs a target share but the rule has no gpu_time_share",
                'add limits.gpu_time_share (e.g. "50%") or `share:` on this step',
            )
            ok = False
        if on and LimitKind.GPU_TIME not in on:
            reader.issue(
                do_node,
                f"{what}: throttle cannot bring down {', '.join(k.value for k in on)}",
                "throttle on gpu_time_share, or use pause/checkpoint-then-kill for memory",
            )
            ok = False
    if not ok:
        return None
    return ActionStep(kind=kind, on=on, line=node.start_mark.line + 1, **step)  # type: ignore[arg-type]


def _parse_ladder(reader: _Reader, node: Node, what: str, limits: Limits | None) -> tuple[ActionStep, ...] | None:
    items = reader.sequence(node, what, "[{do: alert, at: 90%}, {do: kill, at: 100%, for: 60s}]")
    if items is None:
        return None
    if not items:
        reader.issue(node, f"{what} is empty", "add at least one step, e.g. `- {do: alert, at: 100%}`")
        return None
    steps: list[ActionStep] = []
    ok = True
    for index, item in enumerate(items):
        step = _parse_step(reader, item, f"{what}[{index}]", limits)
        if step is None:
            ok = False
            continue
        if steps:
            prev = steps[-1]
            if prev.kind.terminal:
                reader.issue(
                    item,
                    f"{what}[{index}] can never run: the step before it ({prev.kind.value}) ends the container",
                    "remove it or move it before the kill step",
                )
                ok = False
            elif (
                step.at_ratio < prev.at_ratio
                or step.for_s < prev.for_s
                or (step.at_ratio == prev.at_ratio and step.for_s == prev.for_s)
            ):
                reader.issue(
                    item,
                    f"{what}[{index}] ({step.kind.value} at {step.at_ratio:.0%} for {step.for_s:g}s) "
                    f"does not come after the step before it ({prev.kind.value} at {prev.at_ratio:.0%} "
                    f"for {prev.for_s:g}s)",
                    "order the ladder so each step has a higher `at` or a longer `for` than the one before",
                )
                ok = False
        steps.append(step)
    return tuple(steps) if ok else None


def _parse_selector(reader: _Reader, node: Node, what: str) -> Selector | None:
    keys = reader.mapping(node, what, MATCH_KEYS)
    if keys is None:
        return None
    if not keys and isinstance(node, MappingNode) and not node.value:
        reader.issue(
            node,
            f"{what} is empty",
            "add a selector (namespace, pod, container, labels, cgroup) or `default: true`",
        )
        return None
    ok = True
    values: dict[str, object] = {}
    for key in ("namespace", "pod", "container", "container_id", "cgroup"):
        if key in keys:
            text = reader.string(keys[key][1], f"{what}.{key}")
            ok &= text is not None
            values[key] = text
    if "labels" in keys:
        label_keys = reader.mapping(keys["labels"][1], f"{what}.labels", tuple(_label_keys(reader, keys["labels"][1])))
        labels: list[tuple[str, str]] = []
        for label, (_, value_node) in (label_keys or {}).items():
            value = reader.scalar(value_node) if isinstance(value_node, ScalarNode) else None
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                reader.issue(
                    value_node,
                    f"{what}.labels.{label} must be a string, got {_describe(reader, value_node)}",
                    f'quote it, e.g. {label}: "value"',
                )
                ok = False
                continue
            labels.append((label, str(value)))
        ok &= label_keys is not None
        values["labels"] = tuple(labels)
    if "default" in keys:
        default = reader.boolean(keys["default"][1], f"{what}.default")
        ok &= default is not None
        if default is False:
            reader.issue(
                keys["default"][1],
                f"{what}.default: false has no meaning",
                "remove `default`, or write `default: true` for a catch-all rule",
            )
            ok = False
        elif default and len(keys) > 1:
            reader.issue(
                keys["default"][0],
                f"{what}: `default: true` cannot be combined with other selectors",
                "use a separate catch-all rule with only `default: true`, placed last",
            )
            ok = False
        values["default"] = bool(default)
    if not ok:
        return None
    return Selector(**values)  # type: ignore[arg-type]


def _label_keys(reader: _Reader, node: Node) -> list[str]:
    if not isinstance(node, MappingNode):
        return []
    return [k for k in (reader.scalar(n) for n, _ in node.value if isinstance(n, ScalarNode)) if isinstance(k, str)]


def _parse_rule(reader: _Reader, node: Node, index: int, names: dict[str, int]) -> Rule | None:
    what = f"rules[{index}]"
    keys = reader.mapping(node, what, RULE_KEYS)
    if keys is None:
        return None
    ok = True
    name: str | None = None
    if "name" not in keys:
        reader.issue(node, f"{what} has no name", "add `name: <unique-name>` (it appears in audit records and metrics)")
        ok = False
    else:
        name = reader.string(keys["name"][1], f"{what}.name")
        if name is not None and name in names:
            reader.issue(
                keys["name"][1],
                f"{what}: rule name {name!r} already used on line {names[name]}",
                "give every rule a unique name",
            )
            ok = False
        elif name is not None:
            names[name] = keys["name"][1].start_mark.line + 1
            what = f"rule {name!r}"
        ok &= name is not None
    priority = 0
    if "priority" in keys:
        value = reader.scalar(keys["priority"][1]) if isinstance(keys["priority"][1], ScalarNode) else None
        if isinstance(value, bool) or not isinstance(value, int):
            reader.issue(
                keys["priority"][1],
                f"{what}.priority must be an integer, got {_describe(reader, keys['priority'][1])}",
                "higher = more important, e.g. priority: 10",
            )
            ok = False
        else:
            priority = value
    selector: Selector | None = None
    if "match" not in keys:
        reader.issue(node, f"{what} has no `match`", "add `match:` with selectors, or `match: {default: true}`")
        ok = False
    else:
        selector = _parse_selector(reader, keys["match"][1], f"{what}.match")
        ok &= selector is not None
    limits: Limits | None = Limits()
    if "limits" in keys:
        limits = _parse_limits(reader, keys["limits"][1], f"{what}.limits", LIMIT_KEYS, absolute_memory_only=False)
        ok &= limits is not None
    steps: tuple[ActionStep, ...] | None = (ActionStep(kind=ActionKind.ALERT),)
    if "actions" in keys:
        steps = _parse_ladder(reader, keys["actions"][1], f"{what}.actions", limits)
        ok &= steps is not None
    if limits is not None and not limits.kinds() and "actions" in keys:
        reader.issue(
            keys["actions"][0],
            f"{what} has actions but no limits, so they can never fire",
            "add limits (gpu_memory, gpu_time_share, devices, max_processes) or remove actions "
            "(a rule without limits exempts the containers it matches)",
        )
        ok = False
    if not ok or name is None or selector is None or limits is None or steps is None:
        return None
    if not limits.kinds():
        steps = ()
    return Rule(
        name=name,
        selector=selector,
        limits=limits,
        actions=steps,
        priority=priority,
        line=node.start_mark.line + 1,
    )


def _parse_quota(reader: _Reader, node: Node, index: int) -> NamespaceQuota | None:
    what = f"namespace_quotas[{index}]"
    keys = reader.mapping(node, what, QUOTA_KEYS)
    if keys is None:
        return None
    namespace = None
    if "namespace" not in keys:
        reader.issue(node, f"{what} has no namespace", "add `namespace: <name or glob>`")
    else:
        namespace = reader.string(keys["namespace"][1], f"{what}.namespace")
    limits = None
    if "limits" not in keys:
        reader.issue(node, f"{what} has no limits", "add `limits:` with gpu_memory and/or gpu_time_share")
    else:
        limits = _parse_limits(reader, keys["limits"][1], f"{what}.limits", QUOTA_LIMIT_KEYS, absolute_memory_only=True)
        if limits is not None and not limits.kinds():
            reader.issue(keys["limits"][1], f"{what}.limits is empty", "add gpu_memory and/or gpu_time_share")
            limits = None
    steps: tuple[ActionStep, ...] | None = (ActionStep(kind=ActionKind.ALERT),)
    if "actions" in keys:
        steps = _parse_ladder(reader, keys["actions"][1], f"{what}.actions", limits)
    if namespace is None or limits is None or steps is None:
        return None
    return NamespaceQuota(namespace=namespace, limits=limits, actions=steps, line=node.start_mark.line + 1)


def _parse_tuning(reader: _Reader, node: Node) -> Tuning | None:
    keys = reader.mapping(node, "tuning", TUNING_KEYS)
    if keys is None:
        return None
    values: dict[str, object] = {}
    ok = True
    if "hysteresis" in keys:
        values["hysteresis_ratio"] = reader.parsed(
            keys["hysteresis"][1],
            "tuning.hysteresis",
            lambda v: parse_ratio(v, maximum=0.5),
            RATIO_FORM + " up to 50%",
        )
    for key, field_name in (("release_after", "release_after_s"), ("min_hold", "min_hold_s")):
        if key in keys:
            values[field_name] = reader.parsed(keys[key][1], f"tuning.{key}", parse_duration_s, DURATION_FORM)
    if "max_actions_per_minute" in keys:
        values["max_actions_per_minute"] = reader.integer(
            keys["max_actions_per_minute"][1], "tuning.max_actions_per_minute", 1
        )
    ok = all(v is not None for v in values.values())
    return Tuning(**values) if ok else None  # type: ignore[arg-type]


def _parse_deadlock(reader: _Reader, node: Node) -> DeadlockSettings | None:
    keys = reader.mapping(node, "deadlock", DEADLOCK_KEYS)
    if keys is None:
        return None
    values: dict[str, object] = {}
    if "enabled" in keys:
        values["enabled"] = reader.boolean(keys["enabled"][1], "deadlock.enabled")
    if "action" in keys:
        allowed = (ActionKind.PAUSE, ActionKind.CHECKPOINT_KILL, ActionKind.KILL)
        raw = reader.scalar(keys["action"][1]) if isinstance(keys["action"][1], ScalarNode) else None
        if raw not in {a.value for a in allowed}:
            reader.issue(
                keys["action"][1],
                f"deadlock.action: {raw!r} cannot break a deadlock",
                f"use one of: {', '.join(a.value for a in allowed)}",
            )
            values["action"] = None
        else:
            values["action"] = ActionKind(raw)
    for key, field_name in (("grace", "grace_s"), ("blocked_window", "blocked_window_s")):
        if key in keys:
            values[field_name] = reader.parsed(keys[key][1], f"deadlock.{key}", parse_duration_s, DURATION_FORM)
    if "signal" in keys:
        values["signal"] = reader.parsed(keys["signal"][1], "deadlock.signal", _parse_signal, "a signal name")
    ok = all(v is not None for v in values.values())
    return DeadlockSettings(**values) if ok else None  # type: ignore[arg-type]


def _parse_fair_share(reader: _Reader, node: Node) -> FairShareSettings | None:
    keys = reader.mapping(node, "fair_share", FAIR_SHARE_KEYS)
    if keys is None:
        return None
    values: dict[str, object] = {}
    if "enabled" in keys:
        values["enabled"] = reader.boolean(keys["enabled"][1], "fair_share.enabled")
    if "split" in keys:
        values["split"] = reader.choice(keys["split"][1], "fair_share.split", FairShareSplit, "split",
                                        "use demand (adaptive: weighted by what each container asks for) or equal "
                                        "(static: capacity / containers)")
    ok = all(v is not None for v in values.values())
    return FairShareSettings(**values) if ok else None  # type: ignore[arg-type]


def _parse_rescheduling(reader: _Reader, node: Node) -> ReschedulingSettings | None:
    keys = reader.mapping(node, "rescheduling", RESCHEDULING_KEYS)
    if keys is None:
        return None
    values: dict[str, object] = {}
    ok = True
    if "checkpoint_after" in keys:
        value_node = keys["checkpoint_after"][1]
        if isinstance(value_node, ScalarNode) and reader.scalar(value_node) == "never":
            values["checkpoint_after_s"] = None
        else:
            after = reader.parsed(value_node, "rescheduling.checkpoint_after", parse_duration_s,
                                  DURATION_FORM + ' or "never"')
            if after is not None and after <= 0:
                reader.issue(value_node, "rescheduling.checkpoint_after must be longer than 0s",
                             'write a duration such as "10m", or "never"')
                after = None
            ok &= after is not None
            values["checkpoint_after_s"] = after
    if "grace" in keys:
        values["grace_s"] = reader.parsed(keys["grace"][1], "rescheduling.grace", parse_duration_s, DURATION_FORM)
    if "signal" in keys:
        values["signal"] = reader.parsed(keys["signal"][1], "rescheduling.signal", _parse_signal, "a signal name")
    for key in ("gate_new", "demand_from_limit"):
        if key in keys:
            values[key] = reader.boolean(keys[key][1], f"rescheduling.{key}")
    if "headroom" in keys:
        values["headroom"] = reader.parsed(keys["headroom"][1], "rescheduling.headroom",
                                           partial(parse_ratio, maximum=1.0), RATIO_FORM + " up to 100%")
    if "order" in keys:
        values["order"] = reader.choice(keys["order"][1], "rescheduling.order", AdmissionOrder, "order",
                                        'write "arrival" (first come, first admitted) or "smallest" (smallest '
                                        'demand first)')
    ok &= all(v is not None for k, v in values.items() if k != "checkpoint_after_s")
    return ReschedulingSettings(**values) if ok else None  # type: ignore[arg-type]


def _parse_elastic(reader: _Reader, node: Node) -> ElasticSettings | None:
    keys = reader.mapping(node, "elastic", ELASTIC_KEYS)
    if keys is None:
        return None
    values: dict[str, object] = {}
    if "enabled" in keys:
        values["enabled"] = reader.boolean(keys["enabled"][1], "elastic.enabled")
    durations = (("window", "window_s", 1.0, 3600.0), ("min_dwell", "min_dwell_s", 0.0, 3600.0),
                 ("min_gpu_time", "min_gpu_s", 0.0, 3600.0), ("period", "period_s", 0.02, 10.0))
    for key, field_name, minimum, maximum in durations:
        if key in keys:
            value = reader.parsed(keys[key][1], f"elastic.{key}", parse_duration_s, DURATION_FORM)
            if value is not None and not minimum <= value <= maximum:
                reader.issue(keys[key][1], f"elastic.{key} must be between {minimum:g}s and {maximum:g}s, "
                             f"got {value:g}s", f"e.g. elastic.{key}: {ElasticSettings().__dict__[field_name]:g}s")
                value = None
            values[field_name] = value
    ratios = (("floor", "floor", 0.5), ("hysteresis", "hysteresis", 0.5), ("plateau", "plateau", 1.0),
              ("contended", "contended", 1.0))
    for key, field_name, maximum in ratios:
        if key in keys:
            values[field_name] = reader.parsed(keys[key][1], f"elastic.{key}", partial(parse_ratio, maximum=maximum),
                                               RATIO_FORM + f" up to {maximum:.0%}")
    if "throttle" in keys:
        values["throttle"] = reader.choice(keys["throttle"][1], "elastic.throttle", ElasticThrottle, "value",
                                           'write "all-but-top" (every tenant but the largest share) or "yielding" '
                                           '(only the jobs that yield)')
    if "divide" in keys:
        values["divide"] = reader.choice(keys["divide"][1], "elastic.divide", ElasticDivide, "value",
                                         'write "efficiency" (in proportion to growth efficiency) or "plateau" '
                                         '(only plateaued jobs yield)')
    if "checkpoint_plateaued" in keys:
        values["checkpoint_plateaued"] = reader.boolean(keys["checkpoint_plateaued"][1],
                                                        "elastic.checkpoint_plateaued")
    ok = all(v is not None for v in values.values())
    return ElasticSettings(**values) if ok else None  # type: ignore[arg-type]


class _RulesParser:
    """Parses `rules:` items one at a time as the YAML composer produces them, so that only
    one rule's node tree is alive at a time (a 1 MiB file of 12k rules composed whole is
    ~85 MiB of nodes)."""

    def __init__(self, reader: _Reader) -> None:
        self.reader = reader
        self.rules: list[Rule] = []
        self.count = 0
        self.names: dict[str, int] = {}
        self.seen_default: int | None = None

    def __call__(self, item: Node) -> None:
        rule = _parse_rule(self.reader, item, self.count, self.names)
        self.count += 1
        if rule is None:
            return
        if self.seen_default is not None:
            self.reader.issue(
                item,
                f"rule {rule.name!r} can never match: the catch-all rule on line {self.seen_default} comes first",
                "move the `default: true` rule to the end",
            )
        if rule.selector.default:
            self.seen_default = rule.line
        self.rules.append(rule)


class _StreamingLoader(yaml.SafeLoader):
    """SafeLoader whose top-level `rules:` sequence hands each item to `on_item` and keeps
    none (the composed sequence node stays empty; `streamed` says it was)."""

    def __init__(self, text: str, on_item: Callable[[Node], None]) -> None:
        super().__init__(text)
        self._on_item = on_item
        self._depth = 0
        self.streamed = False

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        key: object = index  # a mapping passes its key node here (the stubs say int)
        if (self._depth == 1 and isinstance(key, ScalarNode) and key.value == "rules"
                and not self.streamed and self.check_event(yaml.SequenceStartEvent)):
            return self._compose_items()
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _compose_items(self) -> Node:
        start = self.get_event()
        node = SequenceNode("tag:yaml.org,2002:seq", [], start.start_mark, None, flow_style=start.flow_style)
        if start.anchor is not None:
            self.anchors[start.anchor] = node
        self.streamed = True
        self._depth += 2
        try:
            index = 0
            while not self.check_event(yaml.SequenceEndEvent):
                item = self.compose_node(node, index)
                assert item is not None
                self._on_item(item)
                index += 1
        finally:
            self._depth -= 2
        node.end_mark = self.get_event().end_mark
        return node


def _compose(text: str, on_rule: Callable[[Node], None]) -> tuple[Node | None, bool]:
    """(the document's root node, whether its rules were streamed to on_rule)."""
    loader = _StreamingLoader(text, on_rule)
    try:
        return loader.get_single_node(), loader.streamed
    finally:
        loader.dispose()


def check_policy_text(text: str, file: str = "<policy>") -> tuple[Policy | None, list[PolicyIssue]]:
    """Validate policy YAML text; return (policy or None, the issues found: at most
    MAX_KEPT_ISSUES, then one entry counting the rest). Input nested too deeply to parse is
    an issue, not a RecursionError."""
    try:
        return _check_policy_text(text, file)
    except RecursionError:
        return None, [PolicyIssue(file, 1, "nested too deeply to parse",
                                  "flatten the YAML (a policy is a few levels deep)")]


def _check_policy_text(text: str, file: str) -> tuple[Policy | None, list[PolicyIssue]]:
    reader = _Reader(file)
    streamed_rules = _RulesParser(reader)
    try:
        root, streamed = _compose(text, streamed_rules)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else 1
        return None, [
            PolicyIssue(
                file,
                line,
                f"not valid YAML: {err.problem or err}",
                "fix the YAML syntax (indentation, colons, quotes) on or just before this line",
            )
        ]
    except yaml.YAMLError as err:
        return None, [PolicyIssue(file, 1, f"not valid YAML: {err}", "fix the YAML syntax")]
    if root is None:
        return None, [PolicyIssue(file, 1, "the policy file is empty", "add at least `rules:` with one rule")]
    keys = reader.mapping(root, "the policy", TOP_KEYS)
    if keys is None:
        return None, reader.result()
    if "version" in keys:
        version = reader.scalar(keys["version"][1]) if isinstance(keys["version"][1], ScalarNode) else None
        if version != 1:
            reader.issue(keys["version"][1], f"unsupported policy version {version!r}", "write `version: 1`")
    protected: tuple[str, ...] = DEFAULT_PROTECTED_NAMESPACES
    if "protected_namespaces" in keys:
        items = reader.sequence(keys["protected_namespaces"][1], "protected_namespaces", "[kube-system]")
        ns_names = [reader.string(item, "protected_namespaces entry") for item in items or []]
        protected = tuple(n for n in ns_names if n is not None)
    tuning = Tuning()
    if "tuning" in keys:
        tuning = _parse_tuning(reader, keys["tuning"][1]) or tuning
    deadlock = DeadlockSettings()
    if "deadlock" in keys:
        deadlock = _parse_deadlock(reader, keys["deadlock"][1]) or deadlock
    fair_share = FairShareSettings()
    if "fair_share" in keys:
        fair_share = _parse_fair_share(reader, keys["fair_share"][1]) or fair_share
    rescheduling = ReschedulingSettings()
    if "rescheduling" in keys:
        rescheduling = _parse_rescheduling(reader, keys["rescheduling"][1]) or rescheduling
    elastic = ElasticSettings()
    if "elastic" in keys:
        elastic = _parse_elastic(reader, keys["elastic"][1]) or elastic
    rules: list[Rule] = []
    if "rules" not in keys:
        reader.issue(root, "the policy has no `rules:`", "add `rules:` with at least one rule")
    else:
        if streamed:
            if not streamed_rules.count:
                reader.issue(keys["rules"][1], "`rules` is empty", "add at least one rule")
            rules = streamed_rules.rules
        else:
            items = reader.sequence(keys["rules"][1], "rules", "- name: default ...")
            if items is not None and not items:
                reader.issue(keys["rules"][1], "`rules` is empty", "add at least one rule")
    quotas: list[NamespaceQuota] = []
    if "namespace_quotas" in keys:
        items = reader.sequence(keys["namespace_quotas"][1], "namespace_quotas", "- namespace: team-a ...")
        for index, item in enumerate(items or []):
            quota = _parse_quota(reader, item, index)
            if quota is not None:
                quotas.append(quota)
    if reader.issues:
        return None, reader.result()
    return Policy(
        rules=tuple(rules),
        namespace_quotas=tuple(quotas),
        protected_namespaces=protected,
        tuning=tuning,
        deadlock=deadlock,
        fair_share=fair_share,
        rescheduling=rescheduling,
        elastic=elastic,
        source=file,
    ), []


MAX_POLICY_BYTES = 1 << 20
"""Largest policy file the agent reads (1 MiB: thousands of rules)."""
MAX_LISTED_ISSUES = 50
"""At most this many problems are spelled out in a PolicyError (the rest are counted)."""


def read_policy_text(path: str | Path, max_bytes: int = MAX_POLICY_BYTES) -> str:
    """The text of a policy file, read so that it can neither hang, flood nor leak: resolved
    only below the file's own directory (safeio.read_file_beneath: a ConfigMap's ..data link
    works, a symlink to /etc/shadow or anything else outside is refused before it is read),
    typed on an O_PATH fd before it is opened (a FIFO, a device, a directory are refused), at
    most `max_bytes` (checked with fstat before reading and while reading). PolicyError says
    what is wrong and never quotes a refused file."""
    file = str(path)
    try:
        data = read_file_beneath(path, max_bytes)
    except RefusedFile as err:
        raise PolicyError(
            f"refusing to read policy file {file}: {err.why}",
            fix=f"point --policy at a regular YAML file of at most {max_bytes // 1024} KiB inside the "
                "directory its path names (or mount that directory: a ConfigMap volume)",
        ) from err
    except OSError as err:
        raise PolicyError(
            f"cannot read policy file {file}: {err.strerror or err}",
            fix="check the path and that the agent can read it",
        ) from err
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PolicyError(f"{file}: not UTF-8 text ({err.reason})", fix="save the policy as UTF-8") from err


def load_policy(path: str | Path, max_bytes: int = MAX_POLICY_BYTES) -> Policy:
    """Read (read_policy_text) and validate a policy file; raise PolicyError listing the problems."""
    file = str(path)
    text = read_policy_text(path, max_bytes)
    policy, issues = check_policy_text(text, file)
    if policy is None:
        total = total_problems(issues)
        listed = "\n".join(str(i) for i in issues[:MAX_LISTED_ISSUES] if not i.more)
        if total > MAX_LISTED_ISSUES:
            listed += f"\n... and {total - min(MAX_LISTED_ISSUES, len(issues))} more"
        raise PolicyError(
            f"{total} problem(s) in {file}:\n" + listed,
            fix=f"run `gpuwatch policy check {file}`",
        )
    return policy
