"""Every ``gpuwatch.io/*`` pod annotation: its key, its parser and its one validator (pure).

A pod declares these annotations; the runtime copies them into the OCI bundle's config.json,
where containers/metadata.py reads them into the identity's labels (normalised, under the
same keys), and the extender reads them from the Pod it is asked about. Both parse them
here, so the node and the scheduler never disagree on what a value means:

    gpuwatch.io/sharing:        exclusive | shared | auto     (policy/sharing.py: what it does)
    gpuwatch.io/gpu-share:      "0.5" or "50%"                (a time share of one GPU, in (0, 1])
    gpuwatch.io/progress-file:  /abs/path/inside/container    (signals/progress.py reads it)
    gpuwatch.io/progress-goal:  minimize | maximize
    gpuwatch.io/gpu-memory:     8Gi                           (extender only: a Kubernetes quantity)
    gpuwatch.io/remote-gpu:     "true"                        (extender only)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuwatch.core.units import parse_ratio

SHARING_ANNOTATION = "gpuwatch.io/sharing"
GPU_SHARE_ANNOTATION = "gpuwatch.io/gpu-share"
PROGRESS_FILE_ANNOTATION = "gpuwatch.io/progress-file"
PROGRESS_GOAL_ANNOTATION = "gpuwatch.io/progress-goal"
GPU_MEMORY_ANNOTATION = "gpuwatch.io/gpu-memory"
REMOTE_GPU_ANNOTATION = "gpuwatch.io/remote-gpu"

EXCLUSIVE, SHARED, AUTO = "exclusive", "shared", "auto"
SHARING_MODES = (EXCLUSIVE, SHARED, AUTO)
MINIMIZE, MAXIMIZE = "minimize", "maximize"
GOALS = (MINIMIZE, MAXIMIZE)
MAX_PATH_CHARS = 1024
"""Longest progress-file path accepted (a path is a label value and a file to open)."""


def _choice(value: object, choices: tuple[str, ...]) -> str | None:
    if not isinstance(value, str):
        return None
    word = value.strip().lower()
    return word if word in choices else None


def parse_sharing_mode(value: object) -> str | None:
    """"exclusive" / "shared" / "auto" (case and surrounding blanks ignored), else None."""
    return _choice(value, SHARING_MODES)


def parse_gpu_share(value: object) -> float | None:
    """"0.5" or "50%" -> 0.5; None unless a number in (0, 1] (of one GPU's time)."""
    if not isinstance(value, str):
        return None
    try:
        return parse_ratio(value, maximum=1.0)
    except ValueError:
        return None


def format_share(share: float) -> str:
    return f"{share:.6g}"


def parse_progress_path(value: object) -> str | None:
    """An absolute path inside the container, normalised ("//a/./b" -> "/a/b"); None for a
    relative path, one with "..", a NUL byte or more than MAX_PATH_CHARS characters."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text.startswith("/") or "\0" in text or len(text) > MAX_PATH_CHARS:
        return None
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/" + "/".join(parts)


def parse_progress_goal(value: object) -> str | None:
    """"minimize" / "maximize" (case and surrounding blanks ignored), else None."""
    return _choice(value, GOALS)


@dataclass(frozen=True)
class LabelAnnotation:
    """An annotation the node carries into identity labels: how to read it, how to write the
    normalised value back as a label, and the sentence that says what a valid value is."""

    key: str
    parse: Callable[[object], object | None]
    expected: str
    render: Callable[[object], str] = str


NODE_ANNOTATIONS = (
    LabelAnnotation(SHARING_ANNOTATION, parse_sharing_mode, f"one of {', '.join(SHARING_MODES)}"),
    LabelAnnotation(GPU_SHARE_ANNOTATION, parse_gpu_share, 'a share of one GPU in (0, 1] (like "0.5" or "50%")',
                    lambda share: format_share(share) if isinstance(share, float) else str(share)),
    LabelAnnotation(PROGRESS_FILE_ANNOTATION, parse_progress_path,
                    f'an absolute path inside the container (no "..", at most {MAX_PATH_CHARS} characters)'),
    LabelAnnotation(PROGRESS_GOAL_ANNOTATION, parse_progress_goal, f"one of {', '.join(GOALS)}"),
)
"""In label order: sharing, then progress."""
NODE_ANNOTATION_KEYS = tuple(a.key for a in NODE_ANNOTATIONS)


def label_annotations(annotations: Mapping[str, object]) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """(the valid node annotations, normalised, as label pairs; one problem sentence per
    invalid one). Absent keys are neither; keys that are not the node's are ignored."""
    pairs: list[tuple[str, str]] = []
    problems: list[str] = []
    for ann in NODE_ANNOTATIONS:
        if ann.key not in annotations:
            continue
        raw = annotations[ann.key]
        value = ann.parse(raw)
        if value is None:
            problems.append(f"{ann.key}={raw!r} is not {ann.expected}")
        else:
            pairs.append((ann.key, ann.render(value)))
    return tuple(pairs), tuple(problems)
