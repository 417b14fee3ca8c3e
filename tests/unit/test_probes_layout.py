"""The ctypes mirror (gpuwatch/probes/layout.py) matches bpf/gpuwatch.h exactly.

Compiles a tiny C program against the real header that prints sizeof/offsetof of every
mirrored struct and field and the value of every mirrored constant, and compares."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuwatch.probes import layout


def _c_program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "gpuwatch.h"', "int main(void) {"]
    for cname, mirror in layout.STRUCTS.items():
        lines.append(f'printf("size {cname} %zu\\n", sizeof(struct {cname}));')
        for fname, *_ in mirror._fields_:
            lines.append(f'printf("off {cname}.{fname} %zu\\n", offsetof(struct {cname}, {fname}));')
    for const in layout.CONSTANTS:
        lines.append(f'printf("const {const} %lld\\n", (long long)({const}));')
    for cls in (*layout.RM_ALLOC_PARAMS_BYTES, 0xBEEF):
        lines.append(f'printf("params 0x{cls:x} %u\\n", gw_rm_alloc_params_bytes({cls:#x}));')
    lines += ["return 0;", "}"]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def header_facts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler is required for the layout check (apt-get install gcc)")
    work = tmp_path_factory.mktemp("layout")
    src = work / "layout.c"
    src.write_text(_c_program())
    exe = work / "layout"
    subprocess.run([cc, "-I", str(layout.BPF_DIR), "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    facts: dict[str, int] = {}
    for line in out.splitlines():
        kind, name, value = line.split()
        facts[f"{kind} {name}"] = int(value)
    return facts


@pytest.mark.parametrize("cname", sorted(layout.STRUCTS))
def test_struct_size_and_offsets_match_header(cname: str, header_facts: dict[str, int]) -> None:
    mirror = layout.STRUCTS[cname]
    assert ctypes.sizeof(mirror) == header_facts[f"size {cname}"]
    for fname, *_ in mirror._fields_:
        assert getattr(mirror, fname).offset == header_facts[f"off {cname}.{fname}"], fname


def test_every_header_struct_is_mirrored() -> None:
    text = Path(layout.HEADER_PATH).read_text()
    declared = {line.split()[1] for line in text.splitlines() if line.startswith("struct gw_")}
    # contexts/scratch/in-flight records are kernel-only
    kernel_only = {"gw_sys_enter_args", "gw_sys_exit_args", "gw_path", "gw_open_inflight",
                   "gw_ioctl_inflight", "gw_cuda_inflight"}
    assert declared - kernel_only == set(layout.STRUCTS)


@pytest.mark.parametrize("const", layout.CONSTANTS)
def test_constants_match_header(const: str, header_facts: dict[str, int]) -> None:
    assert getattr(layout, const) == header_facts[f"const {const}"]


def test_stat_names_cover_every_stat() -> None:
    assert len(layout.STAT_NAMES) == layout.GW_STAT_COUNT


def test_rm_alloc_params_table_matches_header(header_facts: dict[str, int]) -> None:
    """Every class of the mirror sizes as the header's switch does, and the header's table
    lists no class the mirror lacks (parsed from GW_RM_ALLOC_PARAMS_TABLE)."""
    for cls, size in layout.RM_ALLOC_PARAMS_BYTES.items():
        assert header_facts[f"params {cls:#x}"] == size, hex(cls)
    text = Path(layout.HEADER_PATH).read_text()
    table = text[text.index("#define GW_RM_ALLOC_PARAMS_TABLE"):text.index("#define GW_RM_ALLOC_PARAMS_CASE")]
    in_header = {int(m.split(",")[0], 16) for m in re.findall(r"X\((0x[0-9A-Fa-f]+, *\d+)\)", table)}
    assert in_header == set(layout.RM_ALLOC_PARAMS_BYTES)


def test_decoded_fields_lie_inside_their_class_blocks_and_unknown_classes_read_nothing(
        header_facts: dict[str, int]) -> None:
    assert header_facts["params 0xbeef"] == 0  # not in the table
    assert layout.RM_ALLOC_PARAMS_BYTES[layout.GW_NV01_MEMORY_LOCAL_USER] >= layout.GW_NV_MEMORY_PARAMS_SIZE_OFFSET + 8
    assert layout.RM_ALLOC_PARAMS_BYTES[layout.GW_NV01_DEVICE_0] >= 4
