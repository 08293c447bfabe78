"""Semantic checks: AST -> typed AST.

Resolves every name, checks ranks, index consistency, dimension unification and dtype rules,
and collects independent errors (up to `MAX_ERRORS`) into one `KspecError`.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, replace
from typing import Union

from kspec.core import (DTYPE_TABLE, FLOAT_DTYPES, INT_DTYPES, STORAGE_FLOATS, format_extent, name_problem, packed_rows_symbol,
                        split_offset_dim)

from . import ast
from .errors import Diagnostic, KspecError, Span
from .printer import BINARY_PREC, print_expr

MAX_ERRORS = 20
# The dtype of a condition (a comparison, and/or/not): it exists only inside expressions, as the
# first argument of `where`; it is never stored or loaded.
BOOL = "bool"
ARITH_OPS = ("+", "-", "*", "/", "%")
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
LOGIC_OPS = ("and", "or")

# name -> (min args, max args)
FUNCTIONS: dict[str, tuple[int, int]] = {
    "relu": (1, 1), "gelu": (1, 1), "gelu_tanh": (1, 1), "silu": (1, 1), "sigmoid": (1, 1),
    "tanh": (1, 1), "exp": (1, 1), "log": (1, 1), "sqrt": (1, 1), "rsqrt": (1, 1), "abs": (1, 1),
    "clamp": (3, 3), "maximum": (2, 2), "minimum": (2, 2),
}
_FLOAT_RANK = {d.name: d.rank for d in DTYPE_TABLE.values() if d.kind == "float"}
SCHEDULE_KEYS = ("tile", "cluster", "stages", "backend")
MAX_LITERAL_DIM = 1 << 31


def is_float(dt: str) -> bool:
    return dt in FLOAT_DTYPES


def accumulator_dtype(dt: str) -> str:
    return "i32" if dt in INT_DTYPES else "f32"


# ---------------------------------------------------------------- typed AST

DimValue = Union[str, int, tuple]   # a symbol name, a literal size, or a product (kspec.core.extent_value)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    role: str                     # in | out | param | temp
    dtype: str
    shape: tuple[DimValue, ...]   # () for scalar params
    layout: str = "row"
    default: float | int | None = None
    span: Span | None = field(default=None, compare=False, repr=False)
    packed: str | None = None     # `packed(cu)`: a varlen batch stored back to back (see the end of this file)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        def dim(d) -> str:
            off = split_offset_dim(d)
            return f"{off[0]} + {off[1]}" if off else format_extent(d)
        shape = f"[{', '.join(map(dim, self.shape))}]" if self.role != "param" else ""
        lay = " col" if self.layout == "col" else ""
        pk = f" packed({self.packed})" if self.packed else ""
        dflt = f" = {self.default}" if self.default is not None else ""
        return f"{self.name}: {self.dtype}{shape}{lay}{pk}{dflt}"


@dataclass(frozen=True)
class TExpr:
    dtype: str
    free: tuple[str, ...]         # free indices, in order of first appearance
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TConst(TExpr):
    value: float | int = 0
    weak: bool = True             # literals take the other operand's dtype


@dataclass(frozen=True)
class TScalar(TExpr):
    name: str = ""


@dataclass(frozen=True)
class TAccess(TExpr):
    tensor: str = ""
    indices: tuple[str, ...] = ()


@dataclass(frozen=True)
class TIndex(TExpr):
    """The integer value of an index (`j - i`, `h / G`): free over that index, dtype i32."""
    name: str = ""


@dataclass(frozen=True)
class TSize(TExpr):
    """The runtime value of a size symbol (`T - S`): a scalar, dtype i32."""
    name: str = ""


# A typed subscript: an index label (str), an integer literal (int), or an integer expression
# (TExpr): an element of an integer tensor (TAccess, TGather) or index arithmetic (`h / G`).
TSubscript = Union[str, int, TExpr]


@dataclass(frozen=True)
class TGather(TExpr):
    """tensor[subscripts]: at least one subscript is not a plain index label."""
    tensor: str = ""
    subscripts: tuple = ()            # tuple[TSubscript, ...]


def subscript_text(x, ctx: int = 0) -> str:
    """A typed subscript (or integer expression) as spec text, parenthesised where precedence needs
    it (ctx: the binding strength of the surrounding position, as in printer.py)."""
    if isinstance(x, TAccess):
        return f"{x.tensor}[{', '.join(x.indices)}]"
    if isinstance(x, TGather):
        return f"{x.tensor}[{', '.join(subscript_text(y) for y in x.subscripts)}]"
    if isinstance(x, (TIndex, TSize, TScalar)):
        return x.name
    if isinstance(x, TConst):
        return repr(x.value)
    if isinstance(x, TBinary):
        p = BINARY_PREC[x.op]
        text = f"{subscript_text(x.lhs, p + 1 if p == BINARY_PREC['<'] else p)} {x.op} " \
               f"{subscript_text(x.rhs, p + 1)}"
        return f"({text})" if p < ctx else text
    if isinstance(x, TUnary):
        text = f"not {subscript_text(x.operand, 3)}" if x.op == "not" else f"-{subscript_text(x.operand, 7)}"
        return f"({text})" if ctx > (3 if x.op == "not" else 7) else text
    if isinstance(x, TCast):
        return f"{x.dtype}({subscript_text(x.operand)})"
    if isinstance(x, TCall):
        return f"{x.fn}({', '.join(subscript_text(a) for a in x.args)})"
    return str(x)


def texpr_children(e: TExpr) -> tuple[TExpr, ...]:
    """The typed sub-expressions of e (gather subscripts included)."""
    if isinstance(e, TGather):
        return tuple(x for x in e.subscripts if isinstance(x, TExpr))
    if isinstance(e, TBinary):
        return (e.lhs, e.rhs)  # type: ignore[return-value]
    if isinstance(e, TCall):
        return e.args
    if isinstance(e, (TUnary, TCast, TReduce, TSoftmax)):
        return (e.operand,)  # type: ignore[return-value]
    return ()


@dataclass(frozen=True)
class TUnary(TExpr):
    op: str = "-"                 # - | not
    operand: TExpr | None = None


@dataclass(frozen=True)
class TBinary(TExpr):
    op: str = "+"                 # + - * / (floor division on integers) % < <= > >= == != and or
    lhs: TExpr | None = None
    rhs: TExpr | None = None


@dataclass(frozen=True)
class TCall(TExpr):
    fn: str = ""
    args: tuple[TExpr, ...] = ()


@dataclass(frozen=True)
class TCast(TExpr):
    operand: TExpr | None = None


@dataclass(frozen=True)
class TReduce(TExpr):
    op: str = "sum"               # sum | max | min | mean | logsumexp
    indices: tuple[str, ...] = ()
    operand: TExpr | None = None


@dataclass(frozen=True)
class TSoftmax(TExpr):
    axis: str = ""
    causal: str | None = None     # query index for a causal mask (key axis > query index is masked)
    operand: TExpr | None = None


@dataclass(frozen=True)
class TStmt:
    target: str
    indices: tuple[str, ...]
    dtype: str
    value: TExpr
    extents: tuple[tuple[str, DimValue], ...]   # every index of the statement -> its dimension
    span: Span | None = field(default=None, compare=False, repr=False)

    def extent(self, index: str) -> DimValue:
        return dict(self.extents)[index]


@dataclass(frozen=True)
class ScheduleHint:
    tile: tuple[int, int, int] | None = None
    cluster: tuple[int, int, int] | None = None
    stages: int | None = None
    backend: str | None = None        # a backend name; checked against the registry when planning
    spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)   # setting -> its span


@dataclass(frozen=True)
class CheckedKernel:
    name: str
    tensors: tuple[TensorInfo, ...]           # declaration order; temps in statement order
    stmts: tuple[TStmt, ...]
    symbols: tuple[str, ...]                  # size symbols, first-use order
    bindings: tuple[tuple[str, int], ...] = ()   # symbols fixed to a literal by unification
    schedules: tuple[tuple[str | None, ScheduleHint], ...] = ()   # arch (None = all) -> hint
    span: Span | None = field(default=None, compare=False, repr=False)

    def tensor(self, name: str) -> TensorInfo:
        by_name = self.__dict__.get("_by_name")
        if by_name is None:          # built once: a kernel of 10,000 statements looks names up often
            by_name = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_by_name", by_name)
        return by_name[name]

    def by_role(self, role: str) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if t.role == role)

    @property
    def inputs(self) -> tuple[TensorInfo, ...]:
        return self.by_role("in")

    @property
    def outputs(self) -> tuple[TensorInfo, ...]:
        return self.by_role("out")

    @property
    def params(self) -> tuple[TensorInfo, ...]:
        return self.by_role("param")

    def schedule_for(self, arch: str) -> ScheduleHint:
        """The hint for `arch`: an arch-specific schedule overrides the generic one field by field."""
        generic = dict(self.schedules).get(None, ScheduleHint())
        specific = dict(self.schedules).get(arch)
        if specific is None:
            return generic
        own = dict(specific.spans)
        return ScheduleHint(specific.tile or generic.tile, specific.cluster or generic.cluster,
                            specific.stages or generic.stages, specific.backend or generic.backend,
                            tuple(own.items()) + tuple((k, sp) for k, sp in generic.spans if k not in own))


@dataclass(frozen=True)
class CheckedProgram:
    kernels: tuple[CheckedKernel, ...]
    targets: tuple[str, ...]                  # archs from `target`, or () = default
    file: str = "<string>"
    source: str = field(default="", repr=False, compare=False)

    def kernel(self, name: str) -> CheckedKernel:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KspecError(f"no kernel named '{name}' in {self.file}",
                         hint=_suggest(name, [k.name for k in self.kernels]) or
                         f"kernels: {', '.join(k.name for k in self.kernels)}")


# ---------------------------------------------------------------- checker

def _suggest(name: str, candidates) -> str | None:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else None


class _Abort(Exception):
    """Stop checking the current statement after its first error."""


class _Checker:
    def __init__(self, program: ast.Program):
        self.program = program
        self.diags: list[Diagnostic] = []

    def error(self, msg: str, span: Span | None, hint: str | None = None, abort: bool = False):
        self.diags.append(Diagnostic(msg, span, hint, self.program.source))
        if len(self.diags) >= MAX_ERRORS:
            raise _TooMany()
        if abort:
            raise _Abort()

    # ---- program ----
    def run(self) -> CheckedProgram:
        p = self.program
        kernels = []
        try:
            seen: dict[str, ast.Kernel] = {}
            for k in p.kernels:
                if k.name in seen:
                    self.error(f"kernel '{k.name}' is defined twice", k.name_span or k.span,
                               f"the first definition is at line {seen[k.name].span.line}" if seen[k.name].span else None)
                    continue
                seen[k.name] = k
                self.check_name(k.name, "kernel", k.name_span or k.span)
            schedules = self.check_schedules(seen)
            for k in seen.values():
                ck = _KernelChecker(self, k).run()
                if ck is not None:
                    kernels.append(_with_schedules(ck, schedules.get(k.name, ())))
            targets = self.check_targets()
            if not p.kernels:
                self.error(f"{p.file} defines no kernels", None,
                           "a spec file holds one or more `kernel NAME { ... }` blocks")
        except _TooMany:
            self.diags.append(Diagnostic(f"too many errors; stopping after {MAX_ERRORS}", None))
        if self.diags:
            raise KspecError(self.diags[0].message, diagnostics=self.diags)
        return CheckedProgram(tuple(kernels), targets, p.file, p.source)

    def check_name(self, name: str, what: str, span: Span | None) -> bool:
        """The identifier rule of kspec.core (length, keywords, the runtime's reserved names)."""
        why = name_problem(name, what)
        if why is None:
            return True
        shown = name if len(name) <= 40 else name[:37] + "..."
        self.error(f"{what} name '{shown}' {why}", span, "choose another name")
        return False

    def check_targets(self) -> tuple[str, ...]:
        archs: list[str] = []
        for i, t in enumerate(self.program.targets):
            if i > 0:
                self.error("only one `target` line is allowed per file", t.span,
                           "list every arch in one line: `target sm90a, sm100a`")
                continue
            for a in t.archs:
                if a in archs:
                    self.error(f"arch '{a}' is listed twice", t.span)
                else:
                    archs.append(a)
        return tuple(archs)

    def check_schedules(self, kernels: dict[str, ast.Kernel]):
        out: dict[str, list[tuple[str | None, ScheduleHint]]] = {}
        seen: set[tuple[str, str | None]] = set()
        for sc in self.program.schedules:
            if sc.kernel not in kernels:
                self.error(f"schedule names unknown kernel '{sc.kernel}'", sc.name_span or sc.span,
                           _suggest(sc.kernel, kernels) or
                           (f"kernels in this file: {', '.join(kernels)}" if kernels else None))
                continue
            if (sc.kernel, sc.arch) in seen:
                self.error(f"kernel '{sc.kernel}' already has a schedule" + (f" for {sc.arch}" if sc.arch else ""),
                           sc.name_span or sc.span)
                continue
            seen.add((sc.kernel, sc.arch))
            hint = self.check_settings(sc)
            out.setdefault(sc.kernel, []).append((sc.arch, hint))
        return {k: tuple(v) for k, v in out.items()}

    def check_settings(self, sc: ast.Schedule) -> ScheduleHint:
        vals: dict[str, object] = {}
        taken: dict[str, ast.Setting] = {}
        for st in sc.settings:
            if st.key not in SCHEDULE_KEYS:
                self.error(f"unknown schedule setting '{st.key}'", st.span,
                           _suggest(st.key, SCHEDULE_KEYS) or f"settings: {', '.join(SCHEDULE_KEYS)}")
                continue
            if st.key in vals:
                self.error(f"setting '{st.key}' is given twice", st.span)
                continue
            if st.key == "backend":
                if not isinstance(st.value, str):
                    self.error("'backend' takes a backend name, like `backend = cutlass`", st.span)
                    continue
                vals[st.key], taken[st.key] = st.value, st
                continue
            if isinstance(st.value, str):
                self.error(f"'{st.key}' takes {'one integer' if st.key == 'stages' else 'three sizes'}, not a name",
                           st.span)
                continue
            if st.key in ("tile", "cluster") and not isinstance(st.value, tuple):
                self.error(f"'{st.key}' takes three sizes, like {'128x128x64' if st.key == 'tile' else '2x1x1'}",
                           st.span)
                continue
            if st.key == "stages" and isinstance(st.value, tuple):
                self.error("'stages' takes one integer, like `stages = 4`", st.span)
                continue
            # sizes only: which tiles, clusters and stage counts exist is each backend's to say, when
            # the kernel is planned (backends/*: setting_problem), at the setting's span
            if any(v < 1 for v in (st.value if isinstance(st.value, tuple) else (st.value,))):
                what = "the stage count is a positive integer" if st.key == "stages" else \
                    f"{st.key} sizes are positive integers"
                self.error(f"impossible {st.key} {st.text}: {what}", st.span)
                continue
            vals[st.key], taken[st.key] = st.value, st
        return ScheduleHint(vals.get("tile"), vals.get("cluster"), vals.get("stages"),  # type: ignore[arg-type]
                            vals.get("backend"),  # type: ignore[arg-type]
                            tuple((k, st.span) for k, st in taken.items() if st.span is not None))


class _TooMany(Exception):
    pass


def _with_schedules(k: CheckedKernel, schedules) -> CheckedKernel:
    return CheckedKernel(k.name, k.tensors, k.stmts, k.symbols, k.bindings, tuple(schedules), k.span)


class _KernelChecker:
    def __init__(self, parent: _Checker, kernel: ast.Kernel):
        self.p = parent
        self.k = kernel
        self.tensors: dict[str, TensorInfo] = {}
        self.decl_spans: dict[str, Span | None] = {}
        self.symbols: list[str] = []
        self.symbol_literal: dict[str, tuple[int, Span | None]] = {}
        self.defined_at: dict[str, int] = {}     # temps/outputs -> statement number
        self.written: dict[str, Span | None] = {}
        self.failed: set[str] = set()
        self.packed_axes: dict[str, tuple] = {}  # tensor -> per axis None | (offsets, batch axis, size symbol)
        self.packed_spans: dict[str, Span | None] = {}
        self.softmax_axis: dict[str, int] = {}   # temps holding a softmax -> the normalised axis

    def error(self, *a, **kw):
        self.p.error(*a, **kw)

    def run(self) -> CheckedKernel | None:
        n_before = len(self.p.diags)
        for d in self.k.decls:
            self.declare(d)
        varlen_check_decls(self)
        for t in self.tensors.values():
            if t.packed is not None and t.rank >= 2:
                self.packed_axes[t.name] = (None, (t.packed, 0, t.shape[1])) + (None,) * (t.rank - 2)
        # statement targets: find every definition first, so "used before defined" can be told
        # apart from "unknown".
        future = {s.target: i for i, s in enumerate(self.k.stmts)}
        stmts = []
        for i, s in enumerate(self.k.stmts):
            try:
                ts = self.statement(i, s, future)
                if ts is not None:
                    stmts.append(ts)
            except _Abort:
                # later uses of a name whose definition failed are not errors of their own
                self.failed.add(s.target)
        for t in list(self.tensors.values()):
            if t.role == "out" and t.name not in self.written:
                self.error(f"output '{t.name}' is never written", self.decl_spans.get(t.name),
                           f"add a statement `{t.name}[...] = ...`")
        if not self.k.stmts and not self.p.diags[n_before:]:
            self.error(f"kernel '{self.k.name}' has no statements", self.k.name_span or self.k.span)
        if len(self.p.diags) > n_before:
            return None
        tensors = tuple(self.tensors.values())
        bindings = tuple((s, v) for s, (v, _) in self.symbol_literal.items())
        return CheckedKernel(self.k.name, tensors, tuple(stmts), tuple(self.symbols), bindings, (), self.k.span)

    # ---- declarations ----
    def declare(self, d: ast.Decl):
        # After an error the declaration is still registered as well as it can be, so the
        # statements that use it are checked too instead of each reporting "unknown name".
        if d.name in self.tensors:
            prev = self.decl_spans[d.name]
            self.error(f"'{d.name}' is declared twice", d.name_span or d.span,
                       f"the first declaration is at line {prev.line}" if prev else None)
            return
        self.p.check_name(d.name, "param" if d.role == "param" else "tensor", d.name_span or d.span)
        if d.packed is not None and d.role == "param":
            self.error(f"param '{d.name}' is a scalar and cannot be packed", d.packed_span or d.span)
        if d.role == "param":
            if d.shape is not None:
                self.error(f"param '{d.name}' has a shape; params are scalars", d.span,
                           f"declare a tensor with `in {d.name} : {d.dtype}[...]`")
            elif d.layout:
                self.error(f"param '{d.name}' is a scalar and has no layout", d.span)
            default = None
            if d.default is not None:
                if d.dtype in INT_DTYPES and isinstance(d.default.value, float):
                    self.error(f"param '{d.name}' is {d.dtype} but its default {d.default.text} is not an integer",
                               d.default.span)
                elif not _fits(d.default.value, d.dtype):
                    self.error(f"default {_abbrev(d.default.text)} does not fit in {d.dtype}", d.default.span)
                else:
                    default = d.default.value
            info = TensorInfo(d.name, "param", d.dtype, (), "row", default, d.span)
        else:
            if d.shape is None:
                self.error(f"{'input' if d.role == 'in' else 'output'} '{d.name}' needs a shape",
                           d.span, f"for example `{d.role} {d.name} : {d.dtype}[M, N]`; scalars are `param`s")
                return
            if d.default is not None:
                self.error("only params take a default value", d.default.span)
            shape: list[DimValue] = []
            for dim in d.shape:
                if dim.is_symbol:
                    if dim.value not in self.symbols:
                        self.symbols.append(dim.value)  # type: ignore[arg-type]
                    if dim.div and dim.div < 2:
                        self.error(f"a quotient dimension divides by 2 or more, not {dim.div}", dim.span)
                    shape.append(f"{dim.value}+{dim.plus}" if dim.plus else
                                 f"{dim.value}/{dim.div}" if dim.div else dim.value)
                else:
                    v = int(dim.value)
                    if v < 1 or v >= MAX_LITERAL_DIM:
                        self.error(f"dimension {v} is out of range (1 to {MAX_LITERAL_DIM - 1})", dim.span)
                    shape.append(v)
            if d.layout == "col" and len(shape) < 2:
                self.error(f"'{d.name}' has rank {len(shape)}; layout col needs rank 2 or more", d.span)
            info = TensorInfo(d.name, d.role, d.dtype, tuple(shape), d.layout or "row", None, d.span, d.packed)
            self.packed_spans[d.name] = d.packed_span or d.span
        self.tensors[d.name] = info
        self.decl_spans[d.name] = d.name_span or d.span

    # ---- statements ----
    def statement(self, i: int, s: ast.Stmt, future: dict[str, int]) -> TStmt | None:
        name = s.target
        target = self.tensors.get(name)
        if target is not None and target.role in ("in", "param"):
            self.error(f"cannot assign to {('input' if target.role == 'in' else 'param')} '{name}'", s.span,
                       "only outputs and new intermediate names can be assigned", abort=True)
        if target is None and name not in self.written:
            sp = s.span and Span(s.span.file, s.span.line, s.span.col, s.span.line, s.span.col + len(name))
            if not self.p.check_name(name, "tensor", sp):
                raise _Abort()
        if name in self.written:
            prev = self.written[name]
            what = "output" if target is not None and target.role == "out" else "intermediate"
            self.error(f"{what} '{name}' is written more than once", s.span,
                       (f"it is first written at line {prev.line}; " if prev else "") +
                       "each name is assigned exactly once (give the new value a new name)", abort=True)
        # recorded before the right side is checked, so a failed statement does not also report
        # its target as never written
        self.written[name] = s.span
        seen_idx: set[str] = set()
        for ix, sp in zip(s.indices, s.index_spans or [None] * len(s.indices)):
            if ix in seen_idx:
                self.error(f"index '{ix}' appears twice on the left side", sp or s.span,
                           "a diagonal cannot be written; use distinct indices", abort=True)
            seen_idx.add(ix)
        if target is not None and len(s.indices) != target.rank:
            self.error(f"'{name}' has rank {target.rank} but is written with {len(s.indices)} "
                       f"{'index' if len(s.indices) == 1 else 'indices'}", s.span,
                       f"declared as {target.describe()}", abort=True)
        if s.dtype and target is not None and target.role == "out" and s.dtype != target.dtype:
            self.error(f"output '{name}' is declared {target.dtype} but annotated {s.dtype}", s.span,
                       "drop the annotation; the output's declared dtype is what is stored", abort=True)
        env = _IndexEnv(self)
        env.lhs_indices = set(s.indices)
        env.lhs = (name, tuple(s.indices))
        if target is not None:
            for ix, dim, sp in zip(s.indices, target.shape, s.index_spans or [None] * len(s.indices)):
                env.bind(ix, dim, f"{name}[{', '.join(s.indices)}]", sp or s.span)
            varlen_note_access(self, env, name, s.indices, s.span)
        value = self.expr(s.value, env, i, future)
        value = varlen_apply(self, env, value, s.span)
        # free indices on the right must be bound on the left
        for ix in value.free:
            if ix not in s.indices:
                sp = _index_span(s.value, ix) or s.value.span
                self.error(f"index '{ix}' is not bound on the left side and is not reduced", sp,
                           f"write `sum({ix}) {print_expr(s.value)}`" if not isinstance(s.value, ast.Reduce)
                           else f"add '{ix}' to the reduction or to the left side", abort=True)
        env.bind_paged()
        for ix, sp in env.value_indices.items():
            if ix not in env.dims and ix not in s.indices:
                self.error(f"the extent of index '{ix}' cannot be inferred: it is used only as a value or "
                           "inside computed subscripts", sp or s.span,
                           f"use '{ix}' as a plain subscript of some tensor (e.g. `x[{ix}]`), whose dimension "
                           "gives its range", abort=True)
        for ix, sp in zip(s.indices, s.index_spans or [None] * len(s.indices)):
            if ix not in env.dims:
                computed = ix in env.value_indices
                self.error(f"index '{ix}' of '{name}' has no extent: it does not occur on the right side"
                           + (" as a plain subscript" if computed else ""), sp or s.span,
                           f"use '{ix}' as a plain subscript of some tensor, or in a subscript `{ix} / P` (P a "
                           f"size or literal) of an axis of extent N, which gives '{ix}' the extent N*P (a "
                           f"paged read: `Kc[bt[b, {ix} / P], {ix} % P, h, e]`)" if computed else
                           f"declare '{name}' as an output with a shape, or use '{ix}' on the right",
                           abort=True)
        if target is not None:
            dtype = target.dtype
        else:
            dtype = s.dtype or value.dtype
        self.check_store(value.dtype, dtype, name, s)
        if target is None:
            shape = tuple(env.dims[ix][0] for ix in s.indices)
            self.tensors[name] = TensorInfo(name, "temp", dtype, shape, "row", None, s.span)
            self.decl_spans[name] = s.span
        self.defined_at[name] = i
        extents = tuple((ix, v[0]) for ix, v in env.dims.items())
        varlen_record_target(self, env, name, tuple(s.indices), value, target, s.span)
        return TStmt(name, tuple(s.indices), dtype, value, extents, s.span)

    def check_store(self, src: str, dst: str, name: str, s: ast.Stmt):
        if src == BOOL:
            self.error(f"a condition cannot be stored in '{name}'", s.value.span,
                       f"use the condition where it chooses values: `where({print_expr(s.value)}, a, b)`",
                       abort=True)
        if is_float(src) != is_float(dst):
            self.error(f"cannot store {_a(src)} value into {dst} '{name}' without a cast", s.value.span,
                       f"write `{dst}(...)` around the value to convert explicitly", abort=True)

    # ---- expressions ----
    def expr(self, e: ast.Expr, env: "_IndexEnv", stmt_no: int, future) -> TExpr:
        if isinstance(e, ast.Num):
            if e.text == "inf":
                return TConst("f32", (), e.span, float("inf"), True)
            if isinstance(e.value, int):
                if abs(e.value) >= 1 << 63:
                    self.error(f"integer literal {_abbrev(e.text)} is too large", e.span, abort=True)
                return TConst("i32", (), e.span, e.value, True)
            if e.value != e.value or abs(e.value) == float("inf") or abs(e.value) > 3.4e38:
                self.error(f"number {_abbrev(e.text)} does not fit in f32", e.span, abort=True)
            return TConst("f32", (), e.span, e.value, True)
        if isinstance(e, ast.Name):
            if e.name not in self.tensors and e.name not in future and e.name not in self.failed:
                return self.value_name(e, env)
            t = self.lookup(e.name, e.span, stmt_no, future)
            if t.role != "param":
                idx = ", ".join(ix.lower() if isinstance(ix, str) else f"i{j}" for j, ix in enumerate(t.shape))
                self.error(f"tensor '{e.name}' is used without indices", e.span,
                           f"write `{e.name}[{idx}]`" if t.shape else None, abort=True)
            return TScalar(t.dtype, (), e.span, e.name)
        if isinstance(e, ast.Access):
            params = [ix for ix in e.indices if ix in self.tensors and self.tensors[ix].role == "param"]
            if params:
                # `x[G]` with G an integer param: a computed subscript, not an index named G
                subs = tuple(ast.Name(ix, sp) if ix in params else ast.IndexVar(ix, sp)
                             for ix, sp in zip(e.indices, e.index_spans or (None,) * len(e.indices)))
                return self.gather(ast.Gather(e.tensor, subs, e.span), env, stmt_no, future)
            t = self.lookup(e.tensor, e.span, stmt_no, future)
            if t.role == "param":
                self.error(f"'{e.tensor}' is a scalar param; use it without indices", e.span,
                           f"write `{e.tensor}`", abort=True)
            if len(e.indices) != t.rank:
                self.error(f"'{e.tensor}' has rank {t.rank} but is used with {len(e.indices)} "
                           f"{'index' if len(e.indices) == 1 else 'indices'}", e.span,
                           f"declared as {t.describe()}", abort=True)
            seen: set[str] = set()
            spans = e.index_spans or (None,) * len(e.indices)
            for ix, dim, sp in zip(e.indices, t.shape, spans):
                if ix in seen:
                    self.error(f"index '{ix}' is used twice in {e.tensor}[...]", sp or e.span,
                               "diagonals are not supported; use distinct indices", abort=True)
                seen.add(ix)
                env.bind(ix, dim, f"{e.tensor}[{', '.join(e.indices)}]", sp or e.span)
            varlen_note_access(self, env, e.tensor, tuple(e.indices), e.span)
            return TAccess(t.dtype, _uniq(e.indices), e.span, e.tensor, tuple(e.indices))
        if isinstance(e, ast.Gather):
            return self.gather(e, env, stmt_no, future)
        if isinstance(e, ast.Unary):
            op = self.expr(e.operand, env, stmt_no, future)
            if e.op == "not":
                self.need_condition(op, e.operand, "'not'")
                return TUnary(BOOL, op.free, e.span, "not", op)
            self.need_value(op, e.operand, "'-'")
            return TUnary(op.dtype, op.free, e.span, "-", op)
        if isinstance(e, ast.Binary):
            return self.binary(e, env, stmt_no, future)
        if isinstance(e, ast.Cast):
            op = self.expr(e.operand, env, stmt_no, future)
            if op.dtype == BOOL:
                self.error(f"a condition cannot be converted to {e.dtype}", e.span,
                           f"write `where({print_expr(e.operand)}, 1.0, 0.0)`", abort=True)
            return TCast(e.dtype, op.free, e.span, op)
        if isinstance(e, ast.Call):
            return self.call(e, env, stmt_no, future)
        if isinstance(e, ast.Reduce):
            return self.reduce(e, env, stmt_no, future)
        raise TypeError(e)

    def gather(self, e: ast.Gather, env, stmt_no, future) -> TExpr:
        t = self.lookup(e.tensor, e.span, stmt_no, future)
        if t.role == "param":
            self.error(f"'{e.tensor}' is a scalar param; it cannot be indexed", e.span,
                       f"write `{e.tensor}`", abort=True)
        if len(e.subscripts) != t.rank:
            self.error(f"'{e.tensor}' has rank {t.rank} but is used with {len(e.subscripts)} "
                       f"{'subscript' if len(e.subscripts) == 1 else 'subscripts'}", e.span,
                       f"declared as {t.describe()}", abort=True)
        shown = print_expr(e)
        subs: list = []
        free: list[str] = []
        for axis, (x, dim) in enumerate(zip(e.subscripts, t.shape)):
            if isinstance(x, ast.IndexVar) and x.name in self.tensors and self.tensors[x.name].role == "param":
                x = ast.Name(x.name, x.span)       # an integer param's value, not an index
            if isinstance(x, ast.IndexVar):
                if x.name in free:
                    self.error(f"index '{x.name}' is used twice in {shown}", x.span or e.span,
                               "diagonals are not supported; use distinct indices", abort=True)
                env.bind(x.name, dim, shown, x.span or e.span)
                subs.append(x.name)
                free.append(x.name)
            elif isinstance(x, ast.Num):
                if not isinstance(x.value, int):
                    self.error(f"subscript {x.text} is not an integer", x.span or e.span, abort=True)
                if isinstance(dim, int) and not 0 <= x.value < dim:
                    self.error(f"subscript {x.text} is out of range for dimension {axis} of '{e.tensor}' "
                               f"(size {dim})", x.span or e.span, f"use 0 to {dim - 1}", abort=True)
                subs.append(int(x.value))
            else:
                if isinstance(x, ast.Access) and x.tensor in self.tensors and \
                        self.tensors[x.tensor].role == "param":
                    self.error(f"'{x.tensor}' is a scalar param; a subscript tensor needs indices", x.span,
                               abort=True)
                it = self.expr(x, env, stmt_no, future)
                self.need_integer_subscript(it, x, axis, e.tensor)
                env.note_paged(it, dim, x.span or e.span)
                subs.append(it)
                free.extend(ix for ix in it.free if ix not in free)
        varlen_note_access(self, env, e.tensor, tuple(subs), e.span)
        return TGather(t.dtype, _uniq(tuple(free)), e.span, e.tensor, tuple(subs))

    def need_integer_subscript(self, it: TExpr, x: ast.Expr, axis: int, tensor: str) -> None:
        """A computed subscript must be an integer expression (no floats, no conditions)."""
        if it.dtype in INT_DTYPES:
            return
        shown = print_expr(x)
        if it.dtype == BOOL:
            self.error(f"subscript {shown} of '{tensor}' is a condition, not an integer", x.span,
                       "a subscript is an integer index expression such as `h / G` or `j % P`", abort=True)
        if isinstance(x, (ast.Access, ast.Gather)):
            name = x.tensor
            self.error(f"subscript tensor '{name}' is {it.dtype}; a subscript must hold integers", x.span,
                       f"declare '{name}' as i32 (or i8), e.g. `in {name} : i32[...]`", abort=True)
        floats = [n for n in _names(x) if n in self.tensors and is_float(self.tensors[n].dtype)]
        hint = (f"'{floats[0]}' is {self.tensors[floats[0]].dtype}; declare it as an integer, e.g. "
                f"`param {floats[0]} : i32`" if floats and self.tensors[floats[0]].role == "param" else
                f"'{floats[0]}' holds {self.tensors[floats[0]].dtype} values; subscripts use integer tensors"
                if floats else "subscripts are computed with integers only (`/` is floor division)")
        self.error(f"subscript {shown} (axis {axis} of '{tensor}') is {it.dtype}; subscripts must be integers",
                   x.span, hint, abort=True)

    def value_name(self, e: ast.Name, env: "_IndexEnv") -> TExpr:
        """A bare name that is no tensor or param: an index's integer value, or a size symbol's."""
        if e.name in env.in_scope():
            env.value_indices.setdefault(e.name, e.span)
            return TIndex("i32", (e.name,), e.span, e.name)
        if e.name in self.symbols:
            return TSize("i32", (), e.span, e.name)
        known = list(self.tensors) + list(env.in_scope()) + list(self.symbols)
        self.error(f"unknown name '{e.name}'", e.span,
                   _suggest(e.name, known) or "a name in an expression is a param, a size symbol of a declared "
                   "shape, or an index of the left side or of an enclosing reduction", abort=True)
        raise AssertionError  # unreachable

    def need_condition(self, x: TExpr, src: ast.Expr, where: str) -> None:
        if x.dtype != BOOL:
            self.error(f"{where} needs a condition, got {_a(x.dtype)} value", src.span,
                       f"compare it, e.g. `{print_expr(src)} > 0`", abort=True)

    def need_value(self, x: TExpr, src: ast.Expr, where: str) -> None:
        if x.dtype == BOOL:
            self.error(f"{where} needs a number, got a condition", src.span,
                       f"choose values with where: `where({print_expr(src)}, 1.0, 0.0)`", abort=True)

    def binary(self, e: ast.Binary, env, stmt_no, future) -> TExpr:
        lhs = self.expr(e.lhs, env, stmt_no, future)
        rhs = self.expr(e.rhs, env, stmt_no, future)
        free = _uniq(lhs.free + rhs.free)
        if e.op in LOGIC_OPS:
            self.need_condition(lhs, e.lhs, f"'{e.op}'")
            self.need_condition(rhs, e.rhs, f"'{e.op}'")
            return TBinary(BOOL, free, e.span, e.op, lhs, rhs)
        self.need_value(lhs, e.lhs, f"'{e.op}'")
        self.need_value(rhs, e.rhs, f"'{e.op}'")
        lhs, rhs = self.promote_index_values(lhs, rhs)
        dt = self.promote(lhs, rhs, e.op, e.span)
        if e.op == "%" and is_float(dt):
            self.error("'%' needs integer operands", e.span,
                       "`%` is the integer modulo of index arithmetic (`j % P`)", abort=True)
        if e.op in COMPARE_OPS:
            return TBinary(BOOL, free, e.span, e.op, lhs, rhs)
        return TBinary(dt, free, e.span, e.op, lhs, rhs)

    def promote_index_values(self, a: TExpr, b: TExpr) -> tuple[TExpr, TExpr]:
        """An integer index value (`j - i`, `T - S`) meeting a floating-point operand is converted to
        f32 (`slope[h] * (j - i)`); integer tensors still need an explicit cast."""
        # a lone integer literal stays weak: it takes the other operand's dtype (`A[m] * 2.0 + 1`)
        if is_float(a.dtype) and _is_index_value(b) and not isinstance(b, TConst):
            return a, TCast("f32", b.free, b.span, b)
        if is_float(b.dtype) and _is_index_value(a) and not isinstance(a, TConst):
            return TCast("f32", a.free, a.span, a), b
        return a, b

    def where(self, e: ast.Call, env, stmt_no, future) -> TExpr:
        if len(e.args) != 3:
            self.error(f"'where' takes 3 arguments, got {len(e.args)}", e.span,
                       "write `where(cond, a, b)`: a where cond holds, else b", abort=True)
        cond, a, b = (self.expr(x, env, stmt_no, future) for x in e.args)
        self.need_condition(cond, e.args[0], "the first argument of 'where'")
        self.need_value(a, e.args[1], "a branch of 'where'")
        self.need_value(b, e.args[2], "a branch of 'where'")
        if a.free and b.free and not (set(a.free) <= set(b.free) or set(b.free) <= set(a.free)):
            self.error(f"the branches of 'where' disagree in shape: [{', '.join(a.free)}] and "
                       f"[{', '.join(b.free)}]", e.span,
                       "one branch's indices must include the other's (a scalar such as -inf fits any)",
                       abort=True)
        a, b = self.promote_index_values(a, b)
        dt = self.promote(a, b, "where", e.span)
        return TCall(dt, _uniq(cond.free + a.free + b.free), e.span, "where", (cond, a, b))

    def lookup(self, name: str, span, stmt_no: int, future) -> TensorInfo:
        if name in self.failed and name not in self.tensors:
            raise _Abort()
        t = self.tensors.get(name)
        # a name is readable once the statement that writes it is done (not inside it: `D[m] = D[m] + ...`)
        if t is not None and (t.role in ("in", "param") or self.defined_at.get(name, stmt_no) < stmt_no):
            return t
        if name in self.failed:
            raise _Abort()           # its statement failed (and said so)
        if t is not None and t.role == "out":
            if name in future and future[name] >= stmt_no:
                here = future[name] == stmt_no
                self.error(f"output '{name}' is read {'by the statement that writes it' if here else 'before it is written'}",
                           span, "compute the value into an intermediate first", abort=True)
        if name in future and future[name] == stmt_no:
            self.error(f"'{name}' is read by the statement that defines it", span,
                       "each name is assigned once, from values defined above it; give the new value a new "
                       "name", abort=True)
        if name in future and future[name] >= stmt_no:
            line = self.k.stmts[future[name]].span.line if self.k.stmts[future[name]].span else "?"
            self.error(f"'{name}' is used before it is defined (line {line})", span,
                       "move its definition above this statement", abort=True)
        known = [n for n in self.tensors] + [n for n in future]
        self.error(f"unknown name '{name}'", span, _suggest(name, known), abort=True)
        raise AssertionError  # unreachable

    def call(self, e: ast.Call, env, stmt_no, future) -> TExpr:
        if e.fn == "where":
            return self.where(e, env, stmt_no, future)
        if e.fn not in FUNCTIONS:
            hint = _suggest(e.fn, FUNCTIONS)
            if e.fn in ("max", "min"):
                hint = f"for the elementwise {e.fn} of two values write `{e.fn}imum(a, b)`"
            elif e.fn == "cast":
                hint = "a cast is written with the dtype's name: `f32(x)`"
            elif e.fn in ("if", "select"):
                hint = "choose between values with `where(cond, a, b)`"
            elif hint is None:
                hint = "functions: " + ", ".join(sorted(FUNCTIONS))
            self.error(f"unknown function '{e.fn}'", e.fn_span or e.span, hint, abort=True)
        lo, hi = FUNCTIONS[e.fn]
        if not lo <= len(e.args) <= hi:
            want = f"{lo}" if lo == hi else f"{lo} to {hi}"
            self.error(f"'{e.fn}' takes {want} argument{'s' if hi > 1 else ''}, got {len(e.args)}", e.span,
                       "write `clamp(x, lo, hi)`" if e.fn == "clamp" else None, abort=True)
        args = [self.expr(a, env, stmt_no, future) for a in e.args]
        for a, src in zip(args, e.args):
            self.need_value(a, src, f"'{e.fn}'")
        dt = args[0].dtype
        for a, src in zip(args[1:], e.args[1:]):
            dt = self.promote_dtypes(dt, a.dtype, args[0], a, src.span)
        if not is_float(dt) and e.fn not in ("maximum", "minimum", "clamp", "abs", "relu"):
            self.error(f"'{e.fn}' needs a floating-point argument, got {dt}", e.span,
                       f"convert first: `{e.fn}(f32(...))`", abort=True)
        if dt in STORAGE_FLOATS:
            dt = "f32"    # f8, f4, e8m0 and tf32 are storage types: arithmetic happens in f32
        free = _uniq(tuple(ix for a in args for ix in a.free))
        return TCall(dt, free, e.span, e.fn, tuple(args))

    def reduce(self, e: ast.Reduce, env, stmt_no, future) -> TExpr:
        env.scopes.append(set(e.indices))       # `sum(j) ... (j - i)`: j's value is known inside
        try:
            operand = self.expr(e.operand, env, stmt_no, future)
        finally:
            env.scopes.pop()
        spans = e.index_spans or (None,) * len(e.indices)
        if operand.dtype == BOOL:
            self.error(f"'{e.op}' needs a number, got a condition", e.operand.span,
                       f"choose values with where: `where({print_expr(e.operand)}, 1.0, 0.0)`", abort=True)
        if e.op == "softmax":
            causal = None
            for o in e.options:
                if o.name != "causal":
                    self.error(f"unknown softmax option '{o.name}'", o.span,
                               "softmax takes `causal=i`, naming the query index", abort=True)
                if o.value not in operand.free:
                    self.error(f"causal index '{o.value}' is not an index of the softmax operand", o.span,
                               abort=True)
                causal = o.value
            if len(e.indices) != 1:
                self.error(f"softmax normalises over exactly one index, got {len(e.indices)}", e.span,
                           "write `softmax(j) s[i, j]`", abort=True)
            axis = e.indices[0]
            if axis not in operand.free:
                self.error(f"softmax over '{axis}', which its operand does not use", spans[0] or e.span,
                           abort=True)
            if causal == axis:
                self.error("the causal query index must differ from the softmax index", e.options[0].span,
                           abort=True)
            if causal is not None:
                self.check_causal_alignment(e, env, axis, causal)
            dt = "f32" if is_float(operand.dtype) else None
            if dt is None:
                self.error(f"softmax needs a floating-point operand, got {operand.dtype}", e.span, abort=True)
            return TSoftmax(dt, operand.free, e.span, axis, causal, operand)
        if e.options:
            self.error(f"'{e.op}' takes no options", e.options[0].span, abort=True)
        seen: set[str] = set()
        for ix, sp in zip(e.indices, spans):
            if ix in seen:
                self.error(f"'{e.op}' lists index '{ix}' twice", sp or e.span, abort=True)
            seen.add(ix)
            if ix not in operand.free:
                self.error(f"'{e.op}({ix})' reduces over '{ix}', which its operand does not use", sp or e.span,
                           f"indices of the operand: {', '.join(operand.free)}" if operand.free else
                           "the operand has no indices", abort=True)
            if ix in env.lhs_indices:
                name, order = env.lhs
                rest = [i for i in order if i not in e.indices and i in operand.free]
                tmp = {"logsumexp": "lse", "max": "mx", "min": "mn", "mean": "mu"}.get(e.op, "acc")
                tmp = tmp if tmp not in (name, *order) else f"{tmp}_{name}"
                red = f"{tmp}[{', '.join(rest)}]" if rest else tmp
                per = f" per [{', '.join(rest)}]" if rest else ""
                self.error(f"index '{ix}' is reduced but also appears on the left side", sp or e.span,
                           f"the reduction has one value{per}: write it to an intermediate "
                           f"first, `{red} = {e.op}({', '.join(e.indices)}) {_abbrev(print_expr(e.operand), 60)}`"
                           f", then read `{red}` in {name}[{', '.join(order)}] (or remove '{ix}' from the left "
                           "side)", abort=True)
        if e.op in ("sum", "mean"):
            dt = accumulator_dtype(operand.dtype) if e.op == "sum" else "f32"
            if e.op == "mean" and not is_float(operand.dtype):
                dt = "f32"
        elif e.op == "logsumexp":
            # log(sum exp(x)), natural log, max-shifted; -inf over an empty or all -inf axis
            if not is_float(operand.dtype):
                self.error(f"logsumexp needs a floating-point operand, got {operand.dtype}", e.operand.span or e.span,
                           f"convert first: `logsumexp({', '.join(e.indices)}) f32({print_expr(e.operand)})`",
                           abort=True)
            dt = "f32"
        else:
            dt = operand.dtype
        free = tuple(ix for ix in operand.free if ix not in e.indices)
        return TReduce(dt, free, e.span, e.op, tuple(e.indices), operand)

    def check_causal_alignment(self, e: ast.Reduce, env, key: str, query: str) -> None:
        """`softmax(j, causal=i)` keeps key j for query i when j <= i: aligned top-left.  With fewer
        queries than keys (decoding against a KV cache) FlashAttention and torch SDPA align the mask
        bottom-right instead; when the two extents can differ, the spec must say which it means."""
        qd, kd = env.dims.get(query, (None,))[0], env.dims.get(key, (None,))[0]
        if qd is None or kd is None or qd == kd:
            return
        fixed = self.symbol_literal
        if isinstance(qd, str) and isinstance(kd, str) and qd in fixed and kd in fixed and \
                fixed[qd][0] == fixed[kd][0]:
            return
        operand = print_expr(e.operand)
        opt = next(o for o in e.options if o.name == "causal")
        q, k = str(qd), str(kd)
        offset = f"{k} - {q}" if isinstance(kd, str) or isinstance(qd, str) else str(int(kd) - int(qd))
        self.error(f"softmax({key}, causal={query}) aligns the mask top-left (key {key} is kept when "
                   f"{key} <= {query}), but query {query} ranges over {q} and key {key} over {k}",
                   opt.span or e.span,
                   f"write the mask explicitly and use softmax({key}): top-left "
                   f"`where({key} <= {query}, {operand}, -inf)`, or bottom-right as FlashAttention and "
                   f"torch SDPA align it `where({key} <= {query} + ({offset}), {operand}, -inf)`", abort=True)

    # ---- dtypes ----
    def promote(self, lhs: TExpr, rhs: TExpr, op: str, span) -> str:
        return self.promote_dtypes(lhs.dtype, rhs.dtype, lhs, rhs, span)

    def promote_dtypes(self, a: str, b: str, ea: TExpr, eb: TExpr, span) -> str:
        weak_a = isinstance(ea, TConst) and ea.weak
        weak_b = isinstance(eb, TConst) and eb.weak
        if weak_a and weak_b:
            return "f32" if "f32" in (a, b) else a
        if weak_b:
            if is_float(b) and not is_float(a):
                self.error(f"a floating-point literal is combined with {_a(a)} value", eb.span,
                           "convert explicitly: `f32(...)`", abort=True)
            return _arith(a)
        if weak_a:
            if is_float(a) and not is_float(b):
                self.error(f"a floating-point literal is combined with {_a(b)} value", ea.span,
                           "convert explicitly: `f32(...)`", abort=True)
            return _arith(b)
        if a == b:
            return _arith(a)
        if is_float(a) != is_float(b):
            self.error(f"cannot combine {a} and {b} without a cast", span,
                       "convert one side explicitly, e.g. `f32(...)`", abort=True)
        if not is_float(a):
            return "i32"
        ra, rb = _FLOAT_RANK[a], _FLOAT_RANK[b]
        if ra == rb == 2:
            self.error(f"cannot combine {a} and {b} without a cast", span,
                       "f16 and bf16 do not mix implicitly; convert one side, e.g. `f32(...)`", abort=True)
        return _arith(a if ra > rb else b)


def _arith(dt: str) -> str:
    """The dtype arithmetic on a value of `dt` produces: f8, f4, e8m0 and tf32 are storage types (f32 math)."""
    return "f32" if dt in STORAGE_FLOATS else dt


class _IndexEnv:
    """Index variable -> (dimension, where it was bound) for one statement."""

    def __init__(self, kc: _KernelChecker):
        self.kc = kc
        self.dims: dict[str, tuple[DimValue, str, Span | None]] = {}
        self.lhs_indices: set[str] = set()
        self.lhs: tuple[str, tuple[str, ...]] = ("", ())   # the statement's target and its indices
        self.scopes: list[set[str]] = []         # indices of the enclosing reductions
        self.value_indices: dict[str, Span | None] = {}    # indices used as values (`j - i`)
        self.paged: dict[str, tuple[DimValue, Span | None]] = {}   # j -> extent from `j / P` (note_paged)
        self.packed = PackedLabels()                  # labels over packed (varlen) sequences

    def in_scope(self) -> set[str]:
        """Index names an expression may use as values here."""
        return self.lhs_indices.union(self.dims, *self.scopes)

    def note_paged(self, sub: TExpr, dim: DimValue, span) -> None:
        """A computed subscript `j / P` (P a size symbol or a positive literal) of an axis of extent N:
        j ranges over N*P (a paged read, `Kc[bt[b, j / P], j % P, ..]`).  Used for an index that no
        plain subscript sizes (bind_paged)."""
        if not (isinstance(sub, TBinary) and sub.op == "/" and isinstance(sub.lhs, TIndex)):
            return
        rhs = sub.rhs
        if isinstance(rhs, TSize):
            page: DimValue = rhs.name
        elif isinstance(rhs, TConst) and isinstance(rhs.value, int) and rhs.value > 0:
            page = rhs.value
        else:
            return
        factors = (*(dim if isinstance(dim, tuple) else (dim,)), page)
        ints = [f for f in factors if isinstance(f, int)]
        syms = tuple(f for f in factors if not isinstance(f, int))
        lit = 1
        for f in ints:
            lit *= f
        extent: DimValue = lit if not syms else (syms[0] if lit == 1 and len(syms) == 1 else
                                                 (*syms, lit) if lit != 1 else syms)
        self.paged.setdefault(sub.lhs.name, (extent, span))

    def bind_paged(self) -> None:
        for ix, (extent, span) in self.paged.items():
            if ix not in self.dims:
                self.dims[ix] = (extent, f"a subscript {ix} / ...", span)

    def bind(self, ix: str, dim: DimValue, where: str, span):
        prev = self.dims.get(ix)
        if prev is None:
            self.dims[ix] = (dim, where, span)
            return
        pdim, pwhere, _ = prev
        if pdim == dim:
            return
        kc = self.kc
        # a symbol meeting a literal fixes the symbol's value for the whole kernel
        sym, lit = (pdim, dim) if isinstance(pdim, str) and isinstance(dim, int) else \
                   (dim, pdim) if isinstance(dim, str) and isinstance(pdim, int) else (None, None)
        if sym is not None:
            fixed = kc.symbol_literal.get(sym)
            if fixed is None:
                kc.symbol_literal[sym] = (lit, span)
                return
            if fixed[0] == lit:
                return
            kc.error(f"dimension {sym} is {lit} here but {fixed[0]} elsewhere", span,
                     f"{sym} was fixed to {fixed[0]} at line {fixed[1].line}" if fixed[1] else None, abort=True)
        if isinstance(pdim, str) and isinstance(dim, str):
            fa, fb = kc.symbol_literal.get(pdim), kc.symbol_literal.get(dim)
            if fa and fb and fa[0] == fb[0]:
                return
            kc.error(f"index '{ix}' ranges over {dim} in {where} but over {pdim} in {pwhere}", span,
                     f"use one dimension name for both (e.g. {pdim})", abort=True)
        kc.error(f"index '{ix}' has size {dim} in {where} but {pdim} in {pwhere}", span,
                 "conflicting literal sizes", abort=True)


# the largest finite value of each dtype, and the integer ranges
_DTYPE_MAX = {"f8e4m3": 448.0, "f8e5m2": 57344.0, "f16": 65504.0, "bf16": 3.3895e38, "tf32": 3.4028e38,
              "f32": 3.4028e38, "f4e2m1": 6.0, "f8e8m0": 1.7014118346046923e38}
_INT_RANGE = {"i8": (-128, 127), "i32": (-(1 << 31), (1 << 31) - 1)}


def _fits(value: float | int, dtype: str) -> bool:
    if dtype in _INT_RANGE:
        lo, hi = _INT_RANGE[dtype]
        return lo <= value <= hi
    return abs(value) <= _DTYPE_MAX[dtype]


def _a(dtype: str) -> str:
    """The article for a dtype as spoken: "an f16", "an i32", "a bf16", "a tf32"."""
    return f"an {dtype}" if dtype[:1] in "fi" else f"a {dtype}"


def _abbrev(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-6:]} ({len(text)} characters)"


def _is_index_value(e: TExpr) -> bool:
    """e is integer arithmetic over index values, size symbols, integer params and literals (no
    tensor element): a value that promotes to f32 next to a floating-point operand."""
    if isinstance(e, (TIndex, TSize)):
        return True
    if isinstance(e, (TConst, TScalar)):
        return e.dtype in INT_DTYPES
    if isinstance(e, TBinary) and e.op in ARITH_OPS:
        return _is_index_value(e.lhs) and _is_index_value(e.rhs)  # type: ignore[arg-type]
    if isinstance(e, TUnary) and e.op == "-":
        return _is_index_value(e.operand)  # type: ignore[arg-type]
    return False


def _names(e: ast.Expr):
    """Every name (bare or tensor) an expression mentions."""
    if isinstance(e, ast.Name):
        yield e.name
    elif isinstance(e, (ast.Access, ast.Gather)):
        yield e.tensor
        for x in getattr(e, "subscripts", ()):
            if not isinstance(x, (ast.IndexVar, ast.Num)):
                yield from _names(x)
    for c in _children(e):
        yield from _names(c)


def _uniq(xs) -> tuple[str, ...]:
    out: list[str] = []
    for x in xs:
        if x not in out:
            out.append(x)
    return tuple(out)


def _index_span(e: ast.Expr, ix: str) -> Span | None:
    """The span of the first occurrence of index `ix` inside expression `e`."""
    if isinstance(e, ast.Access):
        for j, s in zip(e.indices, e.index_spans or ()):
            if j == ix:
                return s
        return None
    if isinstance(e, (ast.IndexVar, ast.Name)):
        return e.span if e.name == ix else None
    if isinstance(e, ast.Gather):
        for x in e.subscripts:
            s = _index_span(x, ix)
            if s is not None:
                return s
        return None
    for child in _children(e):
        s = _index_span(child, ix)
        if s is not None:
            return s
    return None


def _children(e: ast.Expr):
    if isinstance(e, ast.Unary):
        return (e.operand,)
    if isinstance(e, ast.Binary):
        return (e.lhs, e.rhs)
    if isinstance(e, (ast.Call,)):
        return e.args
    if isinstance(e, (ast.Cast, ast.Reduce)):
        return (e.operand,)
    return ()


def check(program: ast.Program) -> CheckedProgram:
    """Check a parsed program; raise one `KspecError` holding every independent error found."""
    try:
        return _Checker(program).run()
    except RecursionError:
        raise KspecError("expression nested too deeply", None) from None


# ---------------------------------------------------------------- printing the typed AST

def _texpr_lines(e: TExpr, depth: int) -> list[str]:
    pad = "  " * depth
    free = f"[{', '.join(e.free)}]" if e.free else "[]"
    if isinstance(e, TConst):
        return [f"{pad}const {e.value!r} : {e.dtype}{' (weak)' if e.weak else ''}"]
    if isinstance(e, TScalar):
        return [f"{pad}param {e.name} : {e.dtype}"]
    if isinstance(e, TAccess):
        return [f"{pad}{e.tensor}[{', '.join(e.indices)}] : {e.dtype}"]
    if isinstance(e, TGather):
        return [f"{pad}gather {e.tensor}[{', '.join(subscript_text(x) for x in e.subscripts)}] : {e.dtype} {free}"]
    if isinstance(e, TIndex):
        return [f"{pad}index {e.name} : {e.dtype}"]
    if isinstance(e, TSize):
        return [f"{pad}size {e.name} : {e.dtype}"]
    if isinstance(e, TUnary):
        head, kids = f"{'neg' if e.op == '-' else e.op} : {e.dtype} {free}", [e.operand]
    elif isinstance(e, TBinary):
        head, kids = f"{e.op} : {e.dtype} {free}", [e.lhs, e.rhs]
    elif isinstance(e, TCall):
        head, kids = f"{e.fn} : {e.dtype} {free}", list(e.args)
    elif isinstance(e, TCast):
        head, kids = f"cast : {e.dtype} {free}", [e.operand]
    elif isinstance(e, TReduce):
        head, kids = f"{e.op}({', '.join(e.indices)}) : {e.dtype} {free}", [e.operand]
    elif isinstance(e, TSoftmax):
        opt = f", causal={e.causal}" if e.causal else ""
        head, kids = f"softmax({e.axis}{opt}) : {e.dtype} {free}", [e.operand]
    else:
        raise TypeError(e)
    out = [pad + head]
    for k in kids:
        out.extend(_texpr_lines(k, depth + 1))  # type: ignore[arg-type]
    return out


def schedule_parts(tile, cluster, stages, sep: str) -> list[str]:
    """["tile<sep>128x128x64", "cluster<sep>2x1x1", "stages<sep>4"] for the settings present."""
    parts = []
    if tile:
        parts.append(f"tile{sep}" + "x".join(map(str, tile)))
    if cluster:
        parts.append(f"cluster{sep}" + "x".join(map(str, cluster)))
    if stages:
        parts.append(f"stages{sep}{stages}")
    return parts


def format_typed(program: CheckedProgram) -> str:
    """The typed AST as an indented tree (what `kspec check --ast` prints)."""
    out: list[str] = [f"program {program.file}" + (f"  target {', '.join(program.targets)}" if program.targets else "")]
    for k in program.kernels:
        out.append(f"kernel {k.name}")
        syms = ", ".join(k.symbols)
        if k.bindings:
            syms += "  (" + ", ".join(f"{s} = {v}" for s, v in k.bindings) + ")"
        out.append(f"  symbols: {syms or '-'}")
        for t in k.tensors:
            out.append(f"  {t.role:<5} {t.describe()}")
        for s in k.stmts:
            ext = ", ".join(f"{i}: {d}" for i, d in s.extents)
            out.append(f"  {s.target}[{', '.join(s.indices)}] : {s.dtype}   ({ext})")
            out.extend(_texpr_lines(s.value, 2))
        for arch, h in k.schedules:
            text = " ".join(schedule_parts(h.tile, h.cluster, h.stages, "=")
                            + ([f"backend={h.backend}"] if h.backend else []))
            out.append(f"  schedule{' for ' + arch if arch else ''}: {text or '-'}")
    return "\n".join(out)


def index_bounds(kernel: CheckedKernel) -> dict[str, list[DimValue]]:
    """Integer tensors used as subscripts -> the sizes of the dimensions they index: a valid value
    lies in [0, size) for each (what random test inputs must respect)."""
    out: dict[str, list[DimValue]] = {}

    def visit(x):
        if isinstance(x, TGather):
            shape = kernel.tensor(x.tensor).shape
            for sub, dim in zip(x.subscripts, shape):
                if isinstance(sub, (TAccess, TGather)):
                    out.setdefault(sub.tensor, []).append(dim)
        for c in texpr_children(x):
            visit(c)

    for st in kernel.stmts:
        visit(st.value)
    return out


def count_ops(e: TExpr) -> dict[str, int]:
    """Counts of operation classes in an expression, for one-line summaries."""
    counts: dict[str, int] = {}

    def visit(x: TExpr):
        if isinstance(x, TReduce):
            is_contraction = x.op == "sum" and isinstance(x.operand, TBinary) and x.operand.op == "*"
            key = "contraction" if is_contraction else "reduction"
            counts[key] = counts.get(key, 0) + 1
            if is_contraction:
                for side in (x.operand.lhs, x.operand.rhs):
                    visit(side)
                return
            visit(x.operand)
        elif isinstance(x, TGather):
            counts["gather"] = counts.get("gather", 0) + 1
        elif isinstance(x, TSoftmax):
            counts["softmax"] = counts.get("softmax", 0) + 1
            visit(x.operand)
        elif isinstance(x, (TBinary, TUnary, TCall, TCast)):
            counts["elementwise"] = counts.get("elementwise", 0) + 1
            for c in ([x.lhs, x.rhs] if isinstance(x, TBinary) else list(x.args) if isinstance(x, TCall)
                      else [x.operand]):
                visit(c)

    visit(e)
    return counts


# ---------------------------------------------------------------- variable-length batches
# Variable-length batches: tensors declared `packed(cu)` (the checker's part).
#
# Varlen is a storage layout, not new semantics: a computation is written over logical
# [B, S, ...] tensors exactly like a dense one, and `in Q : bf16[B, S, H, 128] packed(cu_q)` says
# that sequence b's rows are rows cu_q[b] .. cu_q[b + 1] - 1 of a [total, H, 128] array (FA4's and
# the serving stacks' varlen layout), with `in cu_q : i32[B + 1]`.  S is the longest sequence.
# Positions i >= the sequence's own length do not exist:
#
# - a softmax over a packed axis leaves absent positions out: the checker masks its operand,
#   `where(j < len_k(b), E, -inf)`, with len_k(b) = cu_k[b + 1] - cu_k[b] (a mask fusion lifts like a
#   written one);
# - a size symbol of a packed axis inside an expression (`i + (T - S)`) is that sequence's own
#   length;
# - an output written over a packed axis must be declared `packed` with the same offsets: only its
#   present rows are stored;
# - a logsumexp over a packed axis leaves absent positions out the same way (they are -inf);
# - a sum over a packed axis must multiply by a softmax over that axis (attention's P·V), whose
#   absent entries are 0, or by a packed input read over it (attention's backward dK = dSᵀ·Q):
#   absent rows of an input are 0; other reductions over a packed axis are refused (mask them
#   explicitly).
#
# The numpy reference (backends/reference) reads and writes the packed arrays; see there for what
# a call checks (offsets non-decreasing, within the rows, the first one 0, the last one the row count).


class PackedLabels:
    """Per statement: which labels are packed (label -> (offsets tensor, batch label))."""

    def __init__(self):
        self.labels: dict[str, tuple[str, str]] = {}
        self.sizes: dict[str, str] = {}          # size symbol of a packed axis -> its label


def varlen_check_decls(kc) -> None:
    """Every `packed(cu)` declaration: (batch, seq) leading axes, cu an integer [B + 1] input."""
    seq_of: dict[str, tuple[str, str]] = {}      # seq symbol -> (offsets, tensor)
    for t in list(kc.tensors.values()):
        if t.packed is None:
            continue
        sp = kc.packed_spans.get(t.name)
        if t.role not in ("in", "out"):
            kc.error(f"only inputs and outputs can be packed, not {t.role} '{t.name}'", sp)
            continue
        if t.rank < 2 or not all(isinstance(d, str) and split_offset_dim(d) is None for d in t.shape[:2]):
            kc.error(f"packed tensor '{t.name}' must have a batch and a sequence axis first, both size symbols "
                     f"(declared {t.describe()})", sp,
                     f"write e.g. `{t.role} {t.name} : {t.dtype}[B, S, ...] packed({t.packed})`")
            continue
        cu = kc.tensors.get(t.packed)
        batch, seq = t.shape[0], t.shape[1]
        if cu is None:
            kc.error(f"unknown offsets tensor '{t.packed}' in packed({t.packed})", sp,
                     f"declare it: `in {t.packed} : i32[{batch} + 1]` (cumulative sequence offsets)")
            continue
        if cu.role != "in" or cu.dtype not in INT_DTYPES or cu.rank != 1 or cu.shape[0] != f"{batch}+1":
            kc.error(f"the offsets of packed tensor '{t.name}' must be an integer input vector of {batch} + 1 "
                     f"cumulative offsets, not {cu.role} {cu.describe()}", sp,
                     f"declare `in {t.packed} : i32[{batch} + 1]`: sequence b is rows {t.packed}[b] .. "
                     f"{t.packed}[b + 1] - 1")
            continue
        rows = packed_rows_symbol(t.packed)
        user = next((u for u in kc.tensors.values() if rows in u.shape), None)
        if user is not None:
            kc.error(f"size symbol '{rows}' of '{user.name}' is reserved: it names the row count of the tensors "
                     f"packed by '{t.packed}'", kc.packed_spans.get(user.name) or sp,
                     f"name that size differently (e.g. {rows}_)")
            continue
        prev = seq_of.get(seq)
        if prev is not None and prev[0] != t.packed:
            kc.error(f"sequence axis {seq} is packed by '{t.packed}' here but by '{prev[0]}' in '{prev[1]}'", sp,
                     "one size symbol per packing: name the other sequence axis differently (e.g. T)")
            continue
        seq_of[seq] = (t.packed, t.name)


def varlen_note_access(kc, env, tensor: str, indices, span) -> None:
    """A read or write of tensor[indices]: its packed axes' labels are packed in this statement."""
    axes = kc.packed_axes.get(tensor)
    if not axes:
        return
    for pos, info in enumerate(axes):
        if info is None:
            continue
        cu, bpos, size = info
        label, blabel = indices[pos], indices[bpos]
        if not isinstance(label, str) or not isinstance(blabel, str):
            kc.error(f"the batch and sequence axes of packed '{tensor}' must be read with plain indices", span,
                     f"write `{tensor}[b, i, ...]`", abort=True)
        old = env.packed.labels.get(label)
        if old is not None and old != (cu, blabel):
            kc.error(f"index '{label}' runs over sequences packed by '{old[0]}' and by '{cu}'", span,
                     "use a separate index for each packing", abort=True)
        env.packed.labels[label] = (cu, blabel)
        if size is not None:
            env.packed.sizes.setdefault(size, label)


def _seq_length(cu: str, b: str) -> TExpr:
    """cu[b + 1] - cu[b]: the length of sequence b."""
    nxt = TGather("i32", (b,), None, cu, (TBinary("i32", (b,), None, "+", TIndex("i32", (b,), None, b),
                                                   TConst("i32", (), None, 1, True)),))
    # cu[b] as a gather: cu has B + 1 entries, b ranges over B
    return TBinary("i32", (b,), None, "-", nxt, TGather("i32", (b,), None, cu, (b,)))


def varlen_lengths_as_sizes(kernel, value: TExpr) -> TExpr:
    """value with every sequence length varlen_apply wrote out (`cu[b + 1] - cu[b]`, _seq_length)
    written back as the size symbol of the axis cu packs (`T`): what a spec says inside an
    expression, and what checking it again turns back into the same length (kspec grad prints its
    result as spec text)."""
    symbol = {}
    for t in kernel.tensors:
        if t.packed is not None and t.rank >= 2:
            symbol.setdefault(t.packed, t.shape[1])

    def back(e: TExpr) -> TExpr:
        if isinstance(e, TBinary) and e.op == "-" and isinstance(e.lhs, TGather) and isinstance(e.rhs, TGather) \
                and e.lhs.tensor == e.rhs.tensor and e.lhs.tensor in symbol and len(e.rhs.subscripts) == 1 \
                and isinstance(e.rhs.subscripts[0], str) and e == _seq_length(e.lhs.tensor, e.rhs.subscripts[0]):
            return TSize("i32", (), None, symbol[e.lhs.tensor])
        return e

    return _rebuild_texpr(value, back) if symbol else value


def _rebuild_texpr(e: TExpr, f) -> TExpr:
    """e with f applied bottom-up; free indices grow by what the new children bring."""
    changes = {}
    for fl in fields(e):
        v = getattr(e, fl.name)
        if isinstance(v, TExpr):
            changes[fl.name] = _rebuild_texpr(v, f)
        elif isinstance(v, tuple) and any(isinstance(x, TExpr) for x in v):
            changes[fl.name] = tuple(_rebuild_texpr(x, f) if isinstance(x, TExpr) else x for x in v)
    if changes:
        added = [ix for c in texpr_children(replace(e, **changes)) for ix in c.free]
        reduced = set(e.indices) if isinstance(e, TReduce) else set()
        e = replace(e, **changes, free=_uniq(e.free + tuple(ix for ix in added if ix not in reduced)))
    return f(e)


def varlen_apply(kc, env, value: TExpr, span) -> TExpr:
    """The statement's value with varlen semantics made explicit (module docstring)."""
    packed = env.packed
    if not packed.labels:
        return value

    def rewrite(e: TExpr) -> TExpr:
        if isinstance(e, TSize) and e.name in packed.sizes:
            cu, b = packed.labels[packed.sizes[e.name]]
            return _seq_length(cu, b)
        if isinstance(e, TSoftmax) and e.axis in packed.labels:
            masked = _absent_as_neg_inf(packed, e.operand, e.axis)
            return replace(e, operand=masked, free=_uniq(e.free + masked.free))
        if isinstance(e, TReduce) and e.op == "logsumexp" and set(e.indices) & set(packed.labels):
            # absent positions are -inf, logsumexp's identity (as for a softmax)
            masked = e.operand
            for ix in e.indices:
                if ix in packed.labels:
                    masked = _absent_as_neg_inf(packed, masked, ix)
            return replace(e, operand=masked,
                           free=_uniq(e.free + tuple(x for x in masked.free if x not in e.indices)))
        if isinstance(e, TReduce):
            for ix in e.indices:
                if ix in packed.labels and not (e.op == "sum" and _zero_when_absent(kc, packed, e.operand, ix)):
                    kc.error(f"'{e.op}({ix})' reduces over '{ix}', which runs over packed sequences, where "
                             "positions past a sequence's length do not exist", e.span or span,
                             f"multiply by a softmax over '{ix}' (attention's P·V), or mask it yourself: "
                             f"`{e.op}({ix}) where({ix} < LEN, ..., 0.0)` with LEN the axis's size symbol, "
                             "which inside an expression is each sequence's own length", abort=True)
        return e

    return _rebuild_texpr(value, rewrite)


def _absent_as_neg_inf(packed, operand: TExpr, axis: str) -> TExpr:
    """`where(axis < len(b), operand, -inf)`: the operand with the positions past each sequence's
    length left out of a softmax or logsumexp over the packed axis."""
    cond = _within(packed, axis)
    return TCall(operand.dtype, _uniq(operand.free + cond.free), operand.span, "where",
                 (cond, operand, TConst("f32", (), None, -math.inf, True)))


def _within(packed, axis: str) -> TExpr:
    """`axis < len(b)`: the positions of packed axis `axis` that exist in sequence b."""
    cu, b = packed.labels[axis]
    return TBinary(BOOL, _uniq((axis, b)), None, "<", TIndex("i32", (axis,), None, axis), _seq_length(cu, b))


def _zero_when_absent(kc, packed, e: TExpr, label: str) -> bool:
    """e is a product one factor of which is 0 at absent positions of `label`: a softmax over it, or
    a packed input read over it (a sequence's rows past its length do not exist: 0, what the
    reference reads there, and what no kernel reads)."""
    if isinstance(e, TBinary) and e.op == "*":
        return _zero_when_absent(kc, packed, e.lhs, label) or _zero_when_absent(kc, packed, e.rhs, label)
    if isinstance(e, TCast):
        return _zero_when_absent(kc, packed, e.operand, label)
    if isinstance(e, TCall) and e.fn == "where":
        # where(label < its length, x, 0) (the mask the hint below suggests), or where(c, x, 0) with x 0 there
        cond, x, y = e.args
        if not (isinstance(y, TConst) and y.value == 0):
            return False
        return cond == _within(packed, label) or _zero_when_absent(kc, packed, x, label)
    if isinstance(e, TSoftmax):
        return e.axis == label
    if isinstance(e, TAccess):
        pos = kc.softmax_axis.get(e.tensor)
        if pos is not None and e.indices[pos] == label:
            return True
        t = kc.tensors.get(e.tensor)
        axes = kc.packed_axes.get(e.tensor) or ()
        return t is not None and t.role == "in" and any(
            a is not None and e.indices[pos] == label for pos, a in enumerate(axes))
    return False


def varlen_record_target(kc, env, name: str, indices, value: TExpr, target, span) -> None:
    """After a statement: which axes of its target are packed (temps), whether it is a softmax
    (for `_zero_when_absent`), and an output over a packed axis is declared packed alike."""
    packed = env.packed
    axes = []
    for ix in indices:
        info = packed.labels.get(ix)
        size = next((sz for sz, lab in packed.sizes.items() if lab == ix), None)
        axes.append(None if info is None else (info[0], list(indices).index(info[1]) if info[1] in indices
                                               else None, size))
    if isinstance(value, TSoftmax):
        kc.softmax_axis[name] = list(indices).index(value.axis)
    if target is None or target.role == "temp":
        if any(a is not None and a[1] is None for a in axes):
            ix = next(i for i, a in zip(indices, axes) if a is not None and a[1] is None)
            kc.error(f"'{name}' keeps packed index '{ix}' without its batch index "
                     f"'{packed.labels[ix][1]}'", span, "keep the batch index on the left side", abort=True)
        if any(a is not None for a in axes):
            kc.packed_axes[name] = tuple(axes)
        return
    declared = kc.packed_axes.get(name) or ()
    for pos, (ix, a) in enumerate(zip(indices, axes)):
        if a is None:
            continue
        want = declared[pos] if pos < len(declared) else None
        if want is None or want[0] != a[0] or indices[want[1]] != packed.labels[ix][1]:
            kc.error(f"output '{name}' is written over index '{ix}', which runs over sequences packed by "
                     f"'{a[0]}', so it has no value past a sequence's length", span,
                     f"declare it `out {name} : {target.dtype}[...] packed({a[0]})` with the batch and "
                     f"sequence axes first, so that only present rows are stored", abort=True)
