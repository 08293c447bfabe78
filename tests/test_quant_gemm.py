"""Quantized GEMMs (issue 24): INT8 with a dequantising float epilogue on the i32 accumulator
(SmoothQuant W8A8), FP8 with explicit operand conversions absorbed into the operands and an amax
output (a full reduction over m and n with a cross-CTA atomic finish).

References are checked against float64 numpy written here; plans and builds are real (one CuTe DSL
kernel per arch with tensor-core SASS); launches go through the fake driver."""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from conftest import SPECS, cubin_sass, test_cache_root

from kspec.backends.cute import compat, epilogue, gemm
from kspec.backends.desc import Accum, GemmDesc, Load, Op, Operand, ReductionStore, Store
from kspec.backends.reference import reference
from kspec.compile import plan_spec
from kspec.spec_lang import load_spec

ARCHS = ("sm90a", "sm100a")
E4M3 = ml_dtypes.float8_e4m3fn
needs_dsl = pytest.mark.skipif(compat.available() is not None, reason=f"CuTe DSL unavailable: {compat.available()}")


def _plans(src_or_path, archs=ARCHS):
    is_text = not str(src_or_path).endswith(".kspec")
    prog = load_spec(src_or_path, is_text=is_text)
    (sched,) = plan_spec(prog, archs)
    return sched


# ------------------------------------------------------------------ references (float64 numpy)

def test_int8_dequant_reference_matches_float64_numpy():
    rng = np.random.default_rng(0)
    M, N, K = 37, 29, 300
    A = rng.integers(-128, 128, (M, K), dtype=np.int8)
    B = rng.integers(-128, 128, (N, K), dtype=np.int8)
    sa = (rng.random(M) * 1e-3 + 1e-4).astype(np.float32)
    sb = (rng.random(N) * 1e-2 + 1e-3).astype(np.float32)
    out = reference(SPECS / "gemm_int8_dequant.kspec")(A=A, B=B, sa=sa, sb=sb)
    acc = A.astype(np.int64) @ B.astype(np.int64).T           # exact
    want = acc.astype(np.float64) * sa.astype(np.float64)[:, None] * sb.astype(np.float64)[None, :]
    assert out["D"].dtype == np.float16
    np.testing.assert_allclose(out["D"].astype(np.float64), want, rtol=1e-3, atol=1e-6)


def test_fp8_amax_reference_matches_float64_numpy():
    rng = np.random.default_rng(1)
    M, N, K = 33, 70, 96
    A = (rng.standard_normal((M, K)) * 4).astype(E4M3)
    B = (rng.standard_normal((N, K)) * 4).astype(E4M3)
    out = reference(SPECS / "fp8_gemm_amax.kspec")(A=A, B=B, scale_a=0.5, scale_b=0.25)
    y = 0.125 * (A.astype(np.float64) @ B.astype(np.float64).T)
    np.testing.assert_allclose(out["D"].astype(np.float64), y, rtol=8e-3, atol=1e-2)
    assert out["amax"].shape == (1,) and out["amax"].dtype == np.float32
    np.testing.assert_allclose(out["amax"][0], np.abs(y).max(), rtol=1e-5)


# ------------------------------------------------------------------ planning

def test_fp8_operand_conversions_are_absorbed_into_the_gemm():
    """`sum(k) f32(A) * f32(B)` of fp8 data is the fp8 GEMM: no kernel writes f32 copies."""
    sched = _plans(SPECS / "fp8_gemm_amax.kspec")
    (p,) = sched.plans
    assert p.kind == "gemm" and (p.ir.gemm.a_dtype, p.ir.gemm.b_dtype) == ("f8e4m3", "f8e4m3")
    assert set(p.writes) == {"D", "amax"}
    (r,) = p.ir.epilogue.reductions
    assert (r.name, r.op, r.axis) == ("amax", "max", "mn")
    for arch in ARCHS:
        assert p.choices[arch].backend == "cute" and p.choices[arch].fallback is None


def test_int8_to_f32_operand_conversion_is_not_absorbed():
    """i8 -> f32 products are exact, but an f32 sum of them is not an i32 sum: the conversion stays."""
    src = """kernel k {
      in A : i8[M, K]
      in B : i8[N, K]
      out D : f32[M, N]
      D[m, n] = sum(k) f32(A[m, k]) * f32(B[n, k])
    }"""
    sched = _plans(src)
    gemm_plans = [p for p in sched.plans if p.kind == "gemm"]
    assert all(p.ir.gemm.a_dtype == "f32" for p in gemm_plans)


def test_int8_dequant_plans_one_cute_kernel_per_arch():
    sched = _plans(SPECS / "gemm_int8_dequant.kspec")
    (p,) = sched.plans
    assert p.ir.gemm.acc_dtype == "i32" and p.ir.epilogue.output.dtype == "f16"
    for arch in ARCHS:
        assert p.choices[arch].backend == "cute" and p.choices[arch].fallback is None


def test_float_epilogue_on_i32_must_convert_the_accumulator_first():
    a, b = Operand("t0", "i8", "row"), Operand("t1", "i8", "col")
    ok = GemmDesc("k_0", "sm90a", a, b, "i32",
                  Store("t3", Op("mul", (Op("cast:f32", (Accum(),)), Load("t2", "col", "f32"))), "bf16"))
    assert epilogue.unsupported(ok) is None and epilogue.compute_dtype(ok) == "f32"
    bad = GemmDesc("k_0", "sm90a", a, b, "i32", Store("t3", Op("cast:f32", (Op("add", (Accum(), Accum())),)), "f16"))
    assert "f32(acc[m, n])" in epilogue.unsupported(bad)
    assert "must convert" in gemm.can_implement(bad, "sm90a") if compat.available() is None else True


def test_generated_int8_dequant_epilogue_matches_float64_numpy():
    d = GemmDesc("k_0", "sm90a", Operand("t0", "i8", "row"), Operand("t1", "i8", "col"), "i32",
                 Store("t4", Op("mul", (Op("mul", (Op("cast:f32", (Accum(),)), Load("t2", "col", "f32"))),
                                        Load("t3", "row", "f32"))), "f16"))
    code = epilogue.generate(d)
    assert code.source.splitlines()[1] == "    acc = F.to_f32(acc)"
    rng = np.random.default_rng(2)
    acc = rng.integers(-2 ** 20, 2 ** 20, (8, 16)).astype(np.int32)
    sa, sb = rng.random(8).astype(np.float32), rng.random(16).astype(np.float32)
    (got,) = epilogue.run_numpy(code, acc, (np.broadcast_to(sa[:, None], acc.shape), np.broadcast_to(sb, acc.shape)), ())
    want = acc.astype(np.float64) * sa[:, None] * sb[None, :]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert "epi_dtype=cutlass.Float32" in gemm.entry_source(d, "sm90a", gemm.CuteConfig((128, 128)), code)


def test_full_reduction_abi_is_one_value_per_batch_entry():
    y = Op("abs", (Accum(),))
    d = GemmDesc("k_0", "sm100a", Operand("t0", "f8e4m3", "row"), Operand("t1", "f8e4m3", "col"), "f32",
                 Store("t2", Accum(), "bf16"), reductions=(ReductionStore("t3", "max", "mn", y, "f32"),))
    assert epilogue.unsupported(d) is None
    code = epilogue.generate(d)
    assert code.reductions == (("max", "mn"),)
    (r,) = [t for t in gemm.tensor_abi(d, code) if t.name == "r0"]
    assert (r.shape, r.stride, r.tma) == (("L",), (1,), False)
    assert d.reduction_init() == (("t3", "neg_inf"),)


@needs_dsl
def test_full_reduction_plan_reduces_rows_then_the_tile():
    """The in-tile steps of a full reduction are a row reduction's (plan key 0, full=True); the
    tile's row vector is then combined by flush: the numpy model of both gives the max over the tile."""
    from kspec.backends.cute import reduce as red
    # a WGMMA-like accumulator layout: lane l holds rows l//4 and l//4 + 8, columns 2*(l%4) + {0, 1}
    coords = {t: [(t // 32 * 16 + (t % 32) // 4 + 8 * h, 2 * (t % 4) + c + 8 * j) for j in range(2) for h in range(2)
                  for c in range(2)] for t in range(128)}
    plan = red.make_plan("max", "mn", coords)
    assert plan.full and plan.key == 0 and plan.lane_bits == (1, 2)
    rng = np.random.default_rng(3)
    vals = {t: [float(x) for x in rng.standard_normal(len(coords[t]))] for t in coords}
    rows = red.simulate(plan, vals, coords, (60, 14))
    want = max(v for t in coords for v, c in zip(vals[t], coords[t]) if c[0] < 60 and c[1] < 14)
    assert rows.max() == np.float32(want)


def test_cutlass_backend_refuses_full_reductions():
    from kspec.backends.cutlass.backend import CutlassBackend
    sched = _plans(SPECS / "fp8_gemm_amax.kspec")
    why = CutlassBackend().can_implement(sched.plans[0].ir, "sm90a")
    assert why is not None and "m and n" in why


# ------------------------------------------------------------------ builds, SASS, launches

@pytest.fixture(scope="module")
def quant_artifacts(tmp_path_factory):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    out = tmp_path_factory.mktemp("quant")
    cache = CompileCache(test_cache_root())
    done = {}

    def get(stem):
        if stem not in done:
            done[stem] = compile_spec(SPECS / f"{stem}.kspec", ARCHS, out, cache=cache, backend="cute")
        return done[stem]
    return get


SASS = {"gemm_int8_dequant": (("IGMMA", "I2FP.F32.S32"), ("UTCIMMA", "I2FP.F32.S32")),
        "fp8_gemm_amax": (("QGMMA", "REDG.E.MAX.S32", "REDG.E.MIN"), ("UTCQMMA", "REDG.E.MAX.S32", "REDG.E.MIN"))}


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("stem", sorted(SASS))
def test_quantized_specs_build_one_tensor_core_kernel_per_arch(quant_artifacts, stem):
    art = quant_artifacts(stem)
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    for arch, insns in zip(ARCHS, SASS[stem]):
        b = plan["binaries"][arch]
        assert b["config"]["backend"] == "cute"
        sass = cubin_sass(art / b["cubin"])
        if sass is None:
            pytest.skip("no cuobjdump for the SASS check")
        for insn in insns:
            assert insn in sass, f"{stem} {arch}: no {insn}"


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_launch_abi_through_the_fake_driver(quant_artifacts, arch):
    import kspec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    from kspec.selftest import SIZE_SETS
    dq = kspec.load(quant_artifacts("gemm_int8_dequant"))
    am = kspec.load(quant_artifacts("fp8_gemm_amax"))
    with FakeDriver((9, 0) if arch == "sm90a" else (10, 0), sm_count=132) as fake:
        for sz in SIZE_SETS.values():
            call = fake_call(dq, "gemm_int8_dequant", sz, fake)
            assert check_call(call, arch, dq) == []
            assert [a.name for a in call.plan_args[0]] == ["A", "B", "sa", "sb", "D"]
            n = len(fake.fills)
            call = fake_call(am, "fp8_gemm_amax", sz, fake, params={"scale_a": 0.5, "scale_b": 2.0})
            assert check_call(call, arch, am) == []
            args = {a.name: a for a in call.plan_args[0]}
            assert args["amax"].shape == (1,)
            # the loader sets amax to -inf (the identity of the atomic max) before the launch
            assert fake.fills[n:] == [(args["amax"].ptr, 0xFF800000, 4, 1)]
            blob = call.launches[0].params
            assert struct.pack("<f", 0.5) in blob and struct.pack("<f", 2.0) in blob
