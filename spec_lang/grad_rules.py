"""Expression-level rules of `kspec grad` (spec_lang/grad.py): typed expressions back to source
ASTs, index renaming, and the reverse-mode rule of every elementwise operation.

`backprop(e, adj, active, out)` pushes the adjoint `adj` (an untyped `ast.Expr` over the statement's
indices, f32) down the pointwise typed expression `e` and collects, for every read of an active
tensor, the term it contributes: `out[key] = [term, ...]`, key `("acc", T, indices)` for a plain
read `T[m, n]` and `("gather", T, gather)` for a read at computed subscripts (`x[m, label[m]]`).
Derivatives are written with the language's own functions, in f32 (an operand of another float
dtype is converted first):

    gelu(x)       Φ(x) + x φ(x), with Φ(x) = gelu(x) / x (0.5 at x = 0) and φ the normal density
    gelu_tanh(x)  0.5 (1 + t) + 0.5 x (1 - t²) c (1 + 3·0.044715 x²), t = tanh(c (x + 0.044715 x³))
    silu(x)       σ(x) (1 + x (1 - σ(x)));  sigmoid: σ (1 - σ);  tanh: 1 - tanh²
    exp, log, sqrt, rsqrt, abs (0 at 0), relu (0 at 0)
    clamp(x, a, b)        to x where a <= x <= b, else to the bound taken
    maximum(a, b)         to a where a >= b, else to b (ties: the first argument); minimum alike
    where(c, a, b)        to the branch taken (the condition gets none)
    casts                 differentiate in f32; a cast to an integer dtype is not differentiable

The adjoint is multiplied in before a `where` selects, so a NaN of the branch not taken (exp(-inf
- -inf) of a fully masked row) never reaches a gradient.
"""
from __future__ import annotations

import math
from typing import Callable

from kspec.core import FLOAT_DTYPES, KspecError, KspecInternalError

from . import ast
from .check import (TAccess, TBinary, TCall, TCast, TConst, TExpr, TGather, TIndex, TReduce, TScalar, TSize,
                    TSoftmax, TUnary)

SIXTEEN_BIT = ("f16", "bf16")
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = math.sqrt(2.0 / math.pi)


# ---------------------------------------------------------------- building expressions
# `None` stands for an exact zero: the constructors fold it (and a factor of exactly 1) away.

def num(v: float | int) -> ast.Expr:
    if isinstance(v, float) and math.isinf(v):
        inf = ast.Num(math.inf, "inf")
        return inf if v > 0 else ast.Unary("-", inf)
    if v < 0:
        return ast.Unary("-", num(-v))
    if isinstance(v, int):
        return ast.Num(v, str(v))
    return ast.Num(float(v), repr(float(v)))


def is_num(e, v) -> bool:
    return isinstance(e, ast.Num) and e.value == v and e.text != "inf"


def access(t: str, idx) -> ast.Access:
    return ast.Access(t, tuple(idx))


def mul(a, b):
    if a is None or b is None:
        return None
    if is_num(a, 1):
        return b
    if is_num(b, 1):
        return a
    return ast.Binary("*", a, b)


def div(a, b):
    if a is None:
        return None
    return ast.Binary("/", a, b)


def add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(b, ast.Unary) and b.op == "-":
        return ast.Binary("-", a, b.operand)
    return ast.Binary("+", a, b)


def sub(a, b):
    if b is None:
        return a
    if a is None:
        return neg(b)
    return ast.Binary("-", a, b)


def neg(a):
    if a is None:
        return None
    if isinstance(a, ast.Unary) and a.op == "-":
        return a.operand
    return ast.Unary("-", a)


def call(fn: str, *args) -> ast.Call:
    return ast.Call(fn, tuple(args))


def where(c, a, b):
    """where(c, a, b) with None (zero) branches written 0.0."""
    if a is None and b is None:
        return None
    return call("where", c, num(0.0) if a is None else a, num(0.0) if b is None else b)


def cast(dtype: str, e) -> ast.Expr:
    return ast.Cast(dtype, e)


def total(terms) -> ast.Expr | None:
    out = None
    for t in terms:
        out = add(out, t)
    return out


# ---------------------------------------------------------------- typed -> source

def decompile(e: TExpr) -> ast.Expr:
    """A typed expression as source AST (what the checker would type back to the same tree)."""
    if isinstance(e, TConst):
        return num(e.value)
    if isinstance(e, (TScalar, TIndex, TSize)):
        return ast.Name(e.name)
    if isinstance(e, TAccess):
        return ast.Access(e.tensor, e.indices)
    if isinstance(e, TGather):
        return ast.Gather(e.tensor, tuple(_subscript(x) for x in e.subscripts))
    if isinstance(e, TUnary):
        return ast.Unary(e.op, decompile(e.operand))
    if isinstance(e, TBinary):
        return ast.Binary(e.op, decompile(e.lhs), decompile(e.rhs))
    if isinstance(e, TCall):
        return ast.Call(e.fn, tuple(decompile(a) for a in e.args))
    if isinstance(e, TCast):
        return ast.Cast(e.dtype, decompile(e.operand))
    if isinstance(e, TReduce):
        return ast.Reduce(e.op, e.indices, decompile(e.operand))
    if isinstance(e, TSoftmax):
        opts = (ast.KwArg("causal", e.causal),) if e.causal else ()
        return ast.Reduce("softmax", (e.axis,), decompile(e.operand), opts)
    raise TypeError(e)


def _subscript(x):
    if isinstance(x, str):
        return ast.IndexVar(x)
    if isinstance(x, int):
        return ast.Num(x, str(x))
    return decompile(x)


def f32(e: TExpr) -> ast.Expr:
    """e as source, converted to f32 unless it already is (derivatives are computed in f32)."""
    d = decompile(e)
    return d if e.dtype == "f32" else cast("f32", d)


# ---------------------------------------------------------------- indices

def free_indices(e: ast.Expr, bound: frozenset = frozenset()) -> set[str]:
    """Index names an expression uses free (as subscripts or values; `names` filters values)."""
    out: set[str] = set()

    def visit(x, bound):
        if isinstance(x, ast.Access):
            out.update(i for i in x.indices if i not in bound)
        elif isinstance(x, ast.Gather):
            for s in x.subscripts:
                if isinstance(s, ast.IndexVar):
                    if s.name not in bound:
                        out.add(s.name)
                elif not isinstance(s, ast.Num):
                    visit(s, bound)
        elif isinstance(x, ast.Name):
            if x.name not in bound:
                out.add(x.name)
        elif isinstance(x, ast.Reduce):
            visit(x.operand, bound | set(x.indices))
        else:
            for c in children(x):
                visit(c, bound)

    visit(e, bound)
    return out


def plain_indices(e: ast.Expr) -> set[str]:
    """Index names that occur as a plain subscript somewhere in e (what gives an index its extent)."""
    out: set[str] = set()

    def visit(x):
        if isinstance(x, ast.Access):
            out.update(x.indices)
        elif isinstance(x, ast.Gather):
            for s in x.subscripts:
                if isinstance(s, ast.IndexVar):
                    out.add(s.name)
                elif not isinstance(s, ast.Num):
                    visit(s)
        for c in children(x):
            visit(c)

    visit(e)
    return out


def children(x) -> tuple:
    if isinstance(x, ast.Unary):
        return (x.operand,)
    if isinstance(x, ast.Binary):
        return (x.lhs, x.rhs)
    if isinstance(x, ast.Call):
        return x.args
    if isinstance(x, (ast.Cast, ast.Reduce)):
        return (x.operand,)
    return ()


def rename(e: ast.Expr, mapping: dict[str, str], fresh: Callable[[str], str]) -> ast.Expr:
    """Rename free indices by `mapping`; an index bound by a reduction inside e that collides with
    a new name is renamed to a fresh one first (capture-avoiding)."""
    if not mapping:
        return e
    m = mapping
    if isinstance(e, ast.Access):
        return ast.Access(e.tensor, tuple(m.get(i, i) for i in e.indices))
    if isinstance(e, ast.Gather):
        return ast.Gather(e.tensor, tuple(ast.IndexVar(m.get(s.name, s.name)) if isinstance(s, ast.IndexVar)
                                          else s if isinstance(s, ast.Num) else rename(s, m, fresh)
                                          for s in e.subscripts))
    if isinstance(e, ast.Name):
        return ast.Name(m.get(e.name, e.name))
    if isinstance(e, ast.Num):
        return e
    if isinstance(e, ast.Unary):
        return ast.Unary(e.op, rename(e.operand, m, fresh))
    if isinstance(e, ast.Binary):
        return ast.Binary(e.op, rename(e.lhs, m, fresh), rename(e.rhs, m, fresh))
    if isinstance(e, ast.Call):
        return ast.Call(e.fn, tuple(rename(a, m, fresh) for a in e.args))
    if isinstance(e, ast.Cast):
        return ast.Cast(e.dtype, rename(e.operand, m, fresh))
    if isinstance(e, ast.Reduce):
        inner = {k: v for k, v in m.items() if k not in e.indices}
        targets = set(inner.values())
        bound = {}
        for ix in e.indices:
            if ix in targets:
                bound[ix] = fresh(ix)
        inner.update(bound)
        opts = tuple(ast.KwArg(o.name, inner.get(o.value, o.value)) for o in e.options)
        return ast.Reduce(e.op, tuple(bound.get(i, i) for i in e.indices), rename(e.operand, inner, fresh), opts)
    raise TypeError(e)


def substitute(e: ast.Expr, name: str, value: ast.Expr) -> ast.Expr:
    """e with the free index `name` replaced by the integer expression `value` (a read at `name`
    becomes a read at `value`: an Access turns into a Gather); a reduction binding `name` shadows it."""
    def sub(x):                     # a gather's subscript
        if isinstance(x, ast.IndexVar):
            return value if x.name == name else x
        return x if isinstance(x, ast.Num) else substitute(x, name, value)
    if isinstance(e, ast.Access):
        if name not in e.indices:
            return e
        return ast.Gather(e.tensor, tuple(value if i == name else ast.IndexVar(i) for i in e.indices))
    if isinstance(e, ast.Gather):
        return ast.Gather(e.tensor, tuple(sub(x) for x in e.subscripts))
    if isinstance(e, ast.Name):
        return value if e.name == name else e
    if isinstance(e, ast.Num):
        return e
    if isinstance(e, ast.Unary):
        return ast.Unary(e.op, substitute(e.operand, name, value))
    if isinstance(e, ast.Binary):
        return ast.Binary(e.op, substitute(e.lhs, name, value), substitute(e.rhs, name, value))
    if isinstance(e, ast.Call):
        return ast.Call(e.fn, tuple(substitute(a, name, value) for a in e.args))
    if isinstance(e, ast.Cast):
        return ast.Cast(e.dtype, substitute(e.operand, name, value))
    if isinstance(e, ast.Reduce):
        if name in e.indices or any(o.value == name for o in e.options):
            return e
        if free_indices(value) & set(e.indices):
            raise KspecInternalError(f"substituting {name} would capture an index bound by a reduction")
        return ast.Reduce(e.op, e.indices, substitute(e.operand, name, value), e.options)
    raise TypeError(e)


def modular_shift(s, extents: dict, axis_extent) -> tuple[str, int, int] | None:
    """(f, c, n) when subscript s is `(f + c) % n` or `(f - c) % n` (c, n integer literals, c taken
    mod n) with f an index ranging over exactly n values, the extent of the axis it reads: a
    rotation of that axis (RoPE's rotate-half reads `(e + 64) % 128`), a bijection whose inverse
    is the rotation by n - c.  None for any other subscript."""
    if not (isinstance(s, TBinary) and s.op == "%" and isinstance(s.rhs, TConst) and isinstance(s.lhs, TBinary)):
        return None
    n, inner = s.rhs.value, s.lhs
    if not isinstance(n, int) or n <= 0:
        return None
    if inner.op == "+" and isinstance(inner.lhs, TConst) and isinstance(inner.rhs, TIndex):
        f, c = inner.rhs.name, inner.lhs.value
    elif inner.op in ("+", "-") and isinstance(inner.lhs, TIndex) and isinstance(inner.rhs, TConst):
        f, c = inner.lhs.name, inner.rhs.value if inner.op == "+" else -inner.rhs.value
    else:
        return None
    if not isinstance(c, int) or extents.get(f) != n or axis_extent != n:
        return None
    return f, c % n, n


# ---------------------------------------------------------------- reverse mode over one expression

def tensors_read(e: TExpr) -> set[str]:
    """Tensors e reads as values (not the integer tensors inside gather subscripts)."""
    if isinstance(e, (TAccess, TGather)):
        return {e.tensor}
    out: set[str] = set()
    kids = (e.lhs, e.rhs) if isinstance(e, TBinary) else e.args if isinstance(e, TCall) else \
        (e.operand,) if isinstance(e, (TUnary, TCast, TReduce, TSoftmax)) else ()
    if isinstance(e, TCall) and e.fn == "where":
        kids = e.args[1:]
    for k in kids:
        out |= tensors_read(k)
    return out


def backprop(e: TExpr, adj, active: set[str], out: dict, span=None) -> None:
    """Push adjoint `adj` down pointwise expression `e` (module docstring)."""
    if adj is None or not (tensors_read(e) & active):
        return
    if isinstance(e, TAccess):
        out.setdefault(("acc", e.tensor, e.indices), []).append(adj)
        return
    if isinstance(e, TGather):
        out.setdefault(("gather", e.tensor, e), []).append(adj)
        return
    if isinstance(e, TUnary):
        if e.op == "-":
            backprop(e.operand, neg(adj), active, out, span)
        return
    if isinstance(e, TCast):
        if e.dtype not in FLOAT_DTYPES:
            raise KspecError(f"not differentiable: {e.dtype}(...) converts a value that depends on a "
                             "differentiated input to an integer", e.span or span,
                             "the gradient of a rounding to an integer is zero almost everywhere; take the input "
                             "out of --wrt, or keep the value in floating point")
        backprop(e.operand, adj, active, out, span)
        return
    if isinstance(e, TBinary):
        a, b = e.lhs, e.rhs
        if e.op == "+":
            backprop(a, adj, active, out, span)
            backprop(b, adj, active, out, span)
        elif e.op == "-":
            backprop(a, adj, active, out, span)
            backprop(b, neg(adj), active, out, span)
        elif e.op == "*":
            backprop(a, mul(adj, f32(b)), active, out, span)
            backprop(b, mul(adj, f32(a)), active, out, span)
        elif e.op == "/":
            backprop(a, div(adj, f32(b)), active, out, span)
            backprop(b, neg(div(mul(adj, f32(a)), mul(f32(b), f32(b)))), active, out, span)
        return          # comparisons and logic give conditions: no gradient
    if isinstance(e, TCall):
        _call(e, adj, active, out, span)
        return
    if isinstance(e, (TReduce, TSoftmax)):
        raise AssertionError("backprop on a reduction: statements are normalised first")


def _call(e: TCall, adj, active, out, span) -> None:
    fn, args = e.fn, e.args
    if fn == "where":
        c = decompile(args[0])
        backprop(args[1], where(c, adj, None), active, out, span)
        backprop(args[2], where(c, None, adj), active, out, span)
        return
    x = args[0]
    X = f32(x)
    if fn in ("maximum", "minimum"):
        Y = f32(args[1])
        first = ast.Binary(">=" if fn == "maximum" else "<=", X, Y)
        backprop(x, where(first, adj, None), active, out, span)
        backprop(args[1], where(first, None, adj), active, out, span)
        return
    if fn == "clamp":
        lo, hi = f32(args[1]), f32(args[2])
        inside = ast.Binary("and", ast.Binary(">=", X, lo), ast.Binary("<=", X, hi))
        backprop(x, where(inside, adj, None), active, out, span)
        backprop(args[1], where(ast.Binary("<", X, lo), adj, None), active, out, span)
        backprop(args[2], where(ast.Binary(">", X, hi), adj, None), active, out, span)
        return
    if fn == "relu":
        backprop(x, where(ast.Binary(">", X, num(0.0)), adj, None), active, out, span)
        return
    if fn == "abs":
        backprop(x, where(ast.Binary(">", X, num(0.0)), adj,
                          where(ast.Binary("<", X, num(0.0)), neg(adj), None)), active, out, span)
        return
    backprop(x, _chain(fn, X, adj), active, out, span)


def _chain(fn: str, X, adj):
    """adj times the derivative of the one-argument function fn at X (f32)."""
    if fn == "exp":
        return mul(adj, call("exp", X))
    if fn == "log":
        return div(adj, X)
    if fn == "sqrt":
        return div(mul(adj, num(0.5)), call("sqrt", X))
    if fn == "rsqrt":
        return neg(div(mul(mul(adj, num(0.5)), call("rsqrt", X)), X))
    if fn == "tanh":
        t = call("tanh", X)
        return mul(adj, sub(num(1.0), mul(t, t)))
    if fn == "sigmoid":
        s = call("sigmoid", X)
        return mul(adj, mul(s, sub(num(1.0), s)))
    if fn == "silu":
        s = call("sigmoid", X)
        return mul(adj, mul(s, add(num(1.0), mul(X, sub(num(1.0), s)))))
    if fn == "gelu":
        cdf = where(ast.Binary("==", X, num(0.0)), num(0.5), div(call("gelu", X), X))
        pdf = mul(call("exp", mul(mul(num(-0.5), X), X)), num(_INV_SQRT_2PI))
        return mul(adj, add(cdf, mul(X, pdf)))
    if fn == "gelu_tanh":
        inner = mul(num(_GELU_TANH_C), add(X, mul(mul(mul(num(0.044715), X), X), X)))
        t = call("tanh", inner)
        d = add(mul(num(0.5), add(num(1.0), t)),
                mul(mul(mul(mul(num(0.5), X), sub(num(1.0), mul(t, t))), num(_GELU_TANH_C)),
                    add(num(1.0), mul(mul(num(3 * 0.044715), X), X))))
        return mul(adj, d)
    raise AssertionError(f"no derivative rule for {fn}")
