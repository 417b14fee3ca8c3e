"""Checks a Node Feature Discovery feature file the way NFD reads it (for any test to import).

`check_feature_file(path)` raises AssertionError, naming the line and the rule, for anything
that would make NFD skip the file, skip a line, or publish something other than what the
writer meant; it returns the node labels NFD would publish from it.

Written from NFD's source (github.com/kubernetes-sigs/node-feature-discovery), not from
gpuwatch's writer, so the two check each other:
* source/local/local.go -- `getFeaturesFromFiles`: names starting with "." are skipped;
  `getFileContent`: os.Stat (follows symlinks), only regular files give lines, a size over
  `MaxFeatureFileSize` (65536) skips the whole file; `parseFeatureFile`: split on "\\n",
  strings.TrimSpace per line, "#" lines are comments, "# +" starts a directive
  (`parseDirectives`: "expiry-time=<time.RFC3339>", "no-label", "no-feature"; anything else
  is logged as an error and ignored); the expiry applies to the lines after it and a line
  read after an expiry in the past is dropped; "name=value" splits at the first "=", a bare
  name means "true"; `# +no-label` / `# +no-feature` apply to the next feature line only.
* pkg/nfd-worker/nfd-worker.go -- `GetFeatureLabels`: local-source names are not prefixed;
  a name that is not a qualified name or a value that is not a label value is dropped.
* pkg/apis/nfd/validate/validate.go -- `Label`: unprefixed names are refused (or, by default,
  auto-prefixed with feature.node.kubernetes.io/ by nfd-master: not what the writer meant);
  kubernetes.io and *.kubernetes.io are denied except feature.node.kubernetes.io and
  profile.node.kubernetes.io and their sub-namespaces.
* Kubernetes label syntax from k8s.io/apimachinery pkg/api/validate/content/kube.go
  (`IsLabelKey`, `IsLabelValue`) and dns.go (`IsDNS1123Subdomain`).

Stricter than NFD on purpose, where NFD would silently do something surprising: duplicate
names (NFD keeps the last), directives NFD does not know or cannot parse, comment lines that
look like a mistyped directive ("#+expiry-time=..."), labels already expired, and (unless
`require_expiry=False`) a feature line with no expiry directive before it.
"""

from __future__ import annotations

import os
import re
import stat
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

MAX_FEATURE_FILE_SIZE = 65536
DIRECTIVE_PREFIX = "# +"
FEATURE_LABEL_NS = "feature.node.kubernetes.io"
PROFILE_LABEL_NS = "profile.node.kubernetes.io"

_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Go's time.RFC3339 layout "2006-01-02T15:04:05Z07:00": upper-case T and Z, optional
# fractional seconds, numeric offsets with a colon.
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(\.\d{1,9})?(Z|([+-])(\d{2}):(\d{2}))")
_LOOKS_LIKE_DIRECTIVE = re.compile(r"#\s*\+?\s*(expiry-time|no-label|no-feature)\b")


def parse_rfc3339(text: str) -> datetime:
    """Parse the way Go's time.Parse(time.RFC3339, ...) accepts; ValueError otherwise."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not RFC3339 (2006-01-02T15:04:05Z or +07:00 offset)")
    year, month, day, hour, minute, second = (int(match.group(i)) for i in range(1, 7))
    fraction = match.group(7) or ""
    micro = int((fraction[1:] + "000000")[:6]) if fraction else 0
    if match.group(8) == "Z":
        tz = UTC
    else:
        off_h, off_m = int(match.group(10)), int(match.group(11))
        if off_h > 23 or off_m > 59:
            raise ValueError(f"{text!r}: time zone offset out of range")
        sign = -1 if match.group(9) == "-" else 1
        tz = timezone(sign * timedelta(hours=off_h, minutes=off_m))
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=tz)  # range errors -> ValueError


def label_key_errors(key: str) -> list[str]:
    """Why `key` is not a Kubernetes label key (qualified name); [] when it is."""
    parts = key.split("/")
    if len(parts) > 2:
        return ["more than one '/'"]
    errors = []
    if len(parts) == 2:
        prefix, name = parts
        errors += _part_errors("prefix", prefix, 253, _SUBDOMAIN, "is not a lower-case RFC 1123 subdomain")
    else:
        name = parts[0]
    errors += _part_errors("name part", name, 63, _NAME,
                           "must be alphanumerics, '-', '_' or '.', alphanumeric at both ends")
    return errors


def _part_errors(part: str, value: str, max_len: int, pattern: re.Pattern[str], shape: str) -> list[str]:
    """What is wrong with one part of a key: empty, longer than `max_len`, or not `pattern`
    (`shape` says what it must be)."""
    if not value:
        return [f"empty {part}"]
    if len(value) > max_len:
        return [f"{part} longer than {max_len} characters ({len(value)})"]
    if pattern.fullmatch(value) is None:
        return [f"{part} {value!r} {shape}"]
    return []


def label_value_errors(value: str) -> list[str]:
    """Why `value` is not a Kubernetes label value; [] when it is."""
    errors = []
    if len(value) > 63:
        errors.append(f"longer than 63 characters ({len(value)})")
    if _VALUE.fullmatch(value) is None:
        errors.append("must be empty or alphanumerics, '-', '_' or '.', alphanumeric at both ends")
    return errors


def _namespace_denied(namespace: str) -> bool:
    if namespace == "kubernetes.io" or namespace.endswith(".kubernetes.io"):
        allowed = (FEATURE_LABEL_NS, PROFILE_LABEL_NS)
        return not any(namespace == ns or namespace.endswith("." + ns) for ns in allowed)
    return False


def check_feature_file(path: str | os.PathLike[str], *, now: float | None = None, require_expiry: bool = True,
                       namespace: str | None = "gpuwatch.io") -> dict[str, str]:
    """Apply NFD's local-source rules to one feature file; the labels NFD would publish.

    `now`: epoch seconds to judge the expiry against (default: the real clock).
    `namespace`: every label must be in it (None: any namespace nfd-master accepts by default).
    """
    path = Path(path)
    where = str(path)
    assert not path.name.startswith("."), f"{where}: NFD ignores files whose name starts with '.'"
    try:
        info = os.stat(path)  # NFD stats through symlinks
    except OSError as err:
        raise AssertionError(f"{where}: NFD cannot stat it: {err}") from err
    assert stat.S_ISREG(info.st_mode), f"{where}: not a regular file; NFD reads no features from it"
    assert info.st_size <= MAX_FEATURE_FILE_SIZE, (
        f"{where}: {info.st_size} bytes > NFD's limit of {MAX_FEATURE_FILE_SIZE}: NFD skips the whole file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise AssertionError(f"{where}: not UTF-8 ({err})") from err

    now_dt = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC)
    expiry: datetime | None = None
    skip_label = False
    labels: dict[str, str] = {}
    seen: set[str] = set()
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        at = f"{where}:{number}: {line!r}"
        if not line:
            continue
        if line.startswith("#"):
            if not line.startswith(DIRECTIVE_PREFIX):
                assert _LOOKS_LIKE_DIRECTIVE.match(line) is None, (
                    f"{at}: looks like a directive but NFD reads it as a comment (the syntax is '# +name')")
                continue
            key, sep, value = line[len(DIRECTIVE_PREFIX):].partition("=")
            if key == "expiry-time":
                assert sep, f"{at}: expiry-time needs a value: '# +expiry-time=<RFC3339>'"
                try:
                    expiry = parse_rfc3339(value.strip())
                except ValueError as err:
                    raise AssertionError(f"{at}: NFD cannot parse the expiry: {err}") from err
            elif key == "no-label":
                skip_label = True
            elif key == "no-feature":
                pass
            else:
                raise AssertionError(f"{at}: unknown directive {key!r} (NFD knows expiry-time, no-label, no-feature)")
            continue

        if expiry is None:
            assert not require_expiry, f"{at}: no '# +expiry-time=' directive before this line"
        else:
            assert expiry >= now_dt, f"{at}: expired at {expiry.isoformat()} (now {now_dt.isoformat()}): NFD drops it"
        name, sep, value = line.partition("=")
        if not sep:
            value = "true"
        assert name not in seen, f"{at}: {name!r} appears twice (NFD silently keeps the last one)"
        seen.add(name)
        key_errors = label_key_errors(name)
        assert not key_errors, f"{at}: invalid label name: {'; '.join(key_errors)}"
        value_errors = label_value_errors(value)
        assert not value_errors, f"{at}: invalid label value {value!r}: {'; '.join(value_errors)}"
        prefix, slash, _ = name.partition("/")
        assert slash, f"{at}: unprefixed name; nfd-master would publish it as {FEATURE_LABEL_NS}/{name}"
        assert not _namespace_denied(prefix), f"{at}: nfd-master refuses the {prefix!r} namespace"
        if namespace is not None:
            assert prefix == namespace, f"{at}: expected only {namespace}/ labels"
        if skip_label:
            skip_label = False  # '# +no-label' covers one feature line: a feature, not a label
            continue
        labels[name] = value
    return labels
