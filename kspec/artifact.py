"""The compiled-artifact format: `manifest.json` and the binaries beside it (format version 1).

This module owns the manifest's dataclasses, their JSON form, structural validation, and the
integrity check of the binaries.  The compile driver builds a `Manifest` and calls
`write_manifest(dir, manifest)`; `kspec.load` calls `read_manifest(dir)`.  Every problem is a
`KspecArtifactError` whose message names the offending file.

Layout of an artifact directory::

    OUT/<spec stem>/manifest.json
    OUT/<spec stem>/<plan id>.<arch>.cubin      device code (backends/ABI.md)
    OUT/<spec stem>/<plan id>.<arch>.so         host glue   (backends/ABI.md)

`manifest.json`, format version 1::

    {
      "format": "kspec-artifact", "format_version": 1, "kspec_version": "0.1.0",
      "spec": {"file": "gemm.kspec", "sha256": "<hex of the spec text>"},
      "toolchain": {"nvcc": "13.0.88", "cutlass": "4.2.0.0"},     # free-form name -> version
      "archs": ["sm90a", "sm100a"],            # every plan has a binary for every arch listed
      "kernels": [{                            # one per spec kernel
        "name": "gemm_bias_relu",              # a Python identifier; the Module attribute
        "inputs":  [{"name": "A", "dtype": "f16", "shape": ["M", "K"], "layout": "row"}, ...],
        "outputs": [{"name": "D", "dtype": "f16", "shape": ["M", "N"], "layout": "row"}],
        "params":  [{"name": "alpha", "dtype": "f32", "default": 1.0}],   # default may be null
        "intermediates": [{"name": "t3", "dtype": "f32", "shape": ["M", "N"], "layout": "row"}],
        "index_ranges": [{"tensor": "label", "target": "logits", "axis": 1, "extent": "V",
                          "negative": false, "inclusive": false, "monotonic": false,
                          "plans": ["cross_entropy_0"]}],
        "plans": [{                            # launched in this order on one stream
          "id": "gemm_bias_relu_0", "kind": "gemm",          # gemm | attention | elementwise
          "dims": [["M", "M"], ["N", "N"], ["K", "K"], ["L", 1]],
          "args": ["A", "B", "bias", "D"],
          "scalars": ["alpha"],
          "init": {"rowmax": "neg_inf"},
          "alignment": {"A": 16, "B": 16, "D": 16},
          "multiples": {"K": 64},               # optional
          "binaries": {"sm90a": {
              "cubin": "gemm_bias_relu_0.sm90a.cubin", "host": "gemm_bias_relu_0.sm90a.so",
              "sha256": {"cubin": "<hex>", "host": "<hex>"},
              "symbol": "kspec_kernel",
              "config": {"tile": "128x128x64"},  # informational (kspec inspect)
              "backend": "cutlass", "kind": "gemm",   # who built it, and as what
              "registers": 168, "smem": 0,      # informational; may be null
              "variants": [...]}}               # optional: size-bucketed builds of the plan, below
        }]
      }]
    }

Meaning of the fields
- Names (kernels, tensors, params) are identifiers (`[A-Za-z_][A-Za-z0-9_]*`), unique within a
  kernel across inputs, outputs, params and intermediates, and follow the rule the checker applies
  to a spec (kspec.core.name_problem): at most NAME_MAX characters, no Python keyword, no leading
  `__`; `stream`, `device` and `self` are reserved (the call's keywords), and kernel names are not
  attributes of a loaded module (`path`, `kernels`, ...: kspec.core.RESERVED_KERNEL_NAMES).
- dtype: one of f16, bf16, f32, tf32, f8e4m3, f8e5m2, i8, i32, f4e2m1, f8e8m0 (tf32 tensors are
  stored as f32; f4e2m1 two values a byte).
- shape: each extent is a size symbol (an identifier, bound at call time from the arguments) or a
  non-negative int literal.  Every symbol used anywhere must occur in some input or output shape.
  An extent may also be `SYM+INT` (`B+1`: the B + 1 cumulative offsets of B packed sequences),
  which binds SYM to the argument's extent minus INT, or `SYM/INT` (`K/32`: one block scale per 32
  values), which binds nothing: SYM must be a multiple of INT and the extent SYM / INT.
- packed (optional, a tensor name): a variable-length batch `packed(cu)` is stored as
  [cu_rows, ...] (kspec.core.packed_rows_symbol: the sequences back to back, sequence b at rows
  cu[b] .. cu[b + 1] - 1); its shape is that storage shape, and the kernel's index_ranges hold the
  checks of its offsets (inclusive, monotonic, ends).
- layout fixes the strides, in elements, from the shape:
  `row` = C-contiguous (the last axis has stride 1);
  `col` = the last two axes swapped: a column-major matrix with any batch axes outermost, i.e.
  for shape [..., R, C] the strides are [..., R*C, 1, R].  `col` needs rank >= 2.
  Axes of extent 1 may have any stride.
- plans[*].dims: the ABI's size roles in ABI order (see backends/desc.py `EmittedKernel.dims`),
  each a symbol, an int, or a list of them whose product is the value (a flattened batch [B, H]);
  each mapped to a size symbol of the kernel or an int literal; the loader passes their values to
  `kspec_workspace_size`/`kspec_prepare` in this order.
- plans[*].args: tensor names (inputs, outputs, intermediates) in ABI pointer order.
- plans[*].scalars: in ABI order, each a param name or a number literal (a folded constant);
  passed to the host glue as doubles.
- plans[*].init: tensors (outputs or intermediates) the loader fills before this plan's launch:
  "zero" or "neg_inf" (-inf for floats; the most negative value for ints and f8e4m3).
- plans[*].alignment: required byte alignment of the data pointer of a tensor argument; every
  non-unit stride of that tensor, in bytes, must be a multiple of it too (row pitches).
- plans[*].multiples (optional): dims roles whose value must be a multiple of the given positive
  int (the kernel has no tail handling along it: a GEMM whose A rows are gathered reads whole
  128-byte K tiles); the runtime refuses a call whose sizes are not, before any launch.  Absent: {}.
- plans[*].strides (optional): dims roles whose value is a tensor argument's actual stride, in
  elements, along one axis ({role: [tensor, axis]}) rather than its dense layout's.  A row-layout
  tensor whose every axis but the last has such a role in every plan taking it may be passed with
  any such strides (rows at a pitch, row views of wider tensors); its last axis stays contiguous.
- intermediates: global buffers written by one plan and read by a later one; the loader allocates
  them per call, stream-ordered.
- index_ranges: the integer inputs whose values are subscripts (kspec.core.IndexRange): every
  element of `tensor` (an integer input) selects along axis `axis` of `target` (a tensor name, for
  messages), so it must lie in [0, extent) (`extent` a size symbol bound by the arguments, or an
  int); `negative: true` allows negative values too, `inclusive: true` the extent itself
  ([0, extent]: offsets that mark an end, such as cumulative sequence lengths), and
  `monotonic: true` asks that values never decrease along the tensor's last axis.  The optional
  flags default to false.  The runtime checks them before a launch
  (kspec.runtime.indexcheck).  `[]`: the kernel uses no index tensor.  Absent (artifacts written
  before kspec recorded them): nothing is known, so nothing is checked before the launch; the
  kernels' own guards still keep every read in bounds.
- binaries[*].variants (optional; FlashAttention-4 attention kernels): builds of the same plan for
  different size buckets, each {"cubin", "host", "sha256", "symbol", "config", "select"}, where
  select is a list of boxes {dims role: [lo, hi]} (inclusive, hi null = unbounded); the loader
  launches the first variant one of whose boxes holds the call's dims values.  Every variant
  computes the same function (buckets choose speed); config records what each was built for
  (e.g. "sm_count", the SKU whose SM count its launcher was built with).  The binary's own
  cubin/host are its first variant's.
- binaries: file names are relative to the artifact directory and stay inside it; sha256 is the
  hex digest of each file, checked by `read_manifest`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

# The runtime reads artifacts on machines without the compiler: only the dependency-free core here.
from kspec.core import (ARCHS, DTYPES, IDENT_RE, IndexRange, KspecError, is_int, name_problem,
                        packed_rows_symbol, split_offset_dim, split_quotient_dim)

FORMAT = "kspec-artifact"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

LAYOUTS: tuple[str, ...] = ("row", "col")
PLAN_KINDS: tuple[str, ...] = ("gemm", "attention", "elementwise")
INIT_KINDS: tuple[str, ...] = ("zero", "neg_inf")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

Extent = Union[str, int]          # a size symbol or an int literal
ScalarRef = Union[str, float, int]  # a param name or a folded constant


class KspecArtifactError(KspecError):
    """A compiled artifact that cannot be used: unreadable, malformed, of another format version,
    or with binaries missing or altered since it was written."""


@dataclass(frozen=True)
class SpecRef:
    file: str
    sha256: str


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[Extent, ...]
    layout: str = "row"
    packed: str | None = None           # `packed(cu)`: shape is the storage [cu_rows, ...] (see "packed")

    def strides(self, extents: tuple[int, ...]) -> tuple[int, ...]:
        """Strides in elements of a tensor of this layout with the given extents."""
        return layout_strides(extents, self.layout)

    def describe(self) -> str:
        dims = ", ".join(str(e) for e in self.shape)
        lay = "" if self.layout == "row" else f" {self.layout}"
        pk = f" packed({self.packed})" if self.packed else ""
        return f"{self.dtype}[{dims}]{lay}{pk}"


@dataclass(frozen=True)
class ParamSpec:
    name: str
    dtype: str
    default: float | int | None = None


@dataclass(frozen=True)
class Variant:
    """One size bucket of a binary (see "variants" above); the same fields as Binary plus select."""
    cubin: str
    host: str
    sha256: dict[str, str]
    symbol: str = "kspec_kernel"
    config: dict[str, str] = field(default_factory=dict)
    select: tuple[dict[str, tuple[int, int | None]], ...] = ()

    def holds(self, values: dict[str, int]) -> bool:
        return any(all(r in values and lo <= values[r] and (hi is None or values[r] <= hi)
                       for r, (lo, hi) in box.items()) for box in self.select)


@dataclass(frozen=True)
class Binary:
    cubin: str
    host: str
    sha256: dict[str, str]                     # {"cubin": hex, "host": hex}
    symbol: str = "kspec_kernel"
    config: dict[str, str] = field(default_factory=dict)
    registers: int | None = None
    smem: int | None = None
    backend: str = ""                          # the backend that built it (e.g. "cutlass", "generic")
    kind: str = ""                             # the kernel kind that backend built (gemm, attention, ...)
    variants: tuple[Variant, ...] = ()         # size-bucketed builds (the first is cubin/host above)


@dataclass(frozen=True)
class Plan:
    id: str
    kind: str
    dims: tuple[tuple[str, Union[Extent, tuple[Extent, ...]]], ...]
    args: tuple[str, ...]
    scalars: tuple[ScalarRef, ...] = ()
    init: dict[str, str] = field(default_factory=dict)
    alignment: dict[str, int] = field(default_factory=dict)
    binaries: dict[str, Binary] = field(default_factory=dict)
    strides: dict[str, tuple[str, int]] = field(default_factory=dict)   # dims role -> (tensor, axis)
    multiples: dict[str, int] = field(default_factory=dict)             # dims role -> what it is a multiple of


@dataclass(frozen=True)
class KernelEntry:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    params: tuple[ParamSpec, ...] = ()
    intermediates: tuple[TensorSpec, ...] = ()
    plans: tuple[Plan, ...] = ()
    index_ranges: tuple[IndexRange, ...] | None = None    # None: not recorded (an older artifact)

    def tensor(self, name: str) -> TensorSpec | None:
        for t in (*self.inputs, *self.outputs, *self.intermediates):
            if t.name == name:
                return t
        return None


@dataclass(frozen=True)
class Manifest:
    spec: SpecRef
    archs: tuple[str, ...]
    kernels: tuple[KernelEntry, ...]
    toolchain: dict[str, str] = field(default_factory=dict)
    kspec_version: str = "0.1.0"
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def kernel(self, name: str) -> KernelEntry | None:
        return next((k for k in self.kernels if k.name == name), None)


def layout_strides(extents: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Element strides of a dense tensor: row = C-contiguous; col = last two axes swapped."""
    n = len(extents)
    order = list(range(n))                  # axes from outermost to innermost in memory
    if layout == "col" and n >= 2:
        order[-1], order[-2] = order[-2], order[-1]
    strides = [0] * n
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= max(int(extents[axis]), 1)
    return tuple(strides)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_binary(directory: str | os.PathLike, cubin: str, host: str, *, symbol: str = "kspec_kernel",
                config: dict[str, str] | None = None, registers: int | None = None,
                smem: int | None = None, backend: str = "", kind: str = "") -> Binary:
    """A `Binary` for two files already written into `directory` (names relative to it), with
    their digests computed now.  The compile driver calls this after nvcc."""
    d = Path(directory)
    return Binary(cubin=cubin, host=host,
                  sha256={"cubin": sha256_file(d / cubin), "host": sha256_file(d / host)},
                  symbol=symbol, config=dict(config or {}), registers=registers, smem=smem,
                  backend=backend, kind=kind)


# ---------------------------------------------------------------------------------- JSON form

def _tensor_json(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "layout": t.layout,
            **({"packed": t.packed} if t.packed else {})}


def _binary_json(b: Binary) -> dict[str, Any]:
    out = {"cubin": b.cubin, "host": b.host, "sha256": dict(b.sha256), "symbol": b.symbol,
           "config": dict(b.config), "registers": b.registers, "smem": b.smem,
           "backend": b.backend, "kind": b.kind}
    if b.variants:
        out["variants"] = [{"cubin": v.cubin, "host": v.host, "sha256": dict(v.sha256), "symbol": v.symbol,
                            "config": dict(v.config),
                            "select": [{r: [lo, hi] for r, (lo, hi) in box.items()} for box in v.select]}
                           for v in b.variants]
    return out


def _range_json(r: IndexRange) -> dict[str, Any]:
    return {"tensor": r.tensor, "target": r.target, "axis": r.axis, "extent": r.extent, "negative": r.negative,
            "inclusive": r.inclusive, "monotonic": r.monotonic, **({"ends": True} if r.ends else {}),
            **({"ignore": r.ignore} if r.ignore is not None else {}),
            "plans": list(r.plans)}


def _plan_json(p: Plan) -> dict[str, Any]:
    return {"id": p.id, "kind": p.kind, "dims": [[r, list(v) if isinstance(v, tuple) else v] for r, v in p.dims], "args": list(p.args),
            "scalars": list(p.scalars), "init": dict(p.init), "alignment": dict(p.alignment),
            "binaries": {a: _binary_json(b) for a, b in p.binaries.items()},
            **({"strides": {r: [t, a] for r, (t, a) in p.strides.items()}} if p.strides else {}),
            **({"multiples": dict(p.multiples)} if p.multiples else {})}


def manifest_to_json(m: Manifest) -> dict[str, Any]:
    return {
        "format": m.format, "format_version": m.format_version, "kspec_version": m.kspec_version,
        "spec": {"file": m.spec.file, "sha256": m.spec.sha256},
        "toolchain": dict(m.toolchain),
        "archs": list(m.archs),
        "kernels": [{
            "name": k.name,
            "inputs": [_tensor_json(t) for t in k.inputs],
            "outputs": [_tensor_json(t) for t in k.outputs],
            "params": [{"name": p.name, "dtype": p.dtype, "default": p.default} for p in k.params],
            "intermediates": [_tensor_json(t) for t in k.intermediates],
            "plans": [_plan_json(p) for p in k.plans],
            **({"index_ranges": [_range_json(r) for r in k.index_ranges]} if k.index_ranges is not None else {}),
        } for k in m.kernels],
    }


class _Reader:
    """Decodes the JSON tree into dataclasses; every complaint names the file and the JSON path."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, where: str, msg: str) -> KspecArtifactError:
        return KspecArtifactError(f"{self.file}: {where}: {msg}" if where else f"{self.file}: {msg}",
                                  hint="rebuild the artifact with `kspec compile`")

    def get(self, obj: Any, key: str, where: str, kind: type | tuple[type, ...], optional=False,
            default: Any = None) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(where, "expected a JSON object")
        if key not in obj:
            if optional:
                return default
            raise self.fail(where, f"missing field '{key}'")
        v = obj[key]
        if optional and v is None:
            return default
        # bool is an int in Python; a JSON true is never a valid number here
        if not isinstance(v, kind) or (isinstance(v, bool) and bool not in _as_tuple(kind)):
            raise self.fail(f"{where}.{key}", f"expected {_kind_name(kind)}, got {json.dumps(v)[:60]}")
        return v

    def ident(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not IDENT_RE.match(v):
            raise self.fail(where, f"{json.dumps(v)[:60]} is not a valid identifier")
        return v

    def user_name(self, v: Any, what: str, where: str) -> str:
        """A name the spec gave (kspec.core.name_problem: the checker's rule)."""
        self.ident(v, where)
        why = name_problem(v, what)
        if why is not None:
            raise self.fail(where, f"{what} name {json.dumps(v)[:60]} {why}")
        return v

    def extent(self, v: Any, where: str) -> Extent:
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise self.fail(where, f"extent must be a size symbol or an int, got {json.dumps(v)[:60]}")
        if isinstance(v, int):
            if v < 0:
                raise self.fail(where, f"extent must be non-negative, got {v}")
            return v
        off = split_offset_dim(v) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\+[0-9]+", v) else None
        if off is not None:              # `B+1`: the B + 1 offsets of B packed sequences
            self.ident(off[0], where)
            return v
        quo = split_quotient_dim(v) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*/[1-9][0-9]*", v) else None
        if quo is not None:              # `K/32`: one block scale per 32 values along K
            self.ident(quo[0], where)
            return v
        return self.ident(v, where)

    def tensor(self, obj: Any, where: str) -> TensorSpec:
        name = self.user_name(self.get(obj, "name", where, str), "tensor", f"{where}.name")
        where = f"{where}({name})"
        dtype = self.get(obj, "dtype", where, str)
        if dtype not in DTYPES:
            raise self.fail(where, f"unknown dtype '{dtype}' (known: {', '.join(DTYPES)})")
        shape = self.get(obj, "shape", where, list)
        ext = tuple(self.extent(e, f"{where}.shape[{i}]") for i, e in enumerate(shape))
        layout = self.get(obj, "layout", where, str, optional=True, default="row")
        if layout not in LAYOUTS:
            raise self.fail(where, f"unknown layout '{layout}' (known: row, col)")
        if layout == "col" and len(ext) < 2:
            raise self.fail(where, "layout 'col' needs a tensor of rank >= 2")
        packed = self.get(obj, "packed", where, str, optional=True)
        if packed is not None:
            self.ident(packed, f"{where}.packed")
            if not ext or ext[0] != packed_rows_symbol(packed):
                raise self.fail(where, f"a tensor packed by '{packed}' is stored as [{packed_rows_symbol(packed)}, ...]")
        return TensorSpec(name, dtype, ext, layout, packed)

    def param(self, obj: Any, where: str) -> ParamSpec:
        name = self.user_name(self.get(obj, "name", where, str), "param", f"{where}.name")
        where = f"{where}({name})"
        dtype = self.get(obj, "dtype", where, str)
        if dtype not in DTYPES:
            raise self.fail(where, f"unknown dtype '{dtype}'")
        default = self.get(obj, "default", where, (int, float), optional=True)
        if isinstance(default, float) and not math.isfinite(default) and dtype in ("i8", "i32"):
            raise self.fail(where, "integer param with a non-finite default")
        return ParamSpec(name, dtype, default)

    def files(self, obj: Any, where: str) -> tuple[dict[str, str], dict[str, str]]:
        """The cubin/host file names and their digests of a binary or variant."""
        files = {}
        for key in ("cubin", "host"):
            files[key] = _check_relpath(self, self.get(obj, key, where, str), f"{where}.{key}")
        digests = self.get(obj, "sha256", where, dict)
        sha = {}
        for key in ("cubin", "host"):
            d = self.get(digests, key, f"{where}.sha256", str)
            if not _HEX64.match(d):
                raise self.fail(f"{where}.sha256.{key}", "expected a lowercase hex sha256 digest")
            sha[key] = d
        return files, sha

    def binary(self, obj: Any, where: str) -> Binary:
        files, sha = self.files(obj, where)
        symbol = self.ident(self.get(obj, "symbol", where, str, optional=True, default="kspec_kernel"),
                            f"{where}.symbol")
        config = self.get(obj, "config", where, dict, optional=True, default={})
        registers = self.get(obj, "registers", where, int, optional=True)
        smem = self.get(obj, "smem", where, int, optional=True)
        backend = self.get(obj, "backend", where, str, optional=True, default="")
        kind = self.get(obj, "kind", where, str, optional=True, default="")
        variants = tuple(self.variant(v, f"{where}.variants[{i}]")
                         for i, v in enumerate(self.get(obj, "variants", where, list, optional=True, default=[])))
        return Binary(files["cubin"], files["host"], sha, symbol,
                      {str(k): str(v) for k, v in config.items()}, registers, smem, backend, kind, variants)

    def variant(self, obj: Any, where: str) -> Variant:
        files, sha = self.files(obj, where)
        symbol = self.ident(self.get(obj, "symbol", where, str), f"{where}.symbol")
        config = self.get(obj, "config", where, dict, optional=True, default={})
        boxes = []
        for i, box in enumerate(self.get(obj, "select", where, list)):
            if not isinstance(box, dict) or not box:
                raise self.fail(f"{where}.select[{i}]", "expected a non-empty object {role: [lo, hi]}")
            rng = {}
            for role, r in box.items():
                if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], int) and not isinstance(r[0], bool)
                        and (r[1] is None or (isinstance(r[1], int) and not isinstance(r[1], bool) and r[1] >= r[0]))):
                    raise self.fail(f"{where}.select[{i}].{role}", "expected [lo, hi] integers (hi null: unbounded)")
                rng[str(role)] = (r[0], r[1])
            boxes.append(rng)
        return Variant(files["cubin"], files["host"], sha, symbol, {str(k): str(v) for k, v in config.items()},
                       tuple(boxes))

    def plan(self, obj: Any, where: str, kernel: "_KernelScope", archs: tuple[str, ...]) -> Plan:
        pid = self.ident(self.get(obj, "id", where, str), f"{where}.id")
        where = f"{where}({pid})"
        kind = self.get(obj, "kind", where, str)
        if kind not in PLAN_KINDS:
            raise self.fail(where, f"unknown plan kind '{kind}' (known: {', '.join(PLAN_KINDS)})")
        dims = []
        for i, d in enumerate(self.get(obj, "dims", where, list)):
            if not (isinstance(d, list) and len(d) == 2 and isinstance(d[0], str)):
                raise self.fail(f"{where}.dims[{i}]", "expected [role, symbol-or-int]")
            if isinstance(d[1], list):       # a product of extents, e.g. a flattened batch [B, H]
                v = tuple(self.extent(e, f"{where}.dims[{i}]") for e in d[1])
                if not v:
                    raise self.fail(f"{where}.dims[{i}]", "an empty product of extents")
            else:
                v = self.extent(d[1], f"{where}.dims[{i}]")
            for sym in (v if isinstance(v, tuple) else (v,)):
                if isinstance(sym, str) and sym not in kernel.bindable:
                    raise self.fail(f"{where}.dims[{i}]",
                                    f"size symbol '{sym}' occurs in no input or output shape")
            dims.append((d[0], v))
        args = tuple(self.ident(a, f"{where}.args[{i}]")
                     for i, a in enumerate(self.get(obj, "args", where, list)))
        for a in args:
            if a not in kernel.tensors:
                raise self.fail(f"{where}.args", f"'{a}' is not a tensor of kernel '{kernel.name}'")
        scalars: list[ScalarRef] = []
        for i, s in enumerate(self.get(obj, "scalars", where, list, optional=True, default=[])):
            if isinstance(s, bool) or not isinstance(s, (str, int, float)):
                raise self.fail(f"{where}.scalars[{i}]", "expected a param name or a number")
            if isinstance(s, str) and s not in kernel.params:
                raise self.fail(f"{where}.scalars[{i}]", f"'{s}' is not a param of kernel '{kernel.name}'")
            scalars.append(s)
        init = self.get(obj, "init", where, dict, optional=True, default={})
        for name, how in init.items():
            if name not in kernel.writable:
                raise self.fail(f"{where}.init", f"'{name}' is not an output or intermediate")
            if how not in INIT_KINDS:
                raise self.fail(f"{where}.init.{name}", f"unknown init '{how}' (known: zero, neg_inf)")
        alignment = self.get(obj, "alignment", where, dict, optional=True, default={})
        for name, a in alignment.items():
            if name not in args:
                raise self.fail(f"{where}.alignment", f"'{name}' is not an argument of this plan")
            if isinstance(a, bool) or not isinstance(a, int) or a <= 0 or a & (a - 1):
                raise self.fail(f"{where}.alignment.{name}", "expected a positive power of two")
        bins_obj = self.get(obj, "binaries", where, dict)
        binaries = {}
        for arch, b in bins_obj.items():
            if arch not in archs:
                raise self.fail(f"{where}.binaries", f"binary for '{arch}', which is not in archs {list(archs)}")
            binaries[arch] = self.binary(b, f"{where}.binaries.{arch}")
        for arch in archs:
            if arch not in binaries:
                raise self.fail(f"{where}.binaries", f"no binary for arch '{arch}'")
        strides: dict[str, tuple[str, int]] = {}
        roles = {r for r, _ in dims}
        for role, ref in self.get(obj, "strides", where, dict, optional=True, default={}).items():
            if role not in roles:
                raise self.fail(f"{where}.strides", f"'{role}' is not a dims role of this plan")
            if not (isinstance(ref, list) and len(ref) == 2 and ref[0] in args and isinstance(ref[1], int)
                    and not isinstance(ref[1], bool) and 0 <= ref[1] < kernel.rank[ref[0]]):
                raise self.fail(f"{where}.strides.{role}", "expected [tensor argument, axis]")
            strides[role] = (ref[0], ref[1])
        multiples: dict[str, int] = {}
        for role, m in self.get(obj, "multiples", where, dict, optional=True, default={}).items():
            if role not in roles:
                raise self.fail(f"{where}.multiples", f"'{role}' is not a dims role of this plan")
            if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
                raise self.fail(f"{where}.multiples.{role}", "expected a positive int")
            multiples[role] = m
        return Plan(pid, kind, tuple(dims), args, tuple(scalars), dict(init), dict(alignment), binaries, strides,
                    multiples)

    def kernel(self, obj: Any, where: str, archs: tuple[str, ...]) -> KernelEntry:
        name = self.user_name(self.get(obj, "name", where, str), "kernel", f"{where}.name")
        where = f"{where}({name})"
        groups = {}
        for key in ("inputs", "outputs", "intermediates"):
            items = self.get(obj, key, where, list, optional=(key == "intermediates"), default=[])
            groups[key] = tuple(self.tensor(t, f"{where}.{key}[{i}]") for i, t in enumerate(items))
        params = tuple(self.param(p, f"{where}.params[{i}]")
                       for i, p in enumerate(self.get(obj, "params", where, list, optional=True, default=[])))
        if not groups["outputs"]:
            raise self.fail(where, "a kernel needs at least one output")
        seen: set[str] = set()
        for n in [t.name for g in groups.values() for t in g] + [p.name for p in params]:
            if n in seen:
                raise self.fail(where, f"name '{n}' is used twice")
            seen.add(n)
        scope = _KernelScope(name, groups["inputs"], groups["outputs"], groups["intermediates"], params)
        for t in groups["intermediates"]:
            for e in t.shape:
                if isinstance(e, str) and e not in scope.bindable:
                    raise self.fail(f"{where}.intermediates({t.name})",
                                    f"size symbol '{e}' occurs in no input or output shape")
        plans = tuple(self.plan(p, f"{where}.plans[{i}]", scope, archs)
                      for i, p in enumerate(self.get(obj, "plans", where, list)))
        if not plans:
            raise self.fail(where, "a kernel needs at least one plan")
        ranges = self.get(obj, "index_ranges", where, list, optional=True)
        if ranges is not None:
            ranges = tuple(self.index_range(r, f"{where}.index_ranges[{i}]", scope, {p.id for p in plans})
                           for i, r in enumerate(ranges))
        return KernelEntry(name, groups["inputs"], groups["outputs"], params, groups["intermediates"], plans,
                           ranges)

    def index_range(self, obj: Any, where: str, kernel: "_KernelScope", plan_ids: set[str]) -> IndexRange:
        tensor = self.ident(self.get(obj, "tensor", where, str), f"{where}.tensor")
        spec = next((t for t in kernel.inputs if t.name == tensor), None)
        if spec is None or not is_int(spec.dtype):
            raise self.fail(f"{where}.tensor", f"'{tensor}' is not an integer input of kernel '{kernel.name}'")
        target = self.ident(self.get(obj, "target", where, str), f"{where}.target")
        axis = self.get(obj, "axis", where, int)
        if axis < 0:
            raise self.fail(f"{where}.axis", f"expected a non-negative axis, got {axis}")
        raw = self.get(obj, "extent", where, (str, int, list))
        # a list: the product of its extents (a paged key axis, pages * page size)
        extent = tuple(self.extent(x, f"{where}.extent[{i}]") for i, x in enumerate(raw)) \
            if isinstance(raw, list) and raw else self.extent(raw, f"{where}.extent")
        for sym in (extent if isinstance(extent, tuple) else (extent,)):
            if isinstance(sym, str) and sym not in kernel.bindable:
                raise self.fail(f"{where}.extent", f"size symbol '{sym}' occurs in no input or output shape")
        flags = {k: self.get(obj, k, where, bool, optional=True, default=False)
                 for k in ("negative", "inclusive", "monotonic", "ends")}
        ignore = self.get(obj, "ignore", where, int, optional=True, default=None)
        plans = tuple(self.get(obj, "plans", where, list, optional=True, default=[]))
        for p in plans:
            if p not in plan_ids:
                raise self.fail(f"{where}.plans", f"{json.dumps(p)[:60]} is not a plan of kernel '{kernel.name}'")
        return IndexRange(tensor, target, axis, extent, plans=plans, ignore=ignore, **flags)

    def manifest(self, obj: Any) -> Manifest:
        if not isinstance(obj, dict):
            raise self.fail("", "the manifest is not a JSON object")
        fmt = obj.get("format")
        if fmt != FORMAT:
            raise self.fail("", f"not a kspec artifact (format {json.dumps(fmt)}, expected \"{FORMAT}\")")
        ver = obj.get("format_version")
        if ver != FORMAT_VERSION:
            newer = isinstance(ver, int) and not isinstance(ver, bool) and ver > FORMAT_VERSION
            raise KspecArtifactError(
                f"{self.file}: unsupported artifact format version {json.dumps(ver)} "
                f"(this kspec reads version {FORMAT_VERSION})",
                hint="upgrade kspec to load it" if newer else "rebuild the artifact with `kspec compile`")
        kver = self.get(obj, "kspec_version", "", str)
        spec_obj = self.get(obj, "spec", "", dict)
        spec = SpecRef(self.get(spec_obj, "file", "spec", str), self.get(spec_obj, "sha256", "spec", str))
        toolchain = self.get(obj, "toolchain", "", dict, optional=True, default={})
        archs_list = self.get(obj, "archs", "", list)
        for a in archs_list:
            if a not in ARCHS:
                raise self.fail("archs", f"unknown arch {json.dumps(a)} (known: {', '.join(ARCHS)})")
        if not archs_list or len(set(archs_list)) != len(archs_list):
            raise self.fail("archs", "expected a non-empty list of distinct archs")
        archs = tuple(archs_list)
        kernels = tuple(self.kernel(k, f"kernels[{i}]", archs)
                        for i, k in enumerate(self.get(obj, "kernels", "", list)))
        names = [k.name for k in kernels]
        if len(set(names)) != len(names):
            raise self.fail("kernels", "two kernels have the same name")
        return Manifest(spec, archs, kernels, {str(k): str(v) for k, v in toolchain.items()}, kver)


@dataclass
class _KernelScope:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    intermediates: tuple[TensorSpec, ...]
    param_specs: tuple[ParamSpec, ...]

    def __post_init__(self):
        self.tensors = {t.name for t in (*self.inputs, *self.outputs, *self.intermediates)}
        self.rank = {t.name: len(t.shape) for t in (*self.inputs, *self.outputs, *self.intermediates)}
        self.writable = {t.name for t in (*self.outputs, *self.intermediates)}
        self.params = {p.name for p in self.param_specs}
        self.bindable = {e for t in (*self.inputs, *self.outputs) for e in t.shape if isinstance(e, str)}
        self.bindable |= {split_offset_dim(e)[0] for e in self.bindable if split_offset_dim(e)}


def _as_tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind) -> str:
    names = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


def _check_relpath(reader: _Reader, name: str, where: str) -> str:
    # binaries must stay inside the artifact directory: a manifest is data, not a path to anywhere
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise reader.fail(where, f"binary path {json.dumps(name)} must be relative and inside the artifact")
    return name


# ------------------------------------------------------------------------------ read / write

def manifest_from_json(obj: Any, file: str = MANIFEST_NAME) -> Manifest:
    """Validate a decoded manifest tree and build the dataclasses (no file checks)."""
    return _Reader(file).manifest(obj)


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    """Validate `manifest` and write `<directory>/manifest.json` atomically (temp file + rename).
    The binaries must already be in `directory`; their digests are checked before writing."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / MANIFEST_NAME
    checked = manifest_from_json(json.loads(json.dumps(manifest_to_json(manifest))), str(path))
    verify_binaries(d, checked, interfaces=False)     # the binaries the caller made, as it made them
    manifest = stamp_interfaces(d, manifest)
    obj = manifest_to_json(manifest)
    checked = manifest_from_json(json.loads(json.dumps(obj)), str(path))  # what a reader will see
    verify_binaries(d, checked)
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)          # mkstemp creates 0600; an artifact is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_manifest(directory: str | os.PathLike, verify: bool = True) -> Manifest:
    """Read and validate `<directory>/manifest.json` (or a path to the manifest itself); with
    `verify`, also check that every binary exists and matches its recorded sha256."""
    p = Path(directory)
    path = p if p.is_file() else p / MANIFEST_NAME
    if not path.is_file():
        where = f"{p}: no such artifact directory" if not p.exists() else f"{path}: file not found"
        raise KspecArtifactError(f"{where}", hint="build one with `kspec compile FILE -o OUT`")
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise KspecArtifactError(f"{path}: {size:,} bytes; a manifest has at most {MAX_MANIFEST_BYTES:,}",
                                     hint="rebuild the artifact with `kspec compile`")
        text = path.read_text(encoding="utf-8")
        depth = _json_depth(text)
        if depth > MAX_MANIFEST_DEPTH:
            raise KspecArtifactError(f"{path}: JSON nested {depth} levels deep; a manifest nests at most "
                                     f"{MAX_MANIFEST_DEPTH}", hint="rebuild the artifact with `kspec compile`")
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise KspecArtifactError(f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}",
                                 hint="rebuild the artifact with `kspec compile`") from None
    except RecursionError:
        raise KspecArtifactError(f"{path}: JSON nested too deeply", hint="rebuild the artifact with `kspec compile`") \
            from None
    except (OSError, UnicodeDecodeError) as e:
        raise KspecArtifactError(f"{path}: cannot read: {e}") from None
    m = manifest_from_json(obj, str(path))
    if verify:
        verify_binaries(path.parent, m)
    return m


def verify_binaries(directory: str | os.PathLike, manifest: Manifest, interfaces: bool = True) -> None:
    """Every binary file is a regular file inside the artifact (no symlink, nothing resolving
    outside it), has the digest the manifest records, and (interfaces) each host library carries
    the interface record of its plan (`stamp_interfaces`) that the manifest describes."""
    d = Path(directory)
    root = d.resolve()
    checked: dict[str, str] = {}
    for k in manifest.kernels:
        for plan in k.plans:
            files = [(arch, b) for arch, b0 in plan.binaries.items() for b in (b0, *b0.variants)]
            for arch, b in files:
                for key, name in (("cubin", b.cubin), ("host", b.host)):
                    f = d / name
                    what = f"binary of plan '{plan.id}' for {arch}"
                    if name not in checked:
                        if f.is_symlink() or any(q.is_symlink() for q in f.parents if q != d and d in q.parents):
                            raise KspecArtifactError(f"{f}: is a symbolic link ({key} {what}); an artifact holds "
                                                     "its binaries as plain files",
                                                     hint="rebuild the artifact with `kspec compile`")
                        if not f.is_file():
                            raise KspecArtifactError(f"{f}: missing ({key} {what})",
                                                     hint="rebuild the artifact with `kspec compile`")
                        if root not in f.resolve().parents:
                            raise KspecArtifactError(f"{f}: resolves outside the artifact directory ({key} {what})",
                                                     hint="rebuild the artifact with `kspec compile`")
                        checked[name] = sha256_file(f)
                    if checked[name] != b.sha256[key]:
                        raise KspecArtifactError(
                            f"{f}: sha256 mismatch ({key} {what}): the file was modified after the "
                            f"manifest was written", hint="rebuild the artifact with `kspec compile`")
                if interfaces:
                    _check_interface(d / b.host, k, plan, arch)


# ------------------------------------------------------------------------- interface records
#
# Each host library ends with a record of the interface it was built for: its plan's tensors
# (dtype, shape, layout, packing), argument order, size roles, strides, alignment, scalars and the
# params they name (dtype, default), the tensors it initialises, the launch fields (the cubin's
# name and digest, entry point, config; each size variant and the sizes it serves) and the index
# ranges checked before it launches.  `write_manifest` appends it
# (after the ELF image, which the loader never maps, so the library is unchanged as code); `load`
# reads it back and compares it with the manifest, naming the first field that differs.  So an
# edited manifest, or a library taken from another plan or artifact, does not load, though each
# file still matches its digest.
#
#     <ELF image> <record: UTF-8 JSON> <len(record): 8 bytes, little endian> <INTERFACE_MAGIC>

INTERFACE_MAGIC = b"KSPEC-INTERFACE1"
MAX_MANIFEST_BYTES = 64 << 20
MAX_MANIFEST_DEPTH = 32


def _json_depth(text: str) -> int:
    """How deeply a JSON text nests (brackets outside strings), without decoding it."""
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > best:
                best = depth
                if best > MAX_MANIFEST_DEPTH:
                    return best
        elif ch in "]}":
            depth -= 1
    return best


def plan_interface(k: KernelEntry, plan: Plan, arch: str) -> list[list]:
    """The interface a plan's binaries are built for, as ordered [field, value] pairs."""
    roles = {**{t.name: "input" for t in k.inputs}, **{t.name: "output" for t in k.outputs},
             **{t.name: "intermediate" for t in k.intermediates}}
    out: list[list] = [["kernel", k.name], ["plan", plan.id], ["arch", arch], ["kind", plan.kind],
                       ["args", list(plan.args)]]
    for a in plan.args:
        t = k.tensor(a)
        if t is None:
            continue
        out += [[f"{a}.role", roles[a]], [f"{a}.dtype", t.dtype], [f"{a}.shape", list(t.shape)],
                [f"{a}.layout", t.layout], [f"{a}.packed", t.packed]]
    out += [["dims", [[r, list(v) if isinstance(v, tuple) else v] for r, v in plan.dims]],
            ["strides", {r: [t, a] for r, (t, a) in sorted(plan.strides.items())}],
            ["alignment", {a: plan.alignment[a] for a in plan.args if a in plan.alignment}],
            ["scalars", list(plan.scalars)]]
    if plan.multiples:           # (recorded only where a plan has them: older records stay as they were)
        out.append(["multiples", dict(sorted(plan.multiples.items()))])
    params = {p.name: p for p in k.params}
    for sc in plan.scalars:
        if isinstance(sc, str) and sc in params:
            out += [[f"{sc}.dtype", params[sc].dtype], [f"{sc}.default", params[sc].default]]
    out.append(["init", dict(sorted(plan.init.items()))])
    # what the launch takes from the manifest besides the interface: the cubin (by name and
    # digest: a cubin swapped in with its digest is refused), its entry point, the launch config
    # (CuTe DSL parameter offsets, the SKUs) and each size variant with the sizes it serves
    b = plan.binaries.get(arch)
    if b is not None:
        def launch(x, select=None) -> dict:
            rec = {"cubin": x.cubin, "cubin_sha256": x.sha256.get("cubin"), "symbol": x.symbol,
                   "config": dict(sorted(x.config.items()))}
            return rec if select is None else {**rec, "host": x.host, "select": list(select)}
        out.append(["launch", launch(b)])
        if b.variants:
            out.append(["variants", [launch(v, v.select) for v in b.variants]])
    # the index tensors the runtime checks before this plan launches (an older artifact records none)
    ranges = [_range_json(r) for r in (k.index_ranges or ()) if plan.id in r.plans]
    if ranges:
        out.append(["index_ranges", ranges])
    return out


def _record(interfaces: list[list[list]]) -> bytes:
    body = json.dumps(interfaces, separators=(",", ":"), sort_keys=True).encode()
    return body + len(body).to_bytes(8, "little") + INTERFACE_MAGIC


def read_interfaces(path: str | os.PathLike) -> list[list[list]] | None:
    """The interface records at the end of a host library (one per plan it serves; a hand-built
    artifact may share one library between plans), or None if it has none."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        tail = len(INTERFACE_MAGIC) + 8
        if size < tail:
            return None
        f.seek(size - tail)
        end = f.read(tail)
        if not end.endswith(INTERFACE_MAGIC):
            return None
        n = int.from_bytes(end[:8], "little")
        if n > min(size - tail, 1 << 20):
            return None
        f.seek(size - tail - n)
        try:
            recs = json.loads(f.read(n))
        except (ValueError, RecursionError):
            return None
    ok = isinstance(recs, list) and recs and all(
        isinstance(r, list) and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) for x in r)
        for r in recs)
    return recs if ok else None


def _strip_record(data: bytes) -> bytes:
    tail = len(INTERFACE_MAGIC) + 8
    if len(data) >= tail and data.endswith(INTERFACE_MAGIC):
        n = int.from_bytes(data[-tail:-len(INTERFACE_MAGIC)], "little")
        if n <= len(data) - tail:
            return data[:len(data) - tail - n]
    return data


def stamp_interfaces(directory: str | os.PathLike, manifest: Manifest) -> Manifest:
    """Append the interface records of the plans each host library serves to it (replacing any
    already there) and return the manifest with the libraries' new digests."""
    d = Path(directory)
    served: dict[str, list] = {}
    for k in manifest.kernels:
        for plan in k.plans:
            for arch, b in plan.binaries.items():
                for host in dict.fromkeys((b.host, *(v.host for v in b.variants))):
                    rec = json.loads(json.dumps(plan_interface(k, plan, arch)))
                    if rec not in served.setdefault(host, []):
                        served[host].append(rec)
    digests = {}
    for host, recs in served.items():
        f = d / host
        data = _strip_record(f.read_bytes()) + _record(recs)
        tmp = f.with_name(f".{f.name}.stamp")
        tmp.write_bytes(data)
        os.chmod(tmp, os.stat(f).st_mode & 0o777)
        os.replace(tmp, f)
        digests[host] = hashlib.sha256(data).hexdigest()

    def rehash(sha: dict[str, str], host: str) -> dict[str, str]:
        return {**sha, "host": digests[host]}
    kernels = []
    for k in manifest.kernels:
        plans = []
        for plan in k.plans:
            bins = {}
            for arch, b in plan.binaries.items():
                variants = tuple(Variant(v.cubin, v.host, rehash(v.sha256, v.host), v.symbol, v.config, v.select)
                                 for v in b.variants)
                bins[arch] = Binary(b.cubin, b.host, rehash(b.sha256, b.host), b.symbol, b.config, b.registers,
                                    b.smem, b.backend, b.kind, variants)
            plans.append(Plan(plan.id, plan.kind, plan.dims, plan.args, plan.scalars, plan.init, plan.alignment,
                              bins, plan.strides, plan.multiples))
        kernels.append(KernelEntry(k.name, k.inputs, k.outputs, k.params, k.intermediates, tuple(plans),
                                   k.index_ranges))
    return Manifest(manifest.spec, manifest.archs, tuple(kernels), manifest.toolchain, manifest.kspec_version,
                    manifest.format, manifest.format_version)


def _check_interface(host: Path, k: KernelEntry, plan: Plan, arch: str) -> None:
    recs = read_interfaces(host)
    where = f"plan '{plan.id}' of kernel '{k.name}' ({arch})"
    hint = "rebuild the artifact with `kspec compile`"
    if recs is None:
        raise KspecArtifactError(f"{host}: the host library of {where} carries no interface record (written by an "
                                 "older kspec, or not by kspec)", hint=hint)
    want = json.loads(json.dumps(plan_interface(k, plan, arch)))
    if want in recs:
        return
    key = want[:3]                       # kernel, plan, arch: the record this plan would have
    have = dict((f, v) for f, v in next((r for r in recs if r[:3] == key), recs[0]))
    for field_name, value in want:
        if field_name not in have:
            raise KspecArtifactError(f"{host}: {where}: the manifest has '{field_name}', which the library was not "
                                     "built with", hint=hint)
        if have[field_name] != value:
            raise KspecArtifactError(
                f"{host}: {where}: '{field_name}' is {json.dumps(value)[:80]} in the manifest but the library was "
                f"built for {json.dumps(have[field_name])[:80]}", hint=hint)
    extra = next((f for f in have if f not in dict(want)), None)
    if extra is None:
        return
    raise KspecArtifactError(f"{host}: {where}: the library was built with '{extra}', which the manifest lacks",
                             hint=hint)
