"""Attention variants lifted into the kernel IR: what lies between QK^T and the softmax becomes
`AttentionStructure.score_mod` / `mask` / `aux` (expressions over Score, Index, Size, scalar Loads
and AuxLoads), K/V read at head `h / G` becomes `kv_group` / `kv_head`.  Checked structurally (no
oracle) and through a stand-in backend that implements attention mods, with the exact expressions
asserted; what cannot be lifted is a note, and an error under --strict."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kspec.backends.registry import Planner
from kspec.compiler import format_ir, ir_from_json, ir_to_json, plan_kernel, verify
from kspec.compiler.kir import AuxLoad, BackendChoice, Const, Index, Load, Op, Score, Size
from kspec.core import KspecError, NoBackendError
from kspec.spec_lang import load_spec

SPECS = Path(__file__).resolve().parent.parent / "specs"
ARCHS = ("sm90a", "sm100a")


class ModBackend(Planner):
    """The registry, plus a stand-in attention backend that implements every lifted attention
    (score_mod, mask, GQA): what the FlashAttention-4-based backend will answer."""

    def __init__(self, strict: bool = False, accept: bool = True):
        super().__init__(None, strict)
        self.accept, self.asked = accept, []

    def can_fuse(self, ir, archs):
        if ir.kind != "attention":
            return super().can_fuse(ir, archs)
        self.asked.append(ir)
        return None if self.accept else "the stand-in attention backend is switched off"

    def choose(self, ir, arch):
        if ir.kind == "attention":
            return BackendChoice("stand-in", "attention", None)
        return super().choose(ir, arch)


def attention_ir(src_or_path, oracle=None):
    """The one attention kernel of a spec (text or shipped name), fused structurally (no oracle)
    or through `oracle`."""
    prog = load_spec(SPECS / f"{src_or_path}.kspec") if "{" not in src_or_path else \
        load_spec(src_or_path, is_text=True)
    sched = plan_kernel(prog.kernels[0], ARCHS, oracle)
    (p,) = [p for p in sched.plans if p.kind == "attention"]
    assert len(sched.plans) == 1, [q.kind for q in sched.plans]
    ir = verify(p.ir)
    back = ir_from_json(json.loads(json.dumps(ir_to_json(ir))))
    assert back == ir and format_ir(back) == format_ir(ir)
    return ir


def idx(*labels):
    return tuple(Index(x) for x in labels)


# ---------------------------------------------------------------- the shipped variants, exactly

def test_gqa_reads_k_and_v_at_head_h_over_g():
    a = attention_ir("attention_gqa").attention
    assert (a.kv_group, a.kv_head) == (4, "KH")
    src = (SPECS / "attention_gqa.kspec").read_text().replace("h / 4", "h / G").replace(
        "  in  Q :", "  param G : i32 = 4\n  in  Q :")
    assert (attention_ir(src).attention.kv_group, attention_ir(src).attention.kv_head) == ("G", "KH")
    assert (a.k_buffer, a.v_buffer, a.score_mod, a.mask, a.aux) == ("K", "V", None, None, ())
    assert a.head_dims == (128, 128, 128) and dict(a.dims)["H"] == "H" and a.scale == "scale"


def test_alibi_lifts_into_the_score_mod_and_its_top_left_mask_into_causal():
    ir = attention_ir("attention_alibi")
    a = ir.attention
    distance = Op("cast:f32", (Op("sub", idx("j", "i")),))
    assert a.score_mod == Op("add", (Score(), Op("mul", (AuxLoad("slope", idx("h"), "f32"), distance))))
    assert a.causal and a.mask is None and a.aux == ("slope",)
    assert ir.buffer("slope").shape == ("H",)


def test_sliding_window_mask():
    a = attention_ir("attention_sliding_window").attention
    assert a.score_mod is None and not a.causal
    assert a.mask == Op("and", (Op("le", idx("j", "i")),
                                Op("gt", (Index("j"), Op("sub", (Index("i"), Load("W", "scalar", "i32")))))))


def test_bias_lifts_into_an_aux_load():
    a = attention_ir("attention_bias").attention
    assert a.score_mod == Op("add", (Score(), AuxLoad("bias", idx("b", "h", "i", "j"), "bf16")))
    assert a.mask is None and a.aux == ("bias",) and a.scale == "scale"


def test_softcap_keeps_the_scale_and_lifts_the_cap():
    a = attention_ir("attention_softcap").attention
    cap = Load("cap", "scalar", "f32")
    assert a.scale == "scale"
    assert a.score_mod == Op("mul", (cap, Op("tanh", (Op("div", (Score(), cap)),))))


def test_decode_mask_is_bottom_right():
    a = attention_ir("attention_decode").attention
    assert not a.causal and a.score_mod is None
    assert a.mask == Op("le", (Index("j"), Op("add", (Index("i"), Op("sub", (Size("T"), Size("S")))))))
    assert dict(a.dims)["S"] == "S" and dict(a.dims)["T"] == "T"


def test_varlen_mask_reads_the_lengths():
    a = attention_ir("attention_varlen_padded").attention
    lq, lk = AuxLoad("Lq", idx("b"), "i32"), AuxLoad("Lk", idx("b"), "i32")
    assert a.mask == Op("and", (Op("and", (Op("lt", (Index("i"), lq)), Op("lt", (Index("j"), lk)))),
                                Op("le", (Index("j"), Op("add", (Index("i"), Op("sub", (lk, lq))))))))
    assert a.aux == ("Lq", "Lk") and a.score_mod is None


# ---------------------------------------------------------------- the forms the issue names

HEAD = """kernel k {
  param scale : f32 = 0.125
  in  Q : f16[B, H, S, 64]
  in  K : f16[B, H, T, 64]
  in  V : f16[B, H, T, 64]
  %s
  out O : f16[B, H, S, 64]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h, j, e]
  m[b, h, i, j] = %s
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}"""


def test_bottom_right_mask_and_full_bias_are_fusable_attention():
    oracle = ModBackend()
    a = attention_ir(HEAD % ("", "where(j <= i + (T - S), s[b, h, i, j], -inf)"), oracle).attention
    assert a.mask == Op("le", (Index("j"), Op("add", (Index("i"), Op("sub", (Size("T"), Size("S")))))))
    a = attention_ir(HEAD % ("in bias : f32[B, H, S, T]", "s[b, h, i, j] + bias[b, h, i, j]"), oracle).attention
    assert a.score_mod == Op("add", (Score(), AuxLoad("bias", idx("b", "h", "i", "j"), "f32")))
    assert [ir.kind for ir in oracle.asked] == ["attention", "attention"]


@pytest.mark.parametrize("decl, read, index", [
    ("in bias : f32[H, S, T]", "bias[h, i, j]", ("h", "i", "j")),          # shared across the batch
    ("in bias : f32[B, S, T]", "bias[b, i, j]", ("b", "i", "j")),          # shared across the heads
    ("in bias : f32[B, T]", "bias[b, j]", ("b", "j")),                     # key padding
    ("in bias : f32[S, T]", "bias[i, j]", ("i", "j")),
])
def test_bias_broadcast_over_batch_or_heads(decl, read, index):
    a = attention_ir(HEAD % (decl, f"s[b, h, i, j] + {read}"), ModBackend()).attention
    assert a.score_mod == Op("add", (Score(), AuxLoad("bias", idx(*index), "f32")))


def test_inverted_and_nested_masks_combine():
    a = attention_ir(HEAD % ("", "where(j > i + (T - S), -inf, where(j % 2 == 0, s[b, h, i, j], -inf))")).attention
    # `where(c, -inf, x)` keeps `not c`: an integer comparison, so it flips (j > ... is j <= ...)
    assert a.mask == Op("and", (Op("le", (Index("j"), Op("add", (Index("i"), Op("sub", (
        Size("T"), Size("S"))))))), Op("eq", (Op("mod", (Index("j"), Const(2))), Const(0)))))
    assert a.score_mod is None


def test_explicit_top_left_mask_with_one_extent_is_the_causal_flag_for_cutlass():
    src = HEAD.replace("K : f16[B, H, T, 64]", "K : f16[B, H, S, 64]").replace("V : f16[B, H, T, 64]",
                                                                           "V : f16[B, H, S, 64]")
    sched = plan_kernel(load_spec(src % ("", "where(j <= i, s[b, h, i, j], -inf)"), is_text=True).kernels[0],
                        ARCHS, Planner())
    (p,) = sched.plans
    assert p.kind == "attention" and p.ir.attention.causal and p.ir.attention.mask is None
    # the causal flag is what the CUTLASS FMHA runs; FlashAttention-4 (the CuTe DSL backend) is
    # preferred where it is installed
    from kspec.backends import registry
    want = "cute" if registry.get("cute").can_implement(p.ir, ARCHS[0]) is None else "cutlass"
    assert {ch.backend for ch in p.choices.values()} == {want}
    assert registry.get("cutlass").can_implement(p.ir, ARCHS[0]) is None


def test_a_score_dependent_mask_stays_a_score_mod():
    a = attention_ir(HEAD % ("", "where(s[b, h, i, j] > 0.0, s[b, h, i, j], -inf)")).attention
    assert a.mask is None
    assert a.score_mod == Op("where", (Op("gt", (Score(), Const(0.0))), Score(), Const(-math.inf)))


def test_gqa_with_a_literal_group_and_mqa_through_a_size():
    src = HEAD.replace("K : f16[B, H, T, 64]", "K : f16[B, KH, T, 64]").replace(
        "V : f16[B, H, T, 64]", "V : f16[B, KH, T, 64]").replace("K[b, h, j, e]", "K[b, h / 4, j, e]").replace(
        "V[b, h, j, e]", "V[b, h / 4, j, e]")
    a = attention_ir(src % ("", "s[b, h, i, j]")).attention
    assert (a.kv_group, a.kv_head, a.score_mod, a.mask) == (4, "KH", None, None)


def test_k_and_v_grouped_differently_do_not_fuse():
    src = HEAD.replace("K : f16[B, H, T, 64]", "K : f16[B, KH, T, 64]").replace("K[b, h, j, e]", "K[b, h / 2, j, e]")
    sched = plan_kernel(load_spec(src % ("", "s[b, h, i, j]"), is_text=True).kernels[0], ARCHS)
    assert "attention" not in [p.kind for p in sched.plans]
    assert any("K and V are read with different head groupings" in n for n in sched.fusion.notes)


# ---------------------------------------------------------------- what does not fuse, and --strict

def test_a_reduction_between_qk_and_softmax_is_a_note_and_a_strict_error():
    src = HEAD % ("in r : f32[B, H, S, T, R]", "s[b, h, i, j] + sum(k) r[b, h, i, j, k]")
    k = load_spec(src, is_text=True).kernels[0]
    sched = plan_kernel(k, ARCHS, ModBackend())
    assert "attention" not in [p.kind for p in sched.plans]
    note, = [n for n in sched.fusion.notes if n.startswith("attention at")]
    assert "not fused: between the QK contraction and the softmax, reduction sum(k)" in note
    with pytest.raises(KspecError, match="this attention is not fused into one kernel: between the QK") as ei:
        plan_kernel(k, ARCHS, ModBackend(strict=True))
    assert ei.value.span.line == 10


def test_score_stored_elsewhere_is_a_note():
    src = (HEAD.replace("out O", "out Z : f32[B, H, S, T]\n  out O") % ("", "s[b, h, i, j] + 1.0")).replace(
        "O[b, h, i, e] =", "Z[b, h, i, j] = s[b, h, i, j]\n  O[b, h, i, e] =")
    sched = plan_kernel(load_spec(src, is_text=True).kernels[0], ARCHS)
    assert any("is used elsewhere, so it must be written to memory" in n for n in sched.fusion.notes)


def test_no_backend_for_the_mods_is_a_note_and_a_strict_error():
    src = HEAD % ("", "where(j <= i + (T - S), s[b, h, i, j], -inf)")
    k = load_spec(src, is_text=True).kernels[0]
    try:
        sched = plan_kernel(k, ARCHS, ModBackend(accept=False))
    except NoBackendError as e:
        # unfused, the mask (index arithmetic) is a kernel of its own: a backend that cannot build it
        # says so when planning, at the mask, rather than when compiling
        assert "cannot run a" in str(e) and "index" in str(e) and e.span is not None, e
    else:
        assert [p.kind for p in sched.plans][0] != "attention"
        assert any("not fused (the stand-in attention backend is switched off)" in n for n in sched.fusion.notes)
    with pytest.raises(KspecError, match="no backend implements it"):
        plan_kernel(k, ARCHS, ModBackend(strict=True, accept=False))
    # the shipped registry: FlashAttention-4 (the CuTe DSL backend) runs the mask where it is
    # installed; the CUTLASS FMHA templates decline it with their reason
    from kspec.backends import registry
    first = plan_kernel(k, ARCHS, Planner()).plans[0]
    if first.kind == "attention":
        assert {ch.backend for ch in first.choices.values()} == {"cute"}
        assert "CUTLASS FMHA templates implement no score modification" in \
            registry.get("cutlass").can_implement(first.ir, ARCHS[0])
    else:
        with pytest.raises(KspecError, match="CUTLASS FMHA templates implement no score modification"):
            plan_kernel(k, ARCHS, Planner(None, True))


def test_paged_kv_gather_runs_before_the_attention():
    src = """kernel paged {
  param scale : f32 = 0.125
  param P : i32 = 16
  in  Q  : f16[B, H, S, 64]
  in  Kc : f16[N, P0, H, 64]
  in  Vc : f16[N, P0, H, 64]
  in  bt : i32[B, NB]
  out O  : f16[B, H, S, 64]
  k[b, h, j, e] = Kc[bt[b, j / P], j % P, h, e]
  v[b, h, j, e] = Vc[bt[b, j / P], j % P, h, e]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * k[b, h, j, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * v[b, h, j, e]
}"""
    # j has no extent: `j / P` gives it one only where P is a size (the pool's page axis), not a param
    with pytest.raises(KspecError, match="index 'j' of 'k' has no extent|extent of index 'j' cannot be inferred"):
        load_spec(src, is_text=True)


def test_relative_position_bias_gathers_a_table_by_index_arithmetic():
    import numpy as np

    import kspec
    src = HEAD.replace("K : f16[B, H, T, 64]", "K : f16[B, H, S, 64]").replace(
        "V : f16[B, H, T, 64]", "V : f16[B, H, S, 64]") % ("in rel : f32[H, R]", "s[b, h, i, j] + rel[h, j - i + (S - 1)]")
    a = attention_ir(src, ModBackend()).attention
    offset = Op("add", (Op("sub", idx("j", "i")), Op("sub", (Size("S"), Const(1)))))
    assert a.score_mod == Op("add", (Score(), AuxLoad("rel", (Index("h"), offset), "f32")))
    # the reference against float64 numpy: rel is indexed by the distance j - i, shifted to be >= 0
    rng = np.random.default_rng(5)
    B, H, S = 1, 2, 6
    Q, K, V = (rng.standard_normal((B, H, S, 64)).astype(np.float16) for _ in range(3))
    rel = rng.standard_normal((H, 2 * S - 1)).astype(np.float32)
    out = kspec.reference(src)(Q=Q, K=K, V=V, rel=rel)["O"].astype(np.float64)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    s = 0.125 * np.einsum("bhie,bhje->bhij", Q.astype(np.float64), K.astype(np.float64)) + rel[:, j - i + S - 1]
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhij,bhje->bhie", p / p.sum(-1, keepdims=True), V.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=2e-3, atol=2e-3)
    # a table too short for the distances is a located runtime error naming the subscript
    with pytest.raises(KspecError, match=r"subscript j - i \+ \(S - 2\) of 'rel' \(axis 1\) is -1 at h=0, j=0, "
                                         r"i=5, but that axis has size 11"):
        kspec.reference(src.replace("(S - 1)", "(S - 2)"))(Q=Q, K=K, V=V, rel=rel)
