"""Parse the human units a policy file uses: sizes ("8GiB", "512MB", "50%"), durations
("10s", "1m", "500ms") and ratios ("90%", 0.9).

Each parser returns a value or raises ValueError whose text says what form is expected,
so the loader can turn it into `FILE:LINE: ...; fix: ...` without knowing the grammar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_DURATION_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z%]*)\s*$")

SIZE_FORM = 'a size like "8GiB", "512MiB", "2000000000" (bytes) or a percentage of the device like "50%"'
DURATION_FORM = 'a duration like "500ms", "10s", "2m", "1h" or a number of seconds'
RATIO_FORM = 'a percentage like "90%" or a fraction like 0.9'


@dataclass(frozen=True)
class MemoryAmount:
    """A GPU memory amount: absolute bytes, or a fraction of the device's total memory."""

    bytes: int | None = None
    device_ratio: float | None = None

    def resolve_bytes(self, device_total_bytes: int | None) -> int | None:
        """Bytes for a device of this size (None when a percentage meets an unknown size)."""
        if self.bytes is not None:
            return self.bytes
        if self.device_ratio is None or device_total_bytes is None:
            return None
        return int(self.device_ratio * device_total_bytes)

    def describe(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{(self.device_ratio or 0.0) * 100:g}% of device"


def parse_size(value: object) -> MemoryAmount:
    """ "8GiB" -> 8*2**30 bytes; "50%" -> half of the device; ints are bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected {SIZE_FORM}, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a size must be positive, got {value}")
        return MemoryAmount(bytes=value)
    if not isinstance(value, str):
        raise ValueError(f"expected {SIZE_FORM}, got {value!r}")
    match = _NUMBER_UNIT.match(value)
    if match is None:
        raise ValueError(f"expected {SIZE_FORM}, got {value!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0.0 < number <= 100.0:
            raise ValueError(f"a device percentage must be in (0%, 100%], got {value!r}")
        return MemoryAmount(device_ratio=number / 100.0)
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"unknown size unit {match.group(2)!r} in {value!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB or %"
        )
    size = int(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return MemoryAmount(bytes=size)


def parse_duration_s(value: object) -> float:
    """ "10s" -> 10.0; "500ms" -> 0.5; "2m" -> 120.0; numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected {DURATION_FORM}, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match is None or match.group(2).lower() not in {*_DURATION_UNITS, ""}:
            raise ValueError(f"expected {DURATION_FORM}, got {value!r}")
        seconds = float(match.group(1)) * _DURATION_UNITS.get(match.group(2).lower(), 1.0)
    else:
        raise ValueError(f"expected {DURATION_FORM}, got {value!r}")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {value!r}")
    return seconds


def parse_ratio(value: object, *, maximum: float = 10.0) -> float:
    """ "90%" -> 0.9; 0.9 -> 0.9. Bounded by `maximum` (as a fraction)."""
    if isinstance(value, bool):
        raise ValueError(f"expected {RATIO_FORM}, got {value!r}")
    if isinstance(value, int | float):
        ratio = float(value)
    elif isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match is None or match.group(2) not in {"%", ""}:
            raise ValueError(f"expected {RATIO_FORM}, got {value!r}")
        ratio = float(match.group(1)) / (100.0 if match.group(2) == "%" else 1.0)
    else:
        raise ValueError(f"expected {RATIO_FORM}, got {value!r}")
    if not 0.0 < ratio <= maximum:
        raise ValueError(f"must be above 0% and at most {maximum * 100:g}%, got {value!r}")
    return ratio


def format_bytes(size: int | float) -> str:
    """1536*2**20 -> "1.5GiB" (for messages and explain output)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{value:.4g}{unit}"
        value /= 1024.0
    return f"{value:.4g}TiB"
