"""The numpy reference backend against independent numpy code written here (float64 math, then
rounded to the declared dtype), fused and unfused schedules agreeing bit for bit, dtype handling
and argument errors."""
from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kspec.backends.reference import KspecReferenceError, ReferenceKernel, ReferenceModule, reference
from kspec.spec_lang import KspecError, load_spec
from kspec.core import KspecRuntimeError

SPECS = Path(__file__).resolve().parent.parent / "specs"
F16, BF16, E4M3 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
RTOL = {F16: 2e-3, BF16: 1.6e-2, np.dtype(np.float32): 1e-5}

_erf = np.vectorize(math.erf, otypes=[np.float64])


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def f64(x):
    return np.asarray(x).astype(np.float64)


def assert_close(got, want, dtype):
    """got (in `dtype`) matches the float64 `want` to a rounding of `dtype` (and of f32 sums)."""
    assert got.dtype == np.dtype(dtype)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(f64(got), want, rtol=RTOL[np.dtype(dtype)], atol=RTOL[np.dtype(dtype)] * scale * 1e-2)


def run_both(path_or_src, **args):
    """Run the fused and the unfused schedule; they must agree bit for bit."""
    a = reference(path_or_src)(**args)
    b = reference(path_or_src, fused=False)(**args)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert a[k].tobytes() == b[k].tobytes(), f"fused and unfused differ in {k}"
    return a


# ---------------------------------------------------------------- every shipped spec

def test_gemm():
    rng = np.random.default_rng(1)
    A, B = rand(rng, (33, 40), F16), rand(rng, (40, 17), F16)
    out = run_both(SPECS / "gemm.kspec", A=A, B=B)
    assert list(out) == ["D"]
    assert_close(out["D"], f64(A) @ f64(B), F16)


def test_gemm_bias_relu():
    rng = np.random.default_rng(2)
    A, B, bias = rand(rng, (32, 48), F16), rand(rng, (48, 24), F16), rand(rng, (24,), F16)
    out = run_both(SPECS / "gemm_bias_relu.kspec", A=A, B=B, bias=bias)
    want = np.maximum(f64(A) @ f64(B) + f64(bias)[None, :], 0.0)
    assert_close(out["D"], want, F16)
    assert (f64(out["D"]) >= 0).all() and (out["D"] == 0).any()


@pytest.mark.parametrize("alpha", [None, 0.75])
def test_gemm_bias_gelu_residual(alpha):
    rng = np.random.default_rng(3)
    A, B = rand(rng, (40, 64), F16, 0.3), rand(rng, (64, 24), F16, 0.3)
    bias, R = rand(rng, (24,), F16), rand(rng, (40, 24), F16)
    args = dict(A=A, B=B, bias=bias, R=R)
    if alpha is not None:
        args["alpha"] = alpha
    out = run_both(SPECS / "gemm_bias_gelu_residual.kspec", **args)
    x = (1.0 if alpha is None else alpha) * (f64(A) @ f64(B)) + f64(bias)[None, :]
    want = 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))) + f64(R)
    assert_close(out["D"], want, F16)


def test_gemm_rowmax():
    rng = np.random.default_rng(4)
    A, B = rand(rng, (24, 32), F16), rand(rng, (32, 40), F16)
    bias = rand(rng, (40,), np.float32)
    out = run_both(SPECS / "gemm_rowmax.kspec", A=A, B=B, bias=bias)
    y = f64(A) @ f64(B) + f64(bias)[None, :]
    assert_close(out["D"], y, F16)
    assert_close(out["rowmax"], y.max(axis=1), np.float32)
    assert out["rowmax"].shape == (24,)


def test_fp8_gemm_scaled():
    rng = np.random.default_rng(5)
    A, B = rand(rng, (16, 64), E4M3, 2.0), rand(rng, (64, 32), E4M3, 2.0)
    out = run_both(SPECS / "fp8_gemm_scaled.kspec", A=A, B=B, scale_a=0.5, scale_b=0.25)
    assert_close(out["D"], 0.125 * (f64(A) @ f64(B)), BF16)
    # defaults are 1.0
    out = reference(SPECS / "fp8_gemm_scaled.kspec")(A=A, B=B)
    assert_close(out["D"], f64(A) @ f64(B), BF16)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def test_mlp2():
    rng = np.random.default_rng(11)
    X, W1, W2 = rand(rng, (24, 40), F16, 0.5), rand(rng, (56, 40), F16, 0.3), rand(rng, (16, 56), F16, 0.3)
    out = run_both(SPECS / "mlp2.kspec", X=X, W1=W1, W2=W2)
    h = f64(_gelu_tanh(0.5 * (f64(X) @ f64(W1).T)).astype(F16))     # h is declared f16
    assert_close(out["Y"], h @ f64(W2).T, F16)


def test_swiglu_mlp():
    rng = np.random.default_rng(12)
    X = rand(rng, (20, 32), F16, 0.5)
    Wg, Wu, Wd = rand(rng, (48, 32), F16, 0.3), rand(rng, (48, 32), F16, 0.3), rand(rng, (24, 48), F16, 0.3)
    out = run_both(SPECS / "swiglu_mlp.kspec", X=X, Wg=Wg, Wu=Wu, Wd=Wd)
    g, u = f64(X) @ f64(Wg).T, f64(X) @ f64(Wu).T
    h = f64((g / (1 + np.exp(-g)) * u).astype(F16))
    assert_close(out["Y"], h @ f64(Wd).T, F16)


def test_linear_shared_weight():
    rng = np.random.default_rng(13)
    X, W, bias = rand(rng, (3, 10, 32), F16), rand(rng, (24, 32), F16, 0.3), rand(rng, (24,), F16)
    out = run_both(SPECS / "linear_shared_weight.kspec", X=X, W=W, bias=bias)
    want = np.einsum("bsk,nk->bsn", f64(X), f64(W)) + f64(bias)
    assert out["Y"].shape == (3, 10, 24)
    assert_close(out["Y"], want, F16)


def test_fp8_gemm_cast_bias():
    rng = np.random.default_rng(14)
    A, B, bias = rand(rng, (16, 64), E4M3, 2.0), rand(rng, (32, 64), E4M3, 2.0), rand(rng, (32,), BF16, 4.0)
    out = run_both(SPECS / "fp8_gemm_cast_bias.kspec", A=A, B=B, bias=bias, scale_a=0.5, scale_b=0.25)
    assert_close(out["D"], 0.125 * (f64(A) @ f64(B).T) + f64(bias), BF16)


def test_batched_gemm():
    rng = np.random.default_rng(6)
    A, B = rand(rng, (3, 20, 16), BF16), rand(rng, (3, 16, 12), BF16)
    out = run_both(SPECS / "batched_gemm.kspec", A=A, B=B)
    want = np.stack([f64(A[b]) @ f64(B[b]) for b in range(3)])
    assert_close(out["C"], want, BF16)


def test_batched_gemm_shared_b():
    rng = np.random.default_rng(23)
    A, B = rand(rng, (3, 20, 16), BF16), rand(rng, (12, 16), BF16)
    out = run_both(SPECS / "batched_gemm_shared_b.kspec", A=A, B=B)
    want = np.stack([f64(A[b]) @ f64(B).T for b in range(3)])
    assert_close(out["C"], want, BF16)


def test_masked_scores():
    rng = np.random.default_rng(29)
    Q, K = rand(rng, (3, 20, 64), F16), rand(rng, (3, 12, 64), F16)
    mask = np.where(rng.random((3, 12)) < 0.3, -1e4, 0.0).astype(np.float32)     # padded keys
    out = run_both(SPECS / "masked_scores.kspec", Q=Q, K=K, mask=mask)
    want = np.stack([0.125 * (f64(Q[b]) @ f64(K[b]).T) + f64(mask[b])[None, :] for b in range(3)])
    assert_close(out["P"], want, F16)


def naive_attention(Q, K, V, scale, causal):
    Q, K, V = f64(Q), f64(K), f64(V)
    Bn, H, S, _ = Q.shape
    T = K.shape[2]
    O = np.zeros(Q.shape[:3] + (V.shape[3],))
    for b in range(Bn):
        for h in range(H):
            for i in range(S):
                scores = [scale * float(Q[b, h, i] @ K[b, h, j]) for j in range(T)]
                if causal:
                    scores = [s if j <= i else -math.inf for j, s in enumerate(scores)]
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                tot = sum(w)
                O[b, h, i] = sum((w[j] / tot) * V[b, h, j] for j in range(T))
    return O


def test_attention():
    rng = np.random.default_rng(7)
    Q, K, V = rand(rng, (2, 2, 12, 128), F16), rand(rng, (2, 2, 20, 128), F16), rand(rng, (2, 2, 20, 128), F16)
    out = run_both(SPECS / "attention.kspec", Q=Q, K=K, V=V)
    assert_close(out["O"], naive_attention(Q, K, V, 0.08838834764831845, False), F16)
    out = reference(SPECS / "attention.kspec")(Q=Q, K=K, V=V, scale=0.3)
    assert_close(out["O"], naive_attention(Q, K, V, 0.3, False), F16)


def test_attention_causal():
    rng = np.random.default_rng(8)
    Q, K, V = (rand(rng, (1, 3, 16, 64), BF16) for _ in range(3))
    out = run_both(SPECS / "attention_causal.kspec", Q=Q, K=K, V=V)
    want = naive_attention(Q, K, V, 0.125, True)
    assert_close(out["O"], want, BF16)
    # the first query sees only the first key
    np.testing.assert_array_equal(out["O"][:, :, 0], V[:, :, 0])


def test_attention_lse():
    """O and the log-sum-exp of the masked scaled scores, natural log, in float64 written out here:
    L[b, h, i] = log(sum over kept j of exp(scale * q_i . k_j)); a fully masked row is -inf."""
    rng = np.random.default_rng(21)
    Q, K, V = (rand(rng, (2, 2, 9, 128), BF16) for _ in range(3))
    scale = 0.08838834764831845
    out = run_both(SPECS / "attention_lse.kspec", Q=Q, K=K, V=V)
    assert list(out) == ["O", "L"] and out["L"].dtype == np.float32 and out["L"].shape == (2, 2, 9)
    q, k = f64(Q), f64(K)
    L = np.empty((2, 2, 9))
    for b in range(2):
        for h in range(2):
            for i in range(9):
                s = [scale * float(q[b, h, i] @ k[b, h, j]) for j in range(i + 1)]      # causal: j <= i
                m = max(s)
                L[b, h, i] = m + math.log(sum(math.exp(x - m) for x in s))
    np.testing.assert_allclose(f64(out["L"]), L, rtol=1e-5, atol=1e-5)
    assert_close(out["O"], naive_attention(Q, K, V, scale, True), BF16)
    # the first query sees only the first key: its log-sum-exp is that one score
    np.testing.assert_allclose(f64(out["L"][:, :, 0]), scale * np.einsum("bhe,bhe->bh", q[:, :, 0], k[:, :, 0]),
                               rtol=1e-5, atol=1e-5)
    # a large scale: exp of the scores overflows f32, the max-shifted log-sum-exp does not
    big = reference(SPECS / "attention_lse.kspec")(Q=Q, K=K, V=V, scale=40.0)["L"]
    assert np.isfinite(big).all()


def test_attention_lse_fully_masked_rows_are_minus_inf():
    """A mask that keeps no key for some queries: L = -inf there and O = 0 (FlashAttention's
    convention); the rows that keep keys match float64."""
    src = (SPECS / "attention_lse.kspec").read_text().replace("where(j <= i,", "where(j <= i - 3,")
    rng = np.random.default_rng(22)
    Q, K, V = (rand(rng, (1, 2, 7, 128), BF16) for _ in range(3))
    out = run_both(src, Q=Q, K=K, V=V)
    assert (out["L"][:, :, :3] == -np.inf).all() and (f64(out["O"][:, :, :3]) == 0).all()
    s = 0.08838834764831845 * np.einsum("bhie,bhje->bhij", f64(Q), f64(K))
    keep = np.arange(7)[None, :] <= np.arange(7)[:, None] - 3
    s = np.where(keep, s, -np.inf)[:, :, 3:]
    m = s.max(-1, keepdims=True)
    want = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    np.testing.assert_allclose(f64(out["L"][:, :, 3:]), want, rtol=1e-5, atol=1e-5)


def sdpa64(Q, K, V, scale, *, group=1, bias=None, keep=None, cap=None):
    """Attention in float64, independently of kspec: K/V head h // group, scores scaled, then
    soft-capped, then biased, then masked (keep: True keeps); a fully masked row gives 0."""
    q, k, v = f64(Q), np.repeat(f64(K), group, axis=1), np.repeat(f64(V), group, axis=1)
    s = scale * np.einsum("bhie,bhje->bhij", q, k)
    if cap is not None:
        s = cap * np.tanh(s / cap)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    w = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    tot = w.sum(axis=-1, keepdims=True)
    p = np.divide(w, tot, out=np.zeros_like(w), where=tot > 0)
    return np.einsum("bhij,bhje->bhie", p, v)


def test_attention_gqa():
    rng = np.random.default_rng(31)
    Q = rand(rng, (2, 8, 5, 128), F16)
    K, V = rand(rng, (2, 2, 9, 128), F16), rand(rng, (2, 2, 9, 128), F16)
    out = run_both(SPECS / "attention_gqa.kspec", Q=Q, K=K, V=V)
    assert_close(out["O"], sdpa64(Q, K, V, 0.08838834764831845, group=4), F16)
    # multi-query attention: 4 query heads share one K/V head
    out = reference(SPECS / "attention_gqa.kspec")(Q=Q[:, :4], K=K[:, :1], V=V[:, :1])
    assert_close(out["O"], sdpa64(Q[:, :4], K[:, :1], V[:, :1], 0.08838834764831845, group=4), F16)
    # 7 heads in groups of 4 need a second K/V head: a clear error naming the subscript
    with pytest.raises(KspecError, match=r"subscript h / 4 of 'K' \(axis 1\) is 1 at b=0, h=4, .*size 1"):
        reference(SPECS / "attention_gqa.kspec")(Q=Q[:, :7], K=K[:, :1], V=V[:, :1])


def test_attention_gqa_with_a_param_group():
    """`h / G` with an i32 param G: the same function, G given at call time."""
    rng = np.random.default_rng(32)
    src = (SPECS / "attention_gqa.kspec").read_text().replace("h / 4", "h / G").replace(
        "  in  Q :", "  param G : i32 = 4\n  in  Q :")
    Q = rand(rng, (2, 6, 5, 128), F16)
    K, V = rand(rng, (2, 2, 9, 128), F16), rand(rng, (2, 2, 9, 128), F16)
    out = run_both(src, Q=Q, K=K, V=V, G=3)
    assert_close(out["O"], sdpa64(Q, K, V, 0.08838834764831845, group=3), F16)

def test_attention_alibi():
    rng = np.random.default_rng(32)
    Q, K, V = (rand(rng, (2, 4, 11, 64), BF16) for _ in range(3))
    slope = (2.0 ** -np.arange(1, 5)).astype(np.float32)
    out = run_both(SPECS / "attention_alibi.kspec", Q=Q, K=K, V=V, slope=slope)
    i, j = np.arange(11)[:, None], np.arange(11)[None, :]
    bias = slope[None, :, None, None].astype(np.float64) * (j - i)
    assert_close(out["O"], sdpa64(Q, K, V, 0.125, bias=bias, keep=j <= i), BF16)
    np.testing.assert_array_equal(out["O"][:, :, 0], V[:, :, 0])   # query 0 sees key 0 only


def test_attention_sliding_window():
    rng = np.random.default_rng(33)
    Q, K, V = (rand(rng, (1, 2, 13, 96), F16) for _ in range(3))
    i, j = np.arange(13)[:, None], np.arange(13)[None, :]
    for W in (1, 4, 100):
        out = run_both(SPECS / "attention_sliding_window.kspec", Q=Q, K=K, V=V, W=W)
        assert_close(out["O"], sdpa64(Q, K, V, 0.10206207261596575, keep=(j <= i) & (j > i - W)), F16)
    np.testing.assert_array_equal(reference(SPECS / "attention_sliding_window.kspec")(Q=Q, K=K, V=V, W=1)["O"], V)
    # an empty window masks every key of every row: fully masked rows give 0
    out = run_both(SPECS / "attention_sliding_window.kspec", Q=Q, K=K, V=V, W=0)
    assert not out["O"].any()


@pytest.mark.parametrize("bias_shape", [(2, 3, 6, 10), (3, 6, 10), (2, 1, 6, 10)])
def test_attention_bias(bias_shape):
    rng = np.random.default_rng(34)
    Q = rand(rng, (2, 3, 6, 128), BF16)
    K, V = rand(rng, (2, 3, 10, 128), BF16), rand(rng, (2, 3, 10, 128), BF16)
    bias = rand(rng, bias_shape, BF16, 2.0)
    full = np.broadcast_to(bias, (2, 3, 6, 10))
    if bias_shape == (2, 3, 6, 10):
        out = run_both(SPECS / "attention_bias.kspec", Q=Q, K=K, V=V, bias=bias)
    else:
        # the same spec with the bias shared across the batch (bias[h, i, j]) or the heads
        src = (SPECS / "attention_bias.kspec").read_text()
        decl, read = ("bias : bf16[H, S, T]", "bias[h, i, j]") if len(bias_shape) == 3 else \
            ("bias : bf16[B, 1, S, T]", "bias[b, 0, i, j]")
        src = src.replace("bias : bf16[B, H, S, T]", decl).replace("bias[b, h, i, j]", read)
        out = run_both(src, Q=Q, K=K, V=V, bias=bias)
    assert_close(out["O"], sdpa64(Q, K, V, 0.08838834764831845, bias=f64(full)), BF16)
    # a -inf bias masks: a row of -inf gives 0
    masked = np.array(full)
    masked[:, :, 2] = -np.inf
    out = reference(SPECS / "attention_bias.kspec")(Q=Q, K=K, V=V, bias=masked)
    assert not out["O"][:, :, 2].any()
    assert_close(out["O"], sdpa64(Q, K, V, 0.08838834764831845, bias=f64(masked)), BF16)


def test_attention_softcap():
    rng = np.random.default_rng(35)
    Q = rand(rng, (1, 2, 7, 256), F16, 3.0)
    K, V = rand(rng, (1, 2, 9, 256), F16, 3.0), rand(rng, (1, 2, 9, 256), F16)
    for cap in (50.0, 2.0):
        out = run_both(SPECS / "attention_softcap.kspec", Q=Q, K=K, V=V, cap=cap)
        assert_close(out["O"], sdpa64(Q, K, V, 0.0625, cap=cap), F16)


@pytest.mark.parametrize("S, T", [(1, 9), (3, 9), (5, 3)])
def test_attention_decode_is_bottom_right(S, T):
    rng = np.random.default_rng(36)
    Q = rand(rng, (2, 2, S, 128), BF16)
    K, V = rand(rng, (2, 2, T, 128), BF16), rand(rng, (2, 2, T, 128), BF16)
    out = run_both(SPECS / "attention_decode.kspec", Q=Q, K=K, V=V)
    i, j = np.arange(S)[:, None], np.arange(T)[None, :]
    keep = j <= i + (T - S)
    assert_close(out["O"], sdpa64(Q, K, V, 0.08838834764831845, keep=keep), BF16)
    if S == 1:                     # one new token sees the whole cache
        assert_close(out["O"], sdpa64(Q, K, V, 0.08838834764831845), BF16)
    if S > T:                      # the first S - T queries see no key at all: output 0
        assert not out["O"][:, :, :S - T].any() and out["O"][:, :, S - T:].all()


def paged_attention64(Q, Kc, Vc, bt, kv_len, scale):
    """Decoding over a paged KV cache in float64, independently of kspec: sequence b's keys are the
    first kv_len[b] rows of its pages bt[b, 0], bt[b, 1], ... in order; query i (of S, the newest
    tokens) sees keys j <= i + (kv_len[b] - S); a query that sees no key gives 0."""
    Q, Kc, Vc = f64(Q), f64(Kc), f64(Vc)
    Bn, H, S, _ = Q.shape
    P = Kc.shape[1]
    O = np.zeros(Q.shape[:3] + (Vc.shape[3],))
    for b in range(Bn):
        n = int(kv_len[b])
        rows = [(int(bt[b, j // P]), j % P) for j in range(n)]
        for h in range(H):
            K = np.array([Kc[pg, r, h] for pg, r in rows]).reshape(n, Kc.shape[3])
            V = np.array([Vc[pg, r, h] for pg, r in rows]).reshape(n, Vc.shape[3])
            for i in range(S):
                seen = [j for j in range(n) if j <= i + (n - S)]
                if not seen:
                    continue
                s = np.array([scale * float(Q[b, h, i] @ K[j]) for j in seen])
                w = np.exp(s - s.max())
                O[b, h, i] = (w / w.sum()) @ V[seen]
    return O


def test_attention_paged():
    rng = np.random.default_rng(41)
    Bn, H, S, P, MP, NP = 4, 2, 3, 4, 3, 14
    Q = rand(rng, (Bn, H, S, 128), BF16)
    Kc, Vc = rand(rng, (NP, P, H, 128), BF16), rand(rng, (NP, P, H, 128), BF16)
    bt = rng.permutation(NP)[:Bn * MP].reshape(Bn, MP).astype(np.int32)
    # a partly filled last page, a full table, a length-1 sequence (fewer keys than queries) and an
    # empty one (every query sees no key: output 0)
    kv_len = np.array([6, MP * P, 1, 0], np.int32)
    out = run_both(SPECS / "attention_paged.kspec", Q=Q, Kc=Kc, Vc=Vc, bt=bt, kv_len=kv_len)
    assert_close(out["O"], paged_attention64(Q, Kc, Vc, bt, kv_len, 0.08838834764831845), BF16)
    assert not out["O"][3].any() and not out["O"][2, :, :S - 1].any() and out["O"][2, :, S - 1].all()
    # pages past a sequence's length are never read: any valid page there gives the same output
    bt2 = bt.copy()
    bt2[0, 2] = bt[1, 0]
    again = reference(SPECS / "attention_paged.kspec")(Q=Q, Kc=Kc, Vc=Vc, bt=bt2, kv_len=kv_len)
    assert again["O"].tobytes() == out["O"].tobytes()


def test_attention_paged_block_table_out_of_range():
    rng = np.random.default_rng(42)
    Q = rand(rng, (1, 1, 1, 128), BF16)
    Kc, Vc = rand(rng, (2, 4, 1, 128), BF16), rand(rng, (2, 4, 1, 128), BF16)
    with pytest.raises(KspecRuntimeError, match=r"bt.* is 2 .*size 2"):
        reference(SPECS / "attention_paged.kspec")(Q=Q, Kc=Kc, Vc=Vc, bt=np.array([[0, 2]], np.int32),
                                                  kv_len=np.array([5], np.int32))


def varlen_attention64(Q, K, V, cu_q, cu_k, scale):
    """Causal attention over a packed (varlen) batch in float64, independently of kspec: sequence b
    is rows cu[b] .. cu[b + 1] - 1; query i of a sequence of S queries and T keys sees keys
    j <= i + (T - S) (bottom-right); a query that sees no key gives 0."""
    Q, K, V = f64(Q), f64(K), f64(V)
    O = np.zeros(Q.shape[:2] + (V.shape[2],))
    for b in range(len(cu_q) - 1):
        q0, S, k0, T = cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]
        for h in range(Q.shape[1]):
            for i in range(S):
                seen = [j for j in range(T) if j <= i + (T - S)]
                if seen:
                    s = np.array([scale * float(Q[q0 + i, h] @ K[k0 + j, h]) for j in seen])
                    w = np.exp(s - s.max())
                    O[q0 + i, h] = (w / w.sum()) @ V[[k0 + j for j in seen], h]
    return O


def test_attention_varlen():
    rng = np.random.default_rng(43)
    # a length-0 and a length-1 sequence, more queries than keys, more keys than queries
    lq, lk = [3, 0, 1, 6, 2], [5, 2, 0, 4, 2]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    Q = rand(rng, (cu_q[-1], 2, 128), BF16)
    K, V = rand(rng, (cu_k[-1], 2, 128), BF16), rand(rng, (cu_k[-1], 2, 128), BF16)
    out = run_both(SPECS / "attention_varlen.kspec", cu_q=cu_q, cu_k=cu_k, Q=Q, K=K, V=V)
    assert out["O"].shape == Q.shape                      # present rows only, packed like Q
    assert_close(out["O"], varlen_attention64(Q, K, V, cu_q, cu_k, 0.08838834764831845), BF16)
    # rows of other sequences never mix in: changing sequence 3's keys leaves the others alone
    K2 = K.copy()
    K2[cu_k[3]:cu_k[4]] = 0
    again = reference(SPECS / "attention_varlen.kspec")(cu_q=cu_q, cu_k=cu_k, Q=Q, K=K2, V=V)["O"]
    rows = np.r_[cu_q[0]:cu_q[3], cu_q[4]:cu_q[5]]
    assert again[rows].tobytes() == out["O"][rows].tobytes()


@pytest.mark.parametrize("cu, message", [
    ([0, 3, 2, 9], r"cu_q\[2\] = 2 is less than cu_q\[1\] = 3"),
    ([0, 3, 5, 8], r"last offset cu_q\[3\] = 8 must be the row count of 'Q', 9"),
    ([0, 3, 5, 10], r"cu_q\[3\] = 10 is outside the 9 rows of 'Q'"),
    ([0, 3, 9], r"'cu_k': 4 offsets mean B = 3, but B = 2 from argument 'cu_q'"),
])
def test_attention_varlen_refuses_bad_offsets(cu, message):
    rng = np.random.default_rng(44)
    cu_k = np.array([0, 2, 4, 6], np.int32)
    args = dict(cu_q=np.array(cu, np.int32), cu_k=cu_k, Q=rand(rng, (9, 1, 128), BF16),
                K=rand(rng, (6, 1, 128), BF16), V=rand(rng, (6, 1, 128), BF16))
    with pytest.raises(KspecReferenceError, match=message):
        reference(SPECS / "attention_varlen.kspec")(**args)


def test_attention_varlen_padded_per_sequence():
    rng = np.random.default_rng(37)
    S, T = 5, 7
    Q = rand(rng, (4, 2, S, 128), F16)
    K, V = rand(rng, (4, 2, T, 128), F16), rand(rng, (4, 2, T, 128), F16)
    Lq, Lk = np.array([5, 1, 0, 3], dtype=np.int32), np.array([7, 3, 2, 2], dtype=np.int32)
    out = run_both(SPECS / "attention_varlen_padded.kspec", Q=Q, K=K, V=V, Lq=Lq, Lk=Lk)["O"]
    for b in range(4):
        # each sequence on its own: its Lq queries against its Lk keys, causal bottom-right
        q, k = Lq[b], Lk[b]
        i, j = np.arange(q)[:, None], np.arange(k)[None, :]
        want = sdpa64(Q[b:b + 1, :, :q], K[b:b + 1, :, :k], V[b:b + 1, :, :k], 0.08838834764831845,
                      keep=j <= i + (k - q))
        if q:
            assert_close(out[b:b + 1, :, :q], want, F16)
        assert not out[b, :, q:].any()          # padding slots (and queries that see no key) give 0
    assert not out[3, :, 0].any()               # 3 queries, 2 keys: the first query sees none


def test_gemm_int8_is_exact():
    rng = np.random.default_rng(21)
    A = rng.integers(-128, 128, (9, 257)).astype(np.int8)
    B = rng.integers(-128, 128, (257, 12)).astype(np.int8)
    out = run_both(SPECS / "gemm_int8.kspec", A=A, B=B)
    assert out["D"].dtype == np.int32
    np.testing.assert_array_equal(out["D"], A.astype(np.int64) @ B.astype(np.int64))


def test_gemm_tf32_rounds_operands_to_tf32():
    rng = np.random.default_rng(22)
    A = rng.standard_normal((7, 65)).astype(np.float32)
    B = rng.standard_normal((65, 9)).astype(np.float32)
    out = run_both(SPECS / "gemm_tf32.kspec", A=A, B=B)

    def tf32(x):            # round to nearest even at 10 mantissa bits, independently of kspec
        bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    want = tf32(A) @ tf32(B)
    np.testing.assert_allclose(out["D"].astype(np.float64), want, rtol=1e-5, atol=1e-5)
    # (and not the unrounded f32 product at this size: the rounding is what tf32 means)
    assert np.abs(f64(A) @ f64(B) - want).max() > 1e-4


def test_rope_rotates_each_half_by_the_position_angles():
    """specs/rope.kspec against an independent float64 rotate-half (the generated kernel's own text:
    tests/test_generic_gather.py)."""
    rng = np.random.default_rng(23)
    B, S, H = 2, 5, 3
    q = rand(rng, (B, S, H, 128), BF16)
    ang = np.arange(S)[:, None] * 10000.0 ** (-np.arange(64) / 64)[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1).astype(np.float32)
    sin = np.concatenate([np.sin(ang)] * 2, -1).astype(np.float32)
    out = run_both(SPECS / "rope.kspec", Q=q, cos=cos, sin=sin)
    x = f64(q)
    c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    want = np.concatenate([x[..., :64] * c - x[..., 64:] * s, x[..., 64:] * c + x[..., :64] * s], -1)
    assert out["Y"].dtype == BF16
    np.testing.assert_allclose(f64(out["Y"]), want, rtol=2 ** -7, atol=2 ** -7)


# shipped specs whose reference tests live in tests/test_quant_gemm.py
QUANT_TESTED = {"gemm_int8_dequant", "fp8_gemm_amax", "fp8_gemm_blockwise", "moe_grouped_gemm",
                "moe_gather_gemm", "mxfp8_gemm", "nvfp4_gemm"}


def test_every_shipped_spec_has_a_reference_test():
    tested = {"gemm", "gemm_bias_relu", "gemm_bias_gelu_residual", "gemm_rowmax", "fp8_gemm_scaled",
              "batched_gemm", "attention", "attention_causal", "mlp2", "swiglu_mlp", "linear_shared_weight",
              "fp8_gemm_cast_bias", "gemm_int8", "gemm_tf32", "batched_gemm_shared_b", "masked_scores",
              "attention_gqa", "attention_alibi", "attention_sliding_window", "attention_bias",
              "attention_softcap", "attention_decode", "attention_paged", "attention_varlen",
              "attention_varlen_padded", "attention_lse",
              # row kernels: tests/test_rowwise.py (against float64, odd lengths, strided rows)
              "layernorm", "rmsnorm", "add_rmsnorm", "row_softmax", "cross_entropy", "rope",
              # quantized GEMMs: tests/test_quant_gemm.py (against float64 numpy)
              *QUANT_TESTED}
    assert {p.stem for p in SPECS.glob("*.kspec")} == tested


# ---------------------------------------------------------------- other kernels

def test_transposed_outputs_and_copies():
    src = """kernel t {
  in A : f16[M, K]
  in B : f16[K, N]
  in X : f32[M, N]
  out Dt : f32[N, M]
  out Xt : f32[N, M]
  out Xc : f32[M, N]
  out E  : f32[M, N]
  out Et : f32[N, M]
  Dt[n, m] = sum(k) A[m, k] * B[k, n]
  Xt[n, m] = X[m, n]
  Xc[m, n] = X[m, n]
  E[m, n] = exp(X[m, n])
  Et[n, m] = E[m, n]
}"""
    rng = np.random.default_rng(9)
    A, B, X = rand(rng, (5, 7), F16), rand(rng, (7, 3), F16), rand(rng, (5, 3), np.float32)
    out = run_both(src, A=A, B=B, X=X)
    assert_close(out["Dt"], (f64(A) @ f64(B)).T, np.float32)
    np.testing.assert_array_equal(out["Xt"], X.T)
    np.testing.assert_array_equal(out["Xc"], X)
    np.testing.assert_array_equal(out["Et"], out["E"].T)
    assert_close(out["E"], np.exp(f64(X)), np.float32)


def test_reductions_softmax_and_broadcasts():
    src = """kernel r {
  in x : f32[M, N]
  in w : f32[N]
  out s : f32[M]
  out mn : f32[N]
  out me : f32[M]
  out p : f32[M, N]
  s[m] = sum(n) x[m, n] * w[n]
  mn[n] = min(m) x[m, n]
  me[m] = mean(n) x[m, n]
  p[m, n] = softmax(n) x[m, n] - me[m]
}"""
    rng = np.random.default_rng(10)
    x, w = rand(rng, (6, 9), np.float32), rand(rng, (9,), np.float32)
    out = run_both(src, x=x, w=w)
    X = f64(x)
    assert_close(out["s"], X @ f64(w), np.float32)
    assert_close(out["mn"], X.min(axis=0), np.float32)
    assert_close(out["me"], X.mean(axis=1), np.float32)
    e = np.exp(X - X.max(axis=1, keepdims=True))
    assert_close(out["p"], e / e.sum(axis=1, keepdims=True) - X.mean(axis=1, keepdims=True), np.float32)


def test_elementwise_functions():
    src = """kernel f {
  in x : f32[N]
  out a : f32[N]
  out b : f32[N]
  out c : f32[N]
  out d : f32[N]
  a[i] = silu(x[i]) + sigmoid(x[i]) * tanh(x[i])
  b[i] = clamp(x[i], -0.5, 0.25) + abs(x[i]) - maximum(x[i], 0.0) + minimum(x[i], 0.0)
  c[i] = gelu_tanh(x[i])
  d[i] = exp(x[i]) / 2.0 - sqrt(abs(x[i])) + rsqrt(abs(x[i]) + 1.0) + log(abs(x[i]) + 1.0)
}"""
    x = np.linspace(-3, 3, 25).astype(np.float32)
    out = run_both(src, x=x)
    X = f64(x)
    sig = 1 / (1 + np.exp(-X))
    assert_close(out["a"], X * sig + sig * np.tanh(X), np.float32)
    assert_close(out["b"], np.clip(X, -0.5, 0.25) + np.abs(X) - np.maximum(X, 0) + np.minimum(X, 0), np.float32)
    assert_close(out["c"], 0.5 * X * (1 + np.tanh(math.sqrt(2 / math.pi) * (X + 0.044715 * X ** 3))), np.float32)
    assert_close(out["d"], np.exp(X) / 2 - np.sqrt(np.abs(X)) + 1 / np.sqrt(np.abs(X) + 1) + np.log(np.abs(X) + 1),
                 np.float32)


# ---------------------------------------------------------------- dtypes

def test_outputs_have_the_declared_dtypes():
    src = """kernel d {
  in x : f32[N]
  out h : f16[N]
  out b : bf16[N]
  out e : f8e4m3[N]
  out g : f8e5m2[N]
  out f : f32[N]
  h[i] = x[i] * 1000.0
  b[i] = x[i] * 1000.0
  e[i] = x[i] * 1000.0
  g[i] = x[i] * 1000.0
  f[i] = x[i] * 1000.0
}"""
    x = np.array([0.001, -0.25, 0.3, 70.0, -1e3], dtype=np.float32)
    out = run_both(src, x=x)
    assert {k: v.dtype for k, v in out.items()} == {"h": F16, "b": BF16, "e": E4M3,
                                                   "g": np.dtype(ml_dtypes.float8_e5m2), "f": np.dtype(np.float32)}
    want = f64(x) * 1000.0
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out["h"], want.astype(np.float32).astype(F16))  # 7e4 -> inf in f16
    assert np.isinf(out["h"][3]) and np.isinf(out["h"][4])
    np.testing.assert_array_equal(out["b"], want.astype(np.float32).astype(BF16))
    # e4m3fn has no infinity: out-of-range values saturate to +-448
    assert f64(out["e"]).tolist()[3:] == [448.0, -448.0]
    assert f64(out["e"])[0] == 1.0


def test_inputs_are_rounded_to_their_declared_storage():
    rng = np.random.default_rng(11)
    A32, B32 = rng.standard_normal((8, 16)), rng.standard_normal((16, 4))
    fn = reference(SPECS / "gemm.kspec")
    from_f64 = fn(A=A32, B=B32)["D"]
    from_f16 = fn(A=A32.astype(F16), B=B32.astype(F16))["D"]
    assert from_f64.tobytes() == from_f16.tobytes()
    # fp8 inputs saturate at +-448 instead of turning into NaN
    fp8 = reference(SPECS / "fp8_gemm_scaled.kspec")
    A = np.zeros((1, 16), np.float32)
    A[0, 0] = 1000.0
    B = np.ones((16, 1), np.float32)
    assert f64(fp8(A=A, B=B)["D"])[0, 0] == 448.0


def test_integer_gemm_is_exact():
    src = """kernel q {
  param z : i32 = 3
  in A : i8[M, K]
  in B : i8[K, N]
  out C : i32[M, N]
  out F : f32[M, N]
  C[m, n] = sum(k) A[m, k] * B[k, n] + z
  F[m, n] = f32(C[m, n]) / 2.0
}"""
    rng = np.random.default_rng(12)
    A = rng.integers(-128, 128, (5, 300)).astype(np.int8)
    B = rng.integers(-128, 128, (300, 4)).astype(np.int8)
    out = run_both(src, A=A, B=B, z=-7)
    want = A.astype(np.int64) @ B.astype(np.int64) - 7
    assert out["C"].dtype == np.int32
    np.testing.assert_array_equal(out["C"], want)
    np.testing.assert_array_equal(out["F"], (want / 2).astype(np.float32))


def test_tf32_operands_are_rounded_before_the_mma():
    src = """kernel t {
  in A : tf32[M, K]
  in B : tf32[K, N]
  out C : f32[M, N]
  out S : f32[M, K]
  C[m, n] = sum(k) A[m, k] * B[k, n]
  S[m, k] = A[m, k] + 0.0
}"""
    A = np.full((2, 2), 1 + 2.0 ** -12, np.float32)        # not representable with 10 mantissa bits
    B = np.ones((2, 2), np.float32)
    out = reference(src)(A=A, B=B)
    np.testing.assert_array_equal(out["C"], np.full((2, 2), 2.0, np.float32))
    np.testing.assert_array_equal(out["S"], A)               # elementwise math is f32


# ---------------------------------------------------------------- arguments

GEMM = SPECS / "gemm.kspec"
A_, B_ = np.ones((4, 8), F16), np.ones((8, 5), F16)


@pytest.mark.parametrize("args, message", [
    (dict(A=A_), "gemm: missing input 'B' (B: f16[K, N] col)"),
    (dict(A=A_, B=B_, C=A_), "gemm: unknown argument 'C'"),
    (dict(A=A_[0], B=B_), "argument 'A': expected rank 2 (A: f16[M, K]), got shape (8,)"),
    (dict(A=A_, B=np.ones((7, 5), F16)), "argument 'B': K = 7, but K = 8 from argument 'A'"),
    (dict(A=A_.astype(np.int32), B=B_), "argument 'A': expected f16 values, got a int32 array"),
])
def test_argument_errors(args, message):
    with pytest.raises(KspecReferenceError) as e:
        reference(GEMM)(**args)
    assert isinstance(e.value, KspecError)
    assert e.value.message == message


def test_more_argument_errors():
    q = """kernel q { param z : i32
  in A : i8[M, 4]
  out C : i32[M]
  C[m] = sum(k) A[m, k] + z }"""
    fn = reference(q)
    A = np.ones((3, 4), np.int8)
    with pytest.raises(KspecReferenceError, match="missing param 'z' \\(i32, no default\\)"):
        fn(A=A)
    with pytest.raises(KspecReferenceError, match="param 'z' is a scalar, got shape \\(2,\\)"):
        fn(A=A, z=np.array([1, 2]))
    with pytest.raises(KspecReferenceError, match="expected shape \\[M, 4\\], got \\[3, 5\\]"):
        fn(A=np.ones((3, 5), np.int8), z=1)
    with pytest.raises(KspecReferenceError, match="expected i8 values, got a float32 array"):
        fn(A=A.astype(np.float32), z=1)
    np.testing.assert_array_equal(fn(A=A, z=np.int32(2))["C"], [6, 6, 6])
    with pytest.raises(KspecReferenceError, match="unknown argument 'alpha'") as e:
        reference(GEMM)(A=A_, B=B_, alpha=1.0)
    assert e.value.hint == "arguments: A, B"


def test_size_known_only_from_an_output_is_an_error():
    fn = reference("""kernel c { in A : f32[M, N]
  out D : f32[M, N, P]
  D[m, n, p] = A[m, n] * 2.0 }""")
    with pytest.raises(KspecReferenceError, match="size P cannot be inferred from the inputs"):
        fn(A=np.ones((2, 3), np.float32))


def test_reference_api_forms():
    prog = load_spec(GEMM)
    for spec in (GEMM, str(GEMM), GEMM.read_text(), prog):
        fn = reference(spec)
        assert isinstance(fn, ReferenceKernel) and fn.kernel.name == "gemm"
    assert repr(reference(GEMM)) == "<kspec reference kernel gemm(A: f16[M, K], B: f16[K, N] col) -> (D: f16[M, N])>"
    two = """kernel a { in x : f32[N]
  out y : f32[N]
  y[i] = x[i] * 2.0 }
kernel b { in x : f32[N]
  out y : f32[N]
  y[i] = x[i] + 1.0 }"""
    mod = reference(two)
    assert isinstance(mod, ReferenceModule)
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(mod.a(x=x)["y"], [0, 2, 4])
    np.testing.assert_array_equal(mod.b(x=x)["y"], [1, 2, 3])
    np.testing.assert_array_equal(reference(two, "b")(x=x)["y"], [1, 2, 3])
    with pytest.raises(AttributeError):
        mod.c
    with pytest.raises(KspecError, match="no kernel named 'c'"):
        reference(two, "c")
    with pytest.raises(KspecError, match="not int"):
        reference(42)


def test_integer_division_floors_and_modulo_is_non_negative():
    src = """kernel k {
  param d : i32 = 4
  in  x : f32[N]
  out q : i32[N]
  out r : i32[N]
  out y : f32[N]
  q[i] = (i - 5) / d
  r[i] = (i - 5) % d
  y[i] = x[(i + 3) % N] * (i - 2)
}"""
    x = np.arange(10, dtype=np.float32) * 0.5
    out = run_both(src, x=x)
    i = np.arange(10)
    np.testing.assert_array_equal(out["q"], (i - 5) // 4)            # floor: (-5) / 4 is -2
    np.testing.assert_array_equal(out["r"], (i - 5) % 4)             # never negative for d > 0
    assert out["q"][0] == -2 and out["r"][0] == 3
    np.testing.assert_array_equal(out["y"], x[(i + 3) % 10] * (i - 2))    # index values promote to f32
    with pytest.raises(KspecError, match=r"integer division by zero"):
        reference(src)(x=x, d=0)


@pytest.mark.parametrize("fused", [True, False])
def test_kv_len_past_the_keys_is_refused_like_the_runtime(fused):
    """kv_len[b] > MP * P keys: the runtime refuses it before a launch (compiler.indices), and so does
    the reference, with the same message, fused or not; kv_len = MP * P is fine in both."""
    from kspec.compiler import plan_kernel
    from kspec.compiler.indices import index_ranges
    from kspec.runtime.indexcheck import check_index_values
    rng = np.random.default_rng(43)
    Bn, H, S, P, MP, NP = 2, 1, 1, 4, 2, 4
    Q = rand(rng, (Bn, H, S, 128), BF16)
    Kc, Vc = rand(rng, (NP, P, H, 128), BF16), rand(rng, (NP, P, H, 128), BF16)
    bt = np.array([[0, 1], [2, 3]], np.int32)
    ref = reference(SPECS / "attention_paged.kspec", fused=fused)
    ref(Q=Q, Kc=Kc, Vc=Vc, bt=bt, kv_len=np.array([MP * P, 3], np.int32))
    bad = np.array([MP * P + 1, 3], np.int32)
    with pytest.raises(KspecRuntimeError) as got:
        ref(Q=Q, Kc=Kc, Vc=Vc, bt=bt, kv_len=bad)
    assert "kv_len[0] = 9 is out of range" in str(got.value)
    (counts,) = [r for p in plan_kernel(load_spec(SPECS / "attention_paged.kspec").kernels[0]).plans
                 for r in index_ranges(p.ir) if r.tensor == "kv_len"]
    with pytest.raises(KspecRuntimeError) as runtime:
        check_index_values("attention_paged", (counts,), {"B": Bn, "MP": MP, "P": P, "NP": NP}, {"kv_len": bad})
    assert str(runtime.value) == str(got.value)
