"""`kspec grad` (spec_lang/grad.py): the derived backward of every shipped spec with float inputs,
run through the numpy reference, against torch.autograd of an independent torch implementation
written here (float64 data); the spec as shipped (f16/bf16/fp8/tf32 roundings, loose tolerance)
and with every float dtype made f32 (tight tolerance, which checks the calculus itself); the
generated text round-trips through the printer; located errors for what cannot be differentiated."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kspec
from kspec.numerics import to_storage
from kspec.spec_lang import KspecError, load_spec, parse, print_program
from kspec.core import split_quotient_dim
from kspec.spec_lang.grad import NO_GRADIENT_STORAGE, grad_program

torch = pytest.importorskip("torch", reason="torch (CPU is enough) is needed for torch.autograd")

SPECS = Path(__file__).resolve().parent.parent / "specs"
ROOT = SPECS.parent
F = torch.nn.functional


def _sdpa(Q, K, V, scale, mask=None, mod=None, bias=None):
    """Attention in float64: softmax over keys of the (modified, masked) scores; a fully masked
    row gives 0 (as the spec's softmax does)."""
    s = scale * torch.einsum("bhie,bhje->bhij", Q, K)
    if mod is not None:
        s = mod(s)
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("bhij,bhje->bhie", p, V), s


def _causal(S, T, offset=0):
    i = torch.arange(S)[:, None]
    j = torch.arange(T)[None, :]
    return j <= i + offset


def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


# spec -> (sizes, params used by the test, integer inputs, torch implementation)
def _attn(p, t):
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"])[0]}


def _attn_causal(p, t):
    S = t["Q"].shape[2]
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"], _causal(S, S))[0]}


def _attn_alibi(p, t):
    S = t["Q"].shape[2]
    dist = (torch.arange(S)[None, :] - torch.arange(S)[:, None]).double()
    bias = t["slope"][None, :, None, None] * dist
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"], _causal(S, S), bias=bias)[0]}


def _attn_bias(p, t):
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"], bias=t["bias"])[0]}


def _attn_decode(p, t):
    S, T = t["Q"].shape[2], t["K"].shape[2]
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"], _causal(S, T, T - S))[0]}


def _attn_gqa(p, t):
    K, V = (x.repeat_interleave(4, dim=1) for x in (t["K"], t["V"]))
    return {"O": _sdpa(t["Q"], K, V, p["scale"])[0]}


def _attn_lse(p, t):
    S = t["Q"].shape[2]
    O, s = _sdpa(t["Q"], t["K"], t["V"], p["scale"], _causal(S, S))
    return {"O": O, "L": torch.logsumexp(s, -1)}


def _attn_window(p, t):
    S = t["Q"].shape[2]
    mask = _causal(S, S) & (torch.arange(S)[None, :] > torch.arange(S)[:, None] - p["W"])
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"], mask)[0]}


def _attn_softcap(p, t):
    cap = p["cap"]
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"], mod=lambda s: cap * torch.tanh(s / cap))[0]}


def _attn_padded(p, t):
    S, T = t["Q"].shape[2], t["K"].shape[2]
    lq, lk = t["Lq"][:, None, None, None], t["Lk"][:, None, None, None]
    i = torch.arange(S)[None, None, :, None]
    j = torch.arange(T)[None, None, None, :]
    mask = (i < lq) & (j < lk) & (j <= i + (lk - lq))
    return {"O": _sdpa(t["Q"], t["K"], t["V"], p["scale"], mask)[0]}


def _attn_varlen(p, t):
    """Per sequence b (rows cu[b] .. cu[b + 1] - 1 of the packed [total, H, E] tensors): causal
    attention aligned bottom-right, j <= i + (T_b - S_b)."""
    cq, ck = t["cu_q"].tolist(), t["cu_k"].tolist()
    out = []
    for b in range(len(cq) - 1):
        q, k, v = (x[lo:hi].permute(1, 0, 2)[None] for x, lo, hi in
                   ((t["Q"], cq[b], cq[b + 1]), (t["K"], ck[b], ck[b + 1]), (t["V"], ck[b], ck[b + 1])))
        S, T = q.shape[2], k.shape[2]
        out.append(_sdpa(q, k, v, p["scale"], _causal(S, T, T - S))[0][0].permute(1, 0, 2))
    return {"O": torch.cat(out)}


def _moe_grouped(p, t):
    """Expert e's rows off[e] .. off[e + 1] - 1 of X go through W[e] (+ bias, silu), weighted by rw."""
    off = t["off"].tolist()
    ys = [t["rw"][lo:hi, None] * F.silu(t["X"][lo:hi] @ t["W"][e].T + t["bias"][e])
          for e, (lo, hi) in enumerate(zip(off, off[1:]))]
    return {"Y": torch.cat(ys)}


def _moe_gather(p, t):
    """Expert e's rows r gather token X[idx[r]], times W[e], weighted by rw[r]."""
    off = t["off"].tolist()
    ys = [t["rw"][lo:hi, None] * (t["X"][t["idx"][lo:hi]] @ t["W"][e].T)
          for e, (lo, hi) in enumerate(zip(off, off[1:]))]
    return {"Y": torch.cat(ys)}


def _cross_entropy(p, t):
    lg = t["logits"]
    return {"loss": torch.logsumexp(lg, -1) - lg.gather(1, t["label"][:, None].long())[:, 0]}


def _layernorm(p, t):
    return {"y": F.layer_norm(t["x"], t["x"].shape[-1:], t["gamma"], t["beta"], p["eps"])}


def _add_rmsnorm(p, t):
    h = t["x"] + t["res"]
    return {"h": h, "y": _rms(h, t["w"], p["eps"])}


def _gemm_rowmax(p, t):
    y = t["A"] @ t["B"] + t["bias"]
    return {"D": y, "rowmax": y.amax(-1)}


def _int8_dequant(p, t):
    return {"D": (t["A"] @ t["B"].T) * t["sa"][:, None] * t["sb"][None, :]}


def _fp8_amax(p, t):
    y = p["scale_a"] * p["scale_b"] * (t["A"] @ t["B"].T)
    return {"D": y, "amax": y.abs().amax().reshape(1)}


def _fp8_blockwise(p, t):
    sa = t["sa"].repeat_interleave(128, 1)                              # sa[m, k / 128]
    sb = t["sb"].repeat_interleave(128, 0).repeat_interleave(128, 1)    # sb[n / 128, k / 128]
    return {"D": (t["A"] * sa) @ (t["B"] * sb).T}


def _mxfp8(p, t):
    return {"D": (t["A"] * t["sa"].repeat_interleave(32, 1)) @ (t["B"] * t["sb"].repeat_interleave(32, 1)).T}


def _nvfp4(p, t):
    return {"D": p["alpha"] * ((t["A"] * t["sa"].repeat_interleave(16, 1)) @
                               (t["B"] * t["sb"].repeat_interleave(16, 1)).T)}


def _rope(p, t):
    q = t["Q"]
    rot = torch.cat([-q[..., 64:], q[..., :64]], -1)
    return {"Y": q * t["cos"][None, :, None, :] + rot * t["sin"][None, :, None, :]}


def _swiglu(p, t):
    X = t["X"]
    h = F.silu(X @ t["Wg"].T) * (X @ t["Wu"].T)
    return {"Y": h @ t["Wd"].T}


CASES = {
    "add_rmsnorm": (dict(M=5, N=16), {"eps": 1e-6}, {}, _add_rmsnorm),
    "attention": (dict(B=1, H=2, S=5, T=5), {"scale": 0.088}, {}, _attn),
    "attention_alibi": (dict(B=1, H=2, S=6), {"scale": 0.125}, {}, _attn_alibi),
    "attention_bias": (dict(B=1, H=2, S=5, T=6), {"scale": 0.088}, {}, _attn_bias),
    "attention_causal": (dict(B=2, H=2, S=6), {"scale": 0.125}, {}, _attn_causal),
    "attention_decode": (dict(B=1, H=2, S=3, T=7), {"scale": 0.088}, {}, _attn_decode),
    "attention_gqa": (dict(B=1, H=8, KH=2, S=4, T=5), {"scale": 0.088}, {}, _attn_gqa),
    "attention_lse": (dict(B=1, H=2, S=6), {"scale": 0.088}, {}, _attn_lse),
    "attention_sliding_window": (dict(B=1, H=2, S=7), {"scale": 0.102, "W": 3}, {}, _attn_window),
    "attention_softcap": (dict(B=1, H=1, S=4, T=5), {"scale": 0.0625, "cap": 1.5}, {}, _attn_softcap),
    # packed: sequence lengths 3, 0, 5 (queries) and 4, 2, 5 (keys); a sequence with no query row
    "attention_varlen": (dict(B=3, H=2), {"scale": 0.088},
                         {"cu_q": np.array([0, 3, 3, 8]), "cu_k": np.array([0, 4, 6, 11])}, _attn_varlen),
    "attention_varlen_padded": (dict(B=2, H=1, S=5, T=6), {"scale": 0.088},
                                {"Lq": np.array([5, 3]), "Lk": np.array([6, 2])}, _attn_padded),
    "batched_gemm": (dict(L=2, M=3, K=5, N=4), {}, {}, lambda p, t: {"C": t["A"] @ t["B"]}),
    "batched_gemm_shared_b": (dict(L=2, M=3, K=5, N=4), {}, {}, lambda p, t: {"C": t["A"] @ t["B"].T}),
    "cross_entropy": (dict(M=6, V=11), {}, {"label": np.array([0, 3, 10, 5, 5, 2])}, _cross_entropy),
    "fp8_gemm_cast_bias": (dict(M=4, K=8, N=5), {"scale_a": 1.0, "scale_b": 1.0}, {},
                           lambda p, t: {"D": p["scale_a"] * p["scale_b"] * (t["A"] @ t["B"].T) + t["bias"]}),
    "fp8_gemm_amax": (dict(M=4, K=8, N=5), {"scale_a": 0.5, "scale_b": 1.5}, {}, _fp8_amax),
    "fp8_gemm_blockwise": (dict(M=2, K=256, N=128), {}, {}, _fp8_blockwise),
    "gemm_int8_dequant": (dict(M=4, K=6, N=5), {}, {"A": np.arange(24).reshape(4, 6) % 11 - 5,
                                                    "B": np.arange(30).reshape(5, 6) % 7 - 3}, _int8_dequant),
    "moe_gather_gemm": (dict(E=3, N=5, D=6, F=4), {}, {"off": np.array([0, 2, 2, 6]),
                                                      "idx": np.array([4, 0, 1, 1, 3, 0])}, _moe_gather),
    "moe_grouped_gemm": (dict(E=3, D=6, F=4), {}, {"off": np.array([0, 3, 3, 7])}, _moe_grouped),
    "mxfp8_gemm": (dict(M=3, K=64, N=4), {}, {}, _mxfp8),
    "nvfp4_gemm": (dict(M=3, K=64, N=4), {"alpha": 0.75}, {}, _nvfp4),
    "fp8_gemm_scaled": (dict(M=4, K=8, N=5), {"scale_a": 1.0, "scale_b": 1.0}, {},
                        lambda p, t: {"D": p["scale_a"] * p["scale_b"] * (t["A"] @ t["B"])}),
    "gemm": (dict(M=4, K=6, N=5), {}, {}, lambda p, t: {"D": t["A"] @ t["B"]}),
    "gemm_bias_gelu_residual": (dict(M=4, K=6, N=5), {"alpha": 0.7}, {},
                                lambda p, t: {"D": F.gelu(p["alpha"] * (t["A"] @ t["B"]) + t["bias"]) + t["R"]}),
    "gemm_bias_relu": (dict(M=4, K=6, N=5), {}, {}, lambda p, t: {"D": F.relu(t["A"] @ t["B"] + t["bias"])}),
    "gemm_rowmax": (dict(M=4, K=6, N=5), {}, {}, _gemm_rowmax),
    "gemm_tf32": (dict(M=4, K=6, N=5), {}, {}, lambda p, t: {"D": t["A"] @ t["B"]}),
    "layernorm": (dict(M=5, N=16), {"eps": 1e-5}, {}, _layernorm),
    "linear_shared_weight": (dict(B=2, S=3, K=6, N=4), {}, {},
                             lambda p, t: {"Y": t["X"] @ t["W"].T + t["bias"]}),
    "masked_scores": (dict(B=2, S=3, T=4), {}, {},
                      lambda p, t: {"P": 0.125 * torch.einsum("bie,bje->bij", t["Q"], t["K"]) + t["mask"][:, None]}),
    "mlp2": (dict(M=4, K=6, F=7, N=5), {}, {},
             lambda p, t: {"Y": F.gelu(0.5 * t["X"] @ t["W1"].T, approximate="tanh") @ t["W2"].T}),
    "rmsnorm": (dict(M=5, N=16), {"eps": 1e-6}, {}, lambda p, t: {"y": _rms(t["x"], t["w"], p["eps"])}),
    "row_softmax": (dict(M=4, N=9), {}, {}, lambda p, t: {"y": torch.softmax(t["x"], -1)}),
    "rope": (dict(B=1, S=3, H=2), {}, {}, _rope),
    "swiglu_mlp": (dict(M=4, K=6, F=7, N=5), {}, {}, _swiglu),
}
# shipped specs kspec grad refuses, with the reason it gives
REFUSED = {
    "gemm_int8": "no floating-point input",
    "attention_paged": "used only as a value",
}
# tolerance (max |error| / max |gradient|) by the spec's least precise dtype
TOL = {"f32": 2e-5, "f16": 2e-2, "bf16": 6e-2, "tf32": 5e-3, "f8e4m3": 0.3, "f4e2m1": 0.4}
_LOW = re.compile(r"\b(bf16|f16|tf32|f8e4m3|f8e5m2|f4e2m1)\b")


def test_every_shipped_spec_is_covered():
    assert sorted(CASES) + sorted(REFUSED) and set(CASES) | set(REFUSED) == {p.stem for p in SPECS.glob("*.kspec")}


def _extent(d, sizes):
    """A declared dimension's size: a literal, a symbol, or an exact quotient such as `K/128`."""
    if isinstance(d, int):
        return d
    q = split_quotient_dim(d)
    return sizes[q[0]] // q[1] if q else sizes[d]


def _arrays(kernel, sizes, ints, rng):
    out = {}
    for t in kernel.inputs:
        if t.name in ints:
            out[t.name] = np.asarray(ints[t.name], dtype=np.int32)
            continue
        if t.packed is not None:           # [total rows, ...]: the sequences back to back
            shape = (int(ints[t.packed][-1]),) + tuple(_extent(d, sizes) for d in t.shape[2:])
        else:
            shape = tuple(_extent(d, sizes) for d in t.shape)
        # an E8M0 scale is a power of two (and gets no gradient: NO_GRADIENT_STORAGE)
        x = 2.0 ** rng.integers(-3, 4, shape) if t.dtype in NO_GRADIENT_STORAGE else rng.standard_normal(shape)
        if t.layout == "col":
            x = np.asfortranarray(x)
        out[t.name] = x
    return out


def _exact(x, dtype):
    """x as the reference stores it (rounded to dtype), in float64."""
    return np.asarray(to_storage(x, dtype)).astype(np.float64)


def run_grad(text: str, stem: str, case, seed=0):
    """(kspec gradients, torch gradients) for the spec text's kernel `stem`."""
    sizes, params, ints, fn = case
    prog = load_spec(text, is_text=True)
    k = prog.kernel(stem)
    g = load_spec(grad_program(prog, stem), is_text=True)
    fwd, bwd = kspec.reference(g, f"{stem}_fwd"), kspec.reference(g, f"{stem}_bwd")
    rng = np.random.default_rng(seed)
    xs = _arrays(k, sizes, ints, rng)
    fout = fwd(**xs, **params)
    douts = {}
    for t in k.outputs:
        douts["d" + t.name] = rng.standard_normal(np.shape(fout[t.name]))
    got = bwd(**xs, **{n: v for n, v in fout.items()}, **douts, **params)

    tens = {}
    for t in k.inputs:
        if t.name in ints:
            tens[t.name] = torch.tensor(xs[t.name].astype(np.int64))
        else:
            tens[t.name] = torch.tensor(_exact(xs[t.name], t.dtype), requires_grad=t.dtype not in NO_GRADIENT_STORAGE)
    outs = fn(params, tens)
    loss = sum((outs[t.name] * torch.tensor(_exact(douts["d" + t.name], t.dtype))).sum() for t in k.outputs)
    floats = [t for t in k.inputs if t.name not in ints and t.dtype not in NO_GRADIENT_STORAGE]
    want = torch.autograd.grad(loss, [tens[t.name] for t in floats], allow_unused=True)
    widest = max((t.dtype for t in k.tensors if t.dtype in TOL), key=TOL.__getitem__)
    return {t.name: (np.asarray(got["d" + t.name]).astype(np.float64),
                     np.zeros(tens[t.name].shape) if w is None else w.numpy(), widest)
            for t, w in zip(floats, want)}


def _check(pairs, tol_of):
    for name, (got, want, dtype) in pairs.items():
        assert got.shape == want.shape, name
        assert np.all(np.isfinite(got)), f"d{name} has non-finite values"
        scale = max(np.abs(want).max(), 1e-6)
        err = np.abs(got - want).max() / scale
        assert err <= tol_of(dtype), f"d{name}: relative error {err:.2e} > {tol_of(dtype):.0e}"


@pytest.mark.parametrize("stem", sorted(CASES))
def test_backward_f32_matches_torch_autograd(stem):
    """Every float dtype made f32: the derived backward equals torch.autograd to f32 rounding."""
    text = _LOW.sub("f32", (SPECS / f"{stem}.kspec").read_text())
    _check(run_grad(text, stem, CASES[stem]), lambda dt: TOL["f32"])


@pytest.mark.parametrize("stem", sorted(CASES))
def test_backward_as_shipped_matches_torch_autograd(stem):
    """The spec's own dtypes: the backward's roundings (16-bit GEMM operands, dX stored in X's
    dtype) stay within the dtype's tolerance of the exact gradient."""
    text = (SPECS / f"{stem}.kspec").read_text()
    _check(run_grad(text, stem, CASES[stem]), lambda dt: TOL[dt])


@pytest.mark.parametrize("stem", sorted(REFUSED))
def test_refused_specs_say_why(stem):
    with pytest.raises(KspecError, match=re.escape(REFUSED[stem])) as e:
        grad_program(load_spec(SPECS / f"{stem}.kspec"))
    assert e.value.span is not None


@pytest.mark.parametrize("stem", ["attention_causal", "layernorm", "cross_entropy", "swiglu_mlp", "mlp2"])
def test_generated_text_round_trips(stem):
    text = grad_program(load_spec(SPECS / f"{stem}.kspec"))
    assert print_program(parse(text)) == print_program(parse(print_program(parse(text))))
    g = load_spec(text, is_text=True)
    assert [k.name for k in g.kernels] == [f"{stem}_fwd", f"{stem}_bwd"]


def test_saved_and_recomputed_per_pattern():
    """Attention saves O and the LSE and recomputes P from them; a norm saves its row statistic;
    a GEMM epilogue's pre-activation is recomputed by a GEMM (its derivative in that GEMM's
    epilogue); cross-entropy's gather becomes a one-hot where, no gather of a gradient."""
    att = load_spec(grad_program(load_spec(SPECS / "attention_causal.kspec")), is_text=True)
    fwd, bwd = att.kernel("attention_causal_fwd"), att.kernel("attention_causal_bwd")
    assert [t.name for t in fwd.outputs] == ["O", "p_lse"]
    assert {t.name for t in bwd.inputs} >= {"Q", "K", "V", "O", "p_lse", "dO"}
    assert [t.name for t in bwd.outputs] == ["dQ", "dK", "dV"]
    text = grad_program(load_spec(SPECS / "attention_causal.kspec"))
    assert "p[b, h, i, j] : f32 = exp(p_in[b, h, i, j] - " in text          # P recomputed from the LSE
    assert "p_dsum[b, h, i] = sum(e) f32(dO[b, h, i, e]) * f32(O[b, h, i, e])" in text   # FA's dO·O
    assert "softmax" not in text.split("kernel attention_causal_bwd")[1]
    lse = grad_program(load_spec(SPECS / "attention_lse.kspec"))
    assert "p_lse" not in lse and "in L : f32[B, H, S]" in lse            # its own L is reused
    ln = load_spec(grad_program(load_spec(SPECS / "layernorm.kspec")), is_text=True)
    assert [t.name for t in ln.kernel("layernorm_fwd").outputs] == ["y", "mu", "var"]
    gg = grad_program(load_spec(SPECS / "gemm_bias_gelu_residual.kspec"))
    bwd_text = gg.split("kernel gemm_bias_gelu_residual_bwd")[1]
    assert "acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]" in bwd_text
    assert "dacc[m, n] : f16 = dh_z[m, n] * alpha" in bwd_text
    assert "dbias[n] = sum(m) dh_z[m, n]" in bwd_text
    ce = grad_program(load_spec(SPECS / "cross_entropy.kspec"))
    assert "where(label[m] == v, -dloss[m], 0.0)" in ce


def test_gqa_and_max_adjoints():
    """A read at K[b, h / 4, j, e] is adjoint to a sum over the query heads of each K/V head, taken
    after the per-head gradient (a batched GEMM); a max sends its gradient to the first arg-maximum
    only (ties included)."""
    text = grad_program(load_spec(SPECS / "attention_gqa.kspec"))
    assert "dK_part[b, h, j, e] = sum(i) ds_r[b, h, i, j] * Q[b, h, i, e]" in text, text
    assert "dK[b, kh, j, e] = sum(h) where(h / 4 == kh, dK_part[b, h, j, e], 0.0)" in text, text
    spec = """kernel m {
      in x : f32[M, N]
      out y : f32[M]
      y[m] = max(n) x[m, n]
    }"""
    g = load_spec(grad_program(load_spec(spec, is_text=True)), is_text=True)
    x = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    out = kspec.reference(g, "m_fwd")(x=x)
    dx = kspec.reference(g, "m_bwd")(x=x, y=out["y"], dy=np.array([2.0, 7.0]))["dx"]
    np.testing.assert_array_equal(dx, [[0, 2, 0, 0], [7, 0, 0, 0]])


ELEMENTWISE = {
    "gelu(x[m])": lambda x, y: F.gelu(x), "gelu_tanh(x[m])": lambda x, y: F.gelu(x, approximate="tanh"),
    "silu(x[m])": lambda x, y: F.silu(x), "sigmoid(x[m])": lambda x, y: torch.sigmoid(x),
    "tanh(x[m])": lambda x, y: torch.tanh(x), "exp(x[m])": lambda x, y: torch.exp(x),
    "log(abs(x[m]) + 0.5)": lambda x, y: torch.log(x.abs() + 0.5),
    "sqrt(abs(x[m]) + 0.5)": lambda x, y: torch.sqrt(x.abs() + 0.5),
    "rsqrt(abs(x[m]) + 0.5)": lambda x, y: torch.rsqrt(x.abs() + 0.5),
    "relu(x[m])": lambda x, y: F.relu(x), "clamp(x[m], -0.5, y[m])": lambda x, y: torch.minimum(
        torch.maximum(x, torch.tensor(-0.5, dtype=x.dtype)), y),
    "maximum(x[m], y[m])": lambda x, y: torch.maximum(x, y), "minimum(x[m], y[m])": lambda x, y: torch.minimum(x, y),
    "where(x[m] > 0.3, x[m] * y[m], -y[m])": lambda x, y: torch.where(x > 0.3, x * y, -y),
    "x[m] / y[m] - x[m] * x[m]": lambda x, y: x / y - x * x,
    "f32(bf16(x[m])) * 2.0": lambda x, y: x * 2.0,
}


@pytest.mark.parametrize("expr", sorted(ELEMENTWISE))
def test_elementwise_rules_match_torch(expr):
    spec = f"""kernel e {{
      in x : f32[M]
      in y : f32[M]
      out z : f32[M]
      z[m] = {expr}
    }}"""
    g = load_spec(grad_program(load_spec(spec, is_text=True)), is_text=True)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(64)
    y = np.abs(rng.standard_normal(64)) + 0.2
    x[:4] = [0.0, 1e-3, -2.5, 3.0]
    x32, y32 = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
    dz = rng.standard_normal(64)
    out = kspec.reference(g, "e_fwd")(x=x, y=y)
    got = kspec.reference(g, "e_bwd")(x=x, y=y, **out, dz=dz)
    tx, ty = torch.tensor(x32, requires_grad=True), torch.tensor(y32, requires_grad=True)
    wx, wy = torch.autograd.grad((ELEMENTWISE[expr](tx, ty) * torch.tensor(dz.astype(np.float32).astype(
        np.float64))).sum(), [tx, ty], allow_unused=True)
    for name, w in (("dx", wx), ("dy", wy)):
        if name not in got:
            assert w is None or not w.abs().max() > 0
            continue
        w = np.zeros(64) if w is None else w.numpy()
        np.testing.assert_allclose(got[name], w, rtol=2e-5, atol=2e-6, err_msg=f"{expr}: {name}")


def _assert_error(fn, message, line=None):
    with pytest.raises(KspecError, match=re.escape(message)) as e:
        fn()
    if line is not None:
        assert e.value.span is not None and e.value.span.line == line, e.value.render()
    return e.value


def test_located_errors():
    spec = load_spec(SPECS / "cross_entropy.kspec")
    e = _assert_error(lambda: grad_program(spec, wrt=["label"]), "an i32 input: integer inputs get no gradient", 5)
    assert "logits" in e.hint
    _assert_error(lambda: grad_program(spec, wrt=["logit"]), "not an input of kernel cross_entropy")
    _assert_error(lambda: grad_program(load_spec(SPECS / "layernorm.kspec"), wrt=["eps"]),
                  "scalar params get no gradient", 4)
    rounding = load_spec("""kernel r {
      in x : f32[M]
      in t : f32[N]
      out y : f32[M]
      y[m] = f32(i32(x[m] * 4.0)) + x[m]
    }""", is_text=True)
    _assert_error(lambda: grad_program(rounding), "not differentiable: i32(...)", 5)
    _assert_error(lambda: grad_program(rounding, wrt=["t"]), "input 't' does not reach any output", 3)
    clash = load_spec("""kernel c {
      in x : f32[M]
      in dx : f32[M]
      out y : f32[M]
      y[m] = x[m] * dx[m]
    }""", is_text=True)
    _assert_error(lambda: grad_program(clash), "already uses", 3)


@pytest.mark.parametrize("sub, n", [("(e + 3) % 8", 8), ("(e - 3) % 8", 8), ("(5 + e) % 8", 8), ("(e + 11) % 8", 8),
                                    ("(e + 0) % 8", 8)])
def test_rotated_reads_get_the_inverse_rotation_and_match_torch(sub, n):
    """A read at a rotation of an axis (`(e + c) % n` over all n values of e) is adjoint to a read
    of the gradient at the inverse rotation (no scatter-add); checked against torch.roll's autograd."""
    text = f"""kernel rot {{
  in  X : f32[M, {n}]
  in  w : f32[{n}]
  out Y : f32[M, {n}]
  Y[m, e] = X[m, {sub}] * w[e]
}}"""
    g = grad_program(load_spec(text, is_text=True), wrt=["X"])
    assert "sum(" not in g.split("kernel rot_bwd")[1]
    c = {"(e + 3) % 8": 3, "(e - 3) % 8": -3, "(5 + e) % 8": 5, "(e + 11) % 8": 11, "(e + 0) % 8": 0}[sub]
    rng = np.random.default_rng(3)
    X, w, dY = rng.standard_normal((4, n)), rng.standard_normal(n), rng.standard_normal((4, n))
    bwd = kspec.reference(load_spec(g, is_text=True), "rot_bwd")
    got = bwd(X=X, w=w, Y=np.zeros((4, n)), dY=dY)["dX"]
    tX = torch.tensor(X, requires_grad=True)
    Y = torch.roll(tX, -c, dims=1) * torch.tensor(w)            # Y[m, e] = X[m, (e + c) % n]
    Y.backward(torch.tensor(dY))
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), tX.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_a_rotation_that_is_not_a_bijection_keeps_the_scatter():
    """`(e + 1) % 4` over e in [0, 8) hits each column twice: not inverted, summed as a scatter-add."""
    text = """kernel rot {
  in  X : f32[M, 4]
  out Y : f32[M, 8]
  Y[m, e] = X[m, (e + 1) % 4]
}"""
    g = grad_program(load_spec(text, is_text=True), wrt=["X"])
    assert "sum(" in g.split("kernel rot_bwd")[1] and "==" in g.split("kernel rot_bwd")[1]


def test_wrt_restricts_the_gradients():
    text = grad_program(load_spec(SPECS / "swiglu_mlp.kspec"), wrt=["X", "Wd"])
    bwd = load_spec(text, is_text=True).kernel("swiglu_mlp_bwd")
    assert [t.name for t in bwd.outputs] == ["dX", "dWd"]


def test_cli_grad(tmp_path):
    out = tmp_path / "ln_grad.kspec"
    r = subprocess.run([sys.executable, "-m", "kspec", "grad", str(SPECS / "layernorm.kspec"), "-o", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert [k.name for k in load_spec(out).kernels] == ["layernorm_fwd", "layernorm_bwd"]
    bad = tmp_path / "bad.kspec"
    r = subprocess.run([sys.executable, "-m", "kspec", "grad", str(SPECS / "cross_entropy.kspec"), "--wrt", "label",
                        "-o", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "cross_entropy.kspec:5:" in r.stderr and "integer inputs" in r.stderr
    assert not bad.exists()


def test_e8m0_scales_get_no_gradient():
    """An E8M0 scale is an unsigned power-of-two exponent: d<scale> cannot be stored in it, so the default
    differentiates the data only, and asking for the scale is a located error."""
    prog = load_spec(SPECS / "mxfp8_gemm.kspec")
    bwd = load_spec(grad_program(prog), is_text=True).kernel("mxfp8_gemm_bwd")
    assert [t.name for t in bwd.outputs] == ["dA", "dB"]
    with pytest.raises(KspecError, match=r"--wrt names 'sa', an f8e8m0 input: an E8M0 scale is an unsigned "
                                         r"power-of-two exponent") as e:
        grad_program(prog, wrt=["sa"])
    assert e.value.span is not None
