"""Quantized GEMMs (issue 24): INT8 with a dequantising float epilogue on the i32 accumulator
(SmoothQuant W8A8), FP8 with explicit operand conversions absorbed into the operands and an amax
output (a full reduction over m and n with a cross-CTA atomic finish).

References are checked against float64 numpy written here; plans and builds are real (one CuTe DSL
kernel per arch with tensor-core SASS); launches go through the fake driver."""
from __future__ import annotations

import json
import re
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
            # (a spec's `target` line names its archs: fp8_gemm_blockwise is sm90a only)
            done[stem] = compile_spec(SPECS / f"{stem}.kspec", None, out, cache=cache, backend="cute")
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


# ------------------------------------------------------------------ FP4 / E8M0 numerics (item 3)

def test_e2m1_rounding_matches_ml_dtypes_and_the_documented_rule():
    from kspec.numerics import round_e2m1, to_storage
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.standard_normal(50000) * 3, np.arange(-64, 65) / 8,
                        [np.inf, -np.inf, 0.0, -0.0, 1e30, -1e-30]]).astype(np.float32)
    got = round_e2m1(x)
    want = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))      # signs of zeros included
    # the rule, independently: ties to the even encoding, saturation at 6
    table = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, 5.5: 6.0, 7.0: 6.0,
             -2.5: -2.0, 0.26: 0.5}
    for v, r in table.items():
        assert round_e2m1(np.float32(v)) == np.float32(r), v
    assert round_e2m1(np.float32(np.nan)) == 6.0          # no NaN in e2m1: the documented choice
    assert to_storage(np.float32(2.6), "f4e2m1").dtype == np.dtype(ml_dtypes.float4_e2m1fn)


def test_e8m0_rounding_matches_ml_dtypes():
    from kspec.numerics import round_e8m0
    rng = np.random.default_rng(5)
    with np.errstate(over="ignore"):
        x = np.concatenate([np.exp(rng.standard_normal(50000) * 40), 2.0 ** np.arange(-150, 130),
                            1.5 * 2.0 ** np.arange(-150, 130), [0.0, -1.0, np.inf, np.nan]]).astype(np.float32)
        want = x.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = round_e8m0(x)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert round_e8m0(np.float32(1.5)) == 2.0 and round_e8m0(np.float32(1.49)) == 1.0
    assert round_e8m0(np.float32(1e-40)) == np.float32(2.0 ** -127) and np.isnan(round_e8m0(np.float32(0.0)))


def test_quotient_dimensions_parse_print_and_check():
    from kspec.spec_lang import parse, print_program
    src = MXFP8.replace("f8e8m0[M, K / 32]", "f8e8m0[M, K / 1]")
    with pytest.raises(Exception, match="divides by 2 or more"):
        load_spec(src, is_text=True)
    k = load_spec(MXFP8, is_text=True).kernels[0]
    assert dict((t.name, t.shape) for t in k.inputs)["sa"] == ("M", "K/32")
    printed = print_program(parse(MXFP8))
    assert "f8e8m0[M, K / 32]" in printed and print_program(parse(printed)) == printed


MXFP8 = (SPECS / "mxfp8_gemm.kspec").read_text()

NVFP4 = """kernel nv {
  param alpha : f32 = 1.0
  in  A  : f4e2m1[M, K]
  in  B  : f4e2m1[N, K]
  in  sa : f8e4m3[M, K / 16]
  in  sb : f8e4m3[N, K / 16]
  out D  : bf16[M, N]
  D[m, n] = alpha * sum(k) A[m, k] * sa[m, k / 16] * B[n, k] * sb[n, k / 16]
}"""


def _pow2(rng, shape):
    return (2.0 ** rng.integers(-4, 5, shape)).astype(np.float32)


def test_mxfp8_and_nvfp4_references_match_float64_numpy():
    rng = np.random.default_rng(6)
    M, N, K = 9, 20, 96
    A = (rng.standard_normal((M, K)) * 2).astype(E4M3)
    B = (rng.standard_normal((N, K)) * 2).astype(E4M3)
    sa, sb = _pow2(rng, (M, K // 32)).astype(ml_dtypes.float8_e8m0fnu), _pow2(rng, (N, K // 32)).astype(
        ml_dtypes.float8_e8m0fnu)
    out = reference(MXFP8)(A=A, B=B, sa=sa, sb=sb)
    a = A.astype(np.float64) * np.repeat(sa.astype(np.float64), 32, axis=1)
    b = B.astype(np.float64) * np.repeat(sb.astype(np.float64), 32, axis=1)
    np.testing.assert_allclose(out["D"].astype(np.float64), a @ b.T, rtol=8e-3, atol=1e-2)
    F4 = ml_dtypes.float4_e2m1fn
    A4 = (rng.standard_normal((M, K)) * 3).astype(F4)
    B4 = (rng.standard_normal((N, K)) * 3).astype(F4)
    s4a = (rng.random((M, K // 16)) * 4 + 0.1).astype(E4M3)
    s4b = (rng.random((N, K // 16)) * 4 + 0.1).astype(E4M3)
    out = reference(NVFP4)(A=A4, B=B4, sa=s4a, sb=s4b, alpha=0.5)
    a = A4.astype(np.float64) * np.repeat(s4a.astype(np.float64), 16, axis=1)
    b = B4.astype(np.float64) * np.repeat(s4b.astype(np.float64), 16, axis=1)
    np.testing.assert_allclose(out["D"].astype(np.float64), 0.5 * (a @ b.T), rtol=8e-3, atol=1e-2)


def test_reference_checks_block_scale_extents():
    from kspec.backends.reference import KspecReferenceError
    rng = np.random.default_rng(7)
    A = np.ones((4, 90), E4M3)
    B = np.ones((6, 90), E4M3)
    s = np.ones((4, 3), ml_dtypes.float8_e8m0fnu)
    with pytest.raises(KspecReferenceError, match=r"K = 90 .* not a multiple of 32"):
        reference(MXFP8)(A=A, B=B, sa=s, sb=np.ones((6, 3), ml_dtypes.float8_e8m0fnu))
    A, B = np.ones((4, 96), E4M3), np.ones((6, 96), E4M3)
    with pytest.raises(KspecReferenceError, match=r"'sb': K/32 must be 3 .* got 2"):
        reference(MXFP8)(A=A, B=B, sa=s, sb=np.ones((6, 2), ml_dtypes.float8_e8m0fnu))
    del rng


# ------------------------------------------------------------------ block-scaled GEMMs (item 4)

def test_block_scales_are_recognised_with_their_block_sizes():
    sched = _plans(SPECS / "fp8_gemm_blockwise.kspec")
    (p,) = sched.plans
    assert p.kind == "gemm" and all(p.choices[a].backend == "cute" for a in ARCHS)
    assert [(s.buffer, s.operand, s.block_k, s.block_mn, s.order) for s in p.ir.gemm.block_scales] == \
        [("sa", "a", 128, 1, "mk"), ("sb", "b", 128, 128, "mk")]
    # the weight scales written [k blocks, n blocks] (the issue's `sb[k / 128, n / 128]`)
    src = (SPECS / "fp8_gemm_blockwise.kspec").read_text().replace("sb : f32[N / 128, K / 128]", "sb : f32[K / 128, N / 128]")
    src = src.replace("sb[n / 128, k / 128]", "sb[k / 128, n / 128]")
    (p,) = _plans(src, ("sm90a",)).plans
    assert [(s.block_mn, s.order) for s in p.ir.gemm.block_scales] == [(1, "mk"), (128, "km")]
    from kspec.compiler.kir import ir_from_json, ir_to_json
    assert ir_from_json(ir_to_json(p.ir)) == p.ir


def test_block_scaled_gemms_no_backend_builds_stay_separate_ops_with_a_note():
    # blocks of 64 along K: not the kernels' scale block (their K tile)
    src = (SPECS / "fp8_gemm_blockwise.kspec").read_text().replace("128", "64")
    sched = _plans(src, ("sm90a",))
    assert all(p.kind != "gemm" for p in sched.plans)
    assert any("block-scaled GEMM" in n and "no GEMM backend builds" in n and "blocks of 64 along K" in n
               for n in sched.fusion.notes)
    # f16 operands: the block-scaled kernels take fp8
    src = (SPECS / "fp8_gemm_blockwise.kspec").read_text().replace("f8e4m3", "f16")
    assert any("take fp8 operands" in n for n in _plans(src, ("sm100a",)).fusion.notes)


@needs_dsl
@pytest.mark.cute
def test_fp8_blockwise_builds_qgmma_with_a_per_k_block_promotion(quant_artifacts):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    art = quant_artifacts("fp8_gemm_blockwise")
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    assert list(plan["binaries"]) == list(ARCHS) and plan["args"] == ["A", "B", "sa", "sb", "D"]
    sass = cubin_sass(art / plan["binaries"]["sm90a"]["cubin"])
    if sass is None:
        pytest.skip("no cuobjdump for the SASS check")
    # sm90a: one K tile (= one 128 scale block) of WGMMAs per loop trip; per thread 64 accumulator
    # values (128x128 over two warpgroups) each promoted by one FFMA; 2 rows of A scales + 1 B scale
    assert sass.count("QGMMA.64x128x32.F32.E4M3.E4M3") == 4
    assert sass.count("FFMA ") >= 64 and sass.count("LDG.E ") + sass.count("LDG.E.CONSTANT") >= 3
    # sm100a: one K tile of UMMAs per accumulation, then 4 TMEM loads of 32 columns and 128 FFMA
    # promotions per thread (the whole 128x128 tile in the epilogue warps' registers)
    sass = cubin_sass(art / plan["binaries"]["sm100a"]["cubin"])
    assert sass.count("UTCQMMA") == 4 and sass.count("LDTM.x32") == 4 and sass.count("FFMA ") >= 128
    del CompileCache, compile_spec


@needs_dsl
@pytest.mark.cute
def test_fp8_blockwise_launch_abi_and_scale_checks_through_the_fake_driver(quant_artifacts):
    import kspec
    from kspec.core import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    mod = kspec.load(quant_artifacts("fp8_gemm_blockwise"))
    for arch, cc in (("sm100a", (10, 0)), ("sm90a", (9, 0))):
        with FakeDriver(cc, sm_count=132) as fake:
            for sz in ({"M": 256, "N": 256, "K": 512}, {"M": 200, "N": 384, "K": 128}):
                call = fake_call(mod, "fp8_gemm_blockwise", sz, fake)
                assert check_call(call, arch, mod) == []
                args = {a.name: a for a in call.plan_args[0]}
                assert args["sa"].shape == (sz["M"], sz["K"] // 128)
                assert args["sb"].shape == (sz["N"] // 128, sz["K"] // 128)
                blob = call.launches[0].params
                words = set(struct.unpack_from(f"<{len(blob) // 8}Q", blob[:len(blob) // 8 * 8]))
                assert args["sa"].ptr in words and args["sb"].ptr in words      # read directly, not by TMA
            n = len(fake.launches)
            # K = 200 is not a multiple of the scale block: refused before any launch, naming sa and K
            with pytest.raises(KspecRuntimeError,
                               match=r"argument 'sa': dimension 1 \(K/128\): K = 200 .* not a multiple of 128"):
                fake_call(mod, "fp8_gemm_blockwise", {"M": 64, "N": 128, "K": 200}, fake)
            assert len(fake.launches) == n


@needs_dsl
def test_block_scale_row_plan_promotes_every_thread_like_float64_numpy():
    """The promotion's row bookkeeping (blockscale.row_plan): on a WGMMA-like epilogue partition of a
    128x128 tile over two warpgroups (sub-tiles 128x32), every thread's rows from its first row plus
    the plan's offsets are the rows it holds, and acc += tmp * sa[row, kt] * sb[kt] over four K blocks
    gives the block-scaled product (float64 numpy)."""
    from kspec.backends.cute import blockscale as bsc
    from kspec.core import KspecInternalError
    et, grid = (128, 32), (1, 4)

    def coords(t):          # 256 threads: warpgroup t // 128 holds rows 64 * wg .. + 63 of each sub-tile
        wg, lt = divmod(t, 128)
        return [(64 * wg + 16 * (lt // 32) + (lt % 32) // 4 + 8 * ((v // 2) % 2), 2 * (lt % 4) + v % 2 + 8 * (v // 4))
                for v in range(8)]
    plan = bsc.row_plan(coords, list(range(256)), et, grid)
    assert plan.deltas == (0, 8)
    rng = np.random.default_rng(8)
    M0, KB = 1000, 4
    A = rng.standard_normal((128, 128 * KB))
    B = rng.standard_normal((128, 128 * KB))
    sa = rng.random((M0 + 128, KB)) + 0.5
    sb = rng.random(KB) + 0.5
    tile = np.zeros((128, 128))
    for t in range(256):
        c = coords(t)
        acc = np.zeros((len(plan.slot), len(c)))
        for kt in range(KB):
            ks = slice(128 * kt, 128 * (kt + 1))
            rs = [sa[M0 + c[0][0] + d, kt] for d in plan.deltas]
            for e in range(len(plan.slot)):
                for v, (lm, ln) in enumerate(c):
                    m, n = (e // grid[1]) * et[0] + lm, (e % grid[1]) * et[1] + ln
                    assert c[0][0] + plan.deltas[plan.slot[e][v]] == m
                    acc[e, v] += (A[m, ks] @ B[n, ks]) * rs[plan.slot[e][v]] * sb[kt]
        for e in range(len(plan.slot)):
            for v, (lm, ln) in enumerate(c):
                tile[(e // grid[1]) * et[0] + lm, (e % grid[1]) * et[1] + ln] = acc[e, v]
    want = sum((A[:, 128 * kt:128 * (kt + 1)] * sa[M0:M0 + 128, kt:kt + 1]) @ B[:, 128 * kt:128 * (kt + 1)].T * sb[kt]
               for kt in range(KB))
    covered = np.zeros((128, 128), bool)
    for t in range(256):
        for e in range(len(plan.slot)):
            for lm, ln in coords(t):
                covered[(e // grid[1]) * et[0] + lm, (e % grid[1]) * et[1] + ln] = True
    np.testing.assert_allclose(tile[covered], want[covered], rtol=1e-9, atol=1e-9)
    # a layout whose threads hold different row offsets is refused (the kernel relies on it)
    with pytest.raises(KspecInternalError, match="thread 1"):
        bsc.row_plan(lambda t: [(t, 0), (t + 8 + 8 * (t == 1), 0)], [0, 1], et, grid)


# ------------------------------------------------------------------ MoE grouped GEMMs (item 5: reference level)

MOE_GROUPED = SPECS / "moe_grouped_gemm.kspec"

MOE_GATHER = SPECS / "moe_gather_gemm.kspec"


def test_moe_grouped_and_gather_references_match_float64_numpy_and_check_offsets_and_indices():
    """Tokens stored back to back by expert (`packed(off)`, one group empty), per-expert weights
    W[e, f, d], bias, SiLU and a per-row routing weight; and the gathered variant X[idx[e, t], d].
    The reference refuses decreasing offsets and out-of-range token indices, naming the tensor."""
    from kspec.backends.reference import KspecReferenceError
    from kspec.core import KspecRuntimeError
    BF = ml_dtypes.bfloat16
    rng = np.random.default_rng(9)
    E, D, F, N = 3, 32, 24, 10
    off = np.array([0, 5, 5, 12], np.int32)
    R = int(off[-1])
    X = rng.standard_normal((R, D)).astype(BF)
    W = rng.standard_normal((E, F, D)).astype(BF)
    bias = rng.standard_normal((E, F)).astype(BF)
    rw = rng.random(R).astype(np.float32)
    got = reference(MOE_GROUPED)(X=X, off=off, W=W, bias=bias, rw=rw)["Y"].astype(np.float64)
    assert got.shape == (R, F)
    want = np.zeros((R, F))
    for e in range(E):
        r = slice(off[e], off[e + 1])
        h = X[r].astype(np.float64) @ W[e].astype(np.float64).T + bias[e].astype(np.float64)
        want[r] = rw[r, None] * h / (1 + np.exp(-h))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    Xg = rng.standard_normal((N, D)).astype(BF)
    idx = rng.integers(0, N, R).astype(np.int32)
    got = reference(MOE_GATHER)(X=Xg, idx=idx, off=off, W=W, rw=rw)["Y"].astype(np.float64)
    want = rw[:, None] * np.concatenate([Xg[idx[off[e]:off[e + 1]]].astype(np.float64) @ W[e].astype(np.float64).T
                                         for e in range(E)])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    with pytest.raises(KspecReferenceError, match="'off'.*must not decrease"):
        reference(MOE_GROUPED)(X=X, off=np.array([0, 7, 5, 12], np.int32), W=W, bias=bias, rw=rw)
    bad = idx.copy()
    bad[3] = N
    with pytest.raises(KspecRuntimeError, match=r"idx\[e, t\] of 'X'.* is 10"):
        reference(MOE_GATHER)(X=Xg, idx=bad, off=off, W=W, rw=rw)


def test_moe_grouped_and_gathered_gemms_plan_one_grouped_gemm_on_both_archs():
    """One GEMM batched over the experts, A and D packed by `off` (M = the packed row count), bias
    per expert and routing weight per row in the epilogue: the grouped kernels on both archs; the
    gathered variant is one grouped GEMM whose A rows are read through idx."""
    (p,) = _plans(MOE_GROUPED).plans
    for arch in ARCHS:
        assert p.kind == "gemm" and p.choices[arch].backend == "cute" and p.choices[arch].fallback is None
    assert dict(p.ir.gemm.dims)["M"] == "off_rows" and dict(p.ir.gemm.dims)["L"] == "E"
    from kspec.backends.cute.backend import CuteBackend
    q = p.ir.buffer("rw")
    from dataclasses import replace
    bad = replace(p.ir, buffers=tuple(replace(b, packed=None) if b is q else b for b in p.ir.buffers))
    assert "epilogue input rw (col_batched)" in CuteBackend().can_implement(bad, "sm90a")
    (p,) = _plans(MOE_GATHER).plans
    assert p.kind == "gemm" and all(p.choices[a].backend == "cute" for a in ARCHS)
    assert (p.ir.gemm.a_buffer, p.ir.gemm.a_rows) == ("X", "idx")
    assert dict(p.ir.gemm.dims) == {"M": "off_rows", "N": "F", "K": "D", "L": "E", "R": "N"}
    from kspec.compiler.kir import ir_from_json, ir_to_json
    assert ir_from_json(ir_to_json(p.ir)) == p.ir


@needs_dsl
@pytest.mark.cute
def test_moe_grouped_gemm_builds_and_launches_over_every_group(quant_artifacts):
    """HGMMA from TMA-loaded A rows (2-D descriptor) and per-expert B (3-D), D through the ragged 3-D
    store descriptor; launches for several packings (an empty expert, a single row, ragged ends) match
    the cubin and the tensors (Y's descriptor starts 2^30 rows before Y: the ragged view); decreasing
    offsets or a last offset other than the row count are refused before any launch."""
    import kspec
    from kspec.core import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    from kspec.runtime.tensors import DeviceBuffer
    art = quant_artifacts("moe_grouped_gemm")
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    assert plan["args"] == ["X", "W", "off", "rw", "bias", "Y"]
    for arch, mma in (("sm90a", "HGMMA.64x128x16.F32.BF16"), ("sm100a", "UTCHMMA")):
        sass = cubin_sass(art / plan["binaries"][arch]["cubin"])
        if sass is not None:
            assert mma in sass and "UTMALDG.2D" in sass and "UTMASTG.3D" in sass, arch
    mod = kspec.load(art)
    for arch, cc in (("sm90a", (9, 0)), ("sm100a", (10, 0))):
        with FakeDriver(cc, sm_count=132) as fake:
            for sz in ({"E": 4, "D": 256, "F": 384}, {"E": 8, "D": 64, "F": 128, "off_rows": 8},
                       {"E": 3, "D": 128, "F": 136, "off_rows": 300}):
                call = fake_call(mod, "moe_grouped_gemm", sz, fake)
                assert check_call(call, arch, mod) == []
                rows = call.sizes["off_rows"]
                tiles = (-(-rows // 128) + sz["E"]) * -(-sz["F"] // 128)
                assert call.launches[0].grid[0] * call.launches[0].grid[1] * call.launches[0].grid[2] == min(tiles, 132)
    with FakeDriver((9, 0), sm_count=132) as fake:
        E, D, F, R = 3, 64, 128, 40
        bufs = {}
        for name, shape, dt, size in (("X", (R, D), "bf16", 2), ("W", (E, F, D), "bf16", 2), ("bias", (E, F), "bf16", 2),
                                      ("rw", (R,), "f32", 4)):
            bufs[name] = DeviceBuffer(fake.alloc(int(np.prod(shape)) * size, name), shape, dt)
        n = len(fake.launches)
        for offs, msg in (([0, 30, 20, 40], r"off\[2\] = 20 .*off\[1\] = 30|decrease"),
                          ([0, 10, 20, 39], r"the last offset off\[3\] = 39 must be the row count")):
            o = fake.alloc(16, "off")
            fake.upload(o, np.array(offs, np.int32).tobytes())
            with pytest.raises(KspecRuntimeError, match=msg):
                mod.moe_grouped_gemm(off=DeviceBuffer(o, (4,), "i32"), **bufs)
        assert len(fake.launches) == n


@needs_dsl
@pytest.mark.cute
def test_moe_gather_gemm_gathers_a_rows_by_cp_async_and_checks_indices(quant_artifacts):
    """Both archs: A rows by 16-byte cp.async (LDGSTS) with mbarrier arrivals, B by TMA, D by the
    ragged store; launches match the cubin; a token index out of [0, N) and a K that is not a
    multiple of 64 are refused before any launch."""
    import kspec
    from kspec.core import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    from kspec.runtime.tensors import DeviceBuffer
    art = quant_artifacts("moe_gather_gemm")
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    assert plan["args"] == ["X", "W", "off", "idx", "rw", "Y"]
    assert [d[0] for d in plan["dims"]] == ["M", "N", "K", "L", "R"]
    for arch, mma in (("sm90a", "HGMMA.64x128x16.F32.BF16"), ("sm100a", "UTCHMMA")):
        sass = cubin_sass(art / plan["binaries"][arch]["cubin"])
        if sass is not None:
            assert "LDGSTS.E" in sass and ".128" in sass and "ARRIVES.LDGSTSBAR" in sass and mma in sass, arch
            assert "UTMASTG.3D" in sass and "UTMALDG.3D" in sass and "UTMALDG.2D" not in sass, arch
    ranges = {(r["tensor"], r["target"]) for r in m["kernels"][0]["index_ranges"]}
    assert ("idx", "X") in ranges and {("off", "idx"), ("off", "rw")} & ranges
    mod = kspec.load(art)
    for arch, cc in (("sm100a", (10, 0)), ("sm90a", (9, 0))):
        with FakeDriver(cc, sm_count=132) as fake:
            for sz in ({"E": 4, "D": 256, "F": 384, "N": 1000}, {"E": 8, "D": 64, "F": 128, "N": 10, "off_rows": 8}):
                call = fake_call(mod, "moe_gather_gemm", sz, fake)
                assert check_call(call, arch, mod) == []
    with FakeDriver((9, 0), sm_count=132) as fake:
        E, D, F, N, R = 2, 64, 128, 10, 12
        def buf(shape, dt, size, data=None):
            p = fake.alloc(int(np.prod(shape)) * size, "t")
            if data is not None:
                fake.upload(p, np.asarray(data).tobytes())
            return DeviceBuffer(p, shape, dt)
        off = buf((3,), "i32", 4, np.array([0, 5, 12], np.int32))
        args = dict(X=buf((N, D), "bf16", 2), W=buf((E, F, D), "bf16", 2), rw=buf((R,), "f32", 4), off=off)
        n = len(fake.launches)
        with pytest.raises(KspecRuntimeError, match="idx"):
            mod.moe_gather_gemm(idx=buf((R,), "i32", 4, np.array([0] * 11 + [N], np.int32)), **args)
        args["X"], args["W"] = buf((N, 72), "bf16", 2), buf((E, F, 72), "bf16", 2)
        with pytest.raises(KspecRuntimeError, match="multiple of 64"):
            mod.moe_gather_gemm(idx=buf((R,), "i32", 4, np.zeros(R, np.int32)), **args)
        assert len(fake.launches) == n


def test_mxfp8_plans_the_tcgen05_block_scaled_mma_on_sm100a_only():
    (p,) = _plans(SPECS / "mxfp8_gemm.kspec", ("sm100a",)).plans
    assert p.kind == "gemm" and p.choices["sm100a"].backend == "cute"
    assert [(s.dtype, s.block_k, s.block_mn) for s in p.ir.gemm.block_scales] == [("f8e8m0", 32, 1)] * 2
    from kspec.backends.cute.backend import CuteBackend
    assert "sm100a only" in CuteBackend().can_implement(p.ir, "sm90a")
    # one table of block-scaled kinds: MXFP4 (FP4 data, E8M0 per 32) and NVFP4 (FP4, E4M3 per 16) too
    from kspec.backends.desc import BlockScale

    def desc(data, scale, block):
        return GemmDesc("k_0", "sm100a", Operand("t0", data, "row"), Operand("t1", data, "col"), "f32",
                        Store("t4", Accum(), "bf16"), scales=(BlockScale("t2", "a", scale, block, 1),
                                                              BlockScale("t3", "b", scale, block, 1)))
    assert [k.name for k in gemm.MX_KINDS] == ["MXFP8", "MXFP4", "NVFP4"]
    for data, scale, block, name, kmul in (("f8e4m3", "f8e8m0", 32, "MXFP8", 128), ("f4e2m1", "f8e8m0", 32, "MXFP4", 256),
                                           ("f4e2m1", "f8e4m3", 16, "NVFP4", 256)):
        d = desc(data, scale, block)
        assert gemm.mx_kind(d).name == name and gemm._block_scale_problem(d, "sm100a") is None
        assert gemm.size_multiples(d) == (("K", kmul),)
        assert "sm100a only" in gemm._block_scale_problem(d, "sm90a")
    # fp8 data with NVFP4's scales, FP4 data with scales no kind has: refused by name
    assert "takes NVFP4 (f4e2m1 data)" in gemm._block_scale_problem(desc("f8e4m3", "f8e4m3", 16), "sm100a")
    assert "FP4 data is read by the block-scaled MMA only" in gemm.can_implement(desc("f4e2m1", "f8e4m3", 32),
                                                                                 "sm100a")


@needs_dsl
@pytest.mark.cute
def test_mxfp8_builds_block_scaled_utcqmma_and_launches(quant_artifacts):
    """tcgen05.cp of both scale tiles to tensor memory (UTCCP) and block-scaled UTCQMMA (scale-factor
    operands in tensor memory), the scales copied 4 bytes a row by cp.async (LDGSTS + mbarrier
    arrivals), A/B by TMA; launches match the cubin; a K that is not a multiple of 32 is refused by
    the quotient check, one that is not a multiple of 128 (the K tile) by the plan's size multiple,
    before launch."""
    import kspec
    from kspec.core import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    art = quant_artifacts("mxfp8_gemm")
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    assert list(plan["binaries"]) == ["sm100a"] and plan["args"] == ["A", "B", "sa", "sb", "D"]
    assert plan["alignment"]["sa"] == 4 and plan["alignment"]["sb"] == 4 and plan["multiples"] == {"K": 128}
    sass = cubin_sass(art / plan["binaries"]["sm100a"]["cubin"])
    if sass is not None:
        assert sass.count("UTCCP.T.S.4x32dp128bit") == 2 and sass.count("UTCQMMA") == 4
        mma = [l for l in sass.splitlines() if "UTCQMMA" in l][0]
        assert mma.count("tmem[") == 3                    # D, and the two scale-factor operands
        assert "LDGSTS.E" in sass and "ARRIVES.LDGSTSBAR" in sass and "UTMALDG.3D" in sass
    mod = kspec.load(art)
    with FakeDriver((10, 0), sm_count=148) as fake:
        for sz in ({"M": 256, "N": 256, "K": 512}, {"M": 200, "N": 384, "K": 128}):
            call = fake_call(mod, "mxfp8_gemm", sz, fake)
            assert check_call(call, "sm100a", mod) == []
        n = len(fake.launches)
        with pytest.raises(KspecRuntimeError, match=r"K = 100 .* not a multiple of 32"):
            fake_call(mod, "mxfp8_gemm", {"M": 64, "N": 128, "K": 100}, fake)
        with pytest.raises(KspecRuntimeError, match=r"K = 96 .* not a multiple of 128"):
            fake_call(mod, "mxfp8_gemm", {"M": 64, "N": 128, "K": 96}, fake)
        assert len(fake.launches) == n


def test_e8m0_host_arrays_round_trip_through_the_device():
    """E8M0 scales go to the device and back as ml_dtypes arrays (the fake driver's memory here)."""
    from kspec.runtime import transfer
    from kspec.runtime.fakedriver import FakeDriver
    with FakeDriver((10, 0)):
        a = (2.0 ** np.arange(-3, 5)).astype(np.float32).astype(ml_dtypes.float8_e8m0fnu).reshape(2, 4)
        back = transfer.from_device(transfer.from_numpy(a, "f8e8m0"))
        assert back.dtype == a.dtype and np.array_equal(back.astype(np.float32), a.astype(np.float32))


@pytest.mark.parametrize("name, dt", [("f8e5m2", "float8_e5m2"), ("f8e4m3", "float8_e4m3fn"), ("bf16", "bfloat16")])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_ml_dtypes_host_arrays_round_trip_in_both_layouts(name, dt, layout):
    """fp8 and bf16 host arrays go to the device in a layout and come back equal (the fake driver's
    memory); float8_e5m2 once failed there: numpy's as_strided does not understand its typestr."""
    from kspec.runtime import transfer
    from kspec.runtime.fakedriver import FakeDriver
    a = (np.arange(24, dtype=np.float32).reshape(4, 6) % 7 - 3).astype(getattr(ml_dtypes, dt))
    with FakeDriver((10, 0)):
        back = transfer.from_device(transfer.from_numpy(a, name, layout=layout))
    assert back.dtype == a.dtype and np.array_equal(back.astype(np.float32), a.astype(np.float32))


def test_fp4_host_arrays_are_packed_two_a_byte_on_the_device():
    """from_numpy/to_device take FP4 host arrays (ml_dtypes float4_e2m1fn, a value a byte) and the
    device holds them two a byte along the contiguous axis, value 2i in the low nibble; the device
    bytes are checked against nibbles computed here, and every way back (DeviceArray.to_numpy,
    from_device, the runtime's read of a strided view) unpacks them.  A layout whose rows would
    start mid-byte is refused by name before any copy."""
    from kspec.core import KspecRuntimeError
    from kspec.runtime import transfer
    from kspec.runtime.fakedriver import FakeDriver
    from kspec.runtime.tensors import TensorView
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 16, size=(4, 8)).astype(np.uint8)
    a = codes.view(ml_dtypes.float4_e2m1fn)
    want = _e2m1(codes)
    with FakeDriver((10, 0)) as fake:
        for layout, mem in (("row", codes), ("col", np.ascontiguousarray(codes.T))):
            d = transfer.from_numpy(a, "f4e2m1", layout=layout)
            assert d.nbytes == codes.size // 2
            raw = np.frombuffer(fake.copy_to_host(d.ptr, d.nbytes, 0, "test"), np.uint8)
            flat = mem.ravel()
            assert raw.tolist() == [int(flat[2 * i]) | (int(flat[2 * i + 1]) << 4) for i in range(raw.size)]
            back = d.to_numpy()
            assert back.dtype == np.dtype(ml_dtypes.float4_e2m1fn) and back.shape == a.shape
            assert np.array_equal(back.astype(np.float64), want)
            assert np.array_equal(transfer.from_device(d).astype(np.float64), want)
        # a strided view into the row copy: rows 1..3, values 2..7 (starts on byte 5)
        d = transfer.from_numpy(a, "f4e2m1")
        view = TensorView(d.ptr + (8 + 2) // 2, (3, 6), (8, 1), "f4e2m1", 0, "test view")
        assert np.array_equal(transfer.read_view(view).astype(np.float64), want[1:, 2:])
        with pytest.raises(KspecRuntimeError, match="f4e2m1 strides"):
            transfer.from_numpy(a[:3], "f4e2m1", layout="col")     # col rows of 3 values: odd strides
        # float32 values are rounded to E2M1 by the conversion, then packed
        assert np.array_equal(transfer.from_numpy(np.float32([[0.5, -6.0]]), "f4e2m1").to_numpy().astype(float),
                              [[0.5, -6.0]])


# ------------------------------------------------------------------ NVFP4 / MXFP4 (FP4 data, block-scaled)

NVFP4_SPEC = (SPECS / "nvfp4_gemm.kspec").read_text()
MXFP4 = """target sm100a
kernel mxfp4_gemm {
  in  A  : f4e2m1[M, K]
  in  B  : f4e2m1[N, K]
  in  sa : f8e8m0[M, K / 32]
  in  sb : f8e8m0[N, K / 32]
  out D  : bf16[M, N]
  D[m, n] = sum(k) A[m, k] * sa[m, k / 32] * B[n, k] * sb[n, k / 32]
}"""
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1(codes):
    """FP4 E2M1 values of 4-bit codes, by table: bit 3 the sign, bits 0..2 index 0, .5, 1, 1.5, 2, 3, 4, 6."""
    codes = np.asarray(codes)
    return np.where(codes & 8, -1.0, 1.0) * np.array(E2M1_TABLE)[codes & 7]


def _e4m3(bits):
    """E4M3 (fn) values of bytes: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals at e = 0."""
    bits = np.asarray(bits).astype(np.int64)
    e, m = (bits >> 3) & 15, bits & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where(bits & 0x80, -mag, mag)


def test_nvfp4_and_mxfp4_references_match_float64_numpy_decoded_by_table():
    rng = np.random.default_rng(24)
    M, N, K = 7, 12, 64
    ca, cb = rng.integers(0, 16, (M, K)), rng.integers(0, 16, (N, K))
    A4 = _e2m1(ca).astype(ml_dtypes.float4_e2m1fn)          # exact: every value is an E2M1 value
    B4 = _e2m1(cb).astype(ml_dtypes.float4_e2m1fn)
    assert np.array_equal(A4.view(np.uint8) & 15, ca)        # and the codes are the table's
    # E4M3 scales: positive, normal and subnormal, never NaN (0x7F)
    qa, qb = rng.integers(0x01, 0x60, (M, K // 16)), rng.integers(0x01, 0x60, (N, K // 16))
    sa, sb = qa.astype(np.uint8).view(E4M3), qb.astype(np.uint8).view(E4M3)
    out = reference(NVFP4_SPEC)(A=A4, B=B4, sa=sa, sb=sb, alpha=0.75)
    a = _e2m1(ca) * np.repeat(_e4m3(qa), 16, axis=1)
    b = _e2m1(cb) * np.repeat(_e4m3(qb), 16, axis=1)
    np.testing.assert_allclose(out["D"].astype(np.float64), 0.75 * (a @ b.T), rtol=8e-3, atol=1e-6)
    # MXFP4: E8M0 scales per 32 (2^(byte - 127))
    ea, eb = rng.integers(120, 134, (M, K // 32)), rng.integers(120, 134, (N, K // 32))
    out = reference(MXFP4)(A=A4, B=B4, sa=ea.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu),
                           sb=eb.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu))
    a = _e2m1(ca) * np.repeat(2.0 ** (ea - 127.0), 32, axis=1)
    b = _e2m1(cb) * np.repeat(2.0 ** (eb - 127.0), 32, axis=1)
    np.testing.assert_allclose(out["D"].astype(np.float64), a @ b.T, rtol=8e-3, atol=1e-6)


def test_nvfp4_and_mxfp4_plan_one_block_scaled_gemm_on_sm100a():
    for src, kind, scale in ((SPECS / "nvfp4_gemm.kspec", "NVFP4", ("f8e4m3", 16, 1)),
                             (MXFP4, "MXFP4", ("f8e8m0", 32, 1))):
        (p,) = _plans(src, ("sm100a",)).plans
        assert p.kind == "gemm" and p.choices["sm100a"].backend == "cute"
        assert [(s.dtype, s.block_k, s.block_mn) for s in p.ir.gemm.block_scales] == [scale] * 2
        from kspec.backends.cute.backend import CuteBackend
        desc = CuteBackend()._gemm_desc(p.ir, "sm100a").desc
        assert gemm.mx_kind(desc).name == kind and gemm.k_tile(desc.a.dtype) == 256
        assert "sm100a only" in CuteBackend().can_implement(p.ir, "sm90a")


def test_fp4_views_count_values_packed_two_a_byte():
    """The one rule for f4e2m1 tensors (kspec.runtime.dtypes.span_bytes): shapes and strides count
    values, packed two a byte along the contiguous axis; other strides are even.  torch's
    float4_e2m1fn_x2 (and its DLPack export, 4 bits x 2 lanes) counts bytes: converted to values."""
    from kspec.core import KspecRuntimeError
    from kspec.runtime import dtypes, tensors
    assert dtypes.span_bytes("f4e2m1", (3, 64), (64, 1)) == 96
    assert dtypes.span_bytes("f4e2m1", (1, 5), (6, 1)) == 3 and dtypes.span_bytes("f8e4m3", (3, 64), (64, 1)) == 192
    assert dtypes.span_bytes("f4e2m1", (0, 64), (64, 1)) == 0
    assert dtypes.from_dlpack(17, 4, 2) == "f4e2m1" and dtypes.from_dlpack(17, 4, 1) == "f4e2m1"
    assert tensors._fp4_values((4, 32), (32, 1)) == ((4, 64), (64, 1))
    assert tensors._fp4_values((2, 4, 8), (32, 8, 1)) == ((2, 4, 16), (64, 16, 1))
    v = tensors.as_view(tensors.DeviceBuffer(0x1000, (4, 64), "f4e2m1", strides=(64, 1)), "argument 'A'", 0)
    assert v.byte_range() == (0x1000, 0x1000 + 128)
    with pytest.raises(KspecRuntimeError, match=r"argument 'A': f4e2m1 strides \(65, 1\).*two a byte"):
        tensors.as_view(tensors.DeviceBuffer(0x1000, (4, 64), "f4e2m1", strides=(65, 1)), "argument 'A'", 0)


@needs_dsl
@pytest.mark.cute
def test_nvfp4_builds_block_scaled_utcomma_and_launches(quant_artifacts, tmp_path):
    """NVFP4 and MXFP4 on the one block-scaled kernel: tcgen05.cp of the scale tiles (four 128 x 4
    chunks each: 16 scales a row per 256-value K tile for NVFP4, 8 for MXFP4) and the FP4 block-scaled
    MMA (UTCOMMA, kind::mxf4nvf4, scale factors in tensor memory), scales by 4-byte cp.async, A/B
    (packed FP4) by TMA; launches match the cubin with alpha in the parameters; an odd K is refused
    by the FP4 packing rule (rows start on a byte), one not a multiple of 16 by the quotient check,
    one not a multiple of 256 by the plan's size multiple, all before any launch."""
    import kspec
    from kspec.compile import compile_spec
    from kspec.core import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    art = quant_artifacts("nvfp4_gemm")
    (tmp_path / "mxfp4_gemm.kspec").write_text(MXFP4)
    from kspec.backends.build import CompileCache
    mx = compile_spec(tmp_path / "mxfp4_gemm.kspec", None, tmp_path / "out",
                      cache=CompileCache(test_cache_root()), backend="cute")
    for a, copies in ((art, 8), (mx, 4)):
        m = json.loads((a / "manifest.json").read_text())
        (plan,) = m["kernels"][0]["plans"]
        assert list(plan["binaries"]) == ["sm100a"] and plan["args"] == ["A", "B", "sa", "sb", "D"]
        assert plan["alignment"]["sa"] == 4 and plan["multiples"] == {"K": 256}
        sass = cubin_sass(a / plan["binaries"]["sm100a"]["cubin"])
        if sass is not None:
            assert sass.count("UTCCP.T.S.4x32dp128bit") == copies and sass.count("UTCOMMA") == 4
            assert "UTCQMMA" not in sass and "UTCHMMA" not in sass
            mma = next(line for line in sass.splitlines() if "UTCOMMA" in line)
            assert mma.count("tmem[") == 3                # D, and the two scale-factor operands
            assert "LDGSTS.E" in sass and "ARRIVES.LDGSTSBAR" in sass and "UTMALDG.3D" in sass
    mod = kspec.load(art)
    with FakeDriver((10, 0), sm_count=148) as fake:
        for sz in ({"M": 256, "N": 256, "K": 512}, {"M": 200, "N": 384, "K": 256}):
            call = fake_call(mod, "nvfp4_gemm", sz, fake, params={"alpha": 0.5})
            assert check_call(call, "sm100a", mod) == []
            assert struct.pack("<f", 0.5) in call.launches[0].params
            args = {x.name: x for x in call.plan_args[0]}
            assert args["A"].shape == (sz["M"], sz["K"]) and args["sa"].shape == (sz["M"], sz["K"] // 16)
        n = len(fake.launches)
        for k, why in ((100, r"K = 100 .* not a multiple of 16"), (255, r"'A': f4e2m1 strides \(255, 1\).*two a byte"),
                       (64, r"K = 64 .* not a multiple of 256")):
            with pytest.raises(KspecRuntimeError, match=why):
                fake_call(mod, "nvfp4_gemm", {"M": 64, "N": 128, "K": k}, fake)
        assert len(fake.launches) == n
    mod = kspec.load(mx)
    with FakeDriver((10, 0), sm_count=148) as fake:
        call = fake_call(mod, "mxfp4_gemm", {"M": 128, "N": 256, "K": 768}, fake)
        assert check_call(call, "sm100a", mod) == []
        with pytest.raises(KspecRuntimeError, match=r"K = 128 .* not a multiple of 256"):
            fake_call(mod, "mxfp4_gemm", {"M": 64, "N": 128, "K": 128}, fake)


def test_kspec_graph_plans_nvfp4_as_one_kernel(capsys):
    from kspec.cli import main
    rc = main(["graph", str(SPECS / "nvfp4_gemm.kspec"), "--sizes", "M=1024,N=1024,K=1024"])
    out = capsys.readouterr().out
    assert rc == 0 and "kernel nvfp4_gemm: 1 fused kernel" in out
    assert "block scales (inside the sum): sa of A per 1x16; sb of B per 1x16" in out
    assert re.search(r"nvfp4_gemm_0\s+gemm\s+\S+ GFLOP", out), out


def test_selftest_uploads_fp4_two_values_a_byte():
    """`kspec selftest` uploads f4e2m1 inputs as the device holds them: two E2M1 codes a byte along
    the contiguous axis, value 2i in the low nibble (torch's float4_e2m1fn_x2), after the layout's
    transpose; a row of odd length is refused."""
    import ml_dtypes

    from kspec.runtime.hostimage import pack_fp4
    from kspec.selftest import _storage
    v = np.array([[0.5, 1.0, -6.0, 3.0], [0.0, 1.5, 2.0, 4.0]], dtype=ml_dtypes.float4_e2m1fn)
    # E2M1 codes: 0.5 -> 1, 1 -> 2, -6 -> 0xF (sign 8 + 7), 3 -> 5, 0 -> 0, 1.5 -> 3, 2 -> 4, 4 -> 6
    assert pack_fp4(v).tolist() == [[0x21, 0x5F], [0x30, 0x64]]
    assert _storage(v, "row", "f4e2m1") == bytes([0x21, 0x5F, 0x30, 0x64])
    # col: the storage is the transpose [4, 2], packed along its last axis
    assert _storage(v, "col", "f4e2m1") == bytes([0x01, 0x32, 0x4F, 0x65])
    from kspec.core import KspecRuntimeError
    with pytest.raises(KspecRuntimeError, match="do not fill whole bytes"):
        pack_fp4(v[:, :3])
