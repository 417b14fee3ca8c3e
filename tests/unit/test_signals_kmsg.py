"""Kernel-log Xid parsing and the bounded, non-blocking reader (regular-file mode; /dev/kmsg
itself is read in the system tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.signals.kmsg import KmsgReader, XidRecord, parse_xid_line, pci_address

# Lines in the shapes NVIDIA's driver has printed over the years (newest first).
CASES = [
    ("NVRM: Xid (PCI:0000:1b:00): 31, pid=79749, name=exe, Ch 0000000a, intr 00000000. MMU Fault: ENGINE",
     XidRecord((0, 0x1B, 0), 31, 79749, "exe")),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
     XidRecord((0, 0x3B, 0), 79, None, None)),
    ("NVRM: Xid (PCI:0000:01:00): 79, pid=1122, GPU has fallen off the bus.",
     XidRecord((0, 1, 0), 79, 1122, None)),
    ("NVRM: Xid (PCI:0000:23:00): 79, GPU has fallen off the bus.", XidRecord((0, 0x23, 0), 79, None, None)),
    ("NVRM: Xid (0000:01:00): 13, Graphics Exception: ESR 0x405840=0x0", XidRecord((0, 1, 0), 13, None, None)),
    ("[ 1234.567890] NVRM: Xid (PCI:0001:af:00): 119, pid=42, name=python3, Timeout after 6s of waiting for RPC",
     XidRecord((1, 0xAF, 0), 119, 42, "python3")),
    ("Nov 26 10:00:00 host kernel: NVRM: Xid (PCI:0000:41:00): 48, pid=7, name=a b, DBE (double bit error)",
     XidRecord((0, 0x41, 0), 48, 7, "a b")),
]


@pytest.mark.parametrize(("line", "expected"), CASES)
def test_parses_every_known_shape(line: str, expected: XidRecord) -> None:
    assert parse_xid_line(line) == expected


@pytest.mark.parametrize("line", ["usb 1-1: new high-speed USB device", "NVRM: loading NVIDIA UNIX x86_64", ""])
def test_other_lines_are_not_xids(line: str) -> None:
    assert parse_xid_line(line) is None


@pytest.mark.parametrize("line", ["NVRM: Xid (PCI:zzzz:1b:00): 79, pid=1", "NVRM: Xid garbage",
                                  "NVRM: Xid (PCI:0000:1b:00): , pid=1"])
def test_broken_xid_lines_raise(line: str) -> None:
    with pytest.raises(ValueError, match="unparsable"):
        parse_xid_line(line)


def test_pci_address_matches_nvml_and_kernel_spellings() -> None:
    assert pci_address("00000000:1B:00.0") == pci_address("0000:1b:00") == (0, 0x1B, 0)
    assert pci_address(None) is None
    assert pci_address("garbage") is None


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_file_reader_starts_at_end_and_reads_records_and_plain_lines(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("6,1,100,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=5, name=old, before the agent\n")
    reader = KmsgReader(str(log))
    assert reader.poll() == []  # what was logged before the reader started is not counted
    _append(log, "4,2,200,-;NVRM: Xid (PCI:0000:1b:00): 31, pid=77, name=train, MMU Fault\n"
                 " SUBSYSTEM=pci\n"
                 "[  12.5] NVRM: Xid (PCI:0000:1c:00): 48, pid=78, name=x, DBE\n")
    records = reader.poll()
    assert [(r.xid, r.pid) for r in records] == [(31, 77), (48, 78)]
    assert reader.poll() == []


def test_partial_line_waits_for_its_end(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    reader = KmsgReader(str(log))
    _append(log, "6,1,1,-;NVRM: Xid (PCI:0000:1b:00): 7")
    assert reader.poll() == []
    _append(log, "9, pid=3, name=p, end\n")
    assert [r.xid for r in reader.poll()] == [79]


def test_file_created_after_start_is_read_from_its_beginning(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    reader = KmsgReader(str(log))
    assert not reader.available and reader.errors_total == 1
    _append(log, "6,1,1,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=3, name=p, first line\n")
    assert [r.xid for r in reader.poll()] == [79]


def test_truncated_file_is_read_again_from_start(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("x" * 500 + "\n")
    reader = KmsgReader(str(log))
    log.write_text("6,1,1,-;NVRM: Xid (PCI:0000:1b:00): 43, pid=3, name=p, after rotation\n")
    assert [r.xid for r in reader.poll()] == [43]


def test_malformed_xid_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    reader = KmsgReader(str(log))
    _append(log, "6,1,1,-;NVRM: Xid (PCI:broken\n\x00\xff garbage \n6,2,2,-;NVRM: Xid (PCI:0000:1b:00): 13, x\n")
    assert [r.xid for r in reader.poll()] == [13]
    assert reader.malformed_total == 1


def test_reads_are_bounded_per_poll_and_resume(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    reader = KmsgReader(str(log), max_bytes_per_poll=4096)
    line = "6,1,1,-;NVRM: Xid (PCI:0000:1b:00): 13, pid=3, name=p, padding padding padding\n"
    _append(log, line * 1000)
    first = reader.poll()
    assert 0 < len(first) < 1000
    total = len(first)
    for _ in range(100):
        got = reader.poll()
        if not got:
            break
        total += len(got)
    assert total == 1000


def test_runaway_line_does_not_grow_memory(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    reader = KmsgReader(str(log), max_bytes_per_poll=64 * 1024)
    _append(log, "y" * 200_000)
    for _ in range(5):
        reader.poll()
    assert len(reader._partial) <= 64 * 1024
    assert reader.malformed_total >= 1


def test_fifo_and_directories_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = KmsgReader(str(fifo))
    assert not reader.available and "neither" in (reader.last_error or "")
    assert reader.poll() == []
