"""Spellings of one attention canonicalise to one kernel IR (compiler/canon.py: constant factors,
mask normal form, mask past additive terms; compiler/ir_build.py: structural op ids): each spelling
the issue names is planned from real spec text and its IR digest compared with the canonical
form's, and the FA4 view of the mask (native causal / window) is checked where it matters."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FA4_MISSING, needs_fa4

from kspec.backends.registry import Planner
from kspec.compiler import plan_kernel, verify
from kspec.compiler.kir import BackendChoice
from kspec.spec_lang import load_spec

ARCHS = ("sm90a", "sm100a")

BASE = """kernel k {
  param W : i32 = 16
  in  Q : f16[B, H, S, 64]
  in  K : f16[B, H, S, 64]
  in  V : f16[B, H, S, 64]
  in  bias : f32[B, H, S, S]
  out O : f16[B, H, S, 64]
  s[b, h, i, j] : f32 = SCORE
  m[b, h, i, j] = MOD
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
}"""
QK = "sum(e) Q[b, h, i, e] * K[b, h, j, e]"


class Accepting(Planner):
    """The registry, with every attention accepted (so fusion does not depend on installed FA4).
    Where FlashAttention-4 is not installed, no backend builds most of these attentions (masks,
    score_mods, MQA): the plan's backend choice then names none, as these tests check the kernel IR,
    not who builds it (with FA4 installed, the registry's choice is made and must succeed)."""

    def can_fuse(self, ir, archs):
        return None if ir.kind == "attention" else super().can_fuse(ir, archs)

    def choose(self, ir, arch):
        if ir.kind == "attention" and FA4_MISSING:
            return BackendChoice("none", "attention", f"FlashAttention-4 unavailable: {FA4_MISSING}")
        return super().choose(ir, arch)


def ir_of(score=f"0.125 * {QK}", mod="s[b, h, i, j]"):
    src = BASE.replace("SCORE", score).replace("MOD", mod)
    sched = plan_kernel(load_spec(src, is_text=True).kernels[0], ARCHS, Accepting())
    assert [p.kind for p in sched.plans] == ["attention"], [p.kind for p in sched.plans]
    return verify(sched.plans[0].ir)


CASES = {
    # constant factors fold into the softmax scale
    "divided by sqrt(64.0)": (dict(score=f"({QK}) / sqrt(64.0)"), dict()),
    "times 0.125 after the sum": (dict(score=f"({QK}) * 0.125"), dict()),
    "times 0.125 inside the sum": (dict(score="sum(e) Q[b, h, i, e] * K[b, h, j, e] * 0.125"), dict()),
    # a mask commutes past an additive term
    "causal before the bias": (dict(mod="where(j <= i, s[b, h, i, j], -inf) + bias[b, h, i, j]"),
                               dict(mod="where(j <= i, s[b, h, i, j] + bias[b, h, i, j], -inf)")),
    "bias after a window": (dict(mod="bias[b, h, i, j] + where(j <= i and j > i - W, s[b, h, i, j], -inf)"),
                            dict(mod="where(j <= i and j > i - W, bias[b, h, i, j] + s[b, h, i, j], -inf)")),
    # a disjunctive window with its branches swapped is the conjunction of its bounds
    "window with or, branches swapped": (dict(mod="where(j > i or j <= i - W, -inf, s[b, h, i, j])"),
                                         dict(mod="where(j <= i and j > i - W, s[b, h, i, j], -inf)")),
    "causal with branches swapped": (dict(mod="where(j > i, -inf, s[b, h, i, j])"),
                                     dict(mod="where(j <= i, s[b, h, i, j], -inf)")),
    "not of a conjunction": (dict(mod="where(not (j <= i and j > i - W), -inf, s[b, h, i, j])"),
                             dict(mod="where(j <= i and j > i - W, s[b, h, i, j], -inf)")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_spelling_has_the_canonical_ir(name):
    spelling, canonical = CASES[name]
    a, b = ir_of(**spelling), ir_of(**canonical)
    assert a.digest() == b.digest(), name
    assert a.attention.scale == 0.125 or a.attention.scale == b.attention.scale


def test_the_spellings_are_not_all_one_ir():
    # the digest tells different attentions apart (the comparison above can fail)
    digests = {ir_of().digest(), ir_of(score=f"0.25 * {QK}").digest(),
               ir_of(mod="where(j <= i, s[b, h, i, j], -inf)").digest(),
               ir_of(mod="where(j < i, s[b, h, i, j], -inf)").digest(),
               ir_of(mod="where(j <= i, s[b, h, i, j], -inf) + bias[b, h, i, j]").digest()}
    assert len(digests) == 5
    assert ir_of(score=f"({QK}) / sqrt(64.0)").attention.scale == 0.125


def test_causal_before_bias_is_the_causal_flag_and_a_bias_score_mod():
    a = ir_of(mod="where(j <= i, s[b, h, i, j], -inf) + bias[b, h, i, j]").attention
    assert a.causal and a.mask is None and a.aux == ("bias",)
    from kspec.compiler.kir import AuxLoad, Index, Op, Score
    assert a.score_mod == Op("add", (Score(), AuxLoad("bias", tuple(Index(x) for x in "bhij"), "f32")))


def test_swapped_or_window_is_flashattention_4_native():
    attnmods = pytest.importorskip("kspec.backends.cute.attnmods")
    a = ir_of(mod="where(j > i or j <= i - W, -inf, s[b, h, i, j])").attention
    m = attnmods.analyse(a, dict(a.dims))
    assert m.window is not None and m.mask_mod is None and not m.causal


def test_a_float_comparison_is_not_flipped():
    # not (x > 0.0) is not x <= 0.0 for a NaN score: the condition keeps its `not`
    a = ir_of(mod="where(bias[b, h, i, j] > 0.0, -inf, s[b, h, i, j])").attention
    assert "not" in repr(a.mask) and "le" not in repr(a.mask)


HAND = """mx[b, h, i] = max(j) s[b, h, i, j]
  x[b, h, i, j] = exp(s[b, h, i, j] - mx[b, h, i])
  z[b, h, i] = sum(j) x[b, h, i, j]
  p[b, h, i, j] = x[b, h, i, j] / z[b, h, i]"""


def hand_written(body=HAND):
    return BASE.replace("SCORE", f"0.125 * {QK}").replace("  m[b, h, i, j] = MOD\n", "").replace(
        "  p[b, h, i, j] = softmax(j) m[b, h, i, j]", "  " + body)


def test_a_hand_written_softmax_is_the_softmax():
    sched = plan_kernel(load_spec(hand_written(), is_text=True).kernels[0], ARCHS, Accepting())
    assert [p.kind for p in sched.plans] == ["attention"]
    assert verify(sched.plans[0].ir).digest() == ir_of().digest()


@pytest.mark.parametrize("body, why", [
    (HAND.replace("exp(s[b, h, i, j] - mx[b, h, i])", "exp(s[b, h, i, j] - mx[b, h, i] + 1.0)"), "not y - max y"),
    (HAND.replace("z[b, h, i] = sum(j) x[b, h, i, j]", "z[b, h, i] = sum(j) x[b, h, i, j] * 2.0"), "not sum x"),
    (HAND.replace("mx[b, h, i] = max(j) s[b, h, i, j]", "mx[b, h, i] = min(j) s[b, h, i, j]"), "min, not max"),
])
def test_what_is_not_a_softmax_stays_unfused(body, why):
    sched = plan_kernel(load_spec(hand_written(body), is_text=True).kernels[0], ARCHS, Accepting())
    assert "attention" not in [p.kind for p in sched.plans], why


def _attention64(Q, K, V, scale, keep=None, bias=None):
    s = scale * np.einsum("bhie,bhje->bhij", *(x.astype(np.float64) for x in (Q, K)))
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhij,bhje->bhie", p / p.sum(-1, keepdims=True), V.astype(np.float64))


@pytest.mark.parametrize("kind", ["sqrt", "causal before bias", "swapped window", "hand-written softmax"])
def test_the_rewritten_graph_computes_the_same_values(kind):
    # the reference executes the canonicalised graph: the rewrites keep the values (float64 numpy here)
    import kspec
    rng = np.random.default_rng(3)
    B, H, S, W = 1, 2, 24, 5
    Q, K, V = (rng.standard_normal((B, H, S, 64)).astype(np.float16) for _ in range(3))
    bias = rng.standard_normal((B, H, S, S)).astype(np.float32)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    src, keep, b = {
        "sqrt": (BASE.replace("SCORE", f"({QK}) / sqrt(64.0)").replace("MOD", "s[b, h, i, j]"), None, None),
        "causal before bias": (BASE.replace("SCORE", f"0.125 * {QK}").replace(
            "MOD", "where(j <= i, s[b, h, i, j], -inf) + bias[b, h, i, j]"), j <= i, bias),
        "swapped window": (BASE.replace("SCORE", f"0.125 * {QK}").replace(
            "MOD", "where(j > i or j <= i - W, -inf, s[b, h, i, j])").replace("= 16", f"= {W}"),
            (j <= i) & (j > i - W), None),
        "hand-written softmax": (hand_written(), None, None),
    }[kind]
    out = kspec.reference(src)(Q=Q, K=K, V=V, bias=bias)["O"].astype(np.float64)
    np.testing.assert_allclose(out, _attention64(Q, K, V, 0.125, keep, b), rtol=3e-3, atol=3e-3)


MQA = """kernel k {
  param scale : f32 = 0.125
  in  Q : f16[B, 8, S, 64]
  in  K : f16[KDECL]
  in  V : f16[KDECL]
  out O : f16[B, 8, S, 64]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[KREAD]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[VREAD]
}"""


def mqa(decl="B, T, 64", read="b, j, e"):
    return MQA.replace("KDECL", decl).replace("KREAD", read).replace("VREAD", read)


def _attention_ir(src):
    sched = plan_kernel(load_spec(src, is_text=True).kernels[0], ARCHS, Accepting())
    assert [p.kind for p in sched.plans] == ["attention"], [p.kind for p in sched.plans]
    return verify(sched.plans[0].ir)


@pytest.mark.parametrize("decl, read", [("B, 1, T, 64", "b, 0, j, e"), ("1, B, T, 64", "0, b, j, e"),
                                        ("B, 1, T, 1, 64", "b, 0, j, 0, e")])
def test_singleton_head_axes_are_multi_query_attention(decl, read):
    # K declared [B, 1, T, d] and read at head 0 is K[b, j, e]: the same kernel IR (and MQA: K/V shared
    # across the heads); the spec's own K still takes the declared shape
    a = _attention_ir(mqa(decl, read))
    assert a.digest() == _attention_ir(mqa()).digest()
    assert a.attention.kv_shared == ("h",) and a.buffer("K").shape == ("B", "T", 64)


def test_a_unit_axis_read_elsewhere_is_not_squeezed():
    # K also read at a computed head: not a view of K without its head axis
    src = mqa("B, 1, T, 64", "b, 0, j, e").replace("* V[b, 0, j, e]", "* V[b, h - h, j, e]")
    sched = plan_kernel(load_spec(src, is_text=True).kernels[0], ARCHS, Accepting())
    assert sched.graph is not None
    from kspec.compiler import op
    ins = {op(sched.graph, n).name: op(sched.graph, n) for n in sched.graph.nodes if op(sched.graph, n).kind == "input"}
    assert ins["K"].squeezed == (1,) and ins["V"].squeezed == () and len(ins["V"].shape) == 4


def test_singleton_mqa_computes_the_declared_function():
    import kspec
    rng = np.random.default_rng(5)
    B, S, T = 2, 3, 17
    Q = rng.standard_normal((B, 8, S, 64)).astype(np.float16)
    K, V = (rng.standard_normal((B, 1, T, 64)).astype(np.float16) for _ in range(2))
    out = kspec.reference(mqa("B, 1, T, 64", "b, 0, j, e"))(Q=Q, K=K, V=V)["O"].astype(np.float64)
    Kb, Vb = (np.broadcast_to(x, (B, 8, T, 64)) for x in (K, V))
    s = 0.125 * np.einsum("bhie,bhje->bhij", Q.astype(np.float64), Kb.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhij,bhje->bhie", p / p.sum(-1, keepdims=True), Vb.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=3e-3, atol=3e-3)


# ---------------------------------------------------------------------------------------------
# issue 25's table: every spelling is one fused FlashAttention-4 attention on both archs
# ---------------------------------------------------------------------------------------------

def _spec(decl_q="B, H, S, 64", decl_kv="B, KH, T, 64", read_q="b, h, i, e", read_kv="b, h / 4, j, e",
          body=None, labels="b, h, i", params=""):
    body = body or f"""  s[{labels}, j] : f32 = 0.125 * sum(e) Q[{read_q}] * K[{read_kv.replace('j', 'j')}]
  p[{labels}, j] = softmax(j) s[{labels}, j]"""
    return f"""kernel k {{
{params}  in  Q : f16[{decl_q}]
  in  K : f16[{decl_kv}]
  in  V : f16[{decl_kv}]
  in  bias : f32[B, H, S, T]
  out O : f16[{decl_q}]
{body}
  O[{labels}, e] = sum(j) p[{labels}, j] * V[{read_kv}]
}}"""


QK4 = "sum(e) Q[b, h, i, e] * K[b, h / 4, j, e]"
TABLE = {
    "MQA, K [B, 1, T, d] read at head 0": _spec(decl_kv="B, 1, T, 64", read_kv="b, 0, j, e"),
    "MQA, K/V without a head axis": _spec(decl_kv="B, T, 64", read_kv="b, j, e"),
    "GQA, h / G with param G": _spec(read_kv="b, h / G, j, e", params="  param G : i32 = 4\n"),
    "GQA, heads as two axes": _spec(decl_q="B, KH, 4, S, 64", read_q="b, g, r, i, e", read_kv="b, g, j, e",
                                    labels="b, g, r, i").replace("in  bias : f32[B, H, S, T]\n", ""),
    "hand-written softmax": _spec(body=f"""  s[b, h, i, j] : f32 = 0.125 * {QK4}
  mx[b, h, i] = max(j) s[b, h, i, j]
  x[b, h, i, j] = exp(s[b, h, i, j] - mx[b, h, i])
  z[b, h, i] = sum(j) x[b, h, i, j]
  p[b, h, i, j] = x[b, h, i, j] / z[b, h, i]"""),
    "/ sqrt(64.0) inside the sum": _spec(body="""  s[b, h, i, j] : f32 = sum(e) Q[b, h, i, e] * K[b, h / 4, j, e] / sqrt(64.0)
  p[b, h, i, j] = softmax(j) s[b, h, i, j]"""),
    "causal before an additive bias": _spec(body=f"""  s[b, h, i, j] : f32 = 0.125 * {QK4}
  m[b, h, i, j] = where(j <= i + (T - S), s[b, h, i, j], -inf) + bias[b, h, i, j]
  p[b, h, i, j] = softmax(j) m[b, h, i, j]"""),
    "window with or, branches swapped": _spec(params="  param W : i32 = 64\n", body=f"""  s[b, h, i, j] : f32 = 0.125 * {QK4}
  m[b, h, i, j] = where(j > i + (T - S) or j <= i + (T - S) - W, -inf, s[b, h, i, j])
  p[b, h, i, j] = softmax(j) m[b, h, i, j]"""),
}


@needs_fa4
@pytest.mark.parametrize("name", list(TABLE))
def test_every_spelling_in_the_issue_is_one_flashattention_4_kernel(name):
    from kspec.backends.cute import attention as A
    from kspec.backends.cute import attnmods
    # (--sizes name the GQA group where the spelling leaves it to the call: h / G, MQA over H)
    sched = plan_kernel(load_spec(TABLE[name], is_text=True).kernels[0], ARCHS, Planner(sizes={"G": 4, "H": 32}))
    assert [p.kind for p in sched.plans] == ["attention"], (name, sched.fusion.notes)
    (p,) = sched.plans
    assert all(p.choices[a].backend == "cute" for a in ARCHS), name
    a = A.fold_heads(p.ir, p.ir.attention) or p.ir.attention
    m = attnmods.analyse(*A._fa4_view(p.ir, a, "S"))
    assert a.scale == 0.125
    if name.startswith("causal"):
        assert m.causal and m.score_mod and not m.mask_mod            # FA4's causal flag + a bias score_mod
    elif name.startswith("window"):
        assert m.window is not None and not m.mask_mod and not m.score_mod
    else:
        assert not (m.causal or m.window or m.mask_mod or m.score_mod)
