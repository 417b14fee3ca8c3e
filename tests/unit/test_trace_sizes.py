"""RM_ALLOC parameter sizes in recorded traces (issue 16, item 2), no root needed.

The RM sizes an RM_ALLOC's pAllocParms by class and ignores paramsSize, which real libcuda
sends as 0. The recorder (gpuwatch/sim/csrc/ioctl_recorder.c) keeps that class table in C;
the probes keep it in bpf/gpuwatch.h and gpuwatch/probes/layout.py: the three must agree.
Traces recorded before the recorder followed the class carry no allocation sizes: they must
be recognisable (Trace.allocation_sizes_recorded), and their replay must never leave the
recorded process's pAllocParms address in a block (the probes would read whatever the
replayer has mapped there) but point it at zeros of the class's size.
"""

from __future__ import annotations

import ctypes
import io
import json
import re
import struct
from pathlib import Path

import pytest

from gpuwatch.probes.layout import RM_ALLOC_PARAMS_BYTES
from gpuwatch.sim import replay as replay_module
from gpuwatch.sim.replay import Replayer, _materialize, fill_missing_alloc_params
from gpuwatch.sim.tracefile import Block, Ioctl, read_trace, rm_allocs_in

REPO = Path(__file__).resolve().parents[2]
RECORDER_SRC = REPO / "gpuwatch" / "sim" / "csrc" / "ioctl_recorder.c"
TRACES = REPO / "tests" / "fixtures" / "traces"
REAL_TRACES = sorted((TRACES / "real").rglob("*.jsonl"))

NVOS64_CMD = 0xC030462B
NVOS21_CMD = 0xC020462B
XFER_CMD = 0xC01046D3
RECORDED_ADDRESS = 0x7FFEE5E59C20  # a stack address of the recorded process
HEADER = {"format": "gpuwatch-ioctl-trace", "version": 1, "recorded_at": "2026-11-27T00:00:00Z", "host": "h",
          "pid": 1, "argv": ["x"], "driver_version": "580.159.04", "cuda_driver_version": 13000,
          "simulated": False, "gpus": [{"minor": 0, "uuid": "GPU-0", "name": "n", "memory_total_bytes": 1}]}
OPEN = {"ev": "open", "t_ns": 1, "tid": 1, "path": "/dev/nvidiactl", "flags": 2, "fd": 3}


def recorder_table() -> dict[int, tuple[int, bool]]:
    """class -> (bytes, optional) from the recorder's RM_ALLOC_PARAMS_BYTES array."""
    text = RECORDER_SRC.read_text(encoding="utf-8")
    body = re.search(r"RM_ALLOC_PARAMS_BYTES\[\] = \{(.*?)\n\};", text, re.S)
    assert body, "the recorder's RM_ALLOC_PARAMS_BYTES array is gone"
    rows = re.findall(r"\{(0x[0-9A-Fa-f]+), (\d+), ([01])\}", body.group(1))
    assert len(rows) == body.group(1).count("{"), "an entry the parser cannot read"
    table = {int(cls, 16): (int(size), flag == "1") for cls, size, flag in rows}
    assert len(table) == len(rows), "a class listed twice"
    return table


def test_the_recorder_sizes_rm_alloc_params_as_the_probes_do() -> None:
    assert {cls: size for cls, (size, _) in recorder_table().items()} == RM_ALLOC_PARAMS_BYTES


def test_optional_classes_are_the_rms() -> None:
    """RS_OPTIONAL in the RM's resource_list.h: pAllocParms may be NULL (then nothing is read)."""
    optional = {cls for cls, (_, flag) in recorder_table().items() if flag}
    assert optional == {0x0, 0x1, 0x41, 0x80, 0x2080, 0x2081, 0x503C, 0xC8B5, 0xCB33, 0xC661, 0xCBC0}


def nvos64(hclass: int, params_address: int, params_size: int = 0, status: int = 0) -> bytes:
    image = bytearray(48)
    struct.pack_into("<IIIIQQIII", image, 0, 0xC1D00001, 0xC1D00001, 0xCAFE0001, hclass, params_address, 0,
                     params_size, 0, status)
    return bytes(image)


def alloc_event(params: bytes, nested: list[dict[str, object]] | None = None, cmd: int = NVOS64_CMD
                ) -> dict[str, object]:
    return {"ev": "ioctl", "t_ns": 2, "tid": 1, "fd": 3, "cmd": cmd, "ret": 0, "errno": 0,
            "before": params.hex(), "after": params.hex(), "nested": nested or []}


def write_trace(path: Path, *events: dict[str, object], header: dict[str, object] = HEADER) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in (header, OPEN, *events)), encoding="utf-8")
    return path


@pytest.mark.parametrize("real", REAL_TRACES, ids=lambda p: p.name)
def test_the_real_traces_carry_no_allocation_sizes(real: Path) -> None:
    trace = read_trace(real)
    assert "alloc_params" not in trace.header  # recorded before the recorder sized by class
    assert trace.allocation_sizes_recorded is False


def test_the_hand_built_traces_carry_their_sizes() -> None:
    built = [read_trace(p) for p in sorted(TRACES.glob("*.jsonl"))]
    with_video_memory = [t for t in built if any(
        alloc.hclass == 0x40 for e in t.events if isinstance(e, Ioctl) for alloc in rm_allocs_in(e))]
    assert len(REAL_TRACES) == 2 and len(with_video_memory) >= 8
    assert all(t.allocation_sizes_recorded for t in built)


def test_only_a_successful_video_memory_alloc_without_its_block_marks_a_trace(tmp_path: Path) -> None:
    params = bytes(128)
    sized = {"at": 16, "size": 128, "before": params.hex(), "after": params.hex(), "nested": []}
    ok = read_trace(write_trace(tmp_path / "a.jsonl", alloc_event(nvos64(0x40, RECORDED_ADDRESS), [sized])))
    assert ok.allocation_sizes_recorded is True
    others = read_trace(write_trace(
        tmp_path / "b.jsonl",
        alloc_event(nvos64(0x3E, RECORDED_ADDRESS)),  # system memory: not video memory
        alloc_event(nvos64(0x40, RECORDED_ADDRESS, status=0x1F)),  # failed: nothing allocated
    ))
    assert others.allocation_sizes_recorded is True
    lost = read_trace(write_trace(tmp_path / "c.jsonl", alloc_event(nvos64(0x40, RECORDED_ADDRESS))))
    assert lost.allocation_sizes_recorded is False
    nvos21 = bytearray(32)
    struct.pack_into("<IIIIQII", nvos21, 0, 1, 1, 2, 0x40, RECORDED_ADDRESS, 0, 0)
    inner = {"at": 8, "size": 32, "before": nvos21.hex(), "after": nvos21.hex(), "nested": []}
    xfer = struct.pack("<IIQ", 0x2B, 32, 0x1000)
    through_xfer = read_trace(write_trace(tmp_path / "d.jsonl", alloc_event(xfer, [inner], cmd=XFER_CMD)))
    assert through_xfer.allocation_sizes_recorded is False


def nested_at(address: int, at: int) -> int:
    return int(struct.unpack_from("<Q", ctypes.string_at(address + at, 8))[0])


def test_a_missing_params_block_is_replayed_as_zeros_of_the_class_size(tmp_path: Path) -> None:
    unknown = 0x1234
    trace = read_trace(write_trace(
        tmp_path / "t.jsonl",
        alloc_event(nvos64(0x40, RECORDED_ADDRESS)),  # line 3: 128 zero bytes
        alloc_event(nvos64(0x41, 0)),  # line 4: no params passed: left NULL
        alloc_event(nvos64(0x90E6, RECORDED_ADDRESS)),  # line 5: a class without params: 0 bytes, none lost
        alloc_event(nvos64(unknown, RECORDED_ADDRESS, params_size=16)),  # line 6: unknown class, by paramsSize
        alloc_event(struct.pack("<IIQ", 0x2B, 48, 0x1000), [{  # line 7: an RM_ALLOC inside IOCTL_XFER_CMD
            "at": 8, "size": 48, "before": nvos64(0x80, RECORDED_ADDRESS).hex(),
            "after": nvos64(0x80, RECORDED_ADDRESS).hex(), "nested": []}], cmd=XFER_CMD),
    ))
    blocks, lost = fill_missing_alloc_params(trace)
    assert sorted(blocks) == [3, 5, 6, 7] and lost == 3

    def params_of(block: Block) -> Block:
        (at, child), = block.nested
        assert at == 16
        return child

    assert params_of(blocks[3]).after == bytes(128) and params_of(blocks[3]).before == bytes(128)
    assert params_of(blocks[5]).after == b""
    assert params_of(blocks[6]).after == bytes(16)
    (at, inner), = blocks[7].nested
    assert at == 8 and params_of(inner).after == bytes(56)

    keep: list[ctypes.Array[ctypes.c_char]] = []
    address = _materialize(blocks[3], keep)
    pointer = nested_at(address, 16)
    assert pointer not in (0, RECORDED_ADDRESS) and ctypes.string_at(pointer, 128) == bytes(128)


def test_the_replayer_issues_zeros_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").write_bytes(b"")  # a regular file: ioctls fail, which the replay ignores
    trace = read_trace(write_trace(tmp_path / "t.jsonl", alloc_event(nvos64(0x40, RECORDED_ADDRESS)),
                                   alloc_event(nvos64(0x41, 0))))
    seen: list[tuple[int, int, bytes | None]] = []

    class FakeLibc:
        """What the replay hands the driver: the cmd, pAllocParms, and the bytes there."""

        @staticmethod
        def ioctl(fd: int, cmd: int, address: int) -> int:
            pointer = nested_at(address, 16)
            seen.append((cmd, pointer, ctypes.string_at(pointer, 128) if pointer else None))
            return -1

    monkeypatch.setattr(replay_module, "_libc", FakeLibc)
    stderr = io.StringIO()
    report = Replayer(dev, stderr=stderr).replay(trace)
    assert report.ioctls == 2
    (first, second) = seen
    assert first[0] == NVOS64_CMD and first[1] != RECORDED_ADDRESS and first[2] == bytes(128)
    assert second[1:] == (0, None)
    (line,) = stderr.getvalue().splitlines()
    assert "carries no allocation sizes" in line and "1 RM_ALLOC parameter blocks" in line


def test_a_trace_with_its_sizes_replays_silently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").write_bytes(b"")
    params = bytearray(128)
    struct.pack_into("<Q", params, 64, 2 << 20)
    sized = {"at": 16, "size": 128, "before": params.hex(), "after": params.hex(), "nested": []}
    trace = read_trace(write_trace(tmp_path / "t.jsonl", alloc_event(nvos64(0x40, RECORDED_ADDRESS), [sized]),
                                   header={**HEADER, "alloc_params": "by-class"}))
    assert trace.allocation_sizes_recorded is True
    monkeypatch.setattr(replay_module, "_libc", type("Quiet", (), {"ioctl": staticmethod(lambda *a: -1)}))
    stderr = io.StringIO()
    Replayer(dev, stderr=stderr).replay(trace)
    assert stderr.getvalue() == ""
