"""kspec's dependency-free core: the errors, the arch table, the dtype table, the identifier rule
and the artifact ABI version with its C prototypes.  Every stage imports these from here; there is
one copy of each table.  Standard library only: importing this module must stay as cheap as Python.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

REPORT_HINT = "this is a bug in kspec; please report it with the command and spec that triggered it"


@dataclass(frozen=True)
class Span:
    """A half-open region of a source file; lines and columns are 1-based."""
    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


# The most characters of a source line an error shows (the part around the caret).
EXCERPT_MAX = 200


@dataclass
class Diagnostic:
    message: str
    span: Span | None = None
    hint: str | None = None
    source: str | None = field(default=None, repr=False)

    def render(self) -> str:
        where = f"{self.span}: " if self.span else ""
        out = [f"{where}error: {self.message}"]
        if self.span and self.source is not None:
            # split on '\n' only: spans count lines the way Lark does, and str.splitlines() would
            # also break at '\f', '\x1c', '\u2028', ... (legal inside comments)
            lines = self.source.split("\n")
            if 1 <= self.span.line <= len(lines):
                text = lines[self.span.line - 1].rstrip("\r").expandtabs(1)
                col = self.span.col
                width = 1
                if self.span.end_line == self.span.line and self.span.end_col > self.span.col:
                    width = self.span.end_col - self.span.col
                width = max(1, min(width, len(text) - col + 2))
                if len(text) > EXCERPT_MAX:
                    # a long line is shown as the part around the caret, marked where it is cut
                    start = max(0, min(col - 1 - EXCERPT_MAX // 4, len(text) - EXCERPT_MAX))
                    cut = text[start:start + EXCERPT_MAX]
                    head = "..." if start > 0 else ""
                    tail = "..." if start + EXCERPT_MAX < len(text) else ""
                    col = col - start + len(head)
                    width = max(1, min(width, len(cut) + len(head) - col + 1))
                    text = head + cut + tail
                out.append("    " + text)
                out.append("    " + " " * (col - 1) + "^" * width)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


class KspecError(Exception):
    """A mistake in the user's spec, arguments or environment (CLI exit 1).  Carries one or more
    diagnostics, each with an optional source span and hint; `str()` renders them the way the CLI
    prints them."""

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None,
                 source: str | None = None, diagnostics: list[Diagnostic] | None = None):
        if diagnostics is None:
            diagnostics = [Diagnostic(message, span, hint, source)]
        self.diagnostics = diagnostics
        first = diagnostics[0]
        self.message, self.span, self.hint = first.message, first.span, first.hint
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)

    def with_source(self, source: str) -> "KspecError":
        for d in self.diagnostics:
            if d.source is None:
                d.source = source
        self.args = (self.render(),)
        return self


def os_problem(e: OSError, path) -> str:
    """What an OSError about creating or writing `path` means, for a message that names the path:
    "<ancestor> is a file" when a file stands where a folder must be (mkdir says "File exists"
    or "Not a directory" then), else the system's words."""
    from pathlib import Path
    for up in (Path(path), *Path(path).parents):
        if up.exists():
            if up != Path(path) and not up.is_dir():
                return f"{up} is a file, not a directory"
            break
    return e.strerror or str(e)


class KspecInternalError(Exception):
    """A bug in kspec itself, never a user mistake: the CLI exits 2 with a report hint and shows
    the traceback under --debug."""


class NoBackendError(KspecError):
    """No backend can build a kernel on an arch (a user-facing limit, not a fault): names the
    kernel, the arch and each backend's reason, so callers tell it apart by type, not by message."""

    def __init__(self, kernel: str, kind: str, arch: str, reasons: tuple[tuple[str, str], ...],
                 span: Span | None = None, hint: str | None = None):
        self.kernel, self.kind, self.arch, self.reasons = kernel, kind, arch, tuple(reasons)
        why = "; ".join(f"{b}: {r}" for b, r in self.reasons) or "no backend implements this kind of kernel"
        super().__init__(f"no backend can build kernel {kernel} ({kind}) on {arch}: {why}", span, hint)


class KspecRuntimeError(KspecError):
    """A call that cannot run: bad arguments, no usable CUDA device, or a failed launch.  Names the
    kernel, the argument, what was expected and what was given; raised before any launch."""


# ---------------------------------------------------------------------------------------------
# Archs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    name: str                    # kspec spelling: "sm90a"
    cc: int                      # compute capability major*10 + minor
    nvcc: str                    # nvcc / ptxas target: "sm_90a"
    min_nvcc: tuple[int, int]    # oldest CUDA toolkit that targets it
    family: str                  # "hopper" | "blackwell"


ARCH_TABLE: dict[str, Arch] = {a.name: a for a in (
    Arch("sm90a", 90, "sm_90a", (12, 0), "hopper"),
    Arch("sm100a", 100, "sm_100a", (12, 8), "blackwell"),
)}
ARCHS: tuple[str, ...] = tuple(ARCH_TABLE)


def normalize_arch(text: str) -> str:
    """`sm_90a`, `SM90A`, `sm90a` -> "sm90a"; raises KspecError for an unknown arch."""
    a = text.strip().lower().replace("sm_", "sm")
    if a not in ARCH_TABLE:
        raise KspecError(f"unknown arch '{text.strip()}'", hint=f"archs: {', '.join(ARCHS)}")
    return a


def select_archs(text: str | None, targets: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The archs of a command: `--arch a,b` if given, else the spec's `target` line, else all."""
    if text:
        return tuple(normalize_arch(a) for a in text.split(",") if a.strip())
    return tuple(targets) or ARCHS


def parse_sizes(text: str | None) -> dict[str, int]:
    """`M=256,N=512` -> {"M": 256, "N": 512}."""
    out: dict[str, int] = {}
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, value = part.partition("=")
        if not eq or not name.strip().isidentifier():
            raise KspecError(f"bad size '{part}'", hint="write sizes as NAME=VALUE pairs: M=256,N=512,K=128")
        try:
            v = int(value)
        except ValueError:
            raise KspecError(f"size {name.strip()}={value!r} is not an integer") from None
        if v < 1 or v > 1 << 31:
            raise KspecError(f"size {name.strip()}={v} is out of range (1 to 2^31)")
        out[name.strip()] = v
    return out


def arch_of_cc(cc: int) -> str | None:
    """The arch whose cubins run on a device of compute capability `cc` (major*10+minor), or None."""
    for a in ARCH_TABLE.values():
        if a.cc == cc:
            return a.name
    return None


# ---------------------------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DType:
    name: str                    # kspec spelling
    bits: int                    # storage bits
    kind: str                    # "float" | "int"
    storage: str                 # the dtype of the memory holding it (tf32 lives in f32 storage)
    max_finite: float            # largest finite value
    rank: int                    # float promotion rank: the wider operand wins (tf32 and f32 tie)

    @property
    def itemsize(self) -> int:
        """Bytes per element; 1 for the 4-bit f4e2m1, which memory holds two values a byte (the
        byte size of a tensor of it is `storage_bytes`)."""
        return max(1, self.bits // 8)

    def storage_bytes(self, count: int) -> int:
        """Bytes of memory `count` values occupy: their bits in whole bytes (two f4e2m1 values a byte,
        packed along the contiguous axis)."""
        return (count * self.bits + 7) // 8

    @property
    def per_byte(self) -> int:
        """Values per byte of memory: 2 for a 4-bit dtype (packed along the contiguous axis), else 1."""
        return 8 // self.bits if self.bits < 8 else 1


DTYPE_TABLE: dict[str, DType] = {d.name: d for d in (
    DType("f16", 16, "float", "f16", 65504.0, 2),
    DType("bf16", 16, "float", "bf16", 3.3895313892515355e38, 2),
    DType("f32", 32, "float", "f32", 3.4028234663852886e38, 3),
    DType("tf32", 32, "float", "f32", 3.4028234663852886e38, 3),
    DType("f8e4m3", 8, "float", "f8e4m3", 448.0, 1),
    DType("f8e5m2", 8, "float", "f8e5m2", 57344.0, 1),
    DType("i8", 8, "int", "i8", 127.0, 1),
    DType("i32", 32, "int", "i32", 2147483647.0, 2),
    # block-scaled (MX / NVFP4) data and scales: FP4 e2m1 (values 0, ±0.5 .. ±6, two a byte) and the
    # power-of-two scale E8M0 (2^-127 .. 2^127, no sign, no zero; 0xFF is NaN)
    DType("f4e2m1", 4, "float", "f4e2m1", 6.0, 1),
    DType("f8e8m0", 8, "float", "f8e8m0", 1.7014118346046923e38, 1),
)}
DTYPES: tuple[str, ...] = tuple(DTYPE_TABLE)
FLOAT_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPE_TABLE.values() if d.kind == "float")
INT_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPE_TABLE.values() if d.kind == "int")
FP8_DTYPES: tuple[str, ...] = ("f8e4m3", "f8e5m2")
# storage formats: arithmetic on them happens in f32 (as on the hardware)
STORAGE_FLOATS: tuple[str, ...] = ("f8e4m3", "f8e5m2", "f8e8m0", "f4e2m1", "tf32")


def dtype_bytes(name: str) -> int:
    return DTYPE_TABLE[name].itemsize


def is_int(name: str) -> bool:
    return DTYPE_TABLE[name].kind == "int"


# ---------------------------------------------------------------------------------------------
# Identifiers
# ---------------------------------------------------------------------------------------------

IDENT_MAX = 255
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,%d}$" % (IDENT_MAX - 1))


def is_ident(name: object) -> bool:
    """An identifier kspec may put into generated code or a manifest (ASCII letters, digits, _)."""
    return isinstance(name, str) and IDENT_RE.match(name) is not None


# The names a spec may give its kernels, tensors and params: one rule, one table.  spec_lang.check
# refuses a name that breaks it at the name's span; kspec.artifact refuses a manifest that holds one.
NAME_MAX = 128       # characters of a user name (plan ids, intermediate and file names derive from it)
# keywords of a kernel call (`mod.k(A, B, stream=s)`, `mod.k.to_device(..., device=0)`) and its
# receiver: a tensor or param of one of these names could not be passed by name
RESERVED_ARG_NAMES: frozenset[str] = frozenset({"stream", "device", "self"})
# attributes of a loaded module (kspec.runtime.module.Module): a kernel is an attribute of it too
RESERVED_KERNEL_NAMES: frozenset[str] = frozenset({
    "path", "manifest", "archs", "kernels", "binary", "variant", "glue", "image", "image_digest", "arch_for",
    "split_variants", "step_variants", "launches"})


def name_problem(name: object, what: str) -> str | None:
    """Why `name` cannot be the name of a `what` ("kernel", "tensor", "param"), or None."""
    import keyword
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return "is not an identifier (ASCII letters, digits and _, not starting with a digit)"
    if len(name) > NAME_MAX:
        return f"is {len(name)} characters long; names have at most {NAME_MAX}"
    if keyword.iskeyword(name):
        return "is a Python keyword" + (" (a kernel is an attribute of the loaded module)" if what == "kernel"
                                        else " (arguments are passed by name)")
    if name.startswith("__"):
        return "starts with '__', which Python reserves for its own attributes"
    if what == "kernel" and name in RESERVED_KERNEL_NAMES:
        return "is an attribute of every loaded module"
    if what != "kernel" and name in RESERVED_ARG_NAMES:
        return f"is reserved by the runtime (the call's `{name}` keyword)" if name != "self" else \
            "is reserved by the runtime (the kernel object itself)"
    return None


# Where `kspec compile`, `kspec run FILE` and `kspec build DIR` write when no -o is given: not
# `build/`, which setuptools and most build systems own.
DEFAULT_OUT_DIR = "out"


def file_stem(name: str, limit: int = 64) -> str:
    """`name` as the start of a file name: unchanged up to `limit` characters, else cut and followed
    by a hash of the whole name (file systems cap a name at 255 bytes; distinct names stay distinct)."""
    if len(name) <= limit:
        return name
    import hashlib
    return f"{name[:limit - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def check_ident(name: object, what: str) -> str:
    """Generated names are sanitized upstream; refuse anything else as an internal fault."""
    if not is_ident(name):
        raise KspecInternalError(f"{what} name {name!r} is not an identifier (names must be mapped before codegen)")
    return name  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Artifact ABI
# ---------------------------------------------------------------------------------------------

# Bumped whenever the host-glue entry points or the manifest's launch fields change meaning.
# 3: kspec_workspace_size takes the device and its SM count (persistent schedulers size their
#    workspace by it), and every glue exports kspec_abi_version.
ABI_VERSION = 3

WORKSPACE_PROTO = ("int kspec_workspace_size(const int64_t* dims, int32_t device, int32_t sm_count,\n"
                   "                         uint64_t* bytes, char* err, uint64_t err_cap)")
PREPARE_PROTO = ("int kspec_prepare(const int64_t* dims, void* const* ptrs, const double* scalars,\n"
                 "                  void* workspace, int32_t device, int32_t sm_count,\n"
                 "                  void* params, uint64_t params_cap, uint64_t* params_size,\n"
                 "                  uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],\n"
                 "                  uint32_t* smem_bytes, char* err, uint64_t err_cap)")
ABI_VERSION_PROTO = "int kspec_abi_version(void)"


# The variant roles of a binary whose kernels run in this order as one call, sharing one workspace
# (FlashAttention-4's attention backward, backends/cute/attention_bwd.py), and that workspace's
# layout: the f32 dQ accumulator [B, H, S_r * E_r], then D = rowsum(dO * O) and LSE * log2(e), each
# [B, H, S_r] f32 (S_r: S rounded up to tile_m, E_r: the rounded head dim), each 256-byte aligned.
ATTENTION_BWD_STEPS = ("bwd_preprocess", "bwd_main", "bwd_postprocess")


def attention_bwd_workspace(B: int, H: int, S: int, tile_m: int, head_dim_rounded: int,
                            packed: bool = False) -> "dict[str, tuple]":
    """name -> (byte offset, shape) of dq_accum, dpsum and lse_log2 ([B, H, n]; packed queries:
    [H, n], S the packed row count, each sequence padded as FlashAttention-4 pads it); "total":
    (bytes, ())."""
    def up(n: int, m: int) -> int:
        return -(-n // m) * m
    sr = (S + (B + 1) * tile_m - 1) // tile_m * tile_m if packed else up(S, tile_m)
    lead = (H,) if packed else (B, H)
    n = H if packed else B * H
    acc = up(n * sr * head_dim_rounded * 4, 256)
    rows = up(n * sr * 4, 256)
    return {"dq_accum": (0, (*lead, sr * head_dim_rounded)), "dpsum": (acc, (*lead, sr)),
            "lse_log2": (acc + rows, (*lead, sr)), "total": (acc + 2 * rows, ())}


def abi_header() -> str:
    """The C header every host glue source includes (generated; see backends/ABI.md)."""
    return (f"// kspec host-glue ABI, version {ABI_VERSION} (generated by kspec.core.abi_header)\n"
            "#pragma once\n#include <stdint.h>\n"
            f"#define KSPEC_ABI_VERSION {ABI_VERSION}\n"
            "#ifdef __cplusplus\nextern \"C\" {\n#endif\n"
            f"{WORKSPACE_PROTO};\n{PREPARE_PROTO};\n{ABI_VERSION_PROTO};\n"
            "#ifdef __cplusplus\n}\n#endif\n")


# ---------------------------------------------------------------------------------------------
# Extents: a size symbol, an int, or a product of those (a tuple)
# ---------------------------------------------------------------------------------------------
# An axis's extent is a size symbol bound by the arguments' shapes ("S"), a literal (128), or a
# product (a tuple, ("MP", "P")): the extent of an index the checker derives, such as a paged
# key axis j read as `Kc[bt[b, j / P], j % P, ..]` whose `j / P` indexes an axis of extent MP.

def extent_value(extent, sizes: "dict[str, int]") -> int:
    """The value of an extent (symbol, int or product tuple) at the given size-symbol values."""
    if isinstance(extent, int):
        return extent
    if isinstance(extent, tuple):
        out = 1
        for x in extent:
            out *= extent_value(x, sizes)
        return out
    off = split_offset_dim(extent)
    if off is not None and extent not in sizes:
        return sizes[off[0]] + off[1]
    quo = split_quotient_dim(extent)
    if quo is not None and extent not in sizes:
        return sizes[quo[0]] // quo[1]
    return sizes[extent]


def split_offset_dim(dim) -> "tuple[str, int] | None":
    """A declared dimension `B + 1` is stored as the extent "B+1" (the B + 1 cumulative offsets
    of B sequences): ("B", 1); None for any other extent."""
    if isinstance(dim, str) and "+" in dim:
        sym, _, k = dim.partition("+")
        return sym, int(k)
    return None


def split_quotient_dim(dim) -> "tuple[str, int] | None":
    """A declared dimension `K / 32` is stored as the extent "K/32" (one block scale per 32 values
    along K): ("K", 32); None for any other extent.  The quotient is exact: a call whose K is not a
    multiple of 32 is refused by the runtime before any launch."""
    if isinstance(dim, str) and "/" in dim:
        sym, _, q = dim.partition("/")
        return sym, int(q)
    return None


def packed_rows_symbol(offsets: str) -> str:
    """The size symbol of the row count of the tensors packed by `offsets` (`packed(cu_q)`: stored as
    [cu_q_rows, ...] arrays).  The checker reserves it: no spec may name a size symbol so."""
    return f"{offsets}_rows"


def format_extent(extent) -> str:
    """An extent as text: `MP*P` for a product."""
    return "*".join(map(str, extent)) if isinstance(extent, tuple) else str(extent)


# ---------------------------------------------------------------------------------------------
# Index ranges: the contract between the compile step and the runtime's pre-launch check
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexRange:
    """An integer input tensor whose values are used as subscripts: every element of `tensor`
    selects an element along axis `axis` of `target`, so it must lie in [0, extent) (`extent` a
    size symbol or an int).  `negative`: a negative value is allowed too (it selects nothing).
    `inclusive`: the bound itself is allowed, [0, extent] (offsets such as cumulative sequence
    lengths, where `extent` marks the end).  `monotonic`: values never decrease along the tensor's
    last axis (cumulative offsets).  `ends`: the first value along the last axis is 0 and the last
    is the extent itself (the offsets of a packed tensor: the first sequence starts at its first
    row and the last ends at its last row, so every row belongs to a sequence).  Computed
    from the kernel IR by the compile step
    (kspec.compiler.indices), recorded per kernel in the artifact manifest, checked by the runtime
    before a launch (kspec.runtime.indexcheck)."""
    tensor: str
    target: str
    axis: int
    extent: "str | int"
    negative: bool = False
    plans: tuple[str, ...] = ()          # the plans that read it
    inclusive: bool = False
    monotonic: bool = False
    ends: bool = False
    ignore: "int | None" = None          # a sentinel value (an ignore index) the kernels never gather by

    def bound(self, sizes: "dict[str, int]") -> int:
        """The upper bound at the given size-symbol values (exclusive unless `inclusive`)."""
        return extent_value(self.extent, sizes)

    def condition(self, bound: "str | int | None" = None) -> str:
        """`0 <= t < bound` as text (the recorded extent when no bound value is given)."""
        hi = format_extent(self.extent) if bound is None else bound
        text = f"{'' if self.negative else '0 <= '}{self.tensor} {'<=' if self.inclusive else '<'} {hi}"
        return text if self.ignore is None else f"{text} or {self.tensor} == {self.ignore}"

    def describe(self) -> str:
        order = (", non-decreasing" if self.monotonic else "") + (", the first 0 and the last equal to it" if self.ends else "")
        return f"{self.condition()} ({self.target} axis {self.axis}{order})"
