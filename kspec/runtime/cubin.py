"""What a cubin declares about its kernels, read from the ELF file itself (standard library only).

A cubin is an ELF64 file.  For every kernel `f` it has
- a `FUNC` symbol of that name (entry points carry `STO_CUDA_ENTRY` in `st_other`),
- `.nv.info.f`: a list of attributes, each `u8 format, u8 attribute` followed by a `u16` value
  (formats 1-3) or a `u16` size and that many bytes (format 4, `EIFMT_SVAL`),
- `.nv.shared.f` (NOBITS): the static shared memory the kernel reserves,
- `.nv.constant0.f`: the constant bank that holds the kernel parameters.

The attributes used here, with the names `cuobjdump -elf` prints (tests/test_launch_abi.py checks
this reader against cuobjdump on real cubins):
  EIATTR_KPARAM_INFO (0x17)     per parameter: index, ordinal, offset, size (bits 18-31 of a u32)
  EIATTR_CBANK_PARAM_SIZE (0x19) bytes of the parameter area of the constant bank (includes padding
                                 before an over-aligned parameter, so it can exceed the parameter sizes)
  EIATTR_PARAM_CBANK (0x0a)     constant-bank section, offset and size of the parameter area
  EIATTR_MAX_THREADS (0x05)     `__launch_bounds__` / `.maxntid` (x, y, z)
  EIATTR_REQNTID (0x10)         `.reqntid`: the only block shape the kernel may be launched with
  EIATTR_CTA_PER_CLUSTER (0x3d), EIATTR_EXPLICIT_CLUSTER (0x3e), EIATTR_MAX_CLUSTER_RANK (0x3f)
  EIATTR_REGCOUNT (0x2f, in `.nv.info`), EIATTR_NUM_BARRIERS (0x4c), EIATTR_NUM_MBARRIERS (0x38)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from kspec.runtime.errors import KspecRuntimeError as KspecError

EIATTR_NAMES: dict[int, str] = {
    0x04: "EIATTR_CTAIDZ_USED",
    0x05: "EIATTR_MAX_THREADS",
    0x0a: "EIATTR_PARAM_CBANK",
    0x10: "EIATTR_REQNTID",
    0x17: "EIATTR_KPARAM_INFO",
    0x19: "EIATTR_CBANK_PARAM_SIZE",
    0x1b: "EIATTR_MAXREG_COUNT",
    0x1c: "EIATTR_EXIT_INSTR_OFFSETS",
    0x1e: "EIATTR_CRS_STACK_SIZE",
    0x2f: "EIATTR_REGCOUNT",
    0x36: "EIATTR_SW_WAR",
    0x37: "EIATTR_CUDA_API_VERSION",
    0x38: "EIATTR_NUM_MBARRIERS",
    0x3d: "EIATTR_CTA_PER_CLUSTER",
    0x3e: "EIATTR_EXPLICIT_CLUSTER",
    0x3f: "EIATTR_MAX_CLUSTER_RANK",
    0x4c: "EIATTR_NUM_BARRIERS",
    0x50: "EIATTR_SPARSE_MMA_MASK",
}
_CODE = {v: k for k, v in EIATTR_NAMES.items()}
_EIFMT_SVAL = 4
_SHT_NOBITS = 8
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10


@dataclass(frozen=True)
class Attribute:
    code: int
    fmt: int
    value: int | bytes             # u16 for formats 1-3, the raw bytes for EIFMT_SVAL

    @property
    def name(self) -> str:
        return EIATTR_NAMES.get(self.code, f"EIATTR_0x{self.code:02x}")

    def words(self) -> tuple[int, ...]:
        """An SVAL's payload as little-endian u32s."""
        b = self.value if isinstance(self.value, bytes) else b""
        return struct.unpack(f"<{len(b) // 4}I", b[: len(b) // 4 * 4])


@dataclass(frozen=True)
class ParamInfo:
    index: int
    ordinal: int
    offset: int                    # in the parameter area
    size: int                      # bytes


@dataclass(frozen=True)
class KernelInfo:
    """What the cubin declares about one kernel."""
    name: str
    entry: bool
    attributes: tuple[Attribute, ...]
    params: tuple[ParamInfo, ...]               # by ordinal
    param_area_bytes: int | None                # EIATTR_CBANK_PARAM_SIZE
    max_threads: tuple[int, int, int] | None    # EIATTR_MAX_THREADS
    reqntid: tuple[int, int, int] | None        # EIATTR_REQNTID
    cluster_dims: tuple[int, int, int] | None   # EIATTR_CTA_PER_CLUSTER (compile-time cluster)
    explicit_cluster: bool                      # EIATTR_EXPLICIT_CLUSTER: must launch with a cluster
    max_cluster_rank: int | None                # EIATTR_MAX_CLUSTER_RANK
    static_smem_bytes: int                      # size of .nv.shared.<name>
    registers: int | None = None                # EIATTR_REGCOUNT from the module's .nv.info

    def attribute_names(self) -> list[str]:
        return [a.name for a in self.attributes]


@dataclass(frozen=True)
class CubinInfo:
    path: str
    sm: int                                     # 90, 100, ... from e_flags
    kernels: dict[str, KernelInfo] = field(default_factory=dict)

    def kernel(self, name: str) -> KernelInfo:
        if name not in self.kernels:
            raise KspecError(f"{self.path}: the cubin has no kernel '{name}' "
                             f"(kernels: {', '.join(self.kernels) or 'none'})")
        return self.kernels[name]


def read_cubin(path: str | Path) -> CubinInfo:
    p = Path(path)
    return parse_cubin(p.read_bytes(), str(p))


def parse_cubin(data: bytes, what: str = "cubin") -> CubinInfo:
    """Parse a cubin image; a file that is not a 64-bit little-endian CUDA ELF is a KspecError."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise KspecError(f"{what}: not a 64-bit little-endian ELF file (is it a cubin?)")
    (e_machine,) = struct.unpack_from("<H", data, 18)
    if e_machine != 190:   # EM_CUDA
        raise KspecError(f"{what}: ELF machine {e_machine} is not EM_CUDA (190)")
    e_flags, = struct.unpack_from("<I", data, 48)
    e_shoff, = struct.unpack_from("<Q", data, 40)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 58)
    try:
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
        shstr = sections[e_shstrndx]
    except (struct.error, IndexError):
        raise KspecError(f"{what}: truncated ELF section table") from None

    def cstr(table_off: int, off: int) -> str:
        end = data.index(b"\0", table_off + off)
        return data[table_off + off:end].decode("ascii", "replace")

    named = []
    for s in sections:
        name = cstr(shstr[4], s[0])
        named.append((name, s))
    by_name = {n: s for n, s in named}

    # symbols: entry functions
    funcs: dict[str, bool] = {}
    symbol_names: list[str] = []
    for _sec_name, s in named:
        if s[1] != 2:      # SHT_SYMTAB
            continue
        strtab = sections[s[6]]
        for off in range(s[4], s[4] + s[5], 24):
            st_name, st_info, st_other, _shndx, _value, _size = struct.unpack_from("<IBBHQQ", data, off)
            sym = cstr(strtab[4], st_name) if st_name else ""
            symbol_names.append(sym)
            if st_info & 0xF == _STT_FUNC:
                funcs[sym] = bool(st_other & _STO_CUDA_ENTRY)

    def attrs_of(sec) -> list[Attribute]:
        off, end = sec[4], sec[4] + sec[5]
        out = []
        while off + 4 <= end:
            fmt, code = data[off], data[off + 1]
            if fmt == _EIFMT_SVAL:
                (size,) = struct.unpack_from("<H", data, off + 2)
                out.append(Attribute(code, fmt, bytes(data[off + 4:off + 4 + size])))
                off += 4 + size
            else:
                (v,) = struct.unpack_from("<H", data, off + 2)
                out.append(Attribute(code, fmt, v))
                off += 4
        return out

    regs: dict[str, int] = {}
    if ".nv.info" in by_name:
        for a in attrs_of(by_name[".nv.info"]):
            if a.code == _CODE["EIATTR_REGCOUNT"]:
                sym_index, count = a.words()[:2]
                if sym_index < len(symbol_names):
                    regs[symbol_names[sym_index]] = count

    kernels: dict[str, KernelInfo] = {}
    for name, s in named:
        if not name.startswith(".nv.info."):
            continue
        fn = name[len(".nv.info."):]
        attrs = attrs_of(s)
        first = {}
        for a in attrs:
            first.setdefault(a.code, a)
        params = []
        for a in attrs:
            if a.code == _CODE["EIATTR_KPARAM_INFO"]:
                index, ord_off, flags = struct.unpack_from("<IIL", a.value)
                params.append(ParamInfo(index, ord_off & 0xFFFF, ord_off >> 16, (flags >> 18) & 0x3FFF))
        params.sort(key=lambda q: q.ordinal)

        def dims(code_name: str) -> tuple[int, int, int] | None:
            a = first.get(_CODE[code_name])
            if a is None:
                return None
            w = (tuple(a.words()) + (1, 1, 1))[:3]
            return (int(w[0]), int(w[1]), int(w[2]))

        area = first.get(_CODE["EIATTR_CBANK_PARAM_SIZE"])
        rank = first.get(_CODE["EIATTR_MAX_CLUSTER_RANK"])
        shared = by_name.get(f".nv.shared.{fn}")
        kernels[fn] = KernelInfo(
            name=fn, entry=funcs.get(fn, False), attributes=tuple(attrs), params=tuple(params),
            param_area_bytes=int(area.value) if area is not None and not isinstance(area.value, bytes) else None,
            max_threads=dims("EIATTR_MAX_THREADS"), reqntid=dims("EIATTR_REQNTID"),
            cluster_dims=dims("EIATTR_CTA_PER_CLUSTER"),
            explicit_cluster=_CODE["EIATTR_EXPLICIT_CLUSTER"] in first,
            max_cluster_rank=(int(rank.words()[0]) if rank is not None and isinstance(rank.value, bytes)
                              else (int(rank.value) if rank is not None else None)),
            static_smem_bytes=int(shared[5]) if shared is not None else 0,
            registers=regs.get(fn))
    # CUDA 12+ cubins keep the SM number in bits 8-15 of e_flags (older ones in bits 16-23)
    sm = (e_flags >> 8) & 0xFF or (e_flags >> 16) & 0xFF
    return CubinInfo(what, sm, kernels)
