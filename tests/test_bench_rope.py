"""bench/rope.py on a machine without a GPU: --help works, a run prints kspec's plan (one vectorised
kernel per arch) and says there is nothing to benchmark, exiting 0; the pieces the GPU run relies on
(the bytes it counts, the angle tables in kspec's and QuACK's layouts, the torch eager baseline) are
checked against an independent float64 numpy RoPE on the CPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "rope.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_rope", BENCH)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_help_and_a_gpu_less_run():
    r = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and all(o in r.stdout for o in ("--prebuilt", "--peak-gbs", "--no-compile",
                                                             "--interleaved"))
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run the benchmark itself")
    r = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "nothing to benchmark" in r.stdout, r.stdout + r.stderr
    assert "rope_0 on sm90a: generic elementwise, 16 or 8 elements per thread" in r.stdout
    assert "rope_0 on sm100a: generic elementwise, 16 or 8 elements per thread" in r.stdout


def test_plan_and_bytes():
    m = _module()
    # B=1, S=2, H=3: Q and Y are 2 * 1*2*3*128 bf16 values, cos and sin 2 * 2*128 f32
    assert m.rope_bytes(1, 2, 3) == 2 * 768 * 2 + 2 * 256 * 4
    lines = m.plan_summary(("sm90a",), {"B": 2, "S": 16, "H": 4})
    assert lines[0].endswith("1 kernel(s)")
    # the cost model's traffic is the spec minimum: each tensor moved once
    assert lines[-1].endswith("1.00x the spec minimum"), lines[-1]


def test_tables_and_the_torch_baseline_against_float64_numpy():
    torch = pytest.importorskip("torch")
    m = _module()
    S, B, H = 7, 2, 3
    (cos64, sin64), (cos, sin) = m.tables(torch, S)
    assert cos64.shape == (S, 64) and cos.shape == (S, 128) and cos.dtype == torch.float32
    ang = np.arange(S)[:, None] * 10000.0 ** (-np.arange(0, 128, 2) / 128)[None, :]
    np.testing.assert_allclose(cos64.numpy(), np.cos(ang), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cos.numpy(), np.concatenate([cos64.numpy()] * 2, -1))
    np.testing.assert_array_equal(sin.numpy(), np.concatenate([sin64.numpy()] * 2, -1))
    q = torch.randn(B, S, H, 128).to(torch.bfloat16)
    got = m.rope_torch(torch, q, cos, sin)
    assert got.dtype == torch.bfloat16
    x = q.float().numpy().astype(np.float64)
    c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    # rotate-half as QuACK's non-interleaved kernel states it: (x1 c - x2 s, x2 c + x1 s)
    want = np.concatenate([x[..., :64] * c - x[..., 64:] * s, x[..., 64:] * c + x[..., :64] * s], -1)
    np.testing.assert_allclose(got.float().numpy(), want, rtol=2 ** -7, atol=2 ** -7)
    # GPT-J's interleaved layout: pair (x[2i], x[2i+1]) rotated by angle i, tables [S, 64]
    got = m.rope_torch_interleaved(torch, q, cos64, sin64)
    want = np.empty_like(x)
    want[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    want[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    np.testing.assert_allclose(got.float().numpy(), want, rtol=2 ** -7, atol=2 ** -7)


def test_the_interleaved_spec_is_one_vectorised_kernel_matching_the_torch_baseline():
    """The bench's GPT-J spec plans as one generic kernel with a vector path on both archs, and its
    reference agrees with the torch eager baseline the bench times it against."""
    torch = pytest.importorskip("torch")
    m = _module()
    from kspec.backends.reference import reference
    from kspec.backends.registry import Planner, get
    from kspec.compiler import plan_kernel
    from kspec.spec_lang import load_spec
    sched = plan_kernel(load_spec(m.GPTJ, is_text=True).kernels[0], ("sm90a", "sm100a"), Planner())
    (p,) = sched.plans
    for arch in ("sm90a", "sm100a"):
        assert p.choices[arch].backend == "generic"
        assert get("generic").lower(p.ir, arch).desc.vec == (16, 8)
    S, B, H = 5, 2, 3
    (cos64, sin64), _ = m.tables(torch, S)
    q = torch.randn(B, S, H, 128).to(torch.bfloat16)
    want = m.rope_torch_interleaved(torch, q, cos64, sin64).float().numpy()
    import ml_dtypes
    got = reference(m.GPTJ)(Q=q.float().numpy().astype(ml_dtypes.bfloat16), cos=cos64.numpy(),
                            sin=sin64.numpy())["Y"]
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=2 ** -7, atol=2 ** -7)
