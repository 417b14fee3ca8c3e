"""Parse HOST:PORT options into a clear error instead of a traceback."""

from __future__ import annotations

import click


def parse_listen(value: str, option: str) -> tuple[str, int]:
    """'127.0.0.1:9400', '[::1]:9400', ':9400' (all interfaces) -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9400)", param_hint=option)
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise click.BadParameter(f"port {port_text!r} is not 0..65535", param_hint=option)
    return host, port
