"""The attention backward as FlashAttention-4's own three backward kernels (backends/cute/attention_bwd.py):
`kspec grad`'s backward of the plain and causal attention specs plans as one attention_bwd kernel built
by the CuTe backend on both archs (and what FA4 cannot take is refused with the reason); the offline
build (tensor-core SASS in the main kernel, parameter offsets from the cubins); the runtime's plan
running preprocess, main and postprocess in order with one correctly sized workspace under the fake
driver; bad sizes refused before launch; a warm compile importing neither FA4 nor the DSL.  GQA
(attention_gqa: K and V read at head h / 4): five kernels (the dK and dV postprocesses too), the
dK/dV accumulators in the workspace zeroed before the main kernel.  Padded sequences
(attention_varlen_padded: `i < Lq[b] and j < Lk[b]`): FA4's seqused_q / seqused_k passed to each kernel,
dQ, dK, dV zeroed once before the preprocess."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import (FA4_BWD_MAIN, SPECS, check_fa4_bwd_binaries, checkout_env, fa4_fake_call, grad_artifacts,
                      needs_fa4, one_fa4_bwd_plan, test_cache_root)

from kspec.compile import plan_spec
from kspec.core import ATTENTION_BWD_GQA_STEPS, ATTENTION_BWD_STEPS, KspecError, attention_bwd_workspace
from kspec.spec_lang import load_spec
from kspec.spec_lang.grad import grad_program

ARCHS = ("sm90a", "sm100a")
STEMS = ("attention", "attention_causal")
GQA = "attention_gqa"                  # K and V read at head h / 4: five kernels
MAIN = FA4_BWD_MAIN


def _steps(stem: str) -> tuple[str, ...]:
    return ATTENTION_BWD_GQA_STEPS if stem == GQA else ATTENTION_BWD_STEPS


def _grad_text(stem: str, edit=None) -> str:
    text = (SPECS / f"{stem}.kspec").read_text()
    return grad_program(load_spec(edit(text) if edit else text, is_text=True))


def _plan(stem: str, strict: bool = True, edit=None):
    prog = load_spec(_grad_text(stem, edit), is_text=True, file=f"{stem}_grad.kspec")
    (sched,) = plan_spec(prog, ARCHS, f"{stem}_bwd", strict=strict)
    return sched


@needs_fa4
@pytest.mark.parametrize("stem", STEMS)
def test_backward_plans_as_one_fa4_attention_bwd_kernel_on_both_archs(stem):
    one_fa4_bwd_plan(_plan(stem), ARCHS)                # --strict: no loop fallback, no unfused note


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.replace("128", "96").replace("0.08838834764831845", "0.1"), "head dim 96"),
    (lambda t: t.replace(": f16", ": f32").replace("f16[", "f32["), "not FlashAttention-4's backward"),
])
def test_what_fa4_cannot_take_is_printed_and_refused_by_strict(edit, why):
    sched = _plan("attention", strict=False, edit=edit)
    assert any("attention backward" in n and why in n for n in sched.fusion.notes), sched.fusion.notes
    with pytest.raises(KspecError, match="attention backward"):
        _plan("attention", edit=edit)


def test_causal_backward_over_keys_that_may_differ_from_queries_is_refused():
    # FA4 aligns its causal mask bottom-right, the spec's j <= i top-left: equal only when S = T
    def edit(t):
        return t.replace("K : bf16[B, H, S, 64]", "K : bf16[B, H, T, 64]").replace(
            "V : bf16[B, H, S, 64]", "V : bf16[B, H, T, 64]").replace(
            "softmax(j, causal=i) s[b, h, i, j]", "softmax(j) where(j <= i, s[b, h, i, j], -inf)")
    sched = _plan("attention_causal", strict=False, edit=edit)
    assert any("bottom-right" in n for n in sched.fusion.notes), sched.fusion.notes


@needs_fa4
@pytest.mark.parametrize("stem, varlen", [("attention_varlen", "cu_seqlens_q, cu_seqlens_k"),
                                          ("attention_decode", None)])
def test_bottom_right_causal_and_packed_backwards_plan_as_one_fa4_kernel(stem, varlen):
    """`j <= i + (T - S)` is FA4's own causal alignment (any S, T); over packed (varlen) sequences
    with its per-sequence lengths, with [b, seq, h, e] tensors, the packed LSE a [h, rows] view."""
    (p,) = _plan(stem).plans                           # --strict
    assert p.kind == "attention_bwd" and set(p.writes) == {"dQ", "dK", "dV"}
    for arch in ARCHS:
        c = p.choices[arch]
        cfg = dict(c.config)
        assert c.backend == "cute" and not c.fallback and MAIN[arch] in cfg["kernel"]
        assert cfg["mask"] == "causal (bottom-right)" and cfg.get("varlen") == varlen
    a = p.ir.attention_bwd
    assert a.bottom_right and a.causal
    if varlen:
        assert a.layouts[0] == ("B", "S", "H", "E") and a.layouts[5] == ("B", "S", "H")


def test_top_left_causal_over_packed_sequences_is_refused():
    # j <= i over sequences whose query and key counts differ is not FA4's (bottom-right) causal mask
    # (unfused, nothing builds packed tensors: --strict names the reason first)
    with pytest.raises(KspecError, match="attention backward.*bottom-right"):
        _plan("attention_varlen", edit=lambda t: t.replace("j <= i + (T - S)", "j <= i"))


PADDED = "attention_varlen_padded"     # Lq, Lk: i32[B] used query / key counts over dense tensors
_PADDED_MASK = "where(i < Lq[b] and j < Lk[b] and j <= i + (Lk[b] - Lq[b]), s[b, h, i, j], -inf)"


def _padded_mask(mask: str):
    def edit(t):
        assert _PADDED_MASK in t
        return t.replace(_PADDED_MASK, mask)
    return edit


@needs_fa4
@pytest.mark.parametrize("mask, used, causal", [
    (_PADDED_MASK, ("Lq", "Lk"), True),
    ("where(j < Lk[b] and j <= i + (Lk[b] - S), s[b, h, i, j], -inf)", (None, "Lk"), True),     # seqused_k only
    ("where(i < Lq[b] and j <= i + (T - Lq[b]), s[b, h, i, j], -inf)", ("Lq", None), True),     # seqused_q only
    ("where(j < Lk[b] and i < Lq[b], s[b, h, i, j], -inf)", ("Lq", "Lk"), False),
])
def test_padded_backward_plans_as_one_fa4_kernel_through_seqused(mask, used, causal):
    """`i < Lq[b]` and `j < Lk[b]` (i32 [B] inputs read at the batch) are FA4's seqused_q / seqused_k,
    the bottom-right causal mask over those lengths FA4's own (it aligns within each sequence's used
    lengths); one attention_bwd plan on both archs under --strict, dQ, dK and dV zeroed first."""
    p = one_fa4_bwd_plan(_plan(PADDED, edit=_padded_mask(mask)), ARCHS)
    a = p.ir.attention_bwd
    assert (a.seqused_q, a.seqused_k) == used and a.causal == a.bottom_right == causal
    want = ", ".join(f"seqused_{x}" for x, n in zip("qk", used) if n) + " (dQ, dK, dV zeroed before the call)"
    for arch in ARCHS:
        cfg = dict(p.choices[arch].config)
        assert cfg["seqused"] == want and cfg["mask"] == ("causal (bottom-right)" if causal else "none")


@pytest.mark.parametrize("stem, edit, why", [
    (PADDED, _padded_mask("where(i <= Lq[b] and j < Lk[b], s[b, h, i, j], -inf)"), "the mask is not causal"),
    (PADDED, _padded_mask("where(i < Lq[b] and j < Lk[b] and j <= i + (T - S), s[b, h, i, j], -inf)"),
     "the mask is not causal"),
    (PADDED, _padded_mask("where(i < Lq[b] and j < Lk[b] and j <= i, s[b, h, i, j], -inf)"), "aligned top-left"),
    (PADDED, _padded_mask("where(i < Lq[b] and j < Lk[b] + 1, s[b, h, i, j], -inf)"), "the mask is not causal"),
    ("attention_gqa", lambda t: t.replace("in  V : f16[B, KH, T, 128]", "in  V : f16[B, KH, T, 128]\n  in  Lk : i32[B]").replace(
        "softmax(j) s[b, h, i, j]", "softmax(j) where(j < Lk[b], s[b, h, i, j], -inf)"), "not built yet"),
    ("attention_softcap", lambda t: t.replace("in  V : f16[B, H, T, 256]", "in  V : f16[B, H, T, 256]\n  in  Lk : i32[B]").replace(
        "softmax(j) c[b, h, i, j]", "softmax(j) where(j < Lk[b], c[b, h, i, j], -inf)"), "not built yet"),
])
def test_what_fa4_cannot_take_of_a_padded_backward_is_printed_and_refused_by_strict(stem, edit, why):
    sched = _plan(stem, strict=False, edit=edit)
    assert any("attention backward" in n and why in n for n in sched.fusion.notes), sched.fusion.notes
    with pytest.raises(KspecError, match="attention backward"):
        _plan(stem, edit=edit)


def test_used_lengths_over_packed_sequences_are_refused():
    # (unfused, nothing builds packed tensors: --strict names the reason first)
    def edit(t):
        return t.replace("in  cu_k : i32[B + 1]", "in  cu_k : i32[B + 1]\n  in  Lk : i32[B]").replace(
            "where(j <= i + (T - S),", "where(j < Lk[b],")
    with pytest.raises(KspecError, match="attention backward.*seqused.*packed sequences.*not built yet"):
        _plan("attention_varlen", edit=edit)


@needs_fa4
def test_gqa_backward_plans_as_one_fa4_attention_bwd_kernel_of_five_on_both_archs():
    """K and V read at head h / 4, dK and dV the sums over each group's query heads (what `kspec grad`
    derives): one attention_bwd plan, FA4's GQA backward (five kernels) on both archs, under strict."""
    sched = _plan("attention_gqa")
    (p,) = sched.plans
    assert p.kind == "attention_bwd" and set(p.writes) == {"dQ", "dK", "dV"}
    a = p.ir.attention_bwd
    assert (a.kv_group, a.kv_head, a.k_buffer, a.dk_buffer) == (4, "KH", "K", "dK")
    for arch in ARCHS:
        c = p.choices[arch]
        cfg = dict(c.config)
        assert c.backend == "cute" and not c.fallback and cfg["gqa_group"] == "4"
        assert cfg["kernel"].endswith(f"FlashAttentionBackwardPreprocess, {MAIN[arch]}, FlashAttentionBackwardPostprocess "
                                      "(dQ), FlashAttentionBackwardPostprocess (dK), FlashAttentionBackwardPostprocess (dV)")
        assert "dk_accum f32, dv_accum f32" in cfg["workspace"]


def _gqa_heads(h: str, kh: str):
    def edit(t):
        return t.replace("[B, H, S, 128]", f"[B, {h}, S, 128]").replace("[B, KH, T, 128]", f"[B, {kh}, T, 128]")
    return edit


def _param_group(t: str) -> str:
    """attention_gqa with the group an i32 param G: known only per call."""
    return t.replace("h / 4", "h / G").replace("kernel attention_gqa {", "kernel attention_gqa {\n  param G : i32")


@needs_fa4
@pytest.mark.parametrize("edit, group, name, naming", [
    (_param_group, "G", "G (or the query and K/V head counts)", ({"G": 4}, {"H": 32, "KH": 8})),
    (lambda t: t.replace("h / 4", "h / (H / KH)"), "H/KH", "H and KH", ({"H": 32, "KH": 8},)),
])
def test_gqa_backward_over_a_per_call_group_plans_where_the_sizes_name_it(edit, group, name, naming):
    """`h / G` with G an i32 param, or `h / (H / KH)`: like the forward, FA4's GQA backward is built for
    the group `--sizes` names (G itself, or H and KH); without them it plans unfused, saying so (and
    strict refuses it)."""
    from kspec.backends import registry
    prog = load_spec(_grad_text(GQA, edit), is_text=True, file="g.kspec")
    (sched,) = plan_spec(prog, ARCHS, f"{GQA}_bwd", strict=False)
    assert any("attention backward" in n and f"name {name} with --sizes" in n for n in sched.fusion.notes), \
        sched.fusion.notes
    with pytest.raises(KspecError, match="attention backward"):
        plan_spec(prog, ARCHS, f"{GQA}_bwd", strict=True)
    cute = registry.get("cute")
    for sizes in naming:
        (sched,) = plan_spec(prog, ARCHS, f"{GQA}_bwd", strict=True, sizes=sizes)
        (p,) = sched.plans
        assert p.kind == "attention_bwd" and (p.ir.attention_bwd.kv_group, p.ir.attention_bwd.kv_head) == (group, "KH")
        assert all(dict(c.config)["gqa_group"].startswith("per call") for c in p.choices.values())
        text = ",".join(f"{k}={v}" for k, v in sizes.items())
        lp = cute.lower(p.ir, "sm90a", (*cute.default_config(p.ir, "sm90a"), ("sizes", text)))
        assert (lp.desc.group, lp.desc.groups, dict(lp.config)["gqa_group"]) == (0, (4,), "per call, built for 4")
        # the param checked against the group by the glue; H / KH checked as H = 4 x HK anyway
        assert lp.desc.dims == ("B", "H", "S", "T", "HK")
        assert lp.names.get(lp.desc.group_param) == (None if group == "H/KH" else "G")


@pytest.mark.parametrize("edit, why", [
    # a group kspec does not build per call: an i8 param (the forward's rule: a literal, a size symbol, an i32 param)
    (lambda t: _param_group(t).replace("param G : i32", "param G : i8"), "a size symbol or an i32 param"),
    # 6 query heads over 2 K/V heads at h / 4: a valid spec, but not 4 query heads per K/V head
    (_gqa_heads("6", "2"), "H = 6 query heads over KH = 2 K/V heads at h / 4"),
    # K and V in different groupings
    (lambda t: t.replace("V : f16[B, KH, T, 128]", "V : f16[B, KV, T, 128]").replace("V[b, h / 4", "V[b, h / 2"),
     "different head groupings"),
])
def test_what_fa4_cannot_take_of_a_gqa_backward_is_printed_and_refused_by_strict(edit, why):
    sched = _plan("attention_gqa", strict=False, edit=edit)
    assert any("attention backward" in n and why in n for n in sched.fusion.notes), sched.fusion.notes
    with pytest.raises(KspecError, match="attention backward"):
        _plan("attention_gqa", edit=edit)


# ---------------------------------------------------------------------------------------------
# offline builds
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bwd_artifacts(tmp_path_factory):
    return grad_artifacts(tmp_path_factory.mktemp("fa4bwd"), _grad_text, lambda stem: f"{stem}_bwd")


def _bwd_plan(mod, stem):
    (plan,) = mod[f"{stem}_bwd"].entry.plans
    return plan


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", [*STEMS, GQA, "attention_varlen", PADDED])
def test_backward_builds_its_fa4_kernels_per_arch_with_tensor_core_sass(bwd_artifacts, stem):
    """Three kernels (GQA: five, the dK and dV postprocesses after the dQ one), each with the cubin's
    own parameter offsets; tensor cores and TMA in the main kernel only."""
    import kspec
    art = bwd_artifacts(stem)
    plan = _bwd_plan(kspec.load(art), stem)
    check_fa4_bwd_binaries(art, plan, ARCHS, _steps(stem))
    for arch in ARCHS:
        b = plan.binaries[arch]
        # GQA: the dK/dV accumulators' key rounding (FA4's tile_n; paired tiles with sm_100a's 2-CTA)
        assert ("ws_kv_tile" in b.variants[0].config) == (stem == GQA)
        assert [v.config["seqused"] for v in b.variants] == ["q,k" if stem == PADDED else "none"] * len(b.variants)
        if stem == GQA:
            cfg = b.variants[1].config
            assert cfg["ws_kv_pair"] == ("2" if cfg.get("2cta") == "true" else "1")
            assert [v.config["tile"].split("x")[0] for v in b.variants[3:]] == [cfg["ws_kv_tile"]] * 2


def _fake_call(mod, stem, sizes, cc, sms, arch, params=None):
    return fa4_fake_call(mod, f"{stem}_bwd", sizes, cc, sms, arch, params)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", STEMS)
@pytest.mark.parametrize("arch, cc, sms", [("sm90a", (9, 0), 132), ("sm100a", (10, 0), 148)])
def test_one_call_launches_preprocess_main_postprocess_with_one_workspace(bwd_artifacts, stem, arch, cc, sms):
    import kspec
    mod = kspec.load(bwd_artifacts(stem))
    plan = _bwd_plan(mod, stem)
    b = plan.binaries[arch]
    assert mod.step_variants(plan, arch) == [0, 1, 2]
    for B, H, S in ((2, 3, 300), (1, 1, 1), (3, 2, 1000)):
        sizes = {"B": B, "H": H, "S": S, "T": S}
        call, problems, fake = _fake_call(mod, stem, sizes, cc, sms, arch)
        assert problems == [], problems
        assert call.plan_ids == [plan.id] * 3
        assert [r.symbol for r in call.launches] == [v.symbol for v in b.variants]
        cfg = b.variants[0].config
        tile_m, dr = int(cfg["ws_tile_m"]), int(cfg["ws_head_dim"])
        lay = attention_bwd_workspace(B, H, S, tile_m, dr)
        want = lay["total"][0]
        assert mod.launches(plan, arch, call.binding.dims(plan), 0, sms) == ([0, 1, 2], want)
        ws = {r.prepare.workspace for r in call.launches}
        assert len(ws) == 1 and 0 not in ws
        (ws,) = ws
        assert all(rec.prepare.sm_count == sms for rec in call.launches)
        assert not any(ws <= f[0] < ws + want for f in fake.fills)       # nothing in it cleared
        pre, main, post = call.plan_args
        assert [a.name for a in pre] == ["O", "dO", "<dpsum>", _lse(mod, stem), "<lse_log2>", "<dq_accum>"]
        assert [a.name for a in post] == ["<dq_accum>", "dQ"]
        assert [a.name for a in main][7:] == ["dK", "dV"]
        # the accumulator and row buffers FA4 allocates, inside the one workspace, as kspec sized it
        assert pre[5].ptr == ws and pre[5].shape == (B, H, -(-S // tile_m) * tile_m * dr)
        assert pre[2].ptr == ws + lay["dpsum"][0] and pre[4].ptr == ws + lay["lse_log2"][0]
        assert lay["lse_log2"][0] + 4 * B * H * -(-S // tile_m) * tile_m <= want
        # the preprocess and postprocess run one CTA per (query tile, head, sequence)
        assert call.launches[0].grid == (-(-S // tile_m), H, B)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch, cc, sms", [("sm90a", (9, 0), 132), ("sm100a", (10, 0), 148)])
def test_packed_backward_passes_the_offsets_and_sizes_the_padded_workspace(bwd_artifacts, arch, cc, sms):
    """Over packed sequences each kernel gets FA4's varlen views ([rows, H, E], the LSE [H, rows] of
    the packed [rows, H] array) and the offsets; the workspace is FA4's varlen one ([H, n], n the
    rows padded per sequence: rows + B tiles, rounded up to a tile)."""
    import kspec
    stem = "attention_varlen"
    mod = kspec.load(bwd_artifacts(stem))
    plan = _bwd_plan(mod, stem)
    b = plan.binaries[arch]
    assert [v.config["packed"] for v in b.variants] == ["q,k"] * 3
    tile_m, dr = int(b.variants[0].config["ws_tile_m"]), int(b.variants[0].config["ws_head_dim"])
    for B, H in ((3, 2), (1, 1), (5, 4)):
        call, problems, _fake = _fake_call(mod, stem, {"B": B, "H": H}, cc, sms, arch)
        assert problems == [], problems
        rows = sum(100 + 17 * x for x in range(B))        # fake_call's sequence lengths
        n = (rows + (B + 1) * tile_m - 1) // tile_m * tile_m
        lay = attention_bwd_workspace(B, H, rows, tile_m, dr, packed=True)
        assert lay["dq_accum"][1] == (H, n * dr) and lay["dpsum"][1] == (H, n)
        assert mod.launches(plan, arch, call.binding.dims(plan), 0, sms) == ([0, 1, 2], lay["total"][0])
        pre, main, post = call.plan_args
        assert [a.name for a in pre] == ["O", "dO", "<dpsum>", "p_lse", "<lse_log2>", "<dq_accum>", "cu_q"]
        assert [a.name for a in main][-4:] == ["dK", "dV", "cu_q", "cu_k"]
        assert [a.name for a in post] == ["<dq_accum>", "dQ", "cu_q"]
        (ws,) = {r.prepare.workspace for r in call.launches}
        assert pre[5].ptr == ws and pre[5].shape == (H, n * dr) and pre[2].ptr == ws + lay["dpsum"][0]
        assert pre[0].shape == (rows, H, 128) and pre[3].shape == (rows, H)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch, cc, sms", [("sm90a", (9, 0), 132), ("sm100a", (10, 0), 148)])
def test_padded_backward_passes_the_used_lengths_and_zeroes_dq_dk_dv_before_the_preprocess(bwd_artifacts, arch, cc,
                                                                                          sms):
    """Over padded sequences each kernel gets FA4's seqused_q (and the main kernel seqused_k) in its own
    argument slot, after the plan's tensors; FA4 writes no row past them, where the spec's gradient is
    0, so dQ, dK and dV (exactly those, in full) are zeroed once, before the preprocess; the workspace
    is the dense one, nothing of it cleared."""
    import kspec
    mod = kspec.load(bwd_artifacts(PADDED))
    plan = _bwd_plan(mod, PADDED)
    b = plan.binaries[arch]
    assert plan.init == {"dQ": "zero", "dK": "zero", "dV": "zero"}
    assert mod.step_variants(plan, arch) == [0, 1, 2]
    tile_m, dr = int(b.variants[0].config["ws_tile_m"]), int(b.variants[0].config["ws_head_dim"])
    for B, H, S, T in ((2, 3, 300, 200), (1, 1, 1, 1), (3, 2, 700, 1000)):
        call, problems, fake = _fake_call(mod, PADDED, {"B": B, "H": H, "S": S, "T": T}, cc, sms, arch)
        assert problems == [], problems
        assert [r.symbol for r in call.launches] == [v.symbol for v in b.variants]
        lay = attention_bwd_workspace(B, H, S, tile_m, dr)
        assert mod.launches(plan, arch, call.binding.dims(plan), 0, sms) == ([0, 1, 2], lay["total"][0])
        pre, main, post = call.plan_args
        assert [a.name for a in pre] == ["O", "dO", "<dpsum>", "p_lse", "<lse_log2>", "<dq_accum>", "Lq"]
        assert [a.name for a in main] == ["Q", "K", "V", "dO", "<lse_log2>", "<dpsum>", "<dq_accum>", "dK", "dV",
                                          "Lq", "Lk"]
        assert [a.name for a in post] == ["<dq_accum>", "dQ", "Lq"]
        assert pre[-1].shape == main[-1].shape == (B,) and pre[-1].ptr == main[-2].ptr == post[-1].ptr
        # dQ, dK, dV zeroed in full (f16: 2-byte elements), all three before the first kernel, nothing else
        out = {a.name: a for a in (*main[7:9], post[1])}
        want = sorted((out[n].ptr, 0, 2, B * H * (S if n == "dQ" else T) * 128) for n in ("dQ", "dK", "dV"))
        assert sorted(fake.fills) == want and fake.fills_at == [0, 0, 0], (fake.fills, fake.fills_at)


def _gqa_artifact(bwd_artifacts, group: str):
    """attention_gqa's backward built with its group a literal (h / 4), or an i32 param G built for
    the group --sizes G=4 names."""
    if group == "literal":
        return bwd_artifacts(GQA), None
    return bwd_artifacts(GQA, _param_group, {"G": 4}, "attention_gqa_param"), {"G": 4}


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("group", ["literal", "param"])
@pytest.mark.parametrize("arch, cc, sms", [("sm90a", (9, 0), 132), ("sm100a", (10, 0), 148)])
def test_one_gqa_call_launches_five_kernels_zeroing_the_dk_dv_accumulators_before_the_main_one(bwd_artifacts, arch,
                                                                                                cc, sms, group):
    """A GQA backward call: preprocess, main, then the dQ, dK and dV postprocesses, in order, on one
    workspace holding FA4's dq_accum, dpsum, lse_log2, dk_accum and dv_accum (kspec.core's layout);
    the main kernel accumulates dK and dV into dk_accum and dv_accum [B, KH, T_r * E_r] (zeroed just
    before it, as FA4's torch.zeros allocates them), the postprocesses convert them into dK and dV.
    A per-call group (`param G`, built for G = 4): the same, its kernels in the box G = 4."""
    import kspec
    from kspec.core import attention_bwd_layout
    art, params = _gqa_artifact(bwd_artifacts, group)
    mod = kspec.load(art)
    plan = _bwd_plan(mod, GQA)
    b = plan.binaries[arch]
    assert mod.step_variants(plan, arch) == [0, 1, 2, 3, 4]
    assert all(v.select == (() if group == "literal" else ({"G": (4, 4)},)) for v in b.variants)
    # (T = 300: an odd number of key tiles, which sm_100a's 2-CTA backward pads to an even one)
    for B, KH, S, T in ((2, 3, 300, 300), (1, 1, 1, 1), (3, 2, 1000, 700)):
        sizes = {"B": B, "H": 4 * KH, "S": S, "T": T, "KH": KH}
        call, problems, fake = _fake_call(mod, GQA, sizes, cc, sms, arch, params)
        assert problems == [], problems
        assert call.plan_ids == [plan.id] * 5
        assert [r.symbol for r in call.launches] == [v.symbol for v in b.variants]
        cfg = b.variants[1].config
        roles = {"B": B, "H": 4 * KH, "S": S, "T": T, "HK": KH}
        assert [r for r, _x in plan.dims] == list(roles)
        lay = attention_bwd_layout(cfg, roles)
        want = lay["total"][0]
        assert mod.launches(plan, arch, call.binding.dims(plan), 0, sms) == ([0, 1, 2, 3, 4], want)
        (ws,) = {r.prepare.workspace for r in call.launches}
        pre, main, post, post_dk, post_dv = call.plan_args
        assert [a.name for a in pre] == ["O", "dO", "<dpsum>", _lse(mod, GQA), "<lse_log2>", "<dq_accum>"]
        assert [a.name for a in main] == ["Q", "K", "V", "dO", "<lse_log2>", "<dpsum>", "<dq_accum>", "<dk_accum>",
                                          "<dv_accum>"]
        assert [a.name for a in post] == ["<dq_accum>", "dQ"]
        assert [[a.name for a in x] for x in (post_dk, post_dv)] == [["<dk_accum>", "dK"], ["<dv_accum>", "dV"]]
        # K and V (and dK, dV) have KH heads; the accumulators [B, KH, T_r * E_r] lie after the rows
        assert main[1].shape == (B, KH, T, 128) and post_dv[1].shape == (B, KH, T, 128)
        tile, pair, dr = int(cfg["ws_kv_tile"]), int(cfg["ws_kv_pair"]), int(cfg["ws_head_dim"])
        tiles = -(-T // tile)
        tr = -(-tiles // pair) * pair * tile                      # T rounded to tiles, to pairs of them
        assert main[7].ptr == ws + lay["dk_accum"][0] and main[7].shape == (B, KH, tr * dr)
        assert main[8].ptr == ws + lay["dv_accum"][0] == ws + lay["dk_accum"][0] + -(-B * KH * tr * dr * 4 // 256) * 256
        assert lay["dk_accum"][0] >= lay["lse_log2"][0] + 4 * B * 4 * KH * -(-S // int(cfg["ws_tile_m"])) * \
            int(cfg["ws_tile_m"])
        assert want == lay["dv_accum"][0] + -(-B * KH * tr * dr * 4 // 256) * 256
        # the accumulators (and nothing else of the workspace) zeroed once, after the preprocess and
        # before the main kernel
        zeroed = [(f, at) for f, at in zip(fake.fills, fake.fills_at) if ws <= f[0] < ws + want]
        assert zeroed == [((ws + lay["dk_accum"][0], 0, 4, (want - lay["dk_accum"][0]) // 4), 1)], zeroed
        # the dK and dV postprocesses run over the K/V heads
        assert all(r.grid[1:] == (KH, B) for r in call.launches[3:]), [r.grid for r in call.launches]


def _lse(mod, stem):
    return [t.name for t in mod[f"{stem}_bwd"].entry.inputs if t.name.endswith("lse")][0]


@needs_fa4
@pytest.mark.cute
def test_bad_sizes_are_refused_before_launch(bwd_artifacts):
    import kspec
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.glue import HostGlue
    art = bwd_artifacts("attention")
    mod = kspec.load(art)
    plan = _bwd_plan(mod, "attention")
    v = plan.binaries["sm90a"].variants[1]
    glue = HostGlue(art / v.host, "attention_bwd", plan.args)
    ptrs = [0x7F0000000000 + i * 0x10000000 for i in range(len(plan.args))]
    ws = 0x7E0000000000
    ok = glue.prepare([2, 4, 300, 500], ptrs, [0.1], ws, 0, 132)          # S != T: fine without a mask
    assert ok.grid[0] >= 1 and ok.block[0] > 0
    with pytest.raises(KspecRuntimeError, match="at least one of each"):
        glue.prepare([2, 4, 0, 500], ptrs, [0.1], ws, 0, 132)
    with pytest.raises(KspecRuntimeError, match="without its workspace"):
        glue.prepare([2, 4, 300, 500], ptrs, [0.1], 0, 0, 132)
    assert glue.prepare([0, 4, 300, 500], ptrs, [0.1], ws, 0, 132).grid == (0, 0, 0)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_gqa_sizes_fa4_cannot_take_are_refused_before_launch(bwd_artifacts, arch):
    """Every one of the five kernels' glue refuses a call whose query heads are not 4 per K/V head (the
    spec's h / 4 reads K/V head 0 or 1 of 3 at H = 8, KH = 3: valid, but not FA4's GQA)."""
    import kspec
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.glue import HostGlue
    art = bwd_artifacts(GQA)
    mod = kspec.load(art)
    plan = _bwd_plan(mod, GQA)
    ptrs = [0x7F0000000000 + i * 0x10000000 for i in range(len(plan.args))]
    ws = 0x7E0000000000
    for v in plan.binaries[arch].variants:
        glue = HostGlue(art / v.host, "attention_gqa_bwd", plan.args)
        assert glue.prepare([2, 8, 300, 500, 2], ptrs, [0.1], ws, 0, 132).grid[0] >= 1      # B H S T HK
        with pytest.raises(KspecRuntimeError, match="exactly 4 query heads per K/V head"):
            glue.prepare([2, 8, 300, 500, 3], ptrs, [0.1], ws, 0, 132)
        with pytest.raises(KspecRuntimeError, match="without its workspace"):
            glue.prepare([2, 8, 300, 500, 2], ptrs, [0.1], 0, 0, 132)
        # the workspace every kernel asks for is kspec.core's layout
        lay = attention_bwd_workspace(2, 8, 300, int(v.config["ws_tile_m"]), int(v.config["ws_head_dim"]), 2, 500,
                                      int(v.config["ws_kv_tile"]), int(v.config["ws_kv_pair"]))
        assert glue.workspace_size([2, 8, 300, 500, 2], 0, 132) == lay["total"][0]


@needs_fa4
@pytest.mark.cute
def test_a_call_in_another_group_than_the_per_call_groups_built_is_refused_by_name(bwd_artifacts):
    """The backward of `h / G` built for G = 4 (--sizes G=4): a call with 2 query heads per K/V head
    finds no kernels for its group (the runtime says which it holds and how to build the other); one
    whose param G is not the group H / KH gets the glue's refusal, before anything launches."""
    import kspec
    from kspec.runtime.errors import KspecRuntimeError
    art, _params = _gqa_artifact(bwd_artifacts, "param")
    mod = kspec.load(art)
    sizes = {"B": 1, "H": 4, "S": 64, "T": 64, "KH": 2}
    with pytest.raises(KspecRuntimeError, match=r"kernels for the GQA group 4 .* this call has 4 query heads on 2 K/V "
                                                r"heads \(group 2\)") as e:
        _fake_call(mod, GQA, sizes, (9, 0), 132, "sm90a", {"G": 2})
    assert "--sizes H=4,KH=2" in e.value.hint
    with pytest.raises(KspecRuntimeError, match="GQA group param = 2, but the kernel was built for 4"):
        _fake_call(mod, GQA, {**sizes, "H": 8}, (10, 0), 148, "sm100a", {"G": 2})


@needs_fa4
@pytest.mark.cute
def test_warm_backward_compile_imports_neither_fa4_nor_the_dsl(bwd_artifacts, tmp_path):
    bwd_artifacts("attention_causal")            # the cache is warm
    spec = tmp_path / "g.kspec"
    spec.write_text(_grad_text("attention_causal"))
    code = ("import sys; from kspec.compile import compile_spec; from kspec.backends.build import CompileCache;"
            f"from conftest import test_cache_root; compile_spec({str(spec)!r}, ('sm90a', 'sm100a'), "
            f"{str(tmp_path / 'out')!r}, cache=CompileCache(test_cache_root()), kernel='attention_causal_bwd');"
            "bad = [m for m in ('cutlass', 'flash_attn', 'quack', 'torch') if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(SPECS.parent / "tests"),
                       env=checkout_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


@needs_fa4
@pytest.mark.cute
def test_inspect_says_a_call_launches_the_three_kernels_in_order(bwd_artifacts, capsys):
    from kspec.cli import main
    art = bwd_artifacts("attention_causal")
    assert main(["inspect", str(art), "--sizes", "B=2,H=8,S=4096,T=4096"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "attention_causal_bwd_0" in x]
    want = attention_bwd_workspace(2, 8, 4096, 128, 64)["total"][0]          # head dim 64: tile_m 128 on both
    assert len(lines) == 2 and all(f"variants 0, 1, 2 in order (the attention backward's preprocess, main and "
                                   f"postprocess kernels; {want} bytes of workspace)" in x for x in lines), lines


@needs_fa4
@pytest.mark.cute
def test_inspect_says_a_gqa_call_launches_the_five_kernels_in_order(bwd_artifacts, capsys):
    import kspec
    from kspec.cli import main
    art = bwd_artifacts(GQA)
    assert main(["inspect", str(art), "--sizes", "B=2,H=32,S=4096,T=4096,KH=8"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "attention_gqa_bwd_0" in x]
    plan = _bwd_plan(kspec.load(art), GQA)
    want = [attention_bwd_workspace(2, 32, 4096, *(int(plan.binaries[a].variants[0].config[k]) for k in (
        "ws_tile_m", "ws_head_dim")), 8, 4096, *(int(plan.binaries[a].variants[0].config[k]) for k in (
            "ws_kv_tile", "ws_kv_pair")))["total"][0] for a in ARCHS]
    assert len(lines) == 2 and all(
        f"variants 0, 1, 2, 3, 4 in order (the attention backward's preprocess, main, postprocess, dK postprocess "
        f"and dV postprocess kernels; {w} bytes of workspace)" in x for x, w in zip(lines, want)), lines


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_selftest_fake_checks_each_of_the_five_gqa_launches(bwd_artifacts, capsys, arch):
    """`kspec selftest --fake` of the GQA backward: five launches per call, each checked against its
    kernel's ABI and tensors (the dK/dV accumulators included).  On sm_90a its main kernel at head
    dim 128 declares the full dynamic shared memory beside FA4's 1 KiB static section: open, as for
    the plain backward at head dim 128 (selftest.FA4_SMEM_RISK; a GPU settles it)."""
    from kspec.cli import main
    art = bwd_artifacts(GQA)
    rc = main(["selftest", str(art), "--fake", arch, "--no-bench"])
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if "attention_gqa_bwd " in x]
    assert rc == 0 and lines, out
    for x in lines:
        assert ("PASS" in x and "5 launch(es) recorded, ABI ok" in x) or (
            arch == "sm90a" and "OPEN" in x and "1024 static shared memory exceed" in x), out


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stem", ["attention_causal", "attention_varlen", PADDED])
def test_selftest_fake_checks_each_of_the_three_launches(bwd_artifacts, capsys, arch, stem):
    """`kspec selftest --fake` (what a CPU machine checks before a GPU run) matches the three launches
    of one attention backward call to the plan and checks each against its own kernel's ABI and the
    tensors it reads and writes (the workspace's buffers included); it once zipped one launch per
    plan and reported Q, K, V, dQ, dK, dV missing from the preprocess kernel's parameters."""
    from kspec.cli import main
    art = bwd_artifacts(stem)
    rc = main(["selftest", str(art), "--fake", arch, "--no-bench"])
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if f"{stem}_bwd" in x and "bad-index" not in x]
    assert rc == 0 and lines and all("PASS" in x and "3 launch(es) recorded, ABI ok" in x for x in lines), out
