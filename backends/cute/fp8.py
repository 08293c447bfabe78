"""FP8 attention through FlashAttention-4 (backends/cute/attention.py): e4m3 Q, K and V with per
(sequence, K/V head) descale factors, FA4 4.0.0b36's `FlashAttentionForwardSm100` with
`DescaleTensors(q_descale, k_descale, v_descale)`, each an f32 [B, KH] tensor.

    descales(ir, a) -> (Descales | None, a')   the spec's descale factors as FA4's, and the attention
                                               without them (a' has no such score factors, no o_scale)
    unsupported(ir, a, arch) -> reason | None  what FA4 cannot take

**The spelling.**  The query and key descales multiply the scores, the value descale the output:

    s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h / G, j, e]
    m[b, h, i, j] = s[b, h, i, j] * (q_descale[b, h / G] * k_descale[b, h / G])
    p[b, h, i, j] = softmax(j) m[b, h, i, j]
    O[b, h, i, e] = v_descale[b, h / G] * sum(j) p[b, h, i, j] * V[b, h / G, j, e]

(the score factors in any order or grouping, either one alone; `h` itself when G is 1).  This is FA4's
arithmetic: `softmax_scale * q_descale * k_descale` scales the scores (interface: "FA3 descale
semantics", one value per batch and K/V head), and `v_descale` the finished output.

**Where.**  sm100a only: FA4 b36 asserts "FP8 is only supported on SM100" (interface._flash_attn_fwd);
O is bf16 (FA4 writes FP8 attention's output in bf16).  FA4 rounds the probabilities to e4m3 (scaled
by 2^8, flash_fwd_sm100.py "Low Precision Scaling") before P @ V, as it rounds them to the input
dtype for f16/bf16: the fused kernel's tolerance, not the spec's f32 `p`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

FP8 = "f8e4m3"
SM90_REASON = ("FlashAttention-4 4.0.0b36 runs FP8 attention on sm100a only (its interface asserts \"FP8 is only "
               "supported on SM100\")")


@dataclass(frozen=True)
class Descales:
    q: str | None
    k: str | None
    v: str | None


def _factors(e) -> list:
    from kspec.compiler.kir import Op
    if isinstance(e, Op) and e.fn == "mul":
        return [f for x in e.args for f in _factors(x)]
    return [e]


def _per_kv_head(ir, a, x) -> bool:
    """x loads an f32 [B, KH] input at (b, kv head of h): `d[b, h / G]` (or `d[b, h]` when G is 1)."""
    from kspec.compiler.kir import AuxLoad, Const, Index, Load, Op, Size
    if not isinstance(x, AuxLoad) or len(a.batch) != 2 or len(x.index) != 2:
        return False
    buf = ir.buffer(x.buffer)
    if buf.dtype != "f32" or buf.role != "input" or len(buf.shape) != 2:
        return False
    b, h = (Index(label) for label in a.batch)
    head = x.index[1]
    group = a.kv_group
    if group is None:
        kv_ok = head == h
    else:
        den = Const(group) if isinstance(group, int) else None
        ok_den = (lambda d: d == den) if den is not None else \
            (lambda d: (isinstance(d, Load) and d.name == group) or (isinstance(d, Size) and d.name == group))
        kv_ok = isinstance(head, Op) and head.fn == "floordiv" and head.args[0] == h and ok_den(head.args[1])
    return x.index[0] == b and kv_ok


def descales(ir, a):
    """(Descales, the attention without them) when `a` is FP8 attention in the spelling above (or
    has no descale at all: Descales(None, None, None)); (None, a) when a score factor or the output
    scale is of another form."""
    from kspec.compiler.kir import Score
    q = k = v = None
    score_mod = a.score_mod
    if score_mod is not None:
        fs = _factors(score_mod)
        loads = [f for f in fs if _per_kv_head(ir, a, f)]
        if fs.count(Score()) == 1 and len(loads) == len(fs) - 1 and 1 <= len(loads) <= 2:
            q = loads[0].buffer
            k = loads[1].buffer if len(loads) > 1 else None
            score_mod = None
    if a.o_scale is not None:
        if not _per_kv_head(ir, a, a.o_scale):
            return None, a
        v = a.o_scale.buffer
    used = {x for x in (q, k, v) if x}
    keep_aux = tuple(x for x in a.aux if x not in used or _read_by(score_mod, x) or _read_by(a.mask, x))
    return Descales(q, k, v), replace(a, score_mod=score_mod, o_scale=None, aux=keep_aux)


def _read_by(e, buffer: str) -> bool:
    from kspec.compiler.kir import AuxLoad, epi_nodes
    return e is not None and any(isinstance(x, AuxLoad) and x.buffer == buffer for x in epi_nodes(e))


def unsupported(ir, a, arch: str) -> str | None:
    """Why FA4 cannot take this attention's FP8 inputs or output scale (None: it can)."""
    if a.o_scale is not None and a.dtypes[0] != FP8:
        return ("an output scale (O = d[b, h / G] * sum(j) p V): FlashAttention-4 applies one only to FP8 "
                "attention (its v_descale)")
    if a.dtypes[0] != FP8:
        return None
    if arch != "sm100a":
        return SM90_REASON
    out = ir.buffer(a.out_buffers[0]).dtype
    if out != "bf16":
        return f"FlashAttention-4 writes FP8 attention's O in bf16, not {out}"
    d, rest = descales(ir, a)
    if d is None:
        return ("an output scale FlashAttention-4 cannot apply: its v_descale is one f32 value per sequence and "
                "K/V head, read as v_descale[b, h / G]")
    del rest
    return None
