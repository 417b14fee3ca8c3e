"""JSON parsed with a nesting limit, so no input reaches a RecursionError or a traceback.

One place for every reader of JSON that someone else wrote: request bodies (the webhook,
the extender), and answers (Prometheus, an agent's /snapshot.json). CPython's json parser
recurses once per level and raises RecursionError near the interpreter's limit (~1,000
levels); that error is turned into `JsonRejected` here, and anything deeper than the
caller's `max_depth` (checked iteratively after the parse) is refused the same way.
"""

from __future__ import annotations

import json
from typing import Any


class JsonRejected(ValueError):
    """A document that is not acceptable JSON; the message says why (safe to show: it never
    quotes more than a short parser message, never the document)."""


def depth_ok(value: Any, limit: int) -> bool:
    """Nesting depth of parsed JSON within `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return True


def parse_json(raw: bytes | str, max_depth: int) -> Any:
    """A JSON document nested at most `max_depth` deep; JsonRejected (with the reason) otherwise."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise JsonRejected(f"JSON nested deeper than {max_depth}") from None
    except (ValueError, TypeError) as err:
        raise JsonRejected(f"body is not JSON: {str(err)[:200]}") from None
    if not depth_ok(value, max_depth):
        raise JsonRejected(f"JSON nested deeper than {max_depth}")
    return value
