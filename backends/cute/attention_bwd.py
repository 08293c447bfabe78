"""The backward of a plain or causal attention (compiler.kir.AttentionBwdStructure, what `kspec grad`
derives) as FlashAttention-4's backward: three kernels run in order, sharing a workspace --
flash_bwd_preprocess (D = rowsum(dO * O), LSE scaled to log2, the f32 dQ accumulator zeroed),
flash_bwd_sm90 / flash_bwd_sm100 (dK, dV, and dQ accumulated in f32), flash_bwd_postprocess
(the accumulator scaled and converted to dQ), driven as flash_attn.cute.interface._flash_attn_bwd
drives them.

Status: the capability check below says which backwards FlashAttention-4 covers; the lowering
to those three kernels (entry source, CuTe DSL AOT export, the runtime's three-kernel plan with
its workspace) is not wired in yet, so every attention backward is refused here with that reason
and keeps the unfused plan."""
from __future__ import annotations

from kspec.core import ARCHS

HEAD_DIMS = (64, 128)
DTYPES = ("f16", "bf16")
PENDING = ("FlashAttention-4's backward kernels (preprocess, main, postprocess) are not wired into kspec's "
           "CuTe DSL build yet")


def covered(ir, arch: str) -> str | None:
    """Why FlashAttention-4's backward as kspec would drive it cannot compute this backward (None: it can)."""
    a = ir.attention_bwd
    if a is None:
        return "not an attention backward kspec recognises"
    if arch not in ARCHS:
        return f"FlashAttention-4's backward is built for {', '.join(ARCHS)}, not {arch}"
    if a.dtype not in DTYPES:
        return f"FlashAttention-4's backward takes f16/bf16 Q, K, V, O, dO (got {a.dtype})"
    if a.head_dim not in HEAD_DIMS:
        return f"head dim {a.head_dim}: kspec drives FlashAttention-4's backward at head dims 64 and 128 only"
    if tuple(a.out_dtypes) != (a.dtype,) * 3:
        return f"dQ, dK and dV must be stored as {a.dtype} (got {', '.join(a.out_dtypes)})"
    dims = dict(a.dims)
    if a.causal and dims["S"] != dims["T"]:
        return ("a causal backward with query and key lengths that may differ (FlashAttention-4 aligns its causal "
                "mask bottom-right, the spec's `j <= i` top-left)")
    if len(a.batch) != 2:
        return "FlashAttention-4's backward takes [b, h, seq, head] tensors (one batch and one head axis)"
    return None


def unsupported(ir, arch: str) -> str | None:
    """The backend's answer for an attention_bwd kernel: what FlashAttention-4 cannot do first, then
    that kspec does not build it yet."""
    return covered(ir, arch) or PENDING
