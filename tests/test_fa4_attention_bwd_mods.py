"""The backward of a score-modified attention (soft-capping, ALiBi) as FlashAttention-4's backward with
generated score_mod / score_mod_bwd functions (compiler/attention_grad.py, backends/cute/attnmods.py
analyse_bwd, backends/cute/attention_bwd.py): the derivative kspec derives (by kspec grad's rules)
against torch autograd of the mod written here, in float64 and through the generated source the
kernel traces; `kspec grad`'s softcap (head dim 128), ALiBi and bias (--wrt Q,K,V) backwards plan under
--strict as one cute attention_bwd plan on both archs; a gradient chain edited to a wrong derivative,
a dslope wanted, and head dim 256 are refused with the reason; FA4 is handed the generated functions;
real offline builds (tensor-core SASS in the main kernel) and the launch ABI (aux tensor and scalar
passed to the main kernel) under the fake driver."""
from __future__ import annotations

import json
import math
import struct
import types

import numpy as np
import pytest

from conftest import FA4_BWD_MAIN as MAIN
from conftest import (FAKE_ARCHS, SPECS, check_fa4_bwd_binaries, fa4_fake_call, grad_artifacts, needs_fa4,
                      one_fa4_bwd_plan)

from kspec.compile import plan_spec
from kspec.compiler import format_ir, ir_from_json, ir_to_json, verify
from kspec.compiler.attention_grad import derivative, differs, evaluate, expected_grad, leaves_of
from kspec.compiler.kir import AuxLoad, Const, Index, Load, Op, Score, ScoreGrad, epi_nodes
from kspec.core import KspecError
from kspec.spec_lang import load_spec
from kspec.spec_lang.grad import grad_program

ARCHS = ("sm90a", "sm100a")
SOFTCAP_128 = {"256": "128", "0.0625": "0.08838834764831845"}


def _softcap_text(head_dim: int = 128) -> str:
    text = (SPECS / "attention_softcap.kspec").read_text()
    if head_dim == 128:
        for a, b in SOFTCAP_128.items():
            text = text.replace(a, b)
    return text


def _grad_text(stem: str, wrt=None) -> str:
    text = _softcap_text() if stem == "softcap" else (SPECS / f"attention_{stem}.kspec").read_text()
    return grad_program(load_spec(text, is_text=True), wrt=wrt)


WRT = {"softcap": None, "alibi": ["Q", "K", "V"], "bias": ["Q", "K", "V"]}
STEMS = tuple(WRT)
# the aux tensor each backward's main kernel reads (its name, its shape at B, H, S = T)
AUX = {"softcap": None, "alibi": ("slope", lambda B, H, S: (H,)), "bias": ("bias", lambda B, H, S: (B, H, S, S))}


def _plan(stem: str, text: str | None = None, strict: bool = True):
    prog = load_spec(text or _grad_text(stem, WRT[stem]), is_text=True, file=f"{stem}_grad.kspec")
    (sched,) = plan_spec(prog, ARCHS, f"attention_{stem}_bwd", strict=strict)
    return sched


# ---------------------------------------------------------------------------------------------
# the derivative: kspec grad's rules against torch autograd
# ---------------------------------------------------------------------------------------------

S, CAP, SLOPE = Score(), Load("cap", "scalar", "f32"), AuxLoad("slope", (Index("h"),), "f32")
J_MINUS_I = Op("cast:f32", (Op("sub", (Index("j"), Index("i"))),))
MODS = {
    # name: (kspec expression, the same mod in torch: (score, cap, slope, i, j) -> modified score)
    "softcap": (Op("mul", (CAP, Op("tanh", (Op("div", (S, CAP)),)))), lambda s, c, sl, i, j: c * (s / c).tanh()),
    "alibi": (Op("add", (S, Op("mul", (SLOPE, J_MINUS_I)))), lambda s, c, sl, i, j: s + sl * (j - i)),
    "scaled_gelu": (Op("mul", (Op("gelu", (S,)), SLOPE)),
                    lambda s, c, sl, i, j: 0.5 * s * (1 + (s / math.sqrt(2)).erf()) * sl),
    "sigmoid_gate": (Op("mul", (S, Op("sigmoid", (Op("mul", (S, CAP)),)))),
                     lambda s, c, sl, i, j: s * (s * c).sigmoid()),
    "piecewise": (Op("where", (Op("gt", (S, Const(0.0))), Op("exp", (Op("neg", (S,)),)), Op("mul", (S, S)))),
                  lambda s, c, sl, i, j: (s > 0) * (-s).exp() + (s <= 0) * s * s),
    "clamped_log": (Op("log", (Op("add", (Op("clamp", (S, Const(-1.0), Const(5.0))), Const(2.0))),)),
                    lambda s, c, sl, i, j: (s.clamp(-1.0, 5.0) + 2.0).log()),
}


def _points(n=400, seed=1):
    rng = np.random.default_rng(seed)
    return dict(score=rng.uniform(-6, 6, n), grad=rng.uniform(-2, 2, n), cap=np.full(n, 3.5),
                slope=rng.uniform(-1, 1, n), i=rng.integers(0, 64, n), j=rng.integers(0, 64, n))


def _autograd(fn, p):
    torch = pytest.importorskip("torch")
    s = torch.tensor(p["score"], dtype=torch.float64, requires_grad=True)
    out = fn(s, torch.tensor(p["cap"]), torch.tensor(p["slope"]), torch.tensor(p["i"]), torch.tensor(p["j"]))
    (d,) = torch.autograd.grad(out, s, torch.tensor(p["grad"]))
    return d.numpy()


def _env(p):
    return {Score(): p["score"], ScoreGrad(): p["grad"], CAP: p["cap"], SLOPE: p["slope"],
            Index("i"): p["i"], Index("j"): p["j"]}


@pytest.mark.parametrize("name", sorted(MODS))
def test_derived_score_mod_bwd_is_torch_autograd_of_the_mod_in_float64(name):
    expr, fn = MODS[name]
    p = _points()
    d = derivative(expr)
    assert ScoreGrad() in leaves_of(d)
    got = np.broadcast_to(evaluate(d, _env(p)), p["score"].shape)
    np.testing.assert_allclose(got, _autograd(fn, p), rtol=1e-12, atol=1e-12)


def _bwd_structure(expr, causal=False):
    return types.SimpleNamespace(query="i", key="j", batch=("b", "h"), causal=causal, score_mod=expr,
                                 score_mod_grad=derivative(expr),
                                 aux=tuple(sorted({x.buffer for x in leaves_of(expr) if isinstance(x, AuxLoad)})))


@pytest.mark.parametrize("name", sorted(MODS))
def test_generated_score_mod_bwd_source_computes_the_derivative(name):
    """The source the kernel traces (kspec_score_mod_bwd over dslops), run with numpy in f32."""
    from kspec.backends.cute import attnmods
    expr, fn = MODS[name]
    p = _points()
    a = _bwd_structure(expr)
    mods = attnmods.analyse_bwd(a, {"S": "S", "T": "T"})
    assert "def kspec_score_mod_bwd(grad, score, b_idx, h_idx" in mods.score_mod_bwd and not mods.mask_mod
    scalars = tuple(3.5 for kind, _n in mods.scalars if kind == "param")
    aux = tuple(np.asarray(p["slope"], np.float32) for _ in mods.aux)
    # the aux tensor slope[h] read per point: h is the point's own index into the per-point values
    h = np.arange(len(p["score"]))
    got = attnmods.run_numpy_bwd(mods, grad=p["grad"], score=p["score"], b=0, h=h, i=p["i"], j=p["j"], S=64, T=64,
                                 aux=aux, scalars=scalars)
    want = _autograd(fn, p)
    np.testing.assert_allclose(np.broadcast_to(got, want.shape), want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    # and the forward mod generated alongside it is the mod
    s_mod, _keep = attnmods.run_numpy(mods, score=p["score"], b=0, h=h, i=p["i"], j=p["j"], S=64, T=64, aux=aux,
                                      scalars=scalars)
    torch = pytest.importorskip("torch")
    want_fwd = fn(*(torch.tensor(p[k], dtype=torch.float64) for k in ("score", "cap", "slope", "i", "j"))).numpy()
    np.testing.assert_allclose(s_mod, want_fwd, rtol=2e-4, atol=1e-5 * np.abs(want_fwd).max())


def test_the_check_refuses_a_wrong_derivative_and_other_leaves():
    expr = MODS["softcap"][0]
    scores = types.SimpleNamespace(mask=Op("le", (Index("j"), Index("i"))))
    want = expected_grad(scores, derivative(expr), "scale")
    assert differs(want, want) is None
    # 1 - tanh instead of 1 - tanh^2: same leaves, other values
    t = Op("tanh", (Op("div", (S, CAP)),))
    wrong = Op("mul", (Op("where", (scores.mask, Op("mul", (ScoreGrad(), Op("sub", (Const(1.0), t)))), Const(0.0))),
                       Load("scale", "scalar", "f32")))
    assert "differs" in differs(wrong, want)
    # the scale missing, or the log-sum-exp read: other leaves
    assert "does not read scale" in differs(want.args[0], want)
    extra = Op("mul", (want, AuxLoad("p_lse", (Index("b"), Index("h"), Index("i")), "f32")))
    assert "reads p_lse" in differs(extra, want)
    # a branch of its own, wrong only where random scores never go
    rare = Op("where", (Op("gt", (S, Const(1e6))), Const(0.0), want))
    assert "chooses by gt(score, 1000000.0)" in differs(rare, want)


def test_the_check_visits_the_branches_of_the_derivative_random_points_miss():
    """gelu's derivative chooses by `x == 0` (Φ(0) = 0.5): a wrong value there is refused too."""
    d = derivative(Op("gelu", (S,)))
    cond = next(x for x in epi_nodes(d) if isinstance(x, Op) and x.fn == "eq")
    assert cond == Op("eq", (S, Const(0.0)))

    def at_zero(e, value):
        if isinstance(e, Op) and e.fn == "where" and e.args[0] == cond:
            return Op("where", (cond, value, e.args[2]))
        return Op(e.fn, tuple(at_zero(a, value) for a in e.args)) if isinstance(e, Op) else e
    assert differs(at_zero(d, Const(0.5)), d) is None
    assert "differs" in differs(at_zero(d, Const(0.25)), d)


# ---------------------------------------------------------------------------------------------
# planning
# ---------------------------------------------------------------------------------------------

@needs_fa4
@pytest.mark.parametrize("stem", STEMS)
def test_backward_plans_as_one_fa4_attention_bwd_plan_with_the_mod_on_both_archs(stem):
    p = one_fa4_bwd_plan(_plan(stem))                   # --strict: no loop fallback, no unfused note
    assert all("score_mod_bwd" in dict(p.choices[arch].config)["score_mod"] for arch in ARCHS)
    ir = verify(p.ir)
    a = ir.attention_bwd
    if stem == "softcap":
        assert a.score_mod == MODS["softcap"][0] and a.aux == () and not a.causal
    elif stem == "alibi":
        assert a.score_mod == MODS["alibi"][0] and a.aux == ("slope",) and a.causal
    else:
        idx = tuple(Index(x) for x in "bhij")
        assert a.score_mod == Op("add", (S, AuxLoad("bias", idx, "bf16"))) and a.aux == ("bias",) and not a.causal
    if stem != "softcap":
        assert a.score_mod_grad == ScoreGrad()
    assert a.score_mod_grad == derivative(a.score_mod)
    assert "score_mod: " in format_ir(ir)
    back = ir_from_json(json.loads(json.dumps(ir_to_json(ir))))
    assert back == ir


@needs_fa4
def test_softcap_under_a_bottom_right_causal_mask_plans_with_the_mask_in_its_expected_gradient():
    """`where(j <= i + (T - S), c, -inf)`: FA4's own causal alignment; the gradient chain's where is
    the mask's, so the check's expected dS carries it (and a chain masked by `j <= i` instead fails)."""
    fwd = _softcap_text().replace("softmax(j) c[b, h, i, j]", "softmax(j) where(j <= i + (T - S), c[b, h, i, j], -inf)")
    text = grad_program(load_spec(fwd, is_text=True))
    p = one_fa4_bwd_plan(_plan("softcap", text))
    a = p.ir.attention_bwd
    assert a.causal and a.bottom_right and a.score_mod == MODS["softcap"][0]
    assert all(dict(p.choices[arch].config)["mask"] == "causal (bottom-right)" for arch in ARCHS)
    old = "where(j <= i + (T - S), p[b, h, i, j]"
    assert old in text
    sched = _plan("softcap", text.replace(old, "where(j <= i, p[b, h, i, j]"), strict=False)
    assert any(NOT_DERIVATIVE in n and "chooses by le(idx(j), idx(i))" in n for n in sched.fusion.notes), \
        sched.fusion.notes


def test_plain_backward_ir_keeps_its_digest_fields():
    prog = load_spec(grad_program(load_spec(SPECS / "attention_causal.kspec")), is_text=True)
    (sched,) = plan_spec(prog, ARCHS, "attention_causal_bwd", strict=False)
    for p in sched.plans:
        if p.ir.attention_bwd is not None:
            assert not {"score_mod", "score_mod_grad", "aux"} & set(ir_to_json(p.ir)["attention_bwd"])


NOT_DERIVATIVE = "is not the derivative of the score modification"
TAMPER = {
    # the gradient chain edited: 1 - tanh instead of 1 - tanh^2; the cap divided twice; the
    # log-sum-exp or P read into it
    "tanh'": ("(1.0 - tanh(c_z[b, h, i, j]) * tanh(c_z[b, h, i, j]))", "(1.0 - tanh(c_z[b, h, i, j]))",
              NOT_DERIVATIVE + " mul(cap, tanh(div(score, cap))): its value differs"),
    "cap twice": ("/ cap * scale", "/ cap / cap * scale", NOT_DERIVATIVE),
    "reads lse": ("* cap * (1.0", "* p_lse[b, h, i] * (1.0", NOT_DERIVATIVE + " mul(cap, tanh(div(score, cap))): "
                  "it reads p_lse[idx(b), idx(h), idx(i)]"),
    "reads p": ("* cap * (1.0", "* p[b, h, i, j] * (1.0", "the probabilities have other uses"),
}


@pytest.mark.parametrize("what", sorted(TAMPER))
def test_a_tampered_gradient_chain_is_refused_with_the_reason(what):
    old, new, why = TAMPER[what]
    text = _grad_text("softcap")
    assert old in text
    text = text.replace(old, new)
    sched = _plan("softcap", text, strict=False)
    assert not [p for p in sched.plans if p.kind == "attention_bwd"]
    assert any("attention backward" in n and why in n for n in sched.fusion.notes), sched.fusion.notes
    with pytest.raises(KspecError, match="attention backward"):
        _plan("softcap", text)


def test_alibi_with_dslope_wanted_stays_unfused_with_the_reason():
    text = _grad_text("alibi")                          # every float input: dslope too
    assert "out dslope" in text
    sched = _plan("alibi", text, strict=False)
    assert not [p for p in sched.plans if p.kind == "attention_bwd"]
    assert any("dS is also read by" in n for n in sched.fusion.notes), sched.fusion.notes
    with pytest.raises(KspecError, match="attention backward"):
        _plan("alibi", text)


def test_shipped_softcap_at_head_dim_256_is_refused_with_the_reason():
    text = grad_program(load_spec(_softcap_text(256), is_text=True))
    sched = _plan("softcap", text, strict=False)
    assert any("attention backward" in n and "head dim 256" in n for n in sched.fusion.notes), sched.fusion.notes


# ---------------------------------------------------------------------------------------------
# FA4 is handed the generated functions; offline builds; the launch ABI
# ---------------------------------------------------------------------------------------------

@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_capture_hands_fa4_the_generated_score_mod_and_its_derivative(arch, tmp_path):
    from kspec.backends.cute import attention, attention_bwd, compat
    (p,) = _plan("softcap").plans
    desc = attention_bwd.lower(p.ir, arch)[0]
    (tmp_path / "entry.py").write_text(attention_bwd.entry_source(desc))
    with compat.fa4_target(arch, desc.sm_count):
        mod = attention._import_entry(tmp_path / "entry.py")
        cap = attention_bwd.capture(desc, mod)
    main = cap.objects[1]
    assert type(main).__name__ == MAIN[arch]
    assert main.score_mod is mod.kspec_score_mod and main.score_mod_bwd is mod.kspec_score_mod_bwd


@pytest.fixture(scope="module")
def mod_artifacts(tmp_path_factory):
    return grad_artifacts(tmp_path_factory.mktemp("fa4bwdmods"), lambda stem: _grad_text(stem, WRT[stem]),
                          lambda stem: f"attention_{stem}_bwd")


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", STEMS)
def test_backward_with_a_mod_builds_three_fa4_kernels_per_arch_with_tensor_core_sass(mod_artifacts, stem):
    import kspec
    art = mod_artifacts(stem)
    (plan,) = kspec.load(art)[f"attention_{stem}_bwd"].entry.plans
    assert plan.args[-1] == (AUX[stem][0] if AUX[stem] else "dV")
    check_fa4_bwd_binaries(art, plan)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", STEMS)
@pytest.mark.parametrize("arch, cc, sms", FAKE_ARCHS)
def test_the_main_kernel_is_launched_with_the_mods_aux_tensor_and_scalar(mod_artifacts, stem, arch, cc, sms):
    import kspec
    mod = kspec.load(mod_artifacts(stem))
    (plan,) = mod[f"attention_{stem}_bwd"].entry.plans
    b = plan.binaries[arch]
    B, H, S = 2, 3, 300
    call, problems, _fake = fa4_fake_call(mod, f"attention_{stem}_bwd", {"B": B, "H": H, "S": S, "T": S}, cc, sms, arch,
                                   params={"scale": 0.0771, **({"cap": 37.25} if stem == "softcap" else {})})
    assert problems == [], problems
    assert [r.symbol for r in call.launches] == [v.symbol for v in b.variants]
    pre, main, post = call.plan_args
    names = [a.name for a in main]
    assert names[7:9] == ["dK", "dV"]
    if AUX[stem]:
        aux, shape = AUX[stem]
        assert names[9:] == [aux] and main[9].shape == shape(B, H, S)
        assert aux not in [a.name for a in pre + post]
    else:
        assert len(names) == 9
    # the values reach the main kernel's parameters: the softcap's cap (the mods' aux_scalars[0]) and
    # ALiBi's slope (the bias's) pointer (aux_tensors[0]) in the main kernel's only
    pre_r, main_r, post_r = call.launches
    if stem == "softcap":
        cap = struct.pack("<f", 37.25)
        assert cap in main_r.params and cap not in pre_r.params and cap not in post_r.params
        assert sorted(main_r.prepare.scalars) == pytest.approx(sorted([0.0771, 37.25]))
    else:
        ptr = struct.pack("<Q", main[9].ptr)
        assert ptr in main_r.params and ptr not in pre_r.params and ptr not in post_r.params
    assert struct.pack("<f", 0.0771) in main_r.params
