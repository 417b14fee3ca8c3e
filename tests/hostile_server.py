"""A hostile HTTP server for client tests: answers 200 and then misbehaves.

Modes (the path's last word, or the server's default `mode`):
* ``endless``: no Content-Length, JSON whitespace for ever (as fast as the client reads);
* ``slow``: a valid-looking body, one byte every `slow_interval_s`;
* ``slow-headers``: the status line and headers one byte every `slow_interval_s`;
* ``nested``: a complete body of `nested_depth` nested arrays (`[[[[...]]]]`);
* ``huge-length``: Content-Length of 2**40 and a few bytes.
Each connection is served by its own daemon thread; `close()` stops everything.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


class HostileServer:
    def __init__(self, mode: str = "endless", *, slow_interval_s: float = 0.2, nested_depth: int = 100_000) -> None:
        self.mode = mode
        self.slow_interval_s = slow_interval_s
        self.nested_depth = nested_depth
        self.sent_bytes = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(65536)
                if not data:
                    return
                request += data
            head, _, body = request.partition(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    missing = int(line.split(b":", 1)[1]) - len(body)
                    while missing > 0:  # read the whole request: unread bytes would reset the connection
                        data = conn.recv(min(missing, 65536))
                        if not data:
                            return
                        missing -= len(data)
            for chunk in self._answer():
                if self._closed.is_set():
                    return
                conn.sendall(chunk)
                self.sent_bytes += len(chunk)

    def _answer(self) -> Iterator[bytes]:
        mode = self.mode
        if mode == "endless":
            yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{\"status\":"
            block = b" " * 65536
            while True:
                yield block
        elif mode == "slow":
            yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            while True:
                yield b" "
                time.sleep(self.slow_interval_s)
        elif mode == "slow-headers":
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
                yield bytes([byte])
                time.sleep(self.slow_interval_s)
        elif mode == "nested":
            body = b"[" * self.nested_depth + b"]" * self.nested_depth
            yield (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        elif mode == "huge-length":
            yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1099511627776\r\n\r\n{}"
            time.sleep(30)
        else:
            raise ValueError(mode)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
