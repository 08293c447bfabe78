"""Normal form of a kernel for `kspec grad` (grad.py): every statement's value is pointwise, or one
reduction or softmax at its top.

- a reduction or softmax nested in a statement becomes a temporary of its own (`<target>_r`);
- the argument of a nonlinear function (gelu, silu, exp, rsqrt, ...) that is more than a read
  becomes a temporary (`<target>_z`): the derivative reads it again, and the gradients through it
  share one adjoint;
- a `softmax(j, causal=i)` becomes `softmax(j)` of an operand of its own with the mask written out
  (`<target>_in = where(j <= i, .., -inf)`), which is also what its log-sum-exp is taken of.

The new temporaries are registered in the caller's tensor table; names come from its `fresh`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .check import (BOOL, CheckedKernel, TAccess, TBinary, TCall, TCast, TConst, TExpr, TGather, TIndex, TReduce,
                    TSoftmax, TUnary, TensorInfo, texpr_children, varlen_lengths_as_sizes)
from .errors import KspecError


@dataclass
class NStmt:
    """A normalised statement: its value is pointwise, or one reduction or softmax at the top."""
    target: str
    indices: tuple[str, ...]
    dtype: str
    value: TExpr
    extents: dict
    span: object = None


class Normaliser:
    def __init__(self, k: CheckedKernel, infos: dict[str, TensorInfo], fresh: Callable[[str], str]):
        self.k, self.infos, self.fresh = k, infos, fresh

    def run(self) -> list[NStmt]:
        return self.normalise()

    def normalise(self) -> list[NStmt]:
        out: list[NStmt] = []
        for st in self.k.stmts:
            ext = dict(st.extents)
            value = self._lift(varlen_lengths_as_sizes(self.k, st.value), True, ext, out, st.target, st.span)
            self._push(NStmt(st.target, st.indices, st.dtype, value, _own_extents(ext, st.indices, value), st.span),
                       out)
        return out

    def _push(self, ns: NStmt, out: list[NStmt]) -> None:
        v = ns.value
        if isinstance(v, TSoftmax):
            operand = v.operand
            if v.causal:
                cond = TBinary(BOOL, (v.axis, v.causal), None, "<=", TIndex("i32", (v.axis,), None, v.axis),
                               TIndex("i32", (v.causal,), None, v.causal))
                operand = TCall(operand.dtype, operand.free, None, "where", (cond, operand, TConst("f32", (), None, float("-inf"), True)))
            if not isinstance(operand, TAccess) or v.causal:
                operand = self._temp(operand, ns.target + "_in", ns.extents, out, ns.span)
            ns = replace(ns, value=replace(v, causal=None, operand=operand))
        out.append(ns)

    def _temp(self, e: TExpr, base: str, ext: dict, out: list, span) -> TAccess:
        name = self.fresh(base)
        idx = tuple(e.free)
        missing = [i for i in idx if i not in plain_typed(e)]
        if missing:
            raise KspecError(f"kspec grad cannot name this value on its own: index '{missing[0]}' is used only as a "
                             "value inside it", e.span or span, "write the reduction as a statement of its own")
        info = TensorInfo(name, "temp", e.dtype, tuple(ext[i] for i in idx), "row", None, span)
        self.infos[name] = info
        self._push(NStmt(name, idx, e.dtype, e, _own_extents(ext, idx, e), span), out)
        return TAccess(e.dtype, idx, e.span, name, idx)

    def _lift(self, e: TExpr, top: bool, ext, out, base, span) -> TExpr:
        if isinstance(e, (TReduce, TSoftmax)):
            e = replace(e, operand=self._lift(e.operand, False, ext, out, base, span))
            return e if top else self._temp(e, base + "_r", ext, out, span)
        if isinstance(e, TUnary):
            return replace(e, operand=self._lift(e.operand, False, ext, out, base, span))
        if isinstance(e, TCast):
            return replace(e, operand=self._lift(e.operand, False, ext, out, base, span))
        if isinstance(e, TBinary):
            return replace(e, lhs=self._lift(e.lhs, False, ext, out, base, span),
                           rhs=self._lift(e.rhs, False, ext, out, base, span))
        if isinstance(e, TCall):
            args = tuple(self._lift(a, False, ext, out, base, span) for a in e.args)
            if e.fn in _NAMED_ARGUMENT and not _simple(args[0]) and args[0].free and \
                    set(args[0].free) <= plain_typed(args[0]):
                # the argument of a nonlinear function gets a name: its derivative reads it again, and
                # every gradient flowing through it shares one adjoint (GEMM + bias + gelu: dbias and
                # the backward GEMMs' operand are both computed from the one d(pre-activation))
                args = (self._temp(args[0], base + "_z", ext, out, span),) + args[1:]
            return replace(e, args=args)
        return e


def _all_indices(e: TExpr) -> set[str]:
    out = set(e.free)
    if isinstance(e, TReduce):
        out |= set(e.indices)
    if isinstance(e, TSoftmax):
        out.add(e.axis)
    for c in texpr_children(e):
        out |= _all_indices(c)
    return out


def _own_extents(ext: dict, lhs, value: TExpr) -> dict:
    """The extents of the indices a (normalised) statement itself uses, in the statement's order."""
    mine = set(lhs) | _all_indices(value)
    return {i: d for i, d in ext.items() if i in mine}


_NAMED_ARGUMENT = ("gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt")


def _simple(e: TExpr) -> bool:
    while isinstance(e, TCast):
        e = e.operand
    return isinstance(e, (TAccess, TConst)) or not e.free


def plain_typed(e: TExpr) -> set[str]:
    out: set[str] = set()
    if isinstance(e, TAccess):
        out.update(e.indices)
    if isinstance(e, TGather):
        out.update(s for s in e.subscripts if isinstance(s, str))
    for c in texpr_children(e):
        out |= plain_typed(c)
    return out
