"""Pure text formatting of quantities for `gpuwatch top`.

Every function takes a value that may be ``None`` (a field the GPU backend could not read)
and returns "N/A" for it rather than inventing a zero. Widths are terminal display widths
(East Asian wide characters count two cells), so unicode pod names do not break columns.
"""

from __future__ import annotations

import math
import unicodedata

NA = "N/A"
ELLIPSIS = "…"

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def bytes_text(value_bytes: int | None) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB; huge values stay readable (EiB)."""
    if value_bytes is None:
        return NA
    sign = "-" if value_bytes < 0 else ""
    value = float(abs(value_bytes))
    unit = 0
    while value >= 1024.0 and unit < len(_BINARY_UNITS) - 1:
        value /= 1024.0
        unit += 1
    if unit == 0:
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.1f} {_BINARY_UNITS[unit]}"


def ratio_percent_text(ratio: float | None) -> str:
    """0.531 -> '53%'; None or NaN -> 'N/A'."""
    if ratio is None or not _finite(ratio):
        return NA
    return f"{ratio * 100.0:.0f}%"


def celsius_text(value_celsius: float | None) -> str:
    if value_celsius is None or not _finite(value_celsius):
        return NA
    return f"{value_celsius:.0f}C"


def power_text(power_watts: float | None, limit_watts: float | None) -> str:
    """'120/300 W', '120 W' without a limit, 'N/A' without a reading."""
    if power_watts is None or not _finite(power_watts):
        return NA
    if limit_watts is not None and _finite(limit_watts):
        return f"{power_watts:.0f}/{limit_watts:.0f} W"
    return f"{power_watts:.0f} W"


def seconds_text(value_s: float | None) -> str:
    """Kernel seconds: '12.3' below 10 000 s, then '3.1h' / '2.0d' so columns stay narrow."""
    if value_s is None or not _finite(value_s):
        return NA
    if value_s < 10_000:
        return f"{value_s:.1f}"
    if value_s < 100 * 3600:
        return f"{value_s / 3600:.1f}h"
    return f"{value_s / 86400:.1f}d"


def count_text(value: int | None) -> str:
    """12345 -> '12.3k'; keeps probe counters narrow."""
    if value is None:
        return NA
    magnitude = abs(value)
    for limit, suffix in ((10**12, "T"), (10**9, "G"), (10**6, "M"), (10**4, "k")):
        if magnitude >= limit:
            scale = limit if limit != 10**4 else 10**3
            return f"{value / scale:.1f}{suffix}"
    return str(value)


def memory_ratio(used_bytes: int | None, total_bytes: int | None) -> float | None:
    """used/total, or None when either is unknown or the device reports 0 bytes."""
    if used_bytes is None or total_bytes is None or total_bytes <= 0:
        return None
    return min(max(used_bytes / total_bytes, 0.0), 1.0)


def bar_text(ratio: float | None, width_cells: int) -> str:
    """'[####......]' of `width_cells` cells in total; '[  N/A   ]' when unknown."""
    inner = max(width_cells - 2, 0)
    if ratio is None or not _finite(ratio):
        return "[" + NA.center(inner)[:inner] + "]"
    filled = round(min(max(ratio, 0.0), 1.0) * inner)
    return "[" + "#" * filled + "." * (inner - filled) + "]"


def char_width(char: str) -> int:
    """Terminal cells one character takes (0 for combining marks, 2 for wide CJK)."""
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def display_width(text: str) -> int:
    if text.isascii():  # the common case, and 50x faster than asking unicodedata per char
        return len(text)
    return sum(char_width(c) for c in text)


def clean(text: str) -> str:
    """Replace control characters (a hostile or odd comm/pod name) with '?'."""
    if text.isascii() and text.isprintable():
        return text
    return "".join("?" if unicodedata.category(c) in ("Cc", "Cf") else c for c in text)


def fit(text: str, width_cells: int, align_right: bool = False) -> str:
    """Pad or truncate `text` to exactly `width_cells` display cells (truncation ends in '…')."""
    if width_cells <= 0:
        return ""
    text = clean(text)
    if text.isascii():
        if len(text) > width_cells:
            text = text[: width_cells - 1] + ELLIPSIS
            return text
        return text.rjust(width_cells) if align_right else text.ljust(width_cells)
    if display_width(text) > width_cells:
        out: list[str] = []
        used = 0
        for c in text:
            w = char_width(c)
            if used + w > width_cells - 1:
                break
            out.append(c)
            used += w
        text = "".join(out) + ELLIPSIS
    pad = " " * (width_cells - display_width(text))
    return pad + text if align_right else text + pad


def clip(text: str, width_cells: int) -> str:
    """Cut `text` to at most `width_cells` display cells without padding."""
    if text.isascii():
        return text[: max(width_cells, 0)]
    if display_width(text) <= width_cells:
        return text
    out: list[str] = []
    used = 0
    for c in text:
        w = char_width(c)
        if used + w > width_cells:
            break
        out.append(c)
        used += w
    return "".join(out)
