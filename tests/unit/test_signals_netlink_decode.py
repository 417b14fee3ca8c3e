"""Unit tests for the rtnetlink link decoder in gpuwatch.signals.network (no sockets).

Messages are built here from the kernel's layouts (struct nlmsghdr, struct ifinfomsg,
struct rtattr, 4-byte aligned), so the decoder is checked against the ABI, not against itself.
"""

from __future__ import annotations

import struct

import pytest

from gpuwatch.signals.network import NetlinkLinks, decode_link_messages

RTM_NEWLINK, RTM_DELLINK, NLMSG_ERROR, NLMSG_DONE = 16, 17, 2, 3
IFLA_IFNAME, IFLA_OPERSTATE, IFLA_CARRIER, IFLA_LINKINFO = 3, 16, 33, 18
NLA_F_NESTED = 0x8000


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + bytes(-len(raw) % 4)


def _message(kind: int, body: bytes, flags: int = 0) -> bytes:
    raw = struct.pack("=IHHII", 16 + len(body), kind, flags, 1, 0) + body
    return raw + bytes(-len(raw) % 4)


def _link(kind: int, index: int, name: str | None, operstate: int | None, carrier: int | None,
          if_flags: int = 0x1043) -> bytes:
    body = struct.pack("=BxHiII", 0, 1, index, if_flags, 0)
    if name is not None:
        body += _attr(IFLA_IFNAME, name.encode() + b"\0")
    body += _attr(IFLA_LINKINFO | NLA_F_NESTED, _attr(1, b"veth\0"))  # nested: kept undecoded
    if operstate is not None:
        body += _attr(IFLA_OPERSTATE, bytes([operstate]))
    if carrier is not None:
        body += _attr(IFLA_CARRIER, bytes([carrier]))
    return _message(kind, body)


def test_a_dump_part_decodes_every_link_and_stops_at_done() -> None:
    data = _link(RTM_NEWLINK, 1, "lo", 0, 1, if_flags=0x49) + _link(RTM_NEWLINK, 7, "eth0", 6, 1)
    messages, done, error = decode_link_messages(data + _message(NLMSG_DONE, struct.pack("=i", 0)))
    assert done and error == 0
    assert [(m[0], m[1], m[2]) for m in messages] == [(RTM_NEWLINK, 1, 0x49), (RTM_NEWLINK, 7, 0x1043)]
    assert messages[1][3][IFLA_IFNAME] == b"eth0\0"
    assert messages[1][3][IFLA_LINKINFO] == _attr(1, b"veth\0")  # nested flag masked off the type


def test_an_error_message_reports_its_errno() -> None:
    _, done, error = decode_link_messages(_message(NLMSG_ERROR, struct.pack("=i", -13) + bytes(16)))
    assert not done and error == -13


@pytest.mark.parametrize("data", [
    _link(RTM_NEWLINK, 2, "eth1", 6, 1)[:-4],  # cut short
    struct.pack("=IHHII", 8, RTM_NEWLINK, 0, 1, 0),  # a length below the header's
    _message(RTM_NEWLINK, struct.pack("=BxHiII", 0, 1, 2, 0, 0) + struct.pack("=HH", 200, 3)),  # attribute overrun
    _message(RTM_NEWLINK, struct.pack("=BxHiII", 0, 1, 2, 0, 0), flags=0x10),  # NLM_F_DUMP_INTR
])
def test_truncated_or_interrupted_messages_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_link_messages(data)


class _Fixture(NetlinkLinks):
    """NetlinkLinks without sockets: the decoder's tuples are applied directly."""

    def __init__(self, sys_root: str) -> None:  # no super().__init__: no sockets
        self.sys_root = sys_root
        self._by_index = {}
        self._speeds = {}
        self._ethtool = None


def test_applied_messages_give_the_links_the_reader_uses(tmp_path: object) -> None:
    links = _Fixture(str(tmp_path))
    data = (_link(RTM_NEWLINK, 1, "lo", 0, 1, if_flags=0x49) + _link(RTM_NEWLINK, 3, "eth0", 2, 0)
            + _link(RTM_NEWLINK, 4, "eth1", 9, None) + _link(RTM_NEWLINK, 5, None, 6, 1))
    for message in decode_link_messages(data)[0]:
        links._apply(*message)
    by_name = {link.name: link for link in links._by_index.values()}
    assert sorted(by_name) == ["eth0", "eth1", "lo"]  # a link without a name is skipped
    assert (by_name["lo"].operstate, by_name["lo"].carrier, by_name["lo"].loopback) == ("unknown", True, True)
    assert (by_name["eth0"].operstate, by_name["eth0"].carrier, by_name["eth0"].speed_mbps) == ("down", False, None)
    assert (by_name["eth1"].operstate, by_name["eth1"].carrier) == ("unknown", None)  # unknown code, no carrier
    for message in decode_link_messages(_link(RTM_DELLINK, 3, "eth0", 2, 0))[0]:
        links._apply(*message)
    assert sorted(link.name for link in links._by_index.values()) == ["eth1", "lo"]


def test_a_running_link_takes_its_speed_from_sysfs(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path))
    (root / "class/net/eth0").mkdir(parents=True)
    (root / "class/net/eth0/speed").write_text("25000\n")
    links = _Fixture(str(root))
    for message in decode_link_messages(_link(RTM_NEWLINK, 3, "eth0", 6, 1))[0]:
        links._apply(*message)
    assert links._by_index[3].speed_mbps == 25000
