"""The kspec AST: frozen dataclasses with source spans (spans never take part in equality)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from .errors import Span

from kspec.core import ARCHS, DTYPES  # noqa: E402,F401  (the one copy of each table)
ROLES = ("in", "out", "param")
REDUCERS = ("sum", "max", "min", "mean", "logsumexp")
NORMALIZERS = ("softmax",)


def _span() -> Span | None:
    return field(default=None, compare=False, repr=False)


# ---- expressions ----

@dataclass(frozen=True)
class Num:
    value: float | int
    text: str                      # as written, so printing round-trips exactly
    span: Span | None = _span()


@dataclass(frozen=True)
class Name:
    """A bare name: a scalar param, an index's integer value (`j - i`), a size symbol's runtime
    value (`T - S`) (or, misused, a tensor without indices)."""
    name: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Access:
    tensor: str
    indices: tuple[str, ...]
    span: Span | None = _span()
    index_spans: tuple[Span | None, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class IndexVar:
    """An index name used as a subscript (`m` in `x[m, label[m]]`)."""
    name: str
    span: Span | None = _span()


# A subscript: an index name, an integer literal (`Num` with an int value), an element of an
# integer tensor (`Access`), or integer arithmetic over those, params and size symbols (`h / G`,
# `j % P`: a `Binary`, with `Name`s for the names inside it).
IndexExpr = Union[IndexVar, "Num", Access, "Gather", "Binary", "Unary", "Name"]


@dataclass(frozen=True)
class Gather:
    """A tensor element whose subscripts are index expressions, not only index names:
    `logits[m, label[m]]` reads, for each m, the column that the integer `label[m]` names.
    (An access whose subscripts are all index names is an `Access`.)"""
    tensor: str
    subscripts: tuple[IndexExpr, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Unary:
    op: str                        # "-" | "not"
    operand: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Binary:
    op: str                        # + - * / % < <= > >= == != and or
    lhs: "Expr"
    rhs: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class KwArg:
    name: str
    value: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Call:
    """An elementwise function call: gelu(x), clamp(x, 0, 6), maximum(a, b)."""
    fn: str
    args: tuple["Expr", ...]
    span: Span | None = _span()
    fn_span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Cast:
    dtype: str
    operand: "Expr"
    span: Span | None = _span()


@dataclass(frozen=True)
class Reduce:
    """`sum(k) operand` (also max, min, mean, logsumexp) and the normaliser `softmax(j) operand`.
    options: keyword arguments such as mask=causal (softmax only)."""
    op: str
    indices: tuple[str, ...]
    operand: "Expr"
    options: tuple[KwArg, ...] = ()
    span: Span | None = _span()
    index_spans: tuple[Span | None, ...] = field(default=(), compare=False, repr=False)


Expr = Union[Num, Name, Access, Gather, Unary, Binary, Call, Cast, Reduce]


# ---- declarations and statements ----

@dataclass(frozen=True)
class Dim:
    """A dimension in a declared shape: a symbol (`M`), a literal size (`64`), a symbol plus a
    literal (`B + 1`, plus = 1: the B + 1 cumulative offsets of B sequences), or an exact quotient
    of a symbol by a literal (`K / 32`, div = 32: one block scale per 32 values along K)."""
    value: str | int
    span: Span | None = _span()
    plus: int = 0
    div: int = 0

    @property
    def is_symbol(self) -> bool:
        return isinstance(self.value, str)


@dataclass(frozen=True)
class Decl:
    role: str                      # in | out | param
    name: str
    dtype: str
    shape: tuple[Dim, ...] | None  # None: a scalar (params)
    layout: str | None = None      # row | col | None (= row)
    default: Num | None = None
    span: Span | None = _span()
    name_span: Span | None = field(default=None, compare=False, repr=False)
    packed: str | None = None      # `packed(cu)`: the offsets tensor of a varlen (packed) batch
    packed_span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Stmt:
    target: str
    indices: tuple[str, ...]
    dtype: str | None              # annotation `: f32`
    value: Expr
    span: Span | None = _span()
    index_spans: tuple[Span | None, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Kernel:
    name: str
    decls: tuple[Decl, ...]
    stmts: tuple[Stmt, ...]
    span: Span | None = _span()
    name_span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Setting:
    key: str
    value: tuple[int, ...] | int | str
    text: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Schedule:
    kernel: str
    arch: str | None
    settings: tuple[Setting, ...]
    span: Span | None = _span()
    name_span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Target:
    archs: tuple[str, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Program:
    kernels: tuple[Kernel, ...]
    schedules: tuple[Schedule, ...] = ()
    targets: tuple[Target, ...] = ()
    file: str = field(default="<string>", compare=False)
    source: str = field(default="", compare=False, repr=False)
