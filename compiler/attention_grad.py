"""The score modification of an attention backward: what `kspec grad` derives from a forward whose
scores are modified before the softmax (soft-capping `cap * tanh(s / cap)`, ALiBi `s + slope[h] *
(j - i)`, a bias), in the form FlashAttention-4's backward takes it: `score_mod` (the forward's mod,
applied to the recomputed scaled scores) and `score_mod_bwd` (its derivative, applied to the
gradient P * (dP - D) of the modified scores).

    bwd_scores(g, value, name_of) -> BwdScores | str   the recomputed softmax operand: QK^T, its
                                                       scale, the mod and the mask, lifted
    derivative(score_mod) -> EpiExpr                   ScoreGrad() * d score_mod / d Score()
    expected_grad(scores, derived) -> EpiExpr          dS as FlashAttention-4 computes it
    grad_chain(g, mul, scores, name_of)                the graph's dS (from P * (dP - D) on) lifted
    differs(graph_expr, expected) -> str | None        why the graph's dS is not that (None: it is)

**The derivative** is kspec grad's own (spec_lang/grad_rules.backprop, the one derivative table):
the mod, an expression over Score(), indices, sizes, scalar params and aux loads, is typed as a
spec expression over one active tensor (the score; every other leaf an opaque scalar of its dtype),
pushed back from the adjoint ScoreGrad(), and the result turned back into an expression.

**The check** that the backward spec really computes that derivative: the graph's dS chain (every
node from P * (dP - D) to the value dQ and dK contract, the recomputed mod chain read as Score())
is lifted as an expression too, and it must read exactly the leaves of the expected dS (no
forward value, no other input), choose (where) only by conditions the expected dS chooses by
(structurally: no branch of its own that random points might miss), and agree with it in float64
at random points (scores, gradients, params and aux values random, indices and sizes random
integers, so masks take both branches; a share of the scores set to each constant the score is
compared with, gelu's `x == 0`, relu's `x > 0`).  A tampered gradient fails it; anything not
recognised is refused with the reason.  What it cannot see: a branch of the expected dS itself
taken only on a set random points miss (`f(score) == c` for another f than the score itself).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import networkx as nx

from kspec.core import INT_DTYPES

from .attention import NotLiftable, _lift, _split_mask, score_path_of
from .graph import _BINARY_FN, op, operands
from .kir import AuxLoad, Const, EpiExpr, Index, Load, Op, Score, ScoreGrad, Size, epi_nodes

_SCORE, _GRAD, _LEAF = "__score__", "__dscore__", "__leaf"
_SYMBOL = {fn: sym for sym, fn in _BINARY_FN.items()}
_SYMBOL["floordiv"] = "/"
_BOOL_FNS = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}


@dataclass(frozen=True)
class BwdScores:
    """The recomputed softmax operand of an attention backward: mask(score_mod(scale * QK^T))."""
    root: object                       # the node whose value the softmax read (exp(root - lse))
    qk: object                         # the recomputed QK^T contraction
    scale: object                      # the param node scaling it (None: no scale)
    score: object                      # the node whose value is Score() (the scale node, or qk)
    score_mod: EpiExpr | None
    mask: EpiExpr | None
    aux: tuple                         # input nodes the mod reads (AuxLoad)
    nodes: frozenset                   # nodes computing the mod and mask
    grad: EpiExpr | None = None        # derivative(score_mod), once matched


def bwd_scores(g: nx.DiGraph, value, name_of: Callable[[object], str]) -> BwdScores | str:
    """The softmax operand `value` of an attention backward as QK^T, a scale param, a score
    modification and a mask (compiler/attention.py's lifting, as the forward's); the reason as a str."""
    sp = score_path_of(g, value)
    if isinstance(sp, str):
        return f"the recomputed scores: {sp}"
    scale = None
    if sp.scale:
        params = [u for u, _ in operands(g, sp.scale[0]) if op(g, u).kind == "param"]
        if len(sp.scale) != 1 or op(g, sp.scale[0]).fn != "mul" or len(params) != 1:
            return "the scores are scaled by something other than one param"
        scale = params[0]
    qo = op(g, sp.qk)
    if qo.kind != "contraction" or len(qo.reduced) != 1 or len(qo.axes) != 4 or \
            set(op(g, value).axes) != set(qo.axes):
        return "the scores are not [b, h, i, j] of one contraction over the head dim"
    try:
        expr, aux, nodes = _lift(g, value, {a: a for a in op(g, value).axes}, sp.score, tuple(qo.axes), name_of)
    except NotLiftable as e:
        return f"between QK^T and the softmax, {e}"
    mask, mod = _split_mask(expr)
    if mask is not None and any(isinstance(x, Score) for x in epi_nodes(mask)):
        return "a mask that reads the scores"
    return BwdScores(value, sp.qk, scale, sp.score, None if isinstance(mod, Score) else mod, mask, tuple(aux),
                     frozenset(nodes))


# ---------------------------------------------------------------------------------------------
# the derivative, by kspec grad's rules
# ---------------------------------------------------------------------------------------------

def _is_int(e: EpiExpr) -> bool:
    """e is an integer (index arithmetic) in the attention mods' typing (kir.AttentionStructure)."""
    if isinstance(e, (Index, Size)):
        return True
    if isinstance(e, Const):
        return isinstance(e.value, int)
    if isinstance(e, (Load, AuxLoad)):
        return e.dtype in INT_DTYPES
    if isinstance(e, Op):
        if e.fn.startswith("cast:"):
            return e.fn[5:] in INT_DTYPES
        if e.fn in _BOOL_FNS:
            return False
        args = e.args[1:] if e.fn == "where" else e.args
        return all(_is_int(a) for a in args)
    return False


def _dtype(e: EpiExpr) -> str:
    if isinstance(e, Op) and e.fn in _BOOL_FNS:
        return "bool"
    if isinstance(e, (Load, AuxLoad)):
        return e.dtype
    if isinstance(e, Op) and e.fn.startswith("cast:"):
        return e.fn[5:]
    return "i32" if _is_int(e) else "f32"


def _typed(e: EpiExpr, leaves: dict):
    """e as a typed spec expression (spec_lang.check): Score() the active tensor, ScoreGrad() and
    every other leaf an opaque scalar (leaves: its name -> the expression)."""
    from kspec.spec_lang.check import TAccess, TBinary, TCall, TCast, TConst, TScalar, TUnary
    dt = _dtype(e)
    if isinstance(e, Score):
        return TAccess("f32", (), tensor=_SCORE, indices=())
    if isinstance(e, Const):
        return TConst(dt, (), value=e.value)
    if isinstance(e, Op):
        args = tuple(_typed(a, leaves) for a in e.args)
        if e.fn in ("neg", "not"):
            return TUnary(dt, (), op="-" if e.fn == "neg" else "not", operand=args[0])
        if e.fn.startswith("cast:"):
            return TCast(dt, (), operand=args[0])
        if e.fn in _SYMBOL:
            return TBinary(dt, (), op=_SYMBOL[e.fn], lhs=args[0], rhs=args[1])
        return TCall(dt, (), fn=e.fn, args=args)
    name = next((k for k, v in leaves.items() if v == e), None) or f"{_LEAF}{len(leaves)}"
    leaves[name] = e
    return TScalar(dt, (), name=name)


def _untyped(x, leaves: dict) -> EpiExpr:
    """A source expression (spec_lang.ast) over the names _typed gave back as an expression."""
    from kspec.spec_lang import ast
    if isinstance(x, ast.Name):
        if x.name == _GRAD:
            return ScoreGrad()
        return leaves[x.name]
    if isinstance(x, ast.Access) and x.tensor == _SCORE:
        return Score()
    if isinstance(x, ast.Num):
        return Const(math.inf if x.text == "inf" else x.value)
    if isinstance(x, ast.Unary):
        return Op("neg" if x.op == "-" else "not", (_untyped(x.operand, leaves),))
    if isinstance(x, ast.Binary):
        a, b = _untyped(x.lhs, leaves), _untyped(x.rhs, leaves)
        fn = _BINARY_FN[x.op]
        return Op("floordiv" if fn == "div" and _is_int(a) and _is_int(b) else fn, (a, b))
    if isinstance(x, ast.Call):
        return Op(x.fn, tuple(_untyped(a, leaves) for a in x.args))
    if isinstance(x, ast.Cast):
        return Op(f"cast:{x.dtype}", (_untyped(x.operand, leaves),))
    raise NotLiftable(f"the derivative holds {type(x).__name__}, which has no expression form")


def derivative(score_mod: EpiExpr) -> EpiExpr:
    """ScoreGrad() times the derivative of score_mod with respect to Score(), by kspec grad's rules
    (spec_lang.grad_rules.backprop); Const(0.0) where the mod does not depend on the score."""
    from kspec.spec_lang import ast
    from kspec.spec_lang.grad_rules import backprop, total
    leaves: dict = {}
    out: dict = {}
    backprop(_typed(score_mod, leaves), ast.Name(_GRAD), {_SCORE}, out)
    terms = [t for key, ts in out.items() if key[1] == _SCORE for t in ts]
    d = total(terms)
    return Const(0.0) if d is None else _untyped(d, leaves)


def expected_grad(scores: BwdScores, derived: EpiExpr | None, scale_name: str | None) -> EpiExpr:
    """dS before its rounding, as FlashAttention-4 computes it: the score_mod's derivative applied to
    P * (dP - D) (ScoreGrad() itself without a mod), masked keys 0, times the scale."""
    e = derived if derived is not None else ScoreGrad()
    if scores.mask is not None:
        e = Op("where", (scores.mask, e, Const(0.0)))
    return Op("mul", (e, Load(scale_name, "scalar", "f32"))) if scale_name is not None else e


def grad_chain(g: nx.DiGraph, mul, scores: BwdScores, name_of: Callable[[object], str]):
    """(the dS node dQ and dK contract, its value before the rounding to their dtype lifted as an
    expression with `mul` = P * (dP - D) read as ScoreGrad(), the nodes it computes), or the reason
    (a str).  The chain runs from mul through nodes of one consumer each."""
    n = mul
    while True:
        cs = list(g.successors(n))
        if len(cs) != 1 or op(g, cs[0]).kind not in ("elementwise", "cast", "broadcast"):
            break
        n = cs[0]
    others = [c for c in g.successors(n) if op(g, c).kind != "contraction"]
    if others:
        return (f"dS is also read by {op(g, others[0]).label()} (FlashAttention-4's backward computes dQ, dK and dV "
                "only: a gradient of a tensor the score modification reads is not among them)")
    root = n
    if op(g, n).kind == "cast":
        ((root, _),) = operands(g, n)
    axes = op(g, root).axes
    labels = tuple(op(g, scores.qk).axes)
    if set(axes) != set(labels):
        return "dS is not a value over the scores' [b, h, i, j]"
    try:
        expr, aux, nodes = _lift(g, root, {a: a for a in axes}, scores.score, labels, name_of,
                                 leaves={mul: ScoreGrad()})
    except NotLiftable as e:
        return f"dS is not an elementwise function of P * (dP - D) and the scores ({e})"
    return n, expr, frozenset(nodes)


# ---------------------------------------------------------------------------------------------
# the check: same leaves, same values at random points
# ---------------------------------------------------------------------------------------------

def leaves_of(e: EpiExpr) -> set:
    """The leaves an expression reads (not its constants): Score, ScoreGrad, indices, sizes, scalars,
    aux loads (each as a whole, with its subscripts)."""
    out, stack = set(), [e]
    while stack:
        x = stack.pop()
        if isinstance(x, Op):
            stack.extend(x.args)
        elif not isinstance(x, Const):
            out.add(x)
    return out


def conditions(e: EpiExpr) -> set:
    """The boolean sub-expressions of e: the conditions its where(..)s choose by, and their parts."""
    return {x for x in epi_nodes(e) if isinstance(x, Op) and x.fn in _BOOL_FNS}


def _score_boundaries(e: EpiExpr) -> set[float]:
    """The constants the score is compared with (`score > 0`, gelu's derivative at `x == 0`): values
    random points would (almost) never hit."""
    out = set()
    for x in conditions(e):
        if x.fn in ("lt", "le", "gt", "ge", "eq", "ne"):
            a, b = x.args
            for u, c in ((a, b), (b, a)):
                if isinstance(u, Score) and isinstance(c, Const) and math.isfinite(c.value):
                    out.add(float(c.value))
    return out


def _values(leaves, n: int, rng, boundaries=()):
    import numpy as np
    env = {}
    for x in sorted(leaves, key=repr):
        if isinstance(x, Score):
            # ordinary scores, large ones (a softcap's tanh saturates), and the constants the score
            # is compared with
            env[x] = np.where(rng.random(n) < 0.8, rng.uniform(-8, 8, n), rng.uniform(-300, 300, n))
            for k, c in enumerate(sorted(boundaries)):
                env[x][k::4 * (len(boundaries) + 1)] = c
        elif isinstance(x, ScoreGrad):
            env[x] = rng.uniform(-2, 2, n)
        elif isinstance(x, Index):
            env[x] = rng.integers(0, 48, n)
        elif isinstance(x, Size):
            env[x] = rng.integers(48, 96, n)
        elif x.dtype in INT_DTYPES:
            env[x] = rng.integers(1, 9, n)
        else:
            env[x] = rng.uniform(0.25, 4.0, n) * rng.choice([-1.0, 1.0], n) if isinstance(x, AuxLoad) else \
                rng.uniform(0.25, 4.0, n)
    return env


def evaluate(e: EpiExpr, env: dict):
    """e in float64 (int64 for integers) over the leaf values in env (numpy arrays): the kernels'
    semantics without their f32 rounding; a cast to f16/bf16 rounds, integer `/` and `%` floor."""
    import numpy as np

    from kspec.numerics import FUNCTIONS, floordiv, mod, to_storage
    if isinstance(e, Const):
        return np.asarray(e.value, np.int64 if isinstance(e.value, int) else np.float64)
    if not isinstance(e, Op):
        return env[e]
    args = [evaluate(a, env) for a in e.args]
    fn = e.fn
    with np.errstate(all="ignore"):
        if fn.startswith("cast:"):
            dt = fn[5:]
            if dt in INT_DTYPES:
                return np.trunc(np.asarray(args[0], np.float64)).astype(np.int64)
            x = np.asarray(args[0], np.float64)
            return x if dt in ("f32", "f64") else np.asarray(to_storage(x, dt), np.float64)
        if fn == "floordiv":
            return floordiv(*args)
        if fn == "mod":
            return mod(*args)
        if fn == "div":
            return np.asarray(args[0], np.float64) / np.asarray(args[1], np.float64)
        if fn == "sigmoid":
            return 1.0 / (1.0 + np.exp(-np.asarray(args[0], np.float64)))
        if fn == "silu":
            x = np.asarray(args[0], np.float64)
            return x / (1.0 + np.exp(-x))
        if fn == "gelu":
            x = np.asarray(args[0], np.float64)
            return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
        if fn == "gelu_tanh":
            x = np.asarray(args[0], np.float64)
            return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
        if fn not in FUNCTIONS:
            raise NotLiftable(f"no float64 evaluation of '{fn}'")
        return FUNCTIONS[fn](*args)


def differs(graph_expr: EpiExpr, expected: EpiExpr, points: int = 512, seed: int = 0) -> str | None:
    """Why the graph's dS is not the expected one (None: it is).  It must read exactly the same leaves,
    choose only by conditions the expected one chooses by (so every branch it has is one the points
    below exercise), and agree with it in float64 at `points` random points (both non-finite alike),
    a share of them with the score at each constant a condition compares it with."""
    import numpy as np
    from .kir import format_epi
    new = conditions(graph_expr) - conditions(expected)
    if new:
        return f"it chooses by {format_epi(min(new, key=format_epi))}, which the score_mod's derivative does not"
    have, want = leaves_of(graph_expr), leaves_of(expected)
    if have != want:
        extra = sorted(format_epi(x) for x in have - want)
        missing = sorted(format_epi(x) for x in want - have)
        return ("it reads " + ", ".join(extra) if extra else "it does not read " + ", ".join(missing)) + \
            " (the score_mod's derivative reads " + (", ".join(sorted(format_epi(x) for x in want)) or "nothing") + ")"
    rng = np.random.default_rng(seed)
    env = _values(want, points, rng, _score_boundaries(expected))
    try:
        x = np.broadcast_to(np.asarray(evaluate(graph_expr, env), np.float64), (points,))
        y = np.broadcast_to(np.asarray(evaluate(expected, env), np.float64), (points,))
    except NotLiftable as e:
        return str(e)
    finite = np.isfinite(x) & np.isfinite(y)
    same = np.where(finite, np.abs(x - y) <= 1e-9 * (1.0 + np.abs(y)), (np.isnan(x) & np.isnan(y)) | (x == y))
    if not same.all():
        k = int(np.argmin(same))
        return f"its value differs from the score_mod's derivative ({x[k]!r} against {y[k]!r} at a random point)"
    return None


def mask_of(g: nx.DiGraph, conds, scores: BwdScores, name_of: Callable[[object], str]) -> EpiExpr | None:
    """The where(c, .., -inf) conditions masking the modified scores (outermost first), and-ed, as an
    expression over the scores' labels (None: no mask)."""
    labels = tuple(op(g, scores.qk).axes)
    out = None
    for c in reversed(conds):
        e, _aux, _nodes = _lift(g, c, {a: a for a in op(g, c).axes}, None, labels, name_of)
        out = e if out is None else Op("and", (e, out))
    return out


def match_grad(g: nx.DiGraph, mul, scores: BwdScores, conds, scale_name: str | None,
               name_of: Callable[[object], str]):
    """The dS node of a score-modified attention backward and its scores with the derivative (and
    the mask, from the where(c, .., -inf) conditions `conds`) filled in, or the reason the graph's dS
    is not the score_mod's derivative (a str)."""
    from .kir import format_epi
    try:
        scores = replace(scores, mask=mask_of(g, conds, scores, name_of))
    except NotLiftable as e:
        return f"the mask: {e}"
    derived = derivative(scores.score_mod) if scores.score_mod is not None else None
    found = grad_chain(g, mul, scores, name_of)
    if isinstance(found, str):
        return found
    ds, expr, _nodes = found
    why = differs(expr, expected_grad(scores, derived, scale_name))
    if why:
        return (f"dS = {format_epi(expr)} is not the derivative of the score modification "
                f"{format_epi(scores.score_mod) if scores.score_mod is not None else 'score'}: {why}")
    return ds, replace(scores, grad=derived)
