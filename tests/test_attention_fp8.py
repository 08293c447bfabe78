"""FP8 attention (backends/cute/fp8.py, issue 25 item 4): e4m3 Q, K, V with per (sequence, K/V head)
descale factors, as FlashAttention-4's `DescaleTensors` on sm100a (one kernel: tcgen05 FP8 MMAs),
refused on sm90a with FA4's reason; the spelling's semantics against float64 numpy; the host glue's
launch (descale pointers in the kernel's parameters)."""
from __future__ import annotations


import numpy as np
import pytest

from conftest import cubin_sass, needs_fa4, test_cache_root

import kspec
from kspec.backends.registry import Planner
from kspec.compiler import plan_kernel
from kspec.core import KspecError
from kspec.spec_lang import load_spec

FP8 = """kernel attention_fp8 {
  param scale : f32 = 0.08838834764831845
  in  Q : f8e4m3[B, H, S, 128]
  in  K : f8e4m3[B, KH, T, 128]
  in  V : f8e4m3[B, KH, T, 128]
  in  q_descale : f32[B, KH]
  in  k_descale : f32[B, KH]
  in  v_descale : f32[B, KH]
  out O : bf16[B, H, S, 128]

  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h / 4, j, e]
  m[b, h, i, j] = SCORE
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, h, i, e] = OUT
}"""
DESCALED = "s[b, h, i, j] * (q_descale[b, h / 4] * k_descale[b, h / 4])"
PV = "sum(j) p[b, h, i, j] * V[b, h / 4, j, e]"


def spec(score=DESCALED, out=f"v_descale[b, h / 4] * {PV}"):
    return FP8.replace("SCORE", score).replace("OUT", out)


def _plan(text, archs):
    return plan_kernel(load_spec(text, is_text=True).kernels[0], archs, Planner())


@needs_fa4
@pytest.mark.parametrize("score", [DESCALED, "k_descale[b, h / 4] * (s[b, h, i, j] * q_descale[b, h / 4])",
                                   "q_descale[b, h / 4] * s[b, h, i, j]"])
def test_fp8_attention_is_one_flashattention_4_kernel_on_sm100a(score):
    from kspec.backends.cute import attention as A
    (p,) = _plan(spec(score), ("sm100a",)).plans
    assert p.kind == "attention" and p.choices["sm100a"].backend == "cute"
    cfg = dict(p.choices["sm100a"].config)
    assert cfg["score_mod"] == "none" and cfg["fp8"].startswith("e4m3, descale q")
    desc, names = A.lower(p.ir, "sm100a")[:2]
    assert desc.dtype == "f8e4m3" and desc.mods.score_mod is None and names[desc.descales[2]] == "v_descale"
    assert len([d for d in desc.descales if d]) == (2 if "k_descale" in score else 1) + 1
    assert "descale_tensors=DescaleTensors(" in A.entry_source(desc)
    assert cfg["split_kv"].startswith("none (FP8")


def test_sm90a_says_why_not():
    # FA4's own limit in both environments: without FA4 installed, "install it" would not help here,
    # so what FA4 cannot do is said before whether it is installed
    why = (r'FlashAttention-4 4\.0\.0b36 runs FP8 attention on sm100a only \(its interface asserts "FP8 is only '
           r'supported on SM100"\)')
    with pytest.raises(KspecError, match=r"kernel attention_fp8: this attention is not fused into one kernel: no "
                                         r"backend implements it \(sm90a: cute: " + why) as e:
        plan_kernel(load_spec(spec(), is_text=True).kernels[0], ("sm90a", "sm100a"), Planner(strict=True))
    assert str(e.value).startswith("<string>:13:19: error:")          # located at the softmax
    sched = _plan(spec(), ("sm90a",))
    assert "attention" not in [p.kind for p in sched.plans]


def test_what_fa4_cannot_apply_is_refused_by_name():
    from kspec.backends.cute import attention as A

    def why(text, arch="sm100a"):       # planned structurally (no backend asked), then the backend's reason
        (p,) = [p for p in plan_kernel(load_spec(text, is_text=True).kernels[0], (arch,)).plans]
        assert p.kind == "attention"
        return A.unsupported(p.ir, arch)
    # the output scale read per query head, not per K/V head: not FA4's v_descale
    assert "v_descale[b, h / G]" in why(spec(out=f"v_descale[b, h / 8] * {PV}"))
    # bf16 with an output scale: FA4 applies one to FP8 only
    bf16 = spec().replace("f8e4m3", "bf16")
    assert "only to FP8 attention" in why(bf16)
    # FP8 with an f16 output
    assert "in bf16, not f16" in why(spec().replace("out O : bf16", "out O : f16"))


def _fp8(x):
    import ml_dtypes  # noqa: F401  (numpy's float8 types, through the reference's own dependency)
    return x.astype(ml_dtypes.float8_e4m3fn)


def test_the_spelling_against_float64():
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(11)
    B, KH, S, T = 2, 2, 3, 40
    H = 4 * KH
    Q, K, V = (_fp8(rng.standard_normal(sh).astype(np.float32)) for sh in
               ((B, H, S, 128), (B, KH, T, 128), (B, KH, T, 128)))
    qd, kd, vd = (rng.uniform(0.5, 2.0, (B, KH)).astype(np.float32) for _ in range(3))
    out = kspec.reference(spec())(Q=Q, K=K, V=V, q_descale=qd, k_descale=kd, v_descale=vd)["O"].astype(np.float64)
    q, k, v = (x.astype(np.float64) for x in (Q, K, V))
    g = np.arange(H) // 4
    s = 0.08838834764831845 * np.einsum("bhie,bhje->bhij", q, k[:, g]) * (qd * kd)[:, g][:, :, None, None]
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhij,bhje->bhie", p / p.sum(-1, keepdims=True), v[:, g]) * vd[:, g][:, :, None, None]
    np.testing.assert_allclose(out, want, rtol=1e-2, atol=1e-2)           # O is bf16


@needs_fa4
@pytest.mark.cute
def test_the_fp8_kernel_and_its_launch():
    from kspec.backends.cute import attention as A
    from kspec.runtime.glue import HostGlue
    (p,) = _plan(spec(), ("sm100a",)).plans
    desc, names, dims, _scalars = A.lower(p.ir, "sm100a")
    built = A.build(desc, test_cache_root(), lengths=[1])
    (v,) = built.variants                                   # FP8: no split-KV pair
    sass = cubin_sass(v.cubin)
    if sass is not None:
        # tcgen05 FP8 MMAs, and P packed to e4m3 before P @ V
        assert " UTCQMMA" in sass and "F2FP.SATFINITE.E4M3.F32.PACK" in sass and "UTMALDG" in sass
    args = [names[a] for a in desc.args]
    assert args[-3:] == ["q_descale", "k_descale", "v_descale"]
    glue = HostGlue(v.host, "fp8", args)
    ptrs = [0x7F0000000000 + i * 0x10000000 for i in range(len(args))]
    pr = glue.prepare([1, 32, 1, 4096, 8, 4], ptrs, [0.088], 0, 0, 148)
    words = {int.from_bytes(pr.params_bytes()[i:i + 8], "little") for i in range(0, pr.params_size - 7, 8)}
    assert set(ptrs[-3:]) <= words                         # the descales: raw pointers of the kernel
    assert pr.grid[0] >= 1 and pr.block[0] > 0
