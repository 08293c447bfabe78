"""Variable-length batches (`packed(cu)`, specs/attention_varlen.kspec): the checker's located errors,
what it makes explicit (the softmax mask, per-sequence sizes), the kernel IR's packed buffers and
every backend's decline.  The reference semantics against float64 numpy:
tests/test_reference.py::test_attention_varlen."""
from __future__ import annotations

import pytest

from conftest import FA4_MISSING, SPECS

from kspec.compiler import format_ir, plan_kernel, ir_from_json, ir_to_json
from kspec.core import KspecError
from kspec.spec_lang import load_spec
from kspec.spec_lang.check import TCall, TGather, TSize, texpr_children

VARLEN = SPECS / "attention_varlen.kspec"
HEAD = """kernel k {
  param scale : f32 = 0.125
  in  cu_q : i32[B + 1]
  in  cu_k : i32[B + 1]
"""
BODY = """  s[b, h, i, j] : f32 = scale * sum(e) Q[b, i, h, e] * K[b, j, h, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * V[b, j, h, e]
}"""
DECLS = """  in  Q : bf16[B, S, H, 64] packed(cu_q)
  in  K : bf16[B, T, H, 64] packed(cu_k)
  in  V : bf16[B, T, H, 64] packed(cu_k)
  out O : bf16[B, S, H, 64] packed(cu_q)
"""


def _err(src: str) -> KspecError:
    with pytest.raises(KspecError) as e:
        load_spec(src, is_text=True)
    return e.value


def _nodes(e):
    yield e
    for c in texpr_children(e):
        yield from _nodes(c)


def test_the_checker_makes_varlen_explicit():
    k = load_spec(VARLEN).kernels[0]
    assert k.tensor("Q").describe() == "Q: bf16[B, S, H, 128] packed(cu_q)"
    assert k.tensor("cu_q").describe() == "cu_q: i32[B + 1]"
    m, p = k.stmts[1].value, k.stmts[2].value
    # `T - S` inside the mask is each sequence's own lengths: cu[b + 1] - cu[b], no size symbol left
    assert not [x for x in _nodes(m) if isinstance(x, TSize)]
    assert {x.tensor for x in _nodes(m) if isinstance(x, TGather)} == {"cu_q", "cu_k"}
    # the softmax over the packed key axis leaves absent keys out: where(j < len_k(b), m, -inf)
    (where,) = [x for x in _nodes(p) if isinstance(x, TCall) and x.fn == "where"]
    assert {x.tensor for x in _nodes(where.args[0]) if isinstance(x, TGather)} == {"cu_k"}


@pytest.mark.parametrize("decls, message, hint", [
    (DECLS.replace("in  Q : bf16[B, S, H, 64] packed(cu_q)", "in  Q : bf16[B, S, H, 64] packed(cu_x)"),
     "unknown offsets tensor 'cu_x'", "in cu_x : i32[B + 1]"),
    (DECLS.replace("in  Q : bf16[B, S, H, 64] packed(cu_q)", "in  Q : bf16[64, S, H, 64] packed(cu_q)"),
     "must have a batch and a sequence axis first", "packed(cu_q)"),
    (DECLS.replace("in  K : bf16[B, T, H, 64] packed(cu_k)", "in  K : bf16[B, T, H, 64] packed(scale)"),
     "must be an integer input vector of B + 1", "i32[B + 1]"),
    (DECLS.replace("in  K : bf16[B, T, H, 64] packed(cu_k)", "in  K : bf16[B, S, H, 64] packed(cu_k)"),
     "sequence axis S is packed by 'cu_k' here but by 'cu_q'", "(e.g. T)"),
    (DECLS.replace("out O : bf16[B, S, H, 64] packed(cu_q)", "out O : bf16[B, S, H, 64]"),
     "output 'O' is written over index 'i'", "packed(cu_q)"),
])
def test_located_errors(decls, message, hint):
    src = HEAD + decls + BODY
    e = _err(src)
    assert message in e.message and hint in (e.hint or "")
    assert e.span is not None and e.span.line >= 3


def test_the_row_count_symbol_of_a_packing_is_reserved():
    e = _err(HEAD.replace("kernel k {", "kernel k {\n  in  X : f32[cu_q_rows]") + DECLS + BODY)
    assert "size symbol 'cu_q_rows' of 'X' is reserved" in e.message and e.span is not None


def test_offsets_must_count_the_packed_batch():
    e = _err(HEAD.replace("in  cu_q : i32[B + 1]", "in  cu_q : i32[N + 1]") + DECLS + BODY)
    assert "'Q' must be an integer input vector of B + 1" in e.message and "not in cu_q: i32[N + 1]" in e.message


def test_a_reduction_over_a_packed_axis_must_be_masked():
    src = HEAD + DECLS.replace("out O : bf16[B, S, H, 64] packed(cu_q)", "out M : f32[B, H, S]") + """
  s[b, h, i, j] : f32 = sum(e) Q[b, i, h, e] * K[b, j, h, e]
  M[b, h, i] = max(j) s[b, h, i, j]
}"""
    e = _err(src.replace("in  V : bf16[B, T, H, 64] packed(cu_k)\n", ""))
    assert "'max(j)' reduces over 'j', which runs over packed sequences" in e.message
    assert "softmax" in e.hint and "where(j < LEN" in e.hint


def test_packed_buffers_in_the_kernel_ir_and_which_backends_take_them():
    from kspec.backends.registry import Planner, backends
    sched = plan_kernel(load_spec(VARLEN).kernels[0])
    irs = [p.ir for p in sched.plans]
    packed = {b.name: b.packed for ir in irs for b in ir.buffers if b.packed}
    assert packed == {"Q": "cu_q", "K": "cu_k", "V": "cu_k", "O": "cu_q"}
    for ir in irs:
        assert ir_from_json(ir_to_json(ir)) == ir
    (ir,) = irs                                   # structurally one attention kernel
    assert ir.kind == "attention"
    # FlashAttention's [b, s, h, e] storage order is recorded, not assumed
    assert ir.attention.orders == (("b", "i", "h", "e"), ("b", "j", "h", "e"), ("b", "j", "h", "e"),
                                   ("b", "i", "h", "e"))
    assert "storage: Q[b, i, h, e]" in format_ir(ir)
    assert "packed(" in "\n".join(b.describe() for b in ir.buffers)
    import dataclasses
    from kspec.compiler.kir import verify
    from kspec.core import KspecInternalError
    bad = tuple(dataclasses.replace(b, shape=b.shape[:1]) if b.packed else b for b in ir.buffers)
    with pytest.raises(KspecInternalError, match="packed buffer"):
        verify(dataclasses.replace(ir, buffers=bad))
    with pytest.raises(KspecInternalError, match="storage orders"):
        verify(dataclasses.replace(ir, attention=dataclasses.replace(
            ir.attention, orders=(("b", "i", "e", "h"),) + ir.attention.orders[1:])))
    from kspec.backends.registry import _can_implement
    for b in backends():
        why = _can_implement(b, ir, "sm90a")
        if b.name == "cute":
            assert why is None if FA4_MISSING is None else FA4_MISSING in why   # FA4's route, where installed
        else:
            assert why and "packed(" in why and "dense" in why
    if FA4_MISSING is None:
        for arch in ("sm90a", "sm100a"):
            (p,) = plan_kernel(load_spec(VARLEN).kernels[0], (arch,), Planner()).plans
            assert p.kind == "attention" and p.choices[arch].backend == "cute"
    else:
        with pytest.raises(KspecError, match=r"no backend can build kernel .* packed\(cu_"):
            plan_kernel(load_spec(VARLEN).kernels[0], ("sm90a",), Planner())


def test_the_cute_gemm_declines_packed_buffers_it_cannot_group():
    """A packed A with a weight shared by every sequence is no grouped GEMM (one B per group): the
    CuTe DSL backend says so, and no backend builds it (planning refuses it, located)."""
    from kspec.backends.registry import Planner
    text = """kernel packed_linear {
  in cu : i32[B + 1]
  in X : bf16[B, S, 64] packed(cu)
  in W : bf16[N, 64]
  out Y : bf16[B, S, N] packed(cu)
  Y[b, s, n] = sum(k) X[b, s, k] * W[n, k]
}"""
    with pytest.raises(KspecError, match=r"no backend can build kernel packed_linear_0 \(gemm\) on sm90a: cute: a "
                                         r"grouped GEMM packs A \(X\) by one group axis and reads B per group"):
        plan_kernel(load_spec(text, is_text=True).kernels[0], ("sm90a",), Planner())


@pytest.mark.parametrize("mask, native", [
    ("where(j <= i + (T - S), s[b, h, i, j], -inf)", "causal (bottom-right)"),
    ("s[b, h, i, j]", "none"),
    ("where(j <= i + (T - S) and j >= i + (T - S) - 63, s[b, h, i, j], -inf)", "window"),
])
def test_varlen_masks_are_flashattention_4_native(mask, native):
    """Each sequence's own lengths (cu[b + 1] - cu[b]) become FA4's per-sequence seqlen_q/seqlen_k,
    so causal and window masks stay FA4's own (block skipping), with no generated mask_mod."""
    pytest.importorskip("flash_attn")
    from kspec.backends.cute import attention as A
    src = HEAD + DECLS + f"""  s[b, h, i, j] : f32 = scale * sum(e) Q[b, i, h, e] * K[b, j, h, e]
  m[b, h, i, j] = {mask}
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * V[b, j, h, e]
}}"""
    (p,) = plan_kernel(load_spec(src, is_text=True).kernels[0]).plans
    for arch in ("sm90a", "sm100a"):
        assert A.unsupported(p.ir, arch) is None
        desc, _names, dims, _scalars = A.lower(p.ir, arch)
        assert dict(A.config_items(desc))["mask"] == native
        assert desc.mods.mask_mod is None and desc.mods.score_mod is None
        assert (_names[desc.cu_seqlens_q], _names[desc.cu_seqlens_k]) == ("cu_q", "cu_k")
        assert dict(dims)["S"] == "cu_q_rows" and dict(dims)["T"] == "cu_k_rows"
        assert desc.layouts == (("S", "H", "D"), ("T", "HK", "D"), ("T", "HK", "D"), ("S", "H", "D"))
        src_text = A.entry_source(desc)
        assert "mCuSeqlensQ=mCQ" in src_text and "mCuSeqlensK=mCK" in src_text


ALIBI_VARLEN = HEAD.replace("kernel k {", "kernel k {\n  in  slope : f32[H]") + DECLS + """  s[b, h, i, j] : f32 = scale * sum(e) Q[b, i, h, e] * K[b, j, h, e]
  m[b, h, i, j] = where(j <= i + (T - S), s[b, h, i, j] + slope[h] * f32(j - i), -inf)
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * V[b, j, h, e]
}"""


def test_varlen_score_mods_see_per_sequence_positions():
    """ALiBi over packed sequences: a generated score_mod over FA4's per-sequence q_idx/kv_idx, the
    causal mask FA4's own; its numpy twin (the very source) matches float64 written here."""
    pytest.importorskip("flash_attn")
    import numpy as np
    from kspec.backends.cute import attention as A
    from kspec.backends.cute import attnmods
    (p,) = plan_kernel(load_spec(ALIBI_VARLEN, is_text=True).kernels[0]).plans
    assert A.unsupported(p.ir, "sm90a") is None and A.unsupported(p.ir, "sm100a") is None
    desc = A.lower(p.ir, "sm100a")[0]
    assert desc.mods.causal and desc.mods.score_mod is not None and desc.mods.mask_mod is None
    rng = np.random.default_rng(1)
    S, T, H = 5, 9, 3
    slope = rng.standard_normal(H).astype(np.float32)
    score = rng.standard_normal((H, S, T))
    h, i, j = np.meshgrid(np.arange(H), np.arange(S), np.arange(T), indexing="ij")
    got, keep = attnmods.run_numpy(desc.mods, score=score, b=np.zeros_like(h), h=h, i=i, j=j, S=S, T=T,
                                   aux=(slope,))
    np.testing.assert_allclose(got, score + slope[h].astype(np.float64) * (j - i), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(keep, j <= i + (T - S))      # each sequence's own S and T


def test_varlen_mod_reading_a_tensor_by_position_is_declined_with_the_reason():
    pytest.importorskip("flash_attn")
    from kspec.backends.cute import attention as A
    src = HEAD.replace("kernel k {", "kernel k {\n  in  bias : f32[H, S, T]") + DECLS + """  s[b, h, i, j] : f32 = scale * sum(e) Q[b, i, h, e] * K[b, j, h, e]
  m[b, h, i, j] = s[b, h, i, j] + bias[h, i, j]
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * V[b, j, h, e]
}"""
    try:
        k = load_spec(src, is_text=True).kernels[0]
    except KspecError:
        return                            # the checker refuses it already: nothing reaches a backend
    (p,) = plan_kernel(k).plans
    assert "not by query/key position" in A.unsupported(p.ir, "sm90a")


def test_varlen_with_grouped_kv_heads_lowers_to_fa4():
    """Packed sequences with GQA (K/V [B, T, KH, d] packed, read at head h / 4): FA4's varlen kernel
    with qhead_per_kvhead 4, K/V as [rows, KH, d]."""
    pytest.importorskip("flash_attn")
    from kspec.backends.cute import attention as A
    src = (HEAD + DECLS.replace("K : bf16[B, T, H, 64]", "K : bf16[B, T, KH, 64]")
           .replace("V : bf16[B, T, H, 64]", "V : bf16[B, T, KH, 64]")
           + BODY.replace("K[b, j, h, e]", "K[b, j, h / 4, e]").replace("V[b, j, h, e]", "V[b, j, h / 4, e]"))
    (p,) = plan_kernel(load_spec(src, is_text=True).kernels[0]).plans
    assert p.ir.kind == "attention" and p.ir.attention.kv_group == 4
    for arch in ("sm90a", "sm100a"):
        assert A.unsupported(p.ir, arch) is None
        desc, names, dims, _ = A.lower(p.ir, arch)
        assert desc.group == 4 and dict(dims)["HK"] == "KH"
        modes = {n: (shape, strides) for n, _i, _dt, shape, strides in A._tensors(desc)}
        assert modes["mK"] == (("T", "HK"), (("HK", "64"), ("64",)))
        assert modes["mQ"] == (("S", "H"), (("H", "64"), ("64",)))
