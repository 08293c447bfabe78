"""`logsumexp(j) X`: the language (parse, print, located errors), the numpy reference against float64
numpy written here, fusion (a logsumexp of the attention softmax's operand joins the attention as
its LSE output; one of anything else does not, and still runs), and the generic loop kernel run on
the CPU."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import kspec
from kspec.numerics import storage_dtype
from kspec.compile import emit_spec, plan_spec
from kspec.compiler import build_graph, op
from kspec.core import NoBackendError
from kspec.spec_lang import load_spec, parse, print_program

from conftest import needs_fa4
from test_spec_errors import assert_error

SPECS = Path(__file__).resolve().parent.parent / "specs"


def _lse64(x: np.ndarray, axes) -> np.ndarray:
    """log(sum(exp(x))) over `axes` in float64, the max shift written out: -inf where every entry is
    -inf (or there are none)."""
    x = np.asarray(x, dtype=np.float64)
    axes = tuple(axes)
    m = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    shift = np.where(np.isfinite(m), m, 0.0)
    s = np.sum(np.exp(x - shift), axis=axes, keepdims=True)
    with np.errstate(divide="ignore"):
        out = np.log(s) + shift
    return np.squeeze(out, axis=axes)


ROW = """kernel k {
  in x : bf16[M, N]
  out L : f32[M]
  L[m] = logsumexp(n) x[m, n]
}
"""


# ---------------------------------------------------------------- language

def test_parses_prints_and_types_as_an_f32_reduction():
    prog = load_spec(ROW, is_text=True)
    (st,) = prog.kernels[0].stmts
    assert (st.value.op, st.value.indices, st.value.dtype, st.value.free) == ("logsumexp", ("n",), "f32", ("m",))
    text = "kernel k {\n  in x : f16[M, N, C]\n  out L : f32[M]\n  L[m] = logsumexp(n, c) x[m, n, c] * 0.5 + 1.0\n}\n"
    assert print_program(parse(text)) == text
    assert parse(print_program(parse(text))) == parse(text)
    # the reduction applies to the whole product: the scale is inside, the + 1.0 outside
    g = build_graph(load_spec(text, is_text=True).kernels[0])
    (red,) = [n for n in g if op(g, n).kind == "reduction"]
    assert op(g, red).label() == "reduction logsumexp(n, c)[m] : f32"
    assert [op(g, s).fn for s in g.successors(red)] == ["add"]


HEAD = "kernel k {\n  in x : f32[M, N]\n  in q : i32[M, N]\n  out L : f32[M]\n"


@pytest.mark.parametrize("stmt, line, col, message, hint", [
    ("  L[m] = logsumexp(n) q[m, n]\n", 5, 23, "logsumexp needs a floating-point operand, got i32",
     "convert first: `logsumexp(n) f32(q[m, n])`"),
    ("  L[m] = logsumexp(k) x[m, n]\n", 5, 20, "'logsumexp(k)' reduces over 'k', which its operand does not use",
     "indices of the operand: m, n"),
    ("  L[m] = logsumexp(n, n) x[m, n]\n", 5, 23, "'logsumexp' lists index 'n' twice", None),
    ("  L[m] = logsumexp(n, causal=m) x[m, n]\n", 5, 23, "'logsumexp' takes no options", None),
    ("  L[m] = logsumexp(n) (x[m, n] > 0.0)\n", 5, 24, "'logsumexp' needs a number, got a condition",
     "choose values with where: `where(x[m, n] > 0.0, 1.0, 0.0)`"),
])
def test_misuse_is_a_located_error(stmt, line, col, message, hint):
    assert_error(HEAD + stmt + "}\n", line, col, message, hint)


def test_syntax_misuse_is_located_at_the_reduction():
    e = assert_error(HEAD + "  L[m] = logsumexp(n)\n}\n", 5, 10,
                     "'logsumexp(...)' is a reduction and must be followed by the expression it reduces", n_errors=None)
    assert "logsumexp(k) A[m, k] * B[k, n]" in e.hint
    assert_error("kernel k {\n  in logsumexp : f32[M]\n}\n", 2, 6,
                 "'logsumexp' is a reserved word and cannot be used as a name", n_errors=None)


# ---------------------------------------------------------------- reference

def test_reference_matches_float64_with_masked_rows_and_inf_entries():
    x = (np.random.default_rng(0).standard_normal((6, 37)) * 6).astype(np.float32)
    x[1] = -np.inf                      # a fully masked row
    x[2, ::2] = -np.inf                 # masked entries drop out
    x[3, 4] = 95.0                      # exp(95) overflows f32: only the max shift keeps it finite
    xs = x.astype(storage_dtype("bf16"))
    got = kspec.reference(ROW)(x=xs)["L"]
    want = _lse64(xs.astype(np.float64), (1,))
    assert got.dtype == np.float32 and got[1] == -np.inf and np.isfinite(got[3])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    # +inf wins, NaN propagates, an empty axis is -inf
    y = np.zeros((3, 4), np.float32)
    y[0, 1], y[1, 2] = np.inf, np.nan
    r = kspec.reference(ROW.replace("bf16", "f32"))
    out = r(x=y)["L"]
    assert out[0] == np.inf and np.isnan(out[1]) and out[2] == pytest.approx(math.log(4.0))
    assert (r(x=np.zeros((2, 0), np.float32))["L"] == -np.inf).all()


def test_reference_over_several_axes_and_a_scaled_operand():
    src = "kernel k {\n  in x : f16[M, N, C]\n  out L : f32[M]\n  L[m] = logsumexp(n, c) f32(x[m, n, c]) * 0.5\n}\n"
    x = np.random.default_rng(1).standard_normal((3, 5, 7)).astype(np.float16)
    x[0] = -np.inf
    got = kspec.reference(src)(x=x)["L"]
    np.testing.assert_allclose(got, _lse64(x.astype(np.float64) * 0.5, (1, 2)), rtol=2e-6, atol=1e-6)


def test_over_a_packed_axis_absent_positions_take_no_part():
    """Varlen: sequence b's positions j >= its length do not exist; an empty sequence gives -inf."""
    src = """kernel v {
  in cu : i32[B + 1]
  in x : f32[B, T, 4] packed(cu)
  out L : f32[B, 4]
  L[b, c] = logsumexp(j) x[b, j, c]
}
"""
    cu = np.array([0, 3, 3, 8], np.int32)
    x = np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32)
    got = kspec.reference(src)(cu=cu, x=x)["L"]
    want = np.stack([_lse64(x[cu[b]:cu[b + 1]], (0,)) for b in range(3)])
    assert (got[1] == -np.inf).all()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


# ---------------------------------------------------------------- fusion and planning

ATTN = """kernel a {{
  param scale : f32 = 0.125
  in  Q : bf16[B, H, S, 64]
  in  K : bf16[B, H, T, 64]
  in  V : bf16[B, H, T, 64]
  out O : bf16[B, H, S, 64]
  out L : {ldt}[B, H, S]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h, j, e]
  m[b, h, i, j] = where(j <= i + (T - S), s[b, h, i, j], -inf)
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h, j, e]
  L[b, h, i] = logsumexp(j) {lse_of}[b, h, i, j]
}}
"""


def _plans(src: str, archs=("sm90a", "sm100a")):
    prog = load_spec(src, is_text=True)
    (sched,) = plan_spec(prog, archs)
    return prog, sched


@needs_fa4
def test_logsumexp_of_the_softmax_operand_joins_the_attention():
    _, sched = _plans(ATTN.format(ldt="f32", lse_of="m"))
    (p,) = sched.plans
    a = p.ir.attention
    assert p.kind == "attention" and a.lse == "L" and a.out_buffers == ("O",)
    assert a.mask is not None                                   # bottom-right causal, lifted
    assert [o.fn for o in p.ir.ops if o.kind == "reduction"] == ["logsumexp"]
    assert {b for _, b, _ in p.ir.stores} == {"O", "L"}
    # a written `softmax(j)` of the scores with no mods: the scale's node is read by both
    plain = ATTN.format(ldt="f32", lse_of="s").replace("where(j <= i + (T - S), s[b, h, i, j], -inf)", "s[b, h, i, j]")
    (p,) = _plans(plain)[1].plans
    assert p.kind == "attention" and p.ir.attention.lse == "L" and p.ir.attention.mask is None


@pytest.mark.parametrize("ldt, lse_of, note", [
    ("f32", "s", "the score matrix (s) is used elsewhere"),          # the unmasked scores
    ("bf16", "m", "log-sum-exp not fused: the log-sum-exp it can write is an f32 output over [b, h, i]"),
])
def test_logsumexp_of_anything_else_stays_a_kernel_of_its_own_and_runs(ldt, lse_of, note):
    src = ATTN.format(ldt=ldt, lse_of=lse_of)
    prog = load_spec(src, is_text=True)
    try:
        prog, sched = _plans(src)
    except NoBackendError as e:
        # unfused, the causal mask (index arithmetic) is a kernel of its own; a backend that cannot
        # build it says so when planning, at the mask, rather than when compiling
        assert "cannot run a" in str(e) and "index" in str(e) and e.span.line == 9, e
        sched = None
    if sched is not None:
        kinds = [p.kind for p in sched.plans]
        assert "attention" not in kinds
        assert any(note in n for n in sched.fusion.notes), sched.fusion.notes
        (lse_plan,) = [p for p in sched.plans if any(o.fn == "logsumexp" for o in p.ir.ops)]
        for arch in ("sm90a", "sm100a"):
            assert lse_plan.choices[arch].backend in ("rowwise", "generic")
    # the reference runs it, fused plan or not, against float64
    rng = np.random.default_rng(2)
    B, H, S, T = 1, 2, 3, 5
    q, k, v = (rng.standard_normal((B, H, n, 64)).astype(storage_dtype("bf16")) for n in (S, T, T))
    out = kspec.reference(prog)(Q=q, K=k, V=v)
    s64 = 0.125 * np.einsum("bhie,bhje->bhij", q.astype(np.float64), k.astype(np.float64))
    if lse_of == "m":
        keep = np.arange(T)[None, :] <= np.arange(S)[:, None] + (T - S)
        s64 = np.where(keep, s64, -np.inf)
    tol = 1e-2 if ldt == "bf16" else 1e-4
    np.testing.assert_allclose(out["L"].astype(np.float64), _lse64(s64, (3,)), rtol=tol, atol=tol)


def test_causal_flag_softmax_does_not_take_the_logsumexp_of_its_unmasked_operand():
    src = ATTN.format(ldt="f32", lse_of="s").replace("T, 64]", "S, 64]").replace(
        "p[b, h, i, j] = softmax(j) m[b, h, i, j]", "p[b, h, i, j] = softmax(j, causal=i) s[b, h, i, j]").replace(
        "  m[b, h, i, j] = where(j <= i + (T - S), s[b, h, i, j], -inf)\n", "")
    _, sched = _plans(src)
    assert "attention" not in [p.kind for p in sched.plans]
    assert any("of the scores of a `causal=` softmax is over the unmasked scores" in n for n in sched.fusion.notes)


@needs_fa4
def test_graph_and_lower_show_it(capsys):
    from kspec.cli import main
    assert main(["lower", str(SPECS / "attention_lse.kspec")]) == 0
    out = capsys.readouterr().out
    assert "lse -> L" in out and "reduction logsumexp(j)[b, h, i] : f32" in out and "lse=yes" in out
    assert out.count("kernel attention_lse_0 : attention") == 1
    assert main(["graph", str(SPECS / "attention_lse.kspec")]) == 0
    out = capsys.readouterr().out
    assert "1 fused kernel" in out and "scores stay on chip; log-sum-exp -> L" in out


@needs_fa4
def test_every_backend_implements_or_declines_it():
    from kspec.backends import registry
    _, sched = _plans(ATTN.format(ldt="f32", lse_of="m"))
    (p,) = sched.plans
    for arch in ("sm90a", "sm100a"):
        reasons = {b.name: b.can_implement(p.ir, arch) for b in registry.backends()}
        assert reasons["cute"] is None
        assert reasons["cutlass"] and "log-sum-exp" in reasons["cutlass"]


# ---------------------------------------------------------------- the generic loop kernel, on the CPU


def test_generic_loop_kernel_computes_it_on_the_cpu(tmp_path):
    """logsumexp over two axes is no row kernel: the generic backend's loop kernel, whose generated
    text is compiled with g++ against the CPU emulation of CUDA (tests/generic_emu.py) and run here."""
    from generic_emu import emulate
    src = "kernel k {\n  in x : f16[M, N, C]\n  out L : f32[M]\n  L[m] = logsumexp(n, c) f32(x[m, n, c]) * 0.5\n}\n"
    path = tmp_path / "k.kspec"
    path.write_text(src)
    em = emit_spec(path, ("sm90a",))
    ((ep,),) = em.plans.values()
    assert ep.lowered.backend == "generic"
    x = (np.random.default_rng(4).standard_normal((5, 6, 7)) * 3).astype(np.float16)
    x[1] = -np.inf
    x[2, :, ::2] = -np.inf
    x[3, 0, 0] = 200.0                  # 0.5 * 200: exp(100) overflows f32 without the max shift
    L = np.full(5, np.nan, np.float32)
    emulate(ep, {"M": 5, "N": 6, "C": 7}, None, tmp_path, given={"x": x, "L": L})
    want = _lse64(x.astype(np.float64) * 0.5, (1, 2))
    assert L[1] == -np.inf and np.isfinite(L[3])
    np.testing.assert_allclose(L, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kspec.reference(load_spec(src, is_text=True))(x=x)["L"], want, rtol=1e-5, atol=1e-5)
