"""Network signals: the node's NICs, its RDMA ports, and bytes per container network namespace.

The only module of gpuwatch that imports pyroute2 (a ruff banned-api rule keeps it so), and
only for ethtool netlink where sysfs does not show a device: the link list is decoded here
from plain netlink sockets (a handful of fields), because importing pyroute2 -- its package
`__init__` loads every netlink family it has, asyncio and sqlite3 -- cost the agent 14-22
MiB of RSS, a third of it, for four fields per link.

NICs (`read_nics`) are those of the agent's own network namespace (the DaemonSet runs with
hostNetwork), loopback excluded, in ifindex order. Two kinds of facts, at two rates:

* the link list -- name, ifindex, operstate, carrier, loopback flag -- from an rtnetlink
  link dump (RTM_GETLINK), kept current between dumps by the kernel's link events (an
  RTMGRP_LINK subscription drained without blocking on every read, the RTM_NEWLINK /
  RTM_DELLINK messages decoded by `decode_link_messages`), so an operstate change shows at
  the next read. A full dump is taken on the first read, every `link_refresh_s` (default
  30 s, a safety net), after lost events (ENOBUFS), and when /proc/net/dev lists
  interfaces the list lacks (at most once per `MIN_DUMP_INTERVAL_S`).
  The speed is `/sys/class/net/<dev>/speed` -- the kernel's ethtool link settings, the
  number the ETHTOOL_MSG_LINKMODES_GET netlink request answers -- and ethtool netlink
  (pyroute2's `NlEthtool`) only for a device this sysfs does not show; asked when a link is
  first seen running and whenever it starts running again -- renegotiation, the only way a
  speed changes, takes the carrier down -- and kept otherwise.
  No carrier, not running, unknown or -1 -> None; Mb/s -> bytes/s.
* byte counters from one read of `<proc_root>/net/dev` per call: the 64-bit
  `dev_get_stats()` numbers IFLA_STATS64 carries too, for every interface at once.

Why not one link dump per read -- measured on the build VM (2 vCPU, kernel 6.18, with
pyroute2 0.9.7 before the decoder here replaced it), `time.thread_time()` per call,
averaged over 200 calls:

| what | CPU per call |
|---|---|
| `IPRoute.get_links()` dump, 4 links / 202 links | 0.76 ms / ~50 ms |
| `NlEthtool.get_linkmode()`, per NIC (it re-resolves the family every call) | 0.43-0.6 ms |
| decoding one link event (pyroute2 marshal) | 0.22 ms |
| `/proc/net/dev` read + parse, 4 interfaces | 0.03 ms |
| **`read_nics()`**, host namespace, 3 NICs + lo, no link change | **0.033 ms** |
| `read_nics()`, 6 NICs, no change / after a link flap (events + 2 speeds) | 0.044 ms / 0.57 ms |
| `read_nics()` with the periodic full dump, 3 NICs / 202 veths | 1.0 ms / 54 ms (every 30 s) |
| `read_nics()`, 202 veths, no change | 0.67 ms |
| first `read_nics()` (pyroute2 import, sockets, dump) | ~95 ms, once |

A dump per read alone would take most of a 1 ms budget at a few NICs; with the split a read
costs ~0.04 ms plus ~0.03 ms/s for the periodic dump (the decoder here is cheaper than
pyroute2's marshal: these are upper bounds). Where netlink cannot be opened at all (sockets
refused) the link list comes from `/sys/class/net` instead (`SysfsLinks`, re-read at the
periodic refresh: link changes show up to `link_refresh_s` late); that is logged once.

RDMA (`read_rdma`): `<sys_root>/class/infiniband/<dev>/ports/<n>/` -- state ("4: ACTIVE"),
rate ("100 Gb/sec (4X EDR)"), link_layer, and counters/port_rcv_data and port_xmit_data,
which count 4-byte words (multiplied by 4 here; None where the counters are absent). A NIC
is `rdma=True` when an RDMA device is bound to it: `<ibdev>/device/net/<netdev>` or the
netdev named by one of the first `GID_NDEVS_READ` GID entries of a port
(`ports/<n>/gid_attrs/ndevs/<i>`: RoCE, soft-RoCE), looked up when the link list changes.

Containers (`read_containers`): the network namespace of each (identity, pid) is the inode
of `<proc_root>/<pid>/ns/net` (stat once per target, kept while the target is asked for);
containers in the host's (pid 1's) or the agent's own namespace are skipped (their bytes are
the node's); containers sharing a namespace (a pod) are read once and each reports the
namespace's bytes (do not sum them per pod). Bytes are the sum over all interfaces but lo
of `<proc_root>/<pid>/net/dev`, which shows that pid's namespace. At most
`max_netns_per_cycle` namespaces are read per call, least recently read first (round-robin,
new ones first; a namespace not read yet is left out until its turn); the others report
their last values. After each read the namespace inode of every pid of that namespace is
checked again, so a pid that exited, was reused or moved meanwhile lends no bytes: such a
target, and one whose pid is gone, is dropped from the call's result and counted in
`errors_total["netns_vanished"]` (a target whose namespace is not read this call is checked
at its turn). Caches hold only the
targets and namespaces of the current call. Cost, 200 pods each in its own namespace (same
VM, several runs): 1.2-1.9 ms per call with the default 32 reads (~27 us per namespace read,
~4 us per target), 6-8 ms when all 200 are read every call.

Nothing here raises on bad input: unreadable files, garbage lines and vanished namespaces
count in `errors_total` by source ("nics", "rdma", "netns"), set `last_error`, and are logged
once per distinct message.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.model import ContainerIdentity, ContainerNetwork, NicStats, RdmaPort

log = logging.getLogger(__name__)

SOURCES = ("nics", "rdma", "netns")
VANISHED = "netns_vanished"
LINK_REFRESH_S = 30.0  # full re-read of the link list (events carry changes in between)
MIN_DUMP_INTERVAL_S = 5.0  # full re-reads for an interface set that events did not explain
GID_NDEVS_READ = 8
RDMA_WORD_BYTES = 4
BYTES_PER_MEGABIT = 125_000.0  # ethtool and sysfs speeds are in Mb/s (10^6 bits)
_SPEED_UNKNOWN = (0, 0xFFFF, 0xFFFFFFFF)  # SPEED_UNKNOWN is -1 in a u32 (or u16 in old ioctls)
_NOT_RUNNING = frozenset({"down", "notpresent", "lowerlayerdown"})  # no link, so no speed to ask for
_IFF_LOOPBACK = 0x8
_ARPHRD_LOOPBACK = 772
_RTMGRP_LINK = 0x1
_RTM_NEWLINK = 16
_RTM_DELLINK = 17
_RTM_GETLINK = 18
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
_NLM_F_DUMP_INTR = 0x10
_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
_IFLA_IFNAME = 3
_IFLA_OPERSTATE = 16
_IFLA_CARRIER = 33
_OPERSTATES = ("unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up")  # RFC 2863 codes
_NLMSG_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr: len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # struct ifinfomsg: family, pad, type, index, flags, change
_RECV_BYTES = 1 << 16  # a dump part is at most 32 KiB (one skb); events are smaller
_DUMP_TIMEOUT_S = 5.0
_DUMP_ATTEMPTS = 3
_MAX_DISTINCT_ERRORS = 1024
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)b/sec\b")
_STATE_RE = re.compile(r"[A-Z][A-Z0-9_]*")
_RATE_UNIT = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}

NsKey = tuple[int, int]  # (st_dev, st_ino) of a /proc/<pid>/ns/net
_Member = tuple[ContainerIdentity, int, str]  # a target of read_containers and its identity key


class LinkSourceError(GpuwatchError):
    """The link list could not be read (netlink socket refused, dump failed)."""


@dataclass(frozen=True)
class LinkInfo:
    """One network interface as a link dump reports it."""

    name: str
    index: int
    operstate: str  # lower case, as /sys/class/net/<dev>/operstate: "up", "down", "lowerlayerdown"...
    carrier: bool | None  # None: not reported
    loopback: bool
    speed_mbps: int | None  # None: unknown (virtual, no carrier, not asked)


class LinkSource(Protocol):
    """Where `NetworkReader.read_nics` gets the link list from."""

    def links(self, full: bool) -> list[LinkInfo]:
        """Every interface of the namespace, by ifindex; raises LinkSourceError.

        `full=False` may answer from the state kept since the last call (kept current by
        link events where the source has them: it must then be cheap); `full=True` reads
        every link again.
        """
        ...

    def close(self) -> None: ...


# -- pure parsers ---------------------------------------------------------------------------


def parse_net_dev(text: str) -> tuple[dict[str, tuple[int, int]], int]:
    """`/proc/net/dev` -> ({interface: (receive_bytes, transmit_bytes)}, bad_lines).

    The two header lines are skipped; a line without `name:` and 16 integers counts as bad.
    """
    counters: dict[str, tuple[int, int]] = {}
    bad = 0
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        fields = rest.split()
        name = name.strip()
        if not sep or not name or len(fields) < 16:
            bad += 1
            continue
        try:
            counters[name] = (int(fields[0]), int(fields[8]))
        except ValueError:
            bad += 1
    return counters, bad


def namespace_bytes(counters: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """Receive and transmit bytes of a namespace: every interface but lo."""
    rx = sum(c[0] for name, c in counters.items() if name != "lo")
    tx = sum(c[1] for name, c in counters.items() if name != "lo")
    return rx, tx


def parse_rdma_state(text: str) -> str | None:
    """"4: ACTIVE" -> "ACTIVE"; a bare word is taken as is; None for garbage."""
    word = text.strip().rpartition(":")[2].strip()
    return word if _STATE_RE.fullmatch(word) else None


def parse_rdma_rate(text: str) -> float | None:
    """"100 Gb/sec (4X EDR)" -> 12.5e9 bytes/s; None for garbage or a zero rate."""
    match = _RATE_RE.match(text)
    if match is None:
        return None
    bits = float(match.group(1)) * _RATE_UNIT[match.group(2)]
    return bits / 8 if bits > 0 else None


def speed_bytes_per_second(speed_mbps: int | None) -> float | None:
    """An ethtool speed in Mb/s -> bytes/s; unknown (None, 0, -1, 0xFFFFFFFF) -> None."""
    if speed_mbps is None or speed_mbps < 0 or speed_mbps in _SPEED_UNKNOWN:
        return None
    return speed_mbps * BYTES_PER_MEGABIT


def _running(operstate: str, carrier: bool | None) -> bool:
    """Whether a link has a peer to have a speed with."""
    return carrier is not False and operstate not in _NOT_RUNNING


def _read_text(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _sysfs_speed(sys_root: str, name: str) -> int | None:
    """/sys/class/net/<dev>/speed; the kernel answers EINVAL when the device is down."""
    try:
        return int(_read_text(f"{sys_root}/class/net/{name}/speed").strip())
    except (OSError, ValueError):
        return None


# -- link sources ---------------------------------------------------------------------------


class SysfsLinks:
    """The link list from `<sys_root>/class/net` (the fallback when netlink is unavailable).

    Reads ifindex, operstate, carrier, flags, type and speed of every interface on a full
    read; between full reads it answers the last list (it hears of no link events).
    """

    def __init__(self, sys_root: str = "/sys") -> None:
        self.sys_root = sys_root
        self._last: list[LinkInfo] | None = None

    def links(self, full: bool) -> list[LinkInfo]:
        if self._last is not None and not full:
            return self._last
        base = f"{self.sys_root}/class/net"
        try:
            names = sorted(os.listdir(base))
        except OSError as err:
            raise LinkSourceError(f"cannot list {base}: {err.strerror}") from err
        result = []
        for name in names:
            directory = f"{base}/{name}"
            try:
                index = int(_read_text(f"{directory}/ifindex"))
                operstate = _read_text(f"{directory}/operstate").strip().lower() or "unknown"
                flags = int(_read_text(f"{directory}/flags").strip(), 16)
            except FileNotFoundError:
                continue  # removed while listing, or not an interface
            except (OSError, ValueError) as err:
                raise LinkSourceError(f"unreadable interface {directory}: {err}") from err
            carrier = self._carrier(directory)
            loopback = bool(flags & _IFF_LOOPBACK) or self._type(directory) == _ARPHRD_LOOPBACK
            speed = _sysfs_speed(self.sys_root, name) if _running(operstate, carrier) and not loopback else None
            result.append(LinkInfo(name, index, operstate, carrier, loopback, speed))
        self._last = sorted(result, key=lambda link: link.index)
        return self._last

    def close(self) -> None:
        self._last = None

    @staticmethod
    def _carrier(directory: str) -> bool | None:
        try:
            return _read_text(f"{directory}/carrier").strip() == "1"
        except OSError as err:  # EINVAL while the device is administratively down
            return False if err.errno == errno.EINVAL else None

    @staticmethod
    def _type(directory: str) -> int | None:
        try:
            return int(_read_text(f"{directory}/type"))
        except (OSError, ValueError):
            return None


def decode_link_messages(data: bytes) -> tuple[list[tuple[int, int, int, dict[int, bytes]]], bool, int]:
    """Netlink datagram(s) -> ([(type, index, flags, {IFLA_* attribute: payload})], done, error).

    Decodes the few fields the link list needs from RTM_NEWLINK / RTM_DELLINK messages
    (`struct ifinfomsg` + its top-level attributes, nested ones left undecoded); other
    message types are skipped. `done` is True at NLMSG_DONE; `error` is the negative errno of
    an NLMSG_ERROR (0: none; an ack is 0 too). Raises ValueError on a truncated message.
    """
    messages: list[tuple[int, int, int, dict[int, bytes]]] = []
    offset, done, error = 0, False, 0
    while offset + _NLMSG_HEADER.size <= len(data):
        length, message_type, flags, _seq, _pid = _NLMSG_HEADER.unpack_from(data, offset)
        if length < _NLMSG_HEADER.size or offset + length > len(data):
            raise ValueError(f"netlink message of {length} bytes at {offset} of {len(data)}")
        if flags & _NLM_F_DUMP_INTR:
            raise ValueError("link dump interrupted (the list changed while it was read)")
        body = offset + _NLMSG_HEADER.size
        if message_type == _NLMSG_DONE:
            done = True
        elif message_type == _NLMSG_ERROR:
            error = struct.unpack_from("=i", data, body)[0] if length >= _NLMSG_HEADER.size + 4 else -errno.EIO
        elif message_type in (_RTM_NEWLINK, _RTM_DELLINK) and length >= _NLMSG_HEADER.size + _IFINFOMSG.size:
            _family, _type, index, if_flags, _change = _IFINFOMSG.unpack_from(data, body)
            attributes: dict[int, bytes] = {}
            at = body + _IFINFOMSG.size
            end = offset + length
            while at + 4 <= end:
                rta_len, rta_type = struct.unpack_from("=HH", data, at)
                if rta_len < 4 or at + rta_len > end:
                    raise ValueError(f"netlink attribute of {rta_len} bytes at {at}")
                attributes[rta_type & _NLA_TYPE_MASK] = data[at + 4:at + rta_len]
                at += (rta_len + 3) & ~3
            messages.append((message_type, index, if_flags, attributes))
        offset += (length + 3) & ~3
    return messages, done, error


def _operstate(payload: bytes | None) -> str:
    """IFLA_OPERSTATE (RFC 2863 code, one byte) -> its lower-case name, as sysfs writes it."""
    if not payload:
        return "unknown"
    return _OPERSTATES[payload[0]] if payload[0] < len(_OPERSTATES) else "unknown"


class NetlinkLinks:
    """The link list from rtnetlink: a link dump, kept current by link events.

    Two plain netlink sockets of the network namespace it was created in: one for dumps
    (RTM_GETLINK with NLM_F_DUMP) and an RTMGRP_LINK subscription, non-blocking. Only the
    fields the reader uses are decoded (`decode_link_messages`: ifindex, flags, IFLA_IFNAME,
    IFLA_OPERSTATE, IFLA_CARRIER) -- a few struct unpacks instead of a netlink library,
    whose import (pyroute2: ~14-22 MiB RSS) was a third of the agent's memory. `links(False)`
    drains the subscription and applies RTM_NEWLINK/RTM_DELLINK to the list of the last dump
    -- one failing recv() when nothing happened; a lost-event overflow (ENOBUFS) makes it
    dump instead. A link's speed is asked when it is first seen running and again whenever
    it starts running again (renegotiation, the only way a speed changes, takes the carrier
    down), and kept otherwise: `/sys/class/net/<dev>/speed` (the kernel's ethtool ksettings,
    the number ETHTOOL_MSG_LINKMODES_GET answers), and where sysfs has no such device
    (a /sys of another namespace) ethtool netlink through pyroute2, imported only then.

    Raises LinkSourceError when netlink is unavailable.
    """

    def __init__(self, sys_root: str = "/sys") -> None:
        self.sys_root = sys_root
        self._by_index: dict[int, LinkInfo] = {}
        self._speeds: dict[tuple[int, str, bool], int | None] = {}
        self._dumped = False
        self._seq = 0
        self._events: socket.socket | None = None
        self._dump_socket: socket.socket | None = None
        self._ethtool: Any = None  # pyroute2's NlEthtool, opened at the first speed sysfs lacks
        self._ethtool_error: type[Exception] = OSError
        try:
            self._events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK,
                                         socket.NETLINK_ROUTE)
            self._events.bind((0, _RTMGRP_LINK))
            self._dump_socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
            self._dump_socket.bind((0, 0))
            self._dump_socket.settimeout(_DUMP_TIMEOUT_S)
        except OSError as err:
            self.close()
            raise LinkSourceError(f"rtnetlink socket refused: {err}") from err

    def links(self, full: bool) -> list[LinkInfo]:
        if self._dump_socket is None or self._events is None:
            raise LinkSourceError("link source is closed")
        if full or not self._dumped:
            self._dump()
        else:
            events = self._drain()
            if events is None:
                self._dump()
            else:
                for event in events:
                    self._apply(*event)
        return sorted(self._by_index.values(), key=lambda link: link.index)

    def close(self) -> None:
        if self._ethtool is not None:
            try:
                self._ethtool.close()
            except (OSError, self._ethtool_error) as err:
                log.debug("closing ethtool netlink: %s", err)
            self._ethtool = None
        for name in ("_dump_socket", "_events"):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is not None:
                handle.close()

    def _dump(self) -> None:
        self._drain()  # the dump shows all of it; applying it afterwards could undo newer state
        for attempt in range(_DUMP_ATTEMPTS):
            try:
                messages = self._dump_once()
                break
            except ValueError as err:  # interrupted by a change, or garbage: ask again
                if attempt == _DUMP_ATTEMPTS - 1:
                    raise LinkSourceError(f"rtnetlink link dump failed: {err}") from err
        self._by_index = {}
        for message in messages:
            self._apply(*message)
        self._dumped = True
        keep = {(link.index, link.name, _running(link.operstate, link.carrier)) for link in self._by_index.values()}
        self._speeds = {key: speed for key, speed in self._speeds.items() if key in keep}  # bounded

    def _dump_once(self) -> list[tuple[int, int, int, dict[int, bytes]]]:
        assert self._dump_socket is not None
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        request = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + _IFINFOMSG.size, _RTM_GETLINK,
                                     _NLM_F_REQUEST | _NLM_F_DUMP, self._seq, 0) + bytes(_IFINFOMSG.size)
        messages: list[tuple[int, int, int, dict[int, bytes]]] = []
        try:
            self._dump_socket.send(request)
            while True:
                data = self._dump_socket.recv(_RECV_BYTES)
                if not data:
                    raise LinkSourceError("rtnetlink link dump: socket closed")
                batch, done, error = decode_link_messages(data)
                if error:
                    raise LinkSourceError(f"rtnetlink link dump failed: {os.strerror(-error)}")
                messages.extend(batch)
                if done:
                    return messages
        except OSError as err:  # includes the timeout
            raise LinkSourceError(f"rtnetlink link dump failed: {err}") from err

    def _drain(self) -> list[tuple[int, int, int, dict[int, bytes]]] | None:
        """Link messages received since the last drain; None when some were lost."""
        assert self._events is not None
        events: list[tuple[int, int, int, dict[int, bytes]]] = []
        lost = False
        while True:
            try:
                data = self._events.recv(_RECV_BYTES)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno != errno.ENOBUFS:
                    raise LinkSourceError(f"link event socket: {err.strerror}") from err
                lost = True
                continue
            if not data:
                break
            try:
                events.extend(decode_link_messages(data)[0])
            except (ValueError, struct.error) as err:
                log.debug("undecodable link event: %s", err)
                lost = True
        return None if lost else events

    def _apply(self, message_type: int, index: int, flags: int, attributes: dict[int, bytes]) -> None:
        if message_type == _RTM_DELLINK:
            self._by_index.pop(index, None)
            return
        name = attributes.get(_IFLA_IFNAME, b"").split(b"\0", 1)[0].decode(errors="replace")
        if message_type != _RTM_NEWLINK or not name:
            return
        carrier_attr = attributes.get(_IFLA_CARRIER)
        carrier = None if not carrier_attr else bool(carrier_attr[0])
        loopback = bool(flags & _IFF_LOOPBACK)
        operstate = _operstate(attributes.get(_IFLA_OPERSTATE))
        running = _running(operstate, carrier)
        key = (index, name, running)
        if key not in self._speeds:
            self._speeds[key] = self._speed(name, index) if running and not loopback else None
        self._by_index[index] = LinkInfo(name, index, operstate, carrier, loopback, self._speeds[key])

    def _speed(self, name: str, index: int) -> int | None:
        if os.path.isdir(f"{self.sys_root}/class/net/{name}"):
            return _sysfs_speed(self.sys_root, name)
        return self._ethtool_speed(index)

    def _ethtool_speed(self, index: int) -> int | None:
        """ETHTOOL_MSG_LINKMODES_GET through pyroute2, for a device this sysfs does not show."""
        if self._ethtool is None:
            try:
                from pyroute2.netlink.exceptions import NetlinkError
                from pyroute2.netlink.generic.ethtool import NlEthtool

                self._ethtool_error = NetlinkError
                self._ethtool = NlEthtool()
            except (ImportError, OSError) as err:
                log.debug("ethtool netlink unavailable (%s): no speed", err)
                return None
            except self._ethtool_error as err:
                log.debug("ethtool netlink unavailable (%s): no speed", err)
                return None
        try:
            replies = self._ethtool.get_linkmode(ifindex=index)
        except (OSError, self._ethtool_error):
            replies = None  # EOPNOTSUPP for devices without ksettings (lo, ifb, tun)
        for reply in replies or ():
            value = reply.get_attr("ETHTOOL_A_LINKMODES_SPEED")
            if value is not None:
                return int(value)
        return None


# -- the reader -----------------------------------------------------------------------------


@dataclass
class _NetnsBytes:
    receive_bytes_total: int
    transmit_bytes_total: int
    read_cycle: int
    identity_keys: frozenset[str]


class NetworkReader:
    """Reads NICs, RDMA ports and per-container network bytes; see the module docstring.

    `links` is the link-list source (default: `NetlinkLinks` in the agent's namespace,
    opened at the first `read_nics`, `SysfsLinks` where netlink is unavailable); the reader
    owns it and closes it in `close()`.
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        max_netns_per_cycle: int = 32,
        clock: Callable[[], float] = time.monotonic,
        *,
        links: LinkSource | None = None,
        link_refresh_s: float = LINK_REFRESH_S,
    ) -> None:
        if max_netns_per_cycle < 1:
            raise ValueError("max_netns_per_cycle must be at least 1")
        self.proc_root = proc_root.rstrip("/") or "/"
        self.sys_root = sys_root.rstrip("/") or "/"
        self.max_netns_per_cycle = max_netns_per_cycle
        self.link_refresh_s = link_refresh_s
        self.errors_total: dict[str, int] = {source: 0 for source in (*SOURCES, VANISHED)}
        self.last_error = ""
        self._clock = clock
        self._source = links
        self._links: list[LinkInfo] = []
        self._link_names: frozenset[str] = frozenset()
        self._rdma_netdevs: frozenset[str] = frozenset()
        self._dumped_at: float | None = None
        self._closed = False
        self._netns: dict[NsKey, _NetnsBytes] = {}
        self._target_ns: dict[tuple[str, int], NsKey] = {}  # (identity key, pid) -> namespace, last call's
        self._host: frozenset[NsKey] | None = None
        self._cycle = 0
        self._logged: set[tuple[str, str]] = set()

    # -- lifecycle

    def close(self) -> None:
        """Release the netlink sockets (the link source). Idempotent; read_nics answers ()
        afterwards, the other reads go on working."""
        self._closed = True
        if self._source is not None:
            self._source.close()
            self._source = None

    def __enter__(self) -> NetworkReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- NICs

    def read_nics(self) -> tuple[NicStats, ...]:
        """The namespace's interfaces but loopback, with counters read now."""
        if self._closed:
            return ()
        path = f"{self.proc_root}/net/dev"
        try:
            text = _read_text(path)
        except OSError as err:
            self._error("nics", f"cannot read {path}: {err.strerror}")
            return ()
        counters, bad = parse_net_dev(text)
        if bad:
            self._error("nics", f"{path}: {bad} unparsable line(s)")
        self._update_links(frozenset(counters))
        result = []
        for link in self._links:
            counter = counters.get(link.name)
            if link.loopback or counter is None:  # gone since the link list was read
                continue
            speed = speed_bytes_per_second(link.speed_mbps) if _running(link.operstate, link.carrier) else None
            result.append(NicStats(device=link.name, operstate=link.operstate, speed_bytes_per_second=speed,
                                   receive_bytes_total=counter[0], transmit_bytes_total=counter[1],
                                   rdma=link.name in self._rdma_netdevs))
        return tuple(result)

    def _update_links(self, counter_names: frozenset[str]) -> None:
        """Bring the link list up to date: events every read, a full read when it is due."""
        now = self._clock()
        since = None if self._dumped_at is None else now - self._dumped_at
        full = since is None or since >= self.link_refresh_s
        source = self._link_source()
        try:
            links = source.links(full)
            names = frozenset(link.name for link in links)
            if not full and names != counter_names and since is not None and since >= MIN_DUMP_INTERVAL_S:
                full = True  # /proc/net/dev knows interfaces the events did not announce
                links = source.links(full)
                names = frozenset(link.name for link in links)
        except LinkSourceError as err:
            self._error("nics", str(err))
            if full:
                self._dumped_at = now  # keep the last list; try again at the next refresh
            return
        if full:
            self._dumped_at = now
        if full or names != self._link_names:
            self._rdma_netdevs = self._bound_rdma_netdevs()
        self._links = links
        self._link_names = names

    def _link_source(self) -> LinkSource:
        if self._source is None:
            try:
                self._source = NetlinkLinks(self.sys_root)
            except LinkSourceError as err:
                log.warning("netlink unavailable (%s): NIC list, operstate and speed come from "
                            "%s/class/net, and link changes show only at the %.0f s refresh",
                            err, self.sys_root, self.link_refresh_s)
                self._source = SysfsLinks(self.sys_root)
        return self._source

    def _bound_rdma_netdevs(self) -> frozenset[str]:
        base = f"{self.sys_root}/class/infiniband"
        try:
            devices = os.listdir(base)
        except OSError:
            return frozenset()
        names: set[str] = set()
        for device in devices:
            # soft-RoCE and IB-only devices have no netdev below their parent device
            with contextlib.suppress(OSError):
                names.update(os.listdir(f"{base}/{device}/device/net"))
            try:
                ports = os.listdir(f"{base}/{device}/ports")
            except OSError:
                continue
            for port in ports:
                for index in range(GID_NDEVS_READ):
                    try:
                        name = _read_text(f"{base}/{device}/ports/{port}/gid_attrs/ndevs/{index}").strip()
                    except OSError:
                        continue  # unused GID entries answer EINVAL
                    if name:
                        names.add(name)
        return frozenset(names)

    # -- RDMA

    def read_rdma(self) -> tuple[RdmaPort, ...]:
        """Every port of every RDMA device; () where there is no /sys/class/infiniband."""
        base = f"{self.sys_root}/class/infiniband"
        try:
            devices = sorted(os.listdir(base))
        except FileNotFoundError:
            return ()
        except OSError as err:
            self._error("rdma", f"cannot list {base}: {err.strerror}")
            return ()
        result = []
        for device in devices:
            ports_dir = f"{base}/{device}/ports"
            try:
                port_names = os.listdir(ports_dir)
            except OSError as err:
                self._error("rdma", f"cannot list {ports_dir}: {err.strerror}")
                continue
            numbers = []
            for name in port_names:
                if name.isdigit():
                    numbers.append(int(name))
                else:
                    self._error("rdma", f"{ports_dir}: unexpected entry {name!r}")
            for number in sorted(numbers):
                port = self._read_port(device, number, f"{ports_dir}/{number}")
                if port is not None:
                    result.append(port)
        return tuple(result)

    def _read_port(self, device: str, number: int, directory: str) -> RdmaPort | None:
        try:
            state_text = _read_text(f"{directory}/state")
        except FileNotFoundError:
            return None  # removed while listing
        except OSError as err:
            self._error("rdma", f"cannot read {directory}/state: {err.strerror}")
            state_text = ""
        state = parse_rdma_state(state_text)
        if state is None:
            if state_text:
                self._error("rdma", f"{directory}/state: unparsable {state_text.strip()[:40]!r}")
            state = "UNKNOWN"
        rate = None
        try:
            rate_text = _read_text(f"{directory}/rate")
        except OSError:
            rate_text = ""  # EINVAL while the port has no valid rate (down)
        if rate_text:
            rate = parse_rdma_rate(rate_text)
            if rate is None and not rate_text.strip().startswith("0 "):
                self._error("rdma", f"{directory}/rate: unparsable {rate_text.strip()[:40]!r}")
        try:
            link_layer = _read_text(f"{directory}/link_layer").strip()
        except OSError:
            link_layer = ""
        return RdmaPort(device=device, port=number, state=state, rate_bytes_per_second=rate,
                        receive_bytes_total=self._rdma_counter(f"{directory}/counters/port_rcv_data"),
                        transmit_bytes_total=self._rdma_counter(f"{directory}/counters/port_xmit_data"),
                        link_layer=link_layer)

    def _rdma_counter(self, path: str) -> int | None:
        try:
            text = _read_text(path)
        except FileNotFoundError:
            return None
        except OSError as err:
            self._error("rdma", f"cannot read {path}: {err.strerror}")
            return None
        try:
            words = int(text.strip())
        except ValueError:
            self._error("rdma", f"{path}: unparsable {text.strip()[:40]!r}")
            return None
        return words * RDMA_WORD_BYTES if words >= 0 else None

    # -- containers

    def read_containers(self, targets: Sequence[tuple[ContainerIdentity, int]]) -> tuple[ContainerNetwork, ...]:
        """Bytes of each container's network namespace (host-namespace containers skipped)."""
        self._cycle += 1
        host = self._host_namespaces()
        known = self._target_ns
        target_ns: dict[tuple[str, int], NsKey] = {}
        groups: dict[NsKey, list[_Member]] = {}
        for identity, pid in targets:
            target = (identity.key, pid)
            if target in target_ns:
                continue
            key = known.get(target)
            if key is None:
                key = self._ns_key(pid)
                if key is None:
                    continue
            target_ns[target] = key
            if key not in host:
                groups.setdefault(key, []).append((identity, pid, target[0]))
        previous = self._netns
        current: dict[NsKey, _NetnsBytes] = {}
        for key, members in groups.items():
            entry = previous.get(key)
            if entry is not None and entry.identity_keys.isdisjoint([member[2] for member in members]):
                entry = None  # the inode was reused by another namespace
            if entry is not None:
                current[key] = entry
        order = {key: position for position, key in enumerate(groups)}
        due = sorted(groups, key=lambda k: (current[k].read_cycle if k in current else -1, order[k]))
        gone: set[tuple[str, int]] = set()
        for key in due[: self.max_netns_per_cycle]:
            entry = self._read_namespace(key, groups[key], gone)
            if entry is None:
                current.pop(key, None)
            else:
                current[key] = entry
        for target in gone:
            target_ns.pop(target, None)
        self._netns = current  # only namespaces asked for in this call
        self._target_ns = target_ns
        result = []
        reported: set[str] = set()
        for key, members in groups.items():
            entry = current.get(key)
            if entry is None:
                continue
            for identity, pid, identity_key in members:
                if identity_key in reported or (identity_key, pid) in gone:
                    continue
                reported.add(identity_key)
                result.append(ContainerNetwork(identity=identity, receive_bytes_total=entry.receive_bytes_total,
                                               transmit_bytes_total=entry.transmit_bytes_total))
        return tuple(result)

    def _host_namespaces(self) -> frozenset[NsKey]:
        """The namespaces of pid 1 and of the agent, looked up once (they do not change)."""
        if self._host is None:
            keys = set()
            for who in ("1", "self"):
                path = f"{self.proc_root}/{who}/ns/net"
                try:
                    info = os.stat(path)
                except OSError as err:
                    self._error("netns", f"cannot stat {path}: {err.strerror}")
                    continue
                keys.add((info.st_dev, info.st_ino))
            self._host = frozenset(keys)
        return self._host

    def _ns_key(self, pid: int) -> NsKey | None:
        """The namespace of a pid; None (counted) when the pid is gone or unreadable."""
        path = f"{self.proc_root}/{pid}/ns/net"
        try:
            info = os.stat(path)
        except (FileNotFoundError, ProcessLookupError):
            self.errors_total[VANISHED] += 1
            return None
        except OSError as err:
            self._error("netns", f"cannot stat {self.proc_root}/<pid>/ns/net: {err.strerror}")
            return None
        return info.st_dev, info.st_ino

    def _read_namespace(self, key: NsKey, members: list[_Member],
                        gone: set[tuple[str, int]]) -> _NetnsBytes | None:
        """Read one namespace through the first of its pids that is still in it, then check
        that the others still are; the targets found gone on the way are added to `gone`."""
        entry = None
        for _, pid, identity_key in members:
            if entry is not None:
                if not self._still_in(pid, key):
                    gone.add((identity_key, pid))
                continue
            path = f"{self.proc_root}/{pid}/net/dev"
            try:
                text = _read_text(path)
            except (FileNotFoundError, ProcessLookupError):
                self.errors_total[VANISHED] += 1
                gone.add((identity_key, pid))
                continue
            except OSError as err:
                self._error("netns", f"cannot read {self.proc_root}/<pid>/net/dev: {err.strerror}")
                continue
            if not self._still_in(pid, key):  # exited, reused or moved: the bytes may be another namespace's
                gone.add((identity_key, pid))
                continue
            counters, bad = parse_net_dev(text)
            if bad:
                self._error("netns", f"{self.proc_root}/<pid>/net/dev: {bad} unparsable line(s)")
            rx, tx = namespace_bytes(counters)
            entry = _NetnsBytes(rx, tx, self._cycle, frozenset(member[2] for member in members))
        return entry

    def _still_in(self, pid: int, key: NsKey) -> bool:
        """Whether pid is (still) in namespace `key`; a pid that is not counts as vanished."""
        now_in = self._ns_key(pid)  # counts a pid that is gone
        if now_in is not None and now_in != key:
            self.errors_total[VANISHED] += 1
        return now_in == key

    # -- errors

    def _error(self, source: str, message: str) -> None:
        self.errors_total[source] += 1
        self.last_error = f"{source}: {message}"
        if (source, message) in self._logged:
            return
        if len(self._logged) >= _MAX_DISTINCT_ERRORS:
            self._logged.clear()
        self._logged.add((source, message))
        log.warning("network signals (%s): %s", source, message)


__all__ = [
    "LinkInfo",
    "LinkSource",
    "LinkSourceError",
    "NetlinkLinks",
    "NetworkReader",
    "SysfsLinks",
    "decode_link_messages",
    "namespace_bytes",
    "parse_net_dev",
    "parse_rdma_rate",
    "parse_rdma_state",
    "speed_bytes_per_second",
]
