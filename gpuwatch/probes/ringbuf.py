"""Consumer of a BPF ring buffer map by fd, with mmap and epoll (no libbpf, no BCC).

Layout (kernel/bpf/ringbuf.c): page 0 = consumer position (read-write); from page 1 the
producer position page followed by the data area mapped twice back to back, so a record
that wraps is contiguous. Each record: u32 length (bit 31 busy, bit 30 discarded), u32
page offset, then the payload; records are 8-byte aligned.
"""

from __future__ import annotations

import mmap
import select
import struct
from collections.abc import Callable

from gpuwatch.probes.bpfsys import map_info

_BUSY = 1 << 31
_DISCARD = 1 << 30
_HDR = 8


class RingBuffer:
    """Read records of one BPF_MAP_TYPE_RINGBUF map."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = map_info(fd).max_entries
        self.mask = self.size - 1
        page = mmap.PAGESIZE
        self._cons = mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod = mmap.mmap(fd, page + 2 * self.size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._page = page
        self._epoll = select.epoll()
        self._epoll.register(fd, select.EPOLLIN)

    def poll(self, timeout_ms: int, handle: Callable[[bytes], None]) -> int:
        """Wait up to timeout_ms for data, hand every available record to `handle`."""
        self.wait(timeout_ms)
        return self.consume(handle)

    def wait(self, timeout_ms: int) -> None:
        """Wait up to timeout_ms until a record is available (returns at once if one is)."""
        if self._available() == 0:
            self._epoll.poll(max(timeout_ms, 0) / 1000.0)

    def _available(self) -> int:
        cons = struct.unpack_from("<Q", self._cons, 0)[0]
        prod = struct.unpack_from("<Q", self._prod, 0)[0]
        return int(prod - cons)

    def consume(self, handle: Callable[[bytes], None]) -> int:
        cons = struct.unpack_from("<Q", self._cons, 0)[0]
        prod = struct.unpack_from("<Q", self._prod, 0)[0]
        count = 0
        while cons < prod:
            base = self._page + (cons & self.mask)
            length, _pgoff = struct.unpack_from("<II", self._prod, base)
            if length & _BUSY:
                break
            size = length & ~(_BUSY | _DISCARD)
            if not length & _DISCARD:
                handle(bytes(self._prod[base + _HDR:base + _HDR + size]))
                count += 1
            cons += (size + _HDR + 7) // 8 * 8
            struct.pack_into("<Q", self._cons, 0, cons)
            prod = struct.unpack_from("<Q", self._prod, 0)[0]
        return count

    def close(self) -> None:
        self._epoll.close()
        self._cons.close()
        self._prod.close()
