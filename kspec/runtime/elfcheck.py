"""Is a host `.so` a whole ELF file?  Checked before every dlopen (standard library only).

`dlopen` maps a shared library and trusts its headers: a truncated or damaged file can pass the
loader and then fault (SIGBUS) when a page beyond the end of the file is touched, which kills the
process instead of raising.  `check_shared_object` reads the ELF header, the program headers and
the section headers and refuses, with a KspecRuntimeError naming the file, any file whose headers,
loaded segments or sections do not lie within it.
"""
from __future__ import annotations

import struct
from pathlib import Path

from kspec.runtime.errors import KspecRuntimeError

_ET_DYN = 3
_EM_X86_64, _EM_AARCH64 = 62, 183
_PT_LOAD = 1
_SHT_NOBITS = 8


def check_shared_object(path: str | Path, what: str = "host library") -> None:
    """Raise KspecRuntimeError unless `path` is a whole little-endian ELF64 shared object."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KspecRuntimeError(f"{path}: cannot read the {what}: {e.strerror}") from None
    why = elf_problem(data)
    if why is not None:
        raise KspecRuntimeError(f"{path}: the {what} is not a whole shared library ({why})",
                                hint="the artifact is damaged: rebuild it with `kspec compile`")


def elf_problem(data: bytes) -> str | None:
    """What is wrong with `data` as an ELF64 shared object, or None."""
    n = len(data)
    if n < 64 or data[:4] != b"\x7fELF":
        return f"{n} bytes, no ELF header"
    if data[4] != 2 or data[5] != 1:
        return "not a little-endian 64-bit ELF file"
    (e_type, e_machine, _ver, _entry, e_phoff, e_shoff, _flags, e_ehsize, e_phentsize, e_phnum,
     e_shentsize, e_shnum, _shstrndx) = struct.unpack_from("<HHIQQQIHHHHHH", data, 16)
    if e_type != _ET_DYN:
        return f"ELF type {e_type}, not a shared object"
    if e_machine not in (_EM_X86_64, _EM_AARCH64):
        return f"machine {e_machine}, not x86-64 or AArch64"
    if e_phnum == 0 or e_phentsize < 56 or e_phoff + e_phnum * e_phentsize > n:
        return f"program headers end at byte {e_phoff + e_phnum * e_phentsize} of {n}"
    for k in range(e_phnum):
        p_type, _pf, p_offset, _va, _pa, p_filesz, _memsz, _align = struct.unpack_from(
            "<IIQQQQQQ", data, e_phoff + k * e_phentsize)
        if p_type == _PT_LOAD and p_offset + p_filesz > n:
            return f"loaded segment {k} ends at byte {p_offset + p_filesz} of {n}"
    if e_shnum:
        if e_shentsize < 64 or e_shoff + e_shnum * e_shentsize > n:
            return f"section headers end at byte {e_shoff + e_shnum * e_shentsize} of {n}"
        for k in range(e_shnum):
            _name, sh_type, _f, _addr, sh_offset, sh_size = struct.unpack_from(
                "<IIQQQQ", data, e_shoff + k * e_shentsize)
            if sh_type != _SHT_NOBITS and sh_offset + sh_size > n:
                return f"section {k} ends at byte {sh_offset + sh_size} of {n}"
    return None
