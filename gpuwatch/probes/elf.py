"""Function symbols of an ELF64 shared library -> file offsets, for uprobes.

A uprobe is placed at a file offset. We read .dynsym and .symtab and map each symbol's
virtual address through the PT_LOAD program headers. Pure Python, no BCC.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

SHT_SYMTAB = 2
SHT_DYNSYM = 11
PT_LOAD = 1
STT_FUNC = 2
STT_GNU_IFUNC = 10


class ElfError(ValueError):
    """Not a little-endian ELF64 file, or a truncated one."""


def symbol_offsets(path: str, names: Iterable[str]) -> dict[str, int]:
    """Return {symbol: file offset} for the wanted function symbols defined in `path`."""
    wanted = set(names)
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfError(f"{path}: not a little-endian ELF64 file")
    (e_phoff, e_shoff) = struct.unpack_from("<QQ", data, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, 0x36)
    loads = []
    for i in range(e_phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, _filesz, p_memsz, _align = struct.unpack_from(
            "<IIQQQQQQ", data, e_phoff + i * e_phentsize)
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_memsz, p_offset))
    sections = []
    for i in range(e_shnum):
        sections.append(struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize))
    found: dict[str, int] = {}
    for sh in sections:
        sh_type, sh_offset, sh_size, sh_link, sh_entsize = sh[1], sh[4], sh[5], sh[6], sh[9]
        if sh_type not in (SHT_SYMTAB, SHT_DYNSYM) or sh_entsize == 0:
            continue
        str_off = sections[sh_link][4]
        for off in range(sh_offset, sh_offset + sh_size, sh_entsize):
            st_name, st_info, _other, st_shndx, st_value, _size = struct.unpack_from("<IBBHQQ", data, off)
            if st_value == 0 or st_shndx == 0 or (st_info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC):
                continue
            end = data.index(b"\0", str_off + st_name)
            name = data[str_off + st_name:end].decode(errors="replace").split("@", 1)[0]
            if name not in wanted or name in found:
                continue
            for vaddr, memsz, foff in loads:
                if vaddr <= st_value < vaddr + memsz:
                    found[name] = st_value - vaddr + foff
                    break
    return found
