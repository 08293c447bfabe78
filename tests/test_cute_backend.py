"""The CuTe DSL backend (backends/cute): epilogue generation checked with numpy (fast), capability
and configuration rules, the capture shim's ABI, and real offline builds (marker `cute`) of every
GEMM-family shipped spec for sm_90a and sm_100a: tensor-core SASS, a libc-only host library, and the
launch ABI through the fake-driver layer."""
from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import SPECS, test_cache_root

from kspec.backends.cute import build as cbuild
from kspec.backends.cute import compat, epilogue, gemm
from kspec.backends.desc import Accum, Const, GemmDesc, Load, Op, Operand, ReductionStore, Store
from kspec.core import KspecInternalError

ARCHS = ("sm90a", "sm100a")
HAVE_DSL = compat.available() is None
needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason=f"CuTe DSL unavailable: {compat.available()}")
needs_cc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")


def _desc(value, *, a="f16", b="f16", la="row", lb="col", out="f16", acc="f32", arch="sm90a", **kw):
    return GemmDesc("k_0", arch, Operand("t0", a, la), Operand("t1", b, lb), acc, Store("t9", value, out), **kw)


# ------------------------------------------------------------------ epilogue generation (numpy)

def _gelu64(x):
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))


def test_generated_epilogue_matches_float64_numpy():
    alpha = Load("t5", "scalar", "f32")
    bias, res, rs = Load("t2", "row", "f16"), Load("t3", "full", "f16"), Load("t4", "col", "f32")
    h = Op("gelu", (Op("add", (Op("mul", (alpha, Accum())), bias)),))
    v = Op("add", (Op("mul", (h, rs)), res))
    v = Op("clamp", (Op("sub", (v, Op("silu", (Accum(),)))), Const(-3.0), Const(3.0)))
    v = Op("maximum", (Op("div", (v, Const(2.0))), Op("neg", (Op("sigmoid", (Accum(),)),))))
    v = Op("add", (v, Op("gelu_tanh", (Op("tanh", (Op("abs", (Accum(),)),)),))))
    code = epilogue.generate(_desc(v))
    assert [l.name for l in code.inputs] == ["t2", "t4", "t3"] and [l.name for l in code.scalars] == ["t5"]
    assert code.input_kinds == ("row", "col", "full")
    rng = np.random.default_rng(0)
    acc = rng.standard_normal((16, 24)).astype(np.float32) * 2
    b = rng.standard_normal(24).astype(np.float32)
    r = rng.standard_normal((16, 24)).astype(np.float32)
    c = rng.standard_normal(16).astype(np.float32)
    (got,) = epilogue.run_numpy(code, acc, (np.broadcast_to(b, acc.shape), np.broadcast_to(c[:, None], acc.shape), r),
                                (np.float32(0.5),))
    x = acc.astype(np.float64)
    sig = 1 / (1 + np.exp(-x))
    want = _gelu64(0.5 * x + b) * c[:, None] + r
    want = np.clip(want - x * sig, -3, 3)
    want = np.maximum(want / 2, -sig)
    t = np.tanh(np.abs(x))
    want = want + 0.5 * t * (1 + np.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_generated_epilogue_shares_subexpressions_and_casts():
    s = Op("add", (Accum(), Load("t2", "row", "f16")))
    v = Op("mul", (Op("cast:bf16", (s,)), s))
    code = epilogue.generate(_desc(v))
    assert code.source.count("F.add(") == 1 and "F.cast(v0, 'bf16', 'f32')" in code.source
    acc = np.array([[1.0 + 2 ** -10]], np.float32)
    (got,) = epilogue.run_numpy(code, acc, (np.zeros((1, 1), np.float32),), ())
    assert got[0, 0] == np.float32(1.0) * acc[0, 0]          # bf16 rounds 1 + 2^-10 to 1


def test_no_user_text_in_generated_code():
    code = epilogue.generate(_desc(Op("add", (Accum(), Load("evil'); import os #", "row", "f16")))))
    assert "evil" not in code.source and "import" not in code.source
    src = gemm.entry_source(_desc(Op("relu", (Accum(),))), "sm90a", gemm.CuteConfig((128, 128)), code)
    assert "evil" not in src


def test_unsupported_epilogues_have_reasons():
    aux = _desc(Accum(), aux_stores=(Store("t7", Accum(), "f32"),))
    assert "auxiliary" in epilogue.unsupported(aux)
    assert epilogue.unsupported(_desc(Accum(), aux_stores=(Store("t7", Accum(), "f16"),))) is None
    assert epilogue.unsupported(_desc(Accum(), reductions=(ReductionStore("t8", "max", "n", Accum(), "f32"),))) is None
    bad_op = _desc(Accum(), reductions=(ReductionStore("t8", "min", "n", Accum(), "f32"),))
    assert "sum or max" in epilogue.unsupported(bad_op)
    assert "f32 atomics" in epilogue.unsupported(_desc(Accum(), reductions=(ReductionStore("t8", "sum", "m", Accum(),
                                                                                            "f16"),)))
    int_red = _desc(Accum(), a="i8", b="i8", out="i32", acc="i32",
                    reductions=(ReductionStore("t8", "max", "n", Accum(), "f32"),))
    assert "f32 atomics" in epilogue.unsupported(int_red)
    assert "not supported" in epilogue.unsupported(_desc(Accum(), reductions=(
        ReductionStore("t8", "sum", "n", Op("mod", (Accum(), Const(3.0))), "f32"),)))
    assert "not supported" in epilogue.unsupported(_desc(Op("floordiv", (Accum(), Const(2.0)))))
    with pytest.raises(KspecInternalError):
        epilogue.generate(bad_op)


def test_epilogue_conditions_run_on_the_numpy_twin():
    """Comparisons, and/or/not and where (what `kspec grad` writes for gelu' at 0, relu', a clamp's
    range) generate F.eq/F.land/F.where calls; the generated function, run with dslops.numpy_ops(),
    selects element by element."""
    from kspec.backends.cute import dslops
    z = Accum()
    cdf = Op("where", (Op("eq", (z, Const(0.0))), Const(0.5), Op("div", (Op("gelu", (z,)), z))))
    inside = Op("and", (Op("ge", (z, Const(-1.0))), Op("not", (Op("gt", (z, Const(1.0))),))))
    d = _desc(Op("add", (cdf, Op("where", (inside, Const(1.0), Const(0.0))))))
    assert epilogue.unsupported(d) is None
    code = epilogue.generate(d)
    assert "F.where(" in code.source and "F.land(" in code.source and "F.lnot(" in code.source
    ns: dict = {}
    exec(code.source, ns)
    ns["F"] = dslops.numpy_ops()
    acc = np.array([0.0, 2.0, -0.5, -3.0], dtype=np.float32)
    with np.errstate(invalid="ignore"):            # gelu(0) / 0, in the branch not taken
        (out,) = ns["kspec_epilogue"](acc, [], [])
    phi = np.array([0.5, 0.97725, 0.30854, 0.00135])
    np.testing.assert_allclose(out, phi + [1.0, 0.0, 1.0, 0.0], atol=2e-4)


def _rowmax_colsum_desc(arch="sm90a"):
    """D = gelu(alpha * acc + bias[n]) (f16); rowmax[m] = max_n (alpha * acc + bias); colsum[n] = sum_m D
    before its rounding to f16."""
    y = Op("add", (Op("mul", (Load("t5", "scalar", "f32"), Accum())), Load("t2", "row", "f16")))
    g = Op("gelu", (y,))
    return GemmDesc("k_0", arch, Operand("t0", "f16", "row"), Operand("t1", "f16", "col"), "f32",
                    Store("t3", g, "f16"), reductions=(ReductionStore("t4", "max", "n", y, "f32"),
                                                       ReductionStore("t6", "sum", "m", g, "f32")))


def test_reduced_epilogue_values_match_float64_numpy():
    """The generated epilogue returns D and then each value to reduce; reduced along n (row max)
    and m (column sum) they match float64 numpy.  ABI: reduction outputs last (CUTLASS order),
    (M, L) / (N, L) vectors, 4-byte aligned, initialised by the loader (max: -inf, sum: 0)."""
    d = _rowmax_colsum_desc()
    code = epilogue.generate(d)
    assert code.reductions == (("max", "n"), ("sum", "m"))
    rng = np.random.default_rng(1)
    acc = rng.standard_normal((40, 24)).astype(np.float32) * 3
    bias = rng.standard_normal(24).astype(np.float32)
    dv, yv, gv = epilogue.run_numpy(code, acc, (np.broadcast_to(bias, acc.shape),), (np.float32(0.75),))
    y64 = 0.75 * acc.astype(np.float64) + bias
    g64 = _gelu64(y64)
    np.testing.assert_allclose(yv.max(axis=1), y64.max(axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gv.astype(np.float64).sum(axis=0), g64.sum(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dv, gv)
    assert gemm.abi_names(d, code) == ("t0", "t1", "t2", "t3", "t4", "t6")
    t = {x.name: x for x in gemm.tensor_abi(d, code)}
    assert (t["r0"].shape, t["r0"].stride, t["r0"].tma, t["r0"].ptr_index) == (("M", "L"), (1, ("M",)), False, 4)
    assert (t["r1"].shape, t["r1"].stride, t["r1"].ptr_index) == (("N", "L"), (1, ("N",)), 5)
    assert d.reduction_init() == (("t4", "neg_inf"), ("t6", "zero"))


def _expected_reduction(op, axis, field, coords, bounds):
    """float64 numpy: the reduction of field[m, n] over the (m, n) the threads hold, inside `bounds`."""
    key = 0 if axis == "n" else 1
    ident = -np.inf if op == "max" else 0.0
    out = np.full(bounds[key], ident)
    held = [c for t in coords for c in coords[t]]
    assert len(set(held)) == len(held), "a coordinate is held twice"
    for m, n in held:
        if m < bounds[0] and n < bounds[1]:
            i = (m, n)[key]
            out[i] = max(out[i], field[m, n]) if op == "max" else out[i] + float(field[m, n])
    return out


def _check_plan_numerics(plan, axis, coords, bounds, seed=0):
    from kspec.backends.cute import reduce as red
    rng = np.random.default_rng(seed)
    ext = (max(c[0] for t in coords for c in coords[t]) + 1, max(c[1] for t in coords for c in coords[t]) + 1)
    field = (rng.standard_normal(ext) * 4).astype(np.float32)
    values = {t: [field[c[0], c[1]] for c in coords[t]] for t in coords}
    got = red.simulate(plan, values, coords, bounds)
    want = _expected_reduction(plan.op, axis, field, coords, bounds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_dsl
@pytest.mark.parametrize("op,axis,bits", [("max", "n", (1, 2)), ("sum", "m", (4, 8, 16)), ("sum", "n", (1, 2))])
def test_reduction_plan_on_a_wgmma_like_layout(op, axis, bits):
    """Register grouping, butterfly lane bits and representative lanes derived from coordinates
    (a 128-thread WGMMA-style accumulator layout), checked against float64 numpy on a partial tile."""
    from kspec.backends.cute import reduce as red
    coords = {t: [(16 * (t // 32) + (t % 32) // 4 + 8 * ((v // 2) % 2), 2 * (t % 4) + v % 2 + 8 * (v // 4))
                  for v in range(16)] for t in range(128)}
    plan = red.make_plan(op, axis, {t: coords[t] for t in red.plan_threads(128)})
    assert plan.lane_bits == bits
    assert len(plan.groups) == (2 if axis == "n" else 8)
    for bounds in ((64, 32), (50, 13), (3, 1)):
        _check_plan_numerics(plan, axis, coords, bounds)


@needs_dsl
def test_reduction_plan_rejects_non_uniform_layouts():
    from kspec.backends.cute import reduce as red
    coords = {t: [(t, 0), (t, 1)] for t in range(32)}
    coords[5] = [(5, 0), (6, 1)]                      # thread 5 holds two rows: grouped differently
    with pytest.raises(KspecInternalError, match="thread 5"):
        red.make_plan("max", "n", coords)
    with pytest.raises(KspecInternalError, match="incomplete"):
        red.make_plan("max", "n", {t: [(t, 0)] for t in range(20)})


# ------------------------------------------------------------------ capabilities and configurations

@needs_dsl
@pytest.mark.parametrize("a,b,la,lb,arch,ok", [
    ("f16", "f16", "col", "row", "sm90a", True),
    ("bf16", "bf16", "row", "row", "sm100a", True),
    ("f8e4m3", "f8e5m2", "row", "col", "sm90a", True),
    ("f8e4m3", "f8e4m3", "col", "col", "sm90a", False),     # WGMMA fp8 needs K-major operands
    ("f8e4m3", "f8e5m2", "row", "col", "sm100a", True),      # tcgen05 kind::f8f6f4 mixes kinds
    ("f8e5m2", "f8e4m3", "col", "row", "sm100a", True),
    ("tf32", "tf32", "row", "col", "sm90a", True),
    ("tf32", "tf32", "col", "col", "sm90a", False),         # tf32 WGMMA: K-major only (no 32-bit transpose)
    ("tf32", "tf32", "row", "row", "sm90a", False),
    ("tf32", "tf32", "col", "row", "sm100a", True),
    ("f16", "bf16", "row", "col", "sm100a", False),
])
def test_can_implement(a, b, la, lb, arch, ok):
    d = _desc(Accum(), a=a, b=b, la=la, lb=lb, out="f32", arch=arch)
    why = gemm.can_implement(d, arch)
    assert (why is None) == ok, why


@needs_dsl
def test_int8_needs_an_int32_accumulator_and_a_plain_store():
    assert gemm.can_implement(_desc(Accum(), a="i8", b="i8", out="i32", acc="i32"), "sm90a") is None
    bad = _desc(Op("relu", (Accum(),)), a="i8", b="i8", out="i32", acc="i32")
    assert "integer" in gemm.can_implement(bad, "sm100a")


def test_configurations():
    d = _desc(Accum())
    for arch in ARCHS:
        cands = gemm.candidates(d, arch)
        assert len(cands) >= 10 and all(gemm.valid_config(c, arch) is None for c in cands)
    assert gemm.default_config(d, "sm100a", {"M": 8192, "N": 8192}).use_2cta
    assert gemm.default_config(d, "sm90a", {"M": 32, "N": 4096}).tile == (64, 128)
    assert "2-CTA" in gemm.valid_config(gemm.CuteConfig((256, 128), (1, 1), True), "sm100a")
    assert gemm.valid_config(gemm.CuteConfig((64, 8)), "sm90a") is not None


def test_target_arch_restores_dsl_state():
    if not HAVE_DSL:
        pytest.skip("CuTe DSL unavailable")
    import os

    from cutlass.cutlass_dsl import CuTeDSL
    before = (CuTeDSL._get_dsl().envar.arch, os.environ.get("CUTE_DSL_ARCH"))
    with compat.target_arch("sm90a") as sm:
        assert sm == "sm_90a" and CuTeDSL._get_dsl().envar.arch == "sm_90a"
    assert (CuTeDSL._get_dsl().envar.arch, os.environ.get("CUTE_DSL_ARCH")) == before
    with pytest.raises(KspecInternalError):
        compat.dsl_arch("sm80")


# ------------------------------------------------------------------ parsing what the DSL writes

def test_ptx_param_layout():
    ptx = """.visible .entry kfn(
        .param .align 64 .b8 kfn_param_0[128],
        .param .align 4 .b8 kfn_param_1[12],
        .param .f32 kfn_param_2,
        .param .align 1 .b8 kfn_param_3[1],
        .param .u64 kfn_param_4,
        .param .align 8 .b8 kfn_param_5[40]
    )
    { ret; }"""
    name, offs, sizes = cbuild.ptx_params(ptx)
    assert name == "kfn"
    assert offs == (0, 128, 140, 144, 152, 160) and sizes == (128, 12, 4, 1, 8, 40)
    with pytest.raises(KspecInternalError):
        cbuild.ptx_params(ptx + ptx.replace("kfn", "kfn2"))


def test_header_check_catches_a_changed_export():
    code = epilogue.generate(_desc(Op("add", (Accum(), Load("t2", "row", "f16")))))
    tensors = gemm.tensor_abi(_desc(Accum()), code)
    structs = "".join(
        f"typedef struct {{\n    void *data;\n    int32_t dynamic_shapes[{len(t.dynamic_shapes)}];\n"
        + (f"    int64_t dynamic_strides[{len(t.dynamic_strides)}];\n" if t.dynamic_strides else "")
        + f"}} kspec_k_Tensor_{t.name}_t;\n" for t in tensors)
    params = ", ".join(["kspec_k_Kernel_Module_t *module"] + [f"kspec_k_Tensor_{t.name}_t *{t.name}" for t in tensors]
                       + ["int32_t max_clusters", "cudaStream_t stream"])
    wrapper = (f"static inline int32_t cute_dsl_kspec_k_wrapper({params}) {{\n"
               f"    _mlir_kspec_k__mlir_ciface_cutlass_kspec_entry_X(args, {len(tensors) + 3});\n}}\n")
    assert cbuild.check_header(structs + wrapper, tensors, 0) == "_mlir_kspec_k__mlir_ciface_cutlass_kspec_entry_X"
    with pytest.raises(KspecInternalError, match="tensor d"):
        cbuild.check_header(structs.replace("dynamic_strides[2];\n} kspec_k_Tensor_d_t", "dynamic_strides[1];\n} "
                                            "kspec_k_Tensor_d_t"), tensors, 0)
    with pytest.raises(KspecInternalError, match="signature"):
        cbuild.check_header(structs + wrapper.replace("int32_t max_clusters", "int64_t max_clusters"), tensors, 0)


def test_abi_order_matches_the_cutlass_backend():
    d = _desc(Op("add", (Op("mul", (Accum(), Load("t3", "full", "f16"))), Load("t2", "row", "f16"))))
    code = epilogue.generate(d)
    assert gemm.abi_names(d, code) == ("t0", "t1", "t3", "t2", "t9")
    idx = {t.name: t.ptr_index for t in gemm.tensor_abi(d, code)}
    assert idx == {"a": 0, "b": 1, "i0": 2, "i1": 3, "d": 4}


@needs_cc
def test_shim_structs_match_the_cuda_headers(tmp_path):
    inc = next((p for p in (Path("/usr/local/cuda/include"), *Path("/usr/local").glob("cuda-*/include"))
                if (p / "driver_types.h").exists()), None)
    if inc is None:
        pytest.skip("no CUDA headers")
    src = tmp_path / "check.c"
    src.write_text(f'#include "{cbuild.SHIM_C}"\n#include <driver_types.h>\n#include <stddef.h>\n'
                   "_Static_assert(sizeof(kspec_launch_config) == sizeof(cudaLaunchConfig_t), \"config\");\n"
                   "_Static_assert(offsetof(kspec_launch_config, dynamicSmemBytes) == offsetof(cudaLaunchConfig_t, dynamicSmemBytes), \"smem\");\n"
                   "_Static_assert(offsetof(kspec_launch_config, attrs) == offsetof(cudaLaunchConfig_t, attrs), \"attrs\");\n"
                   "_Static_assert(offsetof(kspec_launch_config, numAttrs) == offsetof(cudaLaunchConfig_t, numAttrs), \"n\");\n"
                   "_Static_assert(sizeof(kspec_launch_attribute) == sizeof(cudaLaunchAttribute), \"attr\");\n"
                   "_Static_assert(offsetof(kspec_launch_attribute, val) == offsetof(cudaLaunchAttribute, val), \"val\");\n"
                   "_Static_assert(KS_ATTR_CLUSTER_DIMENSION == cudaLaunchAttributeClusterDimension, \"cl\");\n"
                   "_Static_assert(KS_FUNC_ATTR_MAX_DYNAMIC_SMEM == cudaFuncAttributeMaxDynamicSharedMemorySize, \"f\");\n"
                   "_Static_assert(KS_DEV_ATTR_SM_COUNT == cudaDevAttrMultiProcessorCount, \"sm\");\n"
                   "_Static_assert(KS_DEV_ATTR_SMEM_OPTIN == cudaDevAttrMaxSharedMemoryPerBlockOptin, \"optin\");\n")
    r = subprocess.run(["gcc", "-fsyntax-only", f"-I{inc}", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ real offline builds (CuTe DSL)

CUTE_SPECS = {   # spec -> tensor-core instruction per arch (by operand dtype)
    "gemm": ("HGMMA", "UTCHMMA"),
    "gemm_bias_relu": ("HGMMA", "UTCHMMA"),
    "gemm_bias_gelu_residual": ("HGMMA", "UTCHMMA"),
    "batched_gemm": ("HGMMA", "UTCHMMA"),
    "batched_gemm_shared_b": ("HGMMA", "UTCHMMA"),     # the batch folded into M: one GEMM
    "masked_scores": ("HGMMA", "UTCHMMA"),             # a per-batch mask row in the epilogue
    "fp8_gemm_scaled": ("QGMMA", "UTCQMMA"),
    "gemm_int8": ("IGMMA", "UTCIMMA"),
    "gemm_rowmax": ("HGMMA", "UTCHMMA"),     # epilogue row max: shared + global atomics
    "gemm_tf32": ("HGMMA", "UTCHMMA"),       # sm90a: kspec's tf32 WGMMA op (K-major A and B)
}


@pytest.fixture(scope="module")
def cute_artifacts(tmp_path_factory):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    out = tmp_path_factory.mktemp("cute")
    cache = CompileCache(test_cache_root())
    done = {}

    def get(stem):
        if stem not in done:
            backend = "auto" if CUTE_SPECS[stem][0] is None else "cute"
            done[stem] = compile_spec(SPECS / f"{stem}.kspec", ARCHS, out, cache=cache, backend=backend)
        return done[stem]
    return get


def _sass(cubin: Path, tc) -> str:
    r = subprocess.run([str(tc.cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, env=tc.env())
    assert r.returncode == 0, r.stderr
    return r.stdout


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("stem", [pytest.param(s, marks=pytest.mark.nvcc) if CUTE_SPECS[s][0] is None else s
                                  for s in sorted(CUTE_SPECS)])
def test_shipped_gemm_spec_builds_offline_for_both_archs(cute_artifacts, stem):
    from kspec.backends.toolchain import find_toolchain
    art = cute_artifacts(stem)
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    assert "backend:cute" in m["toolchain"]
    try:
        tc = find_toolchain()
    except Exception:
        tc = None
    for arch, insn in zip(ARCHS, CUTE_SPECS[stem]):
        b = plan["binaries"][arch]
        if insn is None:
            assert b["config"].get("backend") != "cute"
            continue
        assert b["config"]["backend"] == "cute" and b["symbol"].startswith("kernel_cutlass_kernel_kspec")
        so = art / b["host"]
        # the host library needs glibc only (libc and, for thread-local capture state, the loader's
        # __tls_get_addr) and resolves every CUDA wrapper itself
        deps = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
        needed = {l.split("[")[1].rstrip("]") for l in deps.splitlines() if "(NEEDED)" in l}
        assert needed <= {"libc.so.6", "ld-linux-x86-64.so.2"} and "libc.so.6" in needed
        undef = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
        assert "_cuda" not in undef and "_cu" not in undef.replace("__cxa", "")
        exported = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
        assert sorted(l.split()[-1] for l in exported.splitlines()) == ["kspec_abi_version", "kspec_prepare",
                                                                         "kspec_workspace_size"]
        if tc is not None and tc.cuobjdump is not None:
            sass = _sass(art / b["cubin"], tc)
            assert f" {insn}." in sass or f" {insn} " in sass, f"{stem} {arch}: no {insn}"
            assert "UTMALDG" in sass and "UTMASTG" in sass


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_launch_abi_through_the_fake_driver(cute_artifacts, monkeypatch, arch):
    import kspec
    from kspec.runtime import driver
    from test_runtime import FakeCAI, MultiParamRecorder
    rec = MultiParamRecorder((9, 0) if arch == "sm90a" else (10, 0))
    monkeypatch.setattr(driver, "_driver", rec)
    art = cute_artifacts("gemm_bias_gelu_residual")
    mod = kspec.load(art)
    base = 0x7F0000000000
    M, N, K = 1000, 512, 256
    A = FakeCAI(base, (M, K))
    B = FakeCAI(base + 0x1000000, (K, N), strides=(2, K * 2))
    bias = FakeCAI(base + 0x2000000, (N,))
    R = FakeCAI(base + 0x3000000, (M, N))
    D = FakeCAI(base + 0x4000000, (M, N))
    mod.gemm_bias_gelu_residual(A, B, bias, R, D=D, alpha=0.5)
    (fn,) = [e for e in rec.log if e[0] == "function"]
    (launch,) = [e for e in rec.log if e[0] == "launch"]
    m = json.loads((art / "manifest.json").read_text())
    b = m["kernels"][0]["plans"][0]["binaries"][arch]
    assert fn[2] == b["symbol"] and fn[3].startswith(b"\x7fELF")
    _, what, grid, block, cluster, smem, stream, offsets, blob = launch
    assert offsets == tuple(int(x) for x in b["config"]["param_offsets"].split(","))
    tm, tn = (int(x) for x in b["config"]["tile"].split("x"))
    cm, cn = (int(x) for x in b["config"]["cluster"].split("x"))
    if b["config"]["2cta"] == "true":
        tm //= 2
    tiles = math.ceil(M / tm) * math.ceil(N / tn)
    assert cluster == (cm, cn, 1) and grid[0] == cm and grid[1] == cn
    assert grid[0] * grid[1] * grid[2] == min(tiles, 132 // (cm * cn) * (cm * cn))  # persistent, <= SM count
    assert block[0] in (192, 256, 384) and 0 < smem <= 232448
    # TMA descriptors carry the A, B and D addresses; the gathered inputs are passed as raw pointers
    words = set(struct.unpack_from(f"<{len(blob) // 8}Q", blob[:len(blob) // 8 * 8]))
    for t in (A, B, D, bias, R):
        assert t.__cuda_array_interface__["data"][0] in words
    alpha = struct.pack("<f", 0.5)
    assert alpha in blob


@needs_dsl
@pytest.mark.cute
def test_warm_compile_does_not_import_the_dsl(cute_artifacts, tmp_path):
    cute_artifacts("gemm_bias_relu")
    code = ("import sys, time; t = time.monotonic(); from kspec.compile import compile_spec; "
            "from kspec.backends.build import CompileCache; "
            f"compile_spec({str(SPECS / 'gemm_bias_relu.kspec')!r}, ('sm90a', 'sm100a'), {str(tmp_path)!r}, "
            f"cache=CompileCache({str(test_cache_root())!r}), backend='cute'); "
            "assert 'cutlass.cute' not in sys.modules, 'the DSL was imported'; print(time.monotonic() - t)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "gemm_bias_relu" / "manifest.json").exists()


@needs_dsl
@pytest.mark.cute
def test_resource_counts_come_from_the_cubin_without_cuobjdump(cute_artifacts, tmp_path):
    """kspec compile records registers and static shared memory from the cubin's ELF attributes
    (no cuobjdump run, which took about a second per cubin on the cold path); they equal cuobjdump's."""
    from kspec.compile import _resources
    art = cute_artifacts("gemm_bias_gelu_residual")
    m = json.loads((art / "manifest.json").read_text())
    for arch in ARCHS:
        b = m["kernels"][0]["plans"][0]["binaries"][arch]
        regs, smem = _resources(art / b["cubin"], None, tmp_path, b["symbol"])
        assert regs is not None and 24 <= regs <= 255 and smem is not None
        assert (b["registers"], b["smem"]) == (regs, smem)
        assert not (tmp_path / "resources").exists()          # nothing memoised: nothing was run
        from kspec.backends.toolchain import find_toolchain
        try:
            tc = find_toolchain()
        except Exception:
            continue
        from kspec.backends.inspect import sass_summary
        k = sass_summary(art / b["cubin"], tc).kernel(b["symbol"])
        assert (k.registers, k.shared_bytes) == (regs, smem)


@needs_dsl
@pytest.mark.cute
def test_prepare_rejects_misaligned_leading_dimensions(cute_artifacts):
    from kspec.runtime.glue import HostGlue
    art = cute_artifacts("gemm")
    m = json.loads((art / "manifest.json").read_text())
    b = m["kernels"][0]["plans"][0]["binaries"]["sm90a"]
    g = HostGlue(art / b["host"], "gemm")
    ok = g.prepare([256, 256, 64, 1], [1 << 20, 2 << 20, 3 << 20], [], 0, 0, 132)
    assert ok.grid[2] >= 1 and ok.params_size > 0
    with pytest.raises(Exception, match="K = 60: .*multiple of 8"):
        g.prepare([256, 256, 60, 1], [1 << 20, 2 << 20, 3 << 20], [], 0, 0, 132)
    empty = g.prepare([0, 256, 64, 1], [1 << 20, 2 << 20, 3 << 20], [], 0, 0, 132)
    assert 0 in empty.grid


LAYOUT_CASES = [  # (arch, A layout, B layout, D layout, dtype, config)
    ("sm90a", "row", "row", "row", "f16", gemm.CuteConfig((128, 256), (1, 2))),
    ("sm90a", "col", "col", "col", "bf16", gemm.CuteConfig((64, 128), (2, 1))),
    ("sm90a", "col", "row", "row", "f16", gemm.CuteConfig((128, 128), (1, 1), stages=3)),
    ("sm100a", "row", "row", "col", "bf16", gemm.CuteConfig((64, 256), (1, 1))),
    ("sm100a", "col", "col", "row", "f16", gemm.CuteConfig((256, 128), (4, 1), use_2cta=True)),
    ("sm100a", "col", "row", "row", "tf32", gemm.CuteConfig((128, 64), (2, 1))),
    ("sm90a", "row", "col", "row", "tf32", gemm.CuteConfig((128, 256), (1, 1))),     # two consumer warpgroups
]


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch,la,lb,ld,dt,cfg", LAYOUT_CASES)
def test_layouts_and_candidate_configurations_compile(arch, la, lb, ld, dt, cfg):
    """Every A/B layout combination, column-major D and non-default candidates (clusters, 2-CTA,
    64-row tiles, a stage cap) compile to tensor-core code, with a column bias and a residual."""
    v = Op("add", (Op("mul", (Accum(), Load("t2", "col", "f32"))), Load("t3", "full", dt if dt != "tf32" else "f32")))
    out = "f32" if dt == "tf32" else dt
    d = GemmDesc("k_0", arch, Operand("t0", dt, la), Operand("t1", dt, lb), "f32", Store("t9", v, out, ld))
    assert gemm.can_implement(d, arch) is None
    assert cfg in gemm.candidates(d, arch) or gemm.valid_config(cfg, arch) is None
    b = cbuild.build(d, arch, test_cache_root(), cfg)
    assert dict(b.config)["tile"] == f"{cfg.tile[0]}x{cfg.tile[1]}"
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        pytest.skip("no cuobjdump for the SASS check")
    sass = _sass(Path(b.cubin), tc)
    assert ("HGMMA" if arch == "sm90a" else "UTCHMMA") in sass
    if arch == "sm90a" and dt == "tf32":
        assert "HGMMA.64x256x8.F32.TF32" in sass
    if cfg.use_2cta:
        assert "UTCHMMA.2CTA" in sass


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_shared_memory_f32_add_has_no_native_instruction(arch, tmp_path):
    """Why the CuTe DSL column sums combine in shared memory with ATOMS.CAST.SPIN: ptxas gives CUDA
    C's atomicAdd on a __shared__ float and PTX `red.shared.add.f32` the same compare-and-swap loop
    on these archs, while an int add is one native ATOMS.ADD (reduce.py _atomic).  If a toolkit
    ever gets a native one, this fails and the DSL epilogue should be revisited."""
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no nvcc: {e}")
    if tc.cuobjdump is None:
        pytest.skip("no cuobjdump for the SASS check")
    src = tmp_path / "satom.cu"
    src.write_text(
        "__global__ void f(float* o, const float* x) { __shared__ float s[32]; s[threadIdx.x & 31] = 0.f;\n"
        "  __syncthreads(); atomicAdd(&s[threadIdx.x & 7], x[threadIdx.x]); __syncthreads(); o[threadIdx.x] = s[threadIdx.x & 31]; }\n"
        "__global__ void r(float* o, const float* x) { __shared__ float s[32]; s[threadIdx.x & 31] = 0.f; __syncthreads();\n"
        "  asm volatile(\"red.shared.add.f32 [%0], %1;\" :: \"r\"((unsigned)__cvta_generic_to_shared(&s[threadIdx.x & 7])),\n"
        "               \"f\"(x[threadIdx.x]) : \"memory\"); __syncthreads(); o[threadIdx.x] = s[threadIdx.x & 31]; }\n"
        "__global__ void i(int* o, const int* x) { __shared__ int s[32]; s[threadIdx.x & 31] = 0; __syncthreads();\n"
        "  atomicAdd(&s[threadIdx.x & 7], x[threadIdx.x]); __syncthreads(); o[threadIdx.x] = s[threadIdx.x & 31]; }\n")
    cubin = tmp_path / "satom.cubin"
    r = subprocess.run([str(tc.nvcc), "-cubin", f"-arch={arch}", "-O3", str(src), "-o", str(cubin)],
                       capture_output=True, text=True, env=tc.env())
    assert r.returncode == 0, r.stderr
    funcs = {}
    for chunk in _sass(cubin, tc).split("Function : ")[1:]:
        funcs[chunk.split()[0]] = chunk
    by = {name[3]: body for name, body in funcs.items()}         # _Z1f..., _Z1r..., _Z1i...
    assert "ATOMS.CAST.SPIN" in by["f"] and "ATOMS.CAST.SPIN" in by["r"]
    assert "ATOMS.ADD" in by["i"] and "ATOMS.CAST" not in by["i"]


RED_CASES = [("sm90a", gemm.CuteConfig((128, 256), (1, 1))),               # two consumer warpgroups
             ("sm100a", gemm.CuteConfig((256, 128), (2, 1), use_2cta=True)),  # a 2-CTA MMA tile
             ("sm100a", gemm.CuteConfig((64, 128), (1, 1)))]                  # the M=64 TMEM layout


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch,cfg", RED_CASES)
def test_epilogue_reductions_on_the_kernels_register_layouts(arch, cfg, tmp_path):
    """A row max and a column sum in one kernel: built (traced here, fresh cache), the plans the
    kernel derived from its own register layout combine the values its threads hold into the
    float64 numpy reduction (partial tiles included); the SASS reduces with warp shuffles, shared-
    memory atomics and global atomics (RED/ATOM)."""
    import sys as _sys
    d = _rowmax_colsum_desc(arch)
    assert gemm.can_implement(d, arch) is None
    b = cbuild.build(d, arch, tmp_path, cfg)
    assert b.args == ("t0", "t1", "t2", "t3", "t4", "t6")
    traced = _sys.modules[f"kspec_cute_entry_{b.key[:24]}"].GEMM.traced
    coords = traced["red_coords"]
    assert len(traced["red_plans"]) == 2
    for plan, (op, axis) in zip(traced["red_plans"], (("max", "n"), ("sum", "m"))):
        assert (plan.op, plan.key) == (op, 0 if axis == "n" else 1)
        rows = max(c[0] for t in coords for c in coords[t]) + 1
        cols = max(c[1] for t in coords for c in coords[t]) + 1
        for bounds in ((rows, cols), (rows - 3, cols - 5), (1, 1)):
            _check_plan_numerics(plan, axis, coords, bounds)
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        pytest.skip("no cuobjdump for the SASS check")
    sass = _sass(Path(b.cubin), tc)
    assert "SHFL.BFLY" in sass
    # shared memory: the row max combines with native integer atomics on the float's bits; the
    # column sum with a compare-and-swap loop, which is what sm_90a/sm_100a have for an f32 add to
    # shared memory (ptxas emits the same for CUDA's atomicAdd(float*) and `red.shared.add.f32`;
    # see backends/cute/reduce.py _atomic)
    assert "ATOMS.MAX.S32" in sass and "ATOMS.MIN " in sass
    assert "ATOMS.CAST.SPIN" in sass and "ATOMS.ADD" not in sass
    assert "REDG.E.ADD.F32" in sass or "ATOMG.E.ADD.F32" in sass          # column sums
    assert "REDG.E.MAX.S32" in sass or "ATOMG.E.MAX.S32" in sass          # row max: the int-ordering trick
    assert ("HGMMA" if arch == "sm90a" else "UTCHMMA") in sass


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_gemm_rowmax_launch_abi_through_the_fake_driver(cute_artifacts, arch):
    """specs/gemm_rowmax.kspec is one CuTe DSL kernel per arch; on the fake driver (every size set:
    tile multiples, ragged, smaller than a tile) the launch matches the cubin and the tensors, and
    the loader fills rowmax with -inf on the launch stream before the launch."""
    import kspec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    from kspec.selftest import SIZE_SETS
    art = cute_artifacts("gemm_rowmax")
    mod = kspec.load(art)
    with FakeDriver((9, 0) if arch == "sm90a" else (10, 0), sm_count=132) as fake:
        for sizes in SIZE_SETS.values():
            fills = len(fake.fills)
            call = fake_call(mod, "gemm_rowmax", sizes, fake)
            assert check_call(call, arch, mod) == []
            (rec,) = call.launches
            args = {a.name: a for a in call.plan_args[0]}
            assert fake.fills[fills:] == [(args["rowmax"].ptr, 0xFF800000, 4, sizes["M"])]
            words = set(struct.unpack_from(f"<{len(rec.params) // 8}Q", rec.params[:len(rec.params) // 8 * 8]))
            assert args["rowmax"].ptr in words and args["bias"].ptr in words


def test_cache_key_covers_operand_dtypes_and_layouts():
    """The entry source names tensors but not their dtypes/layouts (they reach the trace as fake
    tensors), so the key must include the tensor ABI: kernels differing only there never share a build."""
    base = dict(a="f8e4m3", b="f8e4m3", la="row", lb="col", out="f16")
    keys = {cbuild.build_key(_desc(Accum(), **{**base, **kw}), "sm100a", gemm.CuteConfig((128, 128)))[0]
            for kw in ({}, {"b": "f8e5m2"}, {"a": "f8e5m2"}, {"lb": "row"}, {"out": "bf16"})}
    assert len(keys) == 5


def _umma_formats(ptx: str, tile_m: int, tile_n: int) -> set[tuple[int, int]]:
    """(A format, B format) fields of every tcgen05 instruction descriptor constant in the PTX that
    describes an M x N UMMA with an f32 accumulator (PTX ISA: bits 4-5 D format, 7-9 A, 10-12 B,
    17-22 N >> 3, 24-28 M >> 4)."""
    import re
    out = set()
    for c in map(int, re.findall(r"\b(\d{6,})\b", ptx)):
        if c < 2 ** 32 and (c >> 24) & 0x1F == tile_m >> 4 and (c >> 17) & 0x3F == tile_n >> 3 and (c >> 4) & 3 == 1:
            out.add(((c >> 7) & 7, (c >> 10) & 7))
    return out


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("a,b", [("f8e4m3", "f8e5m2"), ("f8e5m2", "f8e4m3")])
def test_mixed_fp8_kinds_on_sm100a(a, b):
    """e4m3 x e5m2 (either order) is one tcgen05 kind::f8f6f4 UMMA whose instruction descriptor
    encodes each operand's own format (E4M3 = 0, E5M2 = 1), with per-row/per-column scales."""
    v = Op("mul", (Op("mul", (Accum(), Load("t2", "col", "f32"))), Load("t4", "row", "f32")))
    d = GemmDesc("k_0", "sm100a", Operand("t0", a, "row"), Operand("t1", b, "col"), "f32", Store("t3", v, "bf16"))
    assert gemm.can_implement(d, "sm100a") is None
    built = cbuild.build(d, "sm100a", test_cache_root(), gemm.CuteConfig((128, 128)))
    ptx = (Path(built.dir) / "kernel.ptx").read_text()
    assert "kind::f8f6f4" in ptx
    fmt = {"f8e4m3": 0, "f8e5m2": 1}
    assert _umma_formats(ptx, 128, 128) == {(fmt[a], fmt[b])}
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        pytest.skip("no cuobjdump for the SASS check")
    assert "UTCQMMA" in _sass(Path(built.cubin), tc)


BATCHED_REDUCTIONS = """
kernel bgemm_red {
  in  A  : f16[L, M, K]
  in  B  : f16[L, K, N] col
  out D  : f16[L, M, N]
  out rs : f32[L, M]
  out cm : f32[L, N]

  acc[l, m, n] : f32 = sum(k) A[l, m, k] * B[l, k, n]
  D[l, m, n] = acc[l, m, n]
  rs[l, m] = sum(n) acc[l, m, n]
  cm[l, n] = max(m) acc[l, m, n]
}
"""


@needs_dsl
@pytest.mark.cute
def test_batched_reductions_launch_abi(tmp_path):
    """A batched GEMM with a row sum and a column max fused: one CuTe DSL kernel per arch whose
    launches (every size set, L up to 3) match the cubin and tensors, with one vector per batch
    filled by the loader (sum: 0 over L*M, max: -inf over L*N)."""
    import kspec
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    from kspec.selftest import SIZE_SETS
    spec = tmp_path / "bgemm_red.kspec"
    spec.write_text(BATCHED_REDUCTIONS)
    art = compile_spec(spec, ARCHS, tmp_path / "out", cache=CompileCache(test_cache_root()), backend="cute")
    mod = kspec.load(art)
    for arch in ARCHS:
        with FakeDriver((9, 0) if arch == "sm90a" else (10, 0), sm_count=132) as fake:
            for sz in SIZE_SETS.values():
                n = len(fake.fills)
                call = fake_call(mod, "bgemm_red", sz, fake)
                assert check_call(call, arch, mod) == []
                args = {a.name: a for a in call.plan_args[0]}
                assert args["rs"].strides == (sz["M"], 1)
                assert fake.fills[n:] == [(args["rs"].ptr, 0, 4, sz["L"] * sz["M"]),
                                          (args["cm"].ptr, 0xFF800000, 4, sz["L"] * sz["N"])]


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_auxiliary_output_is_stored_by_tma_beside_d(arch):
    """h = gelu(acc + bias) stored as an extra output while D = h + R: two TMA stores per sub-tile,
    ABI order A, B, inputs, D, aux (the CUTLASS C++ backend's)."""
    h = Op("gelu", (Op("add", (Accum(), Load("t2", "row", "f16"))),))
    d = GemmDesc("k_0", arch, Operand("t0", "f16", "row"), Operand("t1", "f16", "col"), "f32",
                 Store("t4", Op("add", (h, Load("t3", "full", "f16"))), "f16"), aux_stores=(Store("t5", h, "f16"),))
    assert gemm.can_implement(d, arch) is None
    code = epilogue.generate(d)
    acc = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    bias, res = np.full((3, 4), 0.25, np.float32), np.ones((3, 4), np.float32)
    dv, hv = epilogue.run_numpy(code, acc, (bias, res), ())
    np.testing.assert_allclose(hv, _gelu64(acc.astype(np.float64) + 0.25), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dv, hv + 1, rtol=1e-6)
    b = cbuild.build(d, arch, test_cache_root())
    assert b.args == ("t0", "t1", "t2", "t3", "t4", "t5")
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        pytest.skip("no cuobjdump for the SASS check")
    sass = _sass(Path(b.cubin), tc)
    assert sass.count("UTMASTG") >= 2


# ------------------------------------------------------------------ per-batch epilogue vectors

def _batched_desc(arch="sm90a"):
    v = Op("relu", (Op("add", (Op("mul", (Load("t4", "col_batched", "f32"), Accum())), Load("t2", "row_batched", "f16"))),))
    return GemmDesc("k_0", arch, Operand("t0", "f16", "row"), Operand("t1", "f16", "col"), "f32",
                    Store("t3", v, "f16"), batched=True)


def test_per_batch_vectors_are_n_by_l_and_m_by_l_tensors_in_the_abi():
    d = _batched_desc()
    code = epilogue.generate(d)
    assert code.input_kinds == ("col_batched", "row_batched")
    abi = {t.name: t for t in gemm.tensor_abi(d, code)}
    assert (abi["i0"].shape, abi["i0"].stride, abi["i0"].tma) == (("M", "L"), (1, ("M",)), False)
    assert (abi["i1"].shape, abi["i1"].stride, abi["i1"].tma) == (("N", "L"), (1, ("N",)), False)
    glue = cbuild.glue_source(list(abi.values()), 0, "ciface", "entry", (0,), (8,), 1, 0)
    assert "ks_tensor_i1 t_i1 = {ptrs[3], {(int32_t)N, (int32_t)L}, {(int64_t)N}};" in glue
    assert "ks_tensor_i0 t_i0 = {ptrs[2], {(int32_t)M, (int32_t)L}, {(int64_t)M}};" in glue
    # a GEMM that is not batched has no per-batch vectors
    flat = GemmDesc("k_0", "sm90a", d.a, d.b, "f32", d.output)
    assert "not batched" in epilogue.unsupported(flat)


def test_per_batch_vectors_staged_per_tile_match_float64_numpy():
    """Emulates the kernels' staging of vector inputs (element i of the tile's slice at coordinate
    (i, l) of the (N, L) / (M, L) tensor the ABI describes over the row-major [L, N] / [L, M] buffer)
    and runs the generated epilogue per tile, against float64 numpy of the spec's semantics."""
    d = _batched_desc()
    code = epilogue.generate(d)
    abi = {t.name: t for t in gemm.tensor_abi(d, code)}
    rng = np.random.default_rng(7)
    L, M, N, tm, tn = 3, 10, 12, 4, 8
    dims = {"M": M, "N": N, "L": L}
    acc = rng.standard_normal((L, M, N)).astype(np.float32)
    cs = rng.standard_normal((L, M)).astype(np.float32)
    bias = rng.standard_normal((L, N)).astype(np.float16)
    flat = {"i0": cs.reshape(-1), "i1": bias.reshape(-1)}

    def element(t, i, l):
        strides = [1 if s == 1 else math.prod(dims[x] for x in s) for s in t.stride]
        return flat[t.name][i * strides[0] + l * strides[1]]

    got = np.zeros((L, M, N), np.float32)
    for l in range(L):
        for m0 in range(0, M, tm):
            for n0 in range(0, N, tn):
                rows = [min(m0 + i, M - 1) for i in range(tm)]         # clamped as the kernels do
                cols = [min(n0 + i, N - 1) for i in range(tn)]
                vm = np.array([element(abi["i0"], m, l) for m in rows], np.float32)
                vn = np.array([element(abi["i1"], n, l) for n in cols], np.float32)
                tile = acc[l][np.ix_(rows, cols)]
                (out,) = epilogue.run_numpy(code, tile, (np.broadcast_to(vm[:, None], tile.shape),
                                                         np.broadcast_to(vn[None, :], tile.shape)), ())
                got[l, m0:m0 + tm, n0:n0 + tn] = out[:min(tm, M - m0), :min(tn, N - n0)]
    want = np.maximum(cs.astype(np.float64)[:, :, None] * acc + bias.astype(np.float64)[:, None, :], 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


PER_BATCH_SPEC = """kernel bgemm_bias {
  in  A    : f16[L, M, K]
  in  B    : f16[L, K, N] col
  in  bias : f16[L, N]
  in  cs   : f32[L, M]
  out D    : f16[L, M, N]
  D[l, m, n] = relu(cs[l, m] * sum(k) A[l, m, k] * B[l, k, n] + bias[l, n])
}
"""


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_per_batch_vectors_build_offline_and_launch_through_the_fake_driver(tmp_path, monkeypatch, arch):
    """bias[l, n] and cs[l, m] in one batched CuTe DSL GEMM: tensor-core SASS, and the launch passes
    both vectors' addresses to the kernel."""
    import kspec
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    from kspec.runtime import driver
    from test_runtime import FakeCAI, MultiParamRecorder
    spec = tmp_path / "bgemm_bias.kspec"
    spec.write_text(PER_BATCH_SPEC)
    art = compile_spec(spec, (arch,), tmp_path / "out", cache=CompileCache(test_cache_root()), backend="cute")
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    b = plan["binaries"][arch]
    assert b["config"]["backend"] == "cute"
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        tc = None
    if tc is not None and tc.cuobjdump is not None:
        sass = _sass(art / b["cubin"], tc)
        assert ("HGMMA" if arch == "sm90a" else "UTCHMMA") in sass
    rec = MultiParamRecorder((9, 0) if arch == "sm90a" else (10, 0))
    monkeypatch.setattr(driver, "_driver", rec)
    mod = kspec.load(art)
    base = 0x7F0000000000
    L, M, N, K = 4, 300, 256, 128
    A = FakeCAI(base, (L, M, K))
    B = FakeCAI(base + 0x1000000, (L, K, N), strides=(K * N * 2, 2, K * 2))
    bias = FakeCAI(base + 0x2000000, (L, N))
    cs = FakeCAI(base + 0x3000000, (L, M), typestr="<f4")
    D = FakeCAI(base + 0x4000000, (L, M, N))
    mod.bgemm_bias(A, B, bias, cs, D=D)
    (launch,) = [e for e in rec.log if e[0] == "launch"]
    assert 0 < launch[5] <= 232448
    blob = launch[-1]
    words = set(struct.unpack_from(f"<{len(blob) // 8}Q", blob[:len(blob) // 8 * 8]))
    for t in (A, B, D, bias, cs):
        assert t.__cuda_array_interface__["data"][0] in words


# ------------------------------------------------------------------ dual GEMM (SwiGLU gate + up)

def _dual_desc(arch="sm90a", value=None):
    v = value or Op("cast:f16", (Op("mul", (Op("silu", (Accum(),)), Accum(1))),))
    return GemmDesc("k_0", arch, Operand("t0", "f16", "row"), Operand("t1", "f16", "col"), "f32",
                    Store("t3", v, "f16"), b2=Operand("t2", "f16", "col"))


def test_dual_epilogue_reads_both_accumulators_against_float64_numpy():
    """silu(X Wg^T) * (X Wu^T): the generated epilogue takes the second accumulator as acc1; the
    accumulators are the two products of one A tile (float64 here)."""
    bias = Load("t4", "row", "f32")
    d = _dual_desc(value=Op("mul", (Op("silu", (Accum(),)), Op("add", (Accum(1), bias)))))
    code = epilogue.generate(d)
    assert "acc1" in code.source and code.source.startswith("def kspec_epilogue(acc, ins, sc, acc1=None):")
    rng = np.random.default_rng(2)
    X = rng.standard_normal((12, 32)).astype(np.float16)
    Wg, Wu = (rng.standard_normal((20, 32)).astype(np.float16) for _ in range(2))
    b = rng.standard_normal(20).astype(np.float32)
    x, g, u = (t.astype(np.float64) for t in (X, Wg, Wu))
    acc, acc1 = (x @ g.T).astype(np.float32), (x @ u.T).astype(np.float32)
    (got,) = epilogue.run_numpy(code, acc, (np.broadcast_to(b, acc.shape),), (), acc1)
    gate = x @ g.T
    want = gate / (1 + np.exp(-gate)) * (x @ u.T + b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # a plain GEMM has no second accumulator
    with pytest.raises(KspecInternalError, match="accumulator 1"):
        epilogue.generate(_desc(Accum(1)))


def test_dual_gemm_abi_and_configurations():
    d = _dual_desc()
    code = epilogue.generate(d)
    assert gemm.abi_names(d, code) == ("t0", "t1", "t2", "t3")
    abi = {t.name: t for t in gemm.tensor_abi(d, code)}
    assert {n: t.ptr_index for n, t in abi.items()} == {"a": 0, "b": 1, "b2": 2, "d": 3}
    assert abi["b2"].stride == abi["b"].stride and abi["b2"].tma
    for arch in ARCHS:
        cands = gemm.candidates(d, arch)
        assert cands and all(c.tile[1] <= gemm.DUAL_MAX_TILE_N for c in cands)
        assert "dual GEMM" in gemm.valid_config(gemm.CuteConfig((128, 256)), arch, dual=True)
        big = gemm.default_config(d, arch, {"M": 8192, "N": 8192})
        assert gemm.valid_config(big, arch, dual=True) is None and big.tile[1] == 128
    assert gemm.default_config(d, "sm100a", {"M": 8192, "N": 8192}).use_2cta
    src = gemm.entry_source(d, "sm90a", gemm.CuteConfig((128, 128)), code)
    assert "dual=True)" in src and "max_clusters, stream, (b2, ))" in src
    bad = GemmDesc("k_0", "sm90a", d.a, d.b, "f32", d.output, b2=Operand("t2", "bf16", "col"))
    assert "dual GEMM B operands" in gemm.can_implement(bad, "sm90a")


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch,cfg", [("sm90a", gemm.CuteConfig((64, 128))), ("sm90a", gemm.CuteConfig((128, 128), (2, 1))),
                                      ("sm100a", gemm.CuteConfig((128, 128))),
                                      ("sm100a", gemm.CuteConfig((256, 128), (2, 1), True))])
def test_dual_gemm_multiplies_each_a_tile_into_two_accumulators(arch, cfg):
    """The dual kernel multiplies each A tile in shared memory by both B tiles: on sm90a it issues
    twice the WGMMAs of the same GEMM with one B per k-tile, into two register accumulators; on
    sm100a its UMMAs write two tensor-memory accumulators (the one-B kernel: one); B2 arrives by TMA
    beside B; nothing spills."""
    import re
    from kspec.backends.toolchain import find_toolchain
    dual = _dual_desc(arch)
    one = GemmDesc("k_0", arch, dual.a, dual.b, "f32", Store("t3", Op("cast:f16", (Op("silu", (Accum(),)),)), "f16"))
    ptx = {}
    for name, d in (("one", one), ("dual", dual)):
        b = cbuild.build(d, arch, test_cache_root(), cfg)
        ptx[name] = (Path(b.cubin).parent / "kernel.ptx").read_text()
        try:
            tc = find_toolchain()
            sass = _sass(Path(b.cubin), tc)
            assert ("HGMMA" if arch == "sm90a" else "UTCHMMA") in sass
            assert " STL" not in sass, "the accumulators spill to local memory"
        except KspecInternalError:
            pass
    if arch == "sm90a":
        n = {k: len(re.findall(r"wgmma\.mma_async", v)) for k, v in ptx.items()}
        # (with M = 128 the dual kernel splits the tile over two warpgroups, the one-B kernel does not)
        assert n["one"] > 0 and (n["dual"] == 2 * n["one"] if cfg.tile[0] == 64 else n["dual"] > 0), n
    else:
        accs = {k: {m for m in re.findall(r"tcgen05\.mma\.[\w:.]+ \[(%r\d+)\]", v)} for k, v in ptx.items()}
        assert len(accs["one"]) == 1 and len(accs["dual"]) >= 2, accs
    # the TMA loads of the producer: one more tensor (B2) per stage
    assert ptx["dual"].count("cp.async.bulk.tensor") > ptx["one"].count("cp.async.bulk.tensor")


@needs_dsl
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_swiglu_mlp_builds_two_kernels_and_launches_through_the_fake_driver(tmp_path, monkeypatch, arch):
    """specs/swiglu_mlp.kspec: the dual gate/up GEMM then the down projection, both CuTe DSL on
    tensor cores; the first launch reads X, Wg and Wu, the second Wd and writes Y."""
    import kspec
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    from kspec.runtime import driver
    from test_runtime import FakeCAI, MultiParamRecorder
    art = compile_spec(SPECS / "swiglu_mlp.kspec", (arch,), tmp_path, cache=CompileCache(test_cache_root()),
                       backend="cute")
    m = json.loads((art / "manifest.json").read_text())
    plans = m["kernels"][0]["plans"]
    assert len(plans) == 2 and all(p["binaries"][arch]["config"]["backend"] == "cute" for p in plans)
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        tc = None
    if tc is not None and tc.cuobjdump is not None:
        for p in plans:
            assert ("HGMMA" if arch == "sm90a" else "UTCHMMA") in _sass(art / p["binaries"][arch]["cubin"], tc)
    rec = MultiParamRecorder((9, 0) if arch == "sm90a" else (10, 0))
    monkeypatch.setattr(driver, "_driver", rec)
    mod = kspec.load(art)
    base = 0x7F0000000000
    M, K, F, N = 256, 512, 1024, 512
    X = FakeCAI(base, (M, K))
    Wg, Wu = FakeCAI(base + 0x1000000, (F, K)), FakeCAI(base + 0x2000000, (F, K))
    Wd = FakeCAI(base + 0x3000000, (N, F))
    Y = FakeCAI(base + 0x4000000, (M, N))
    mod.swiglu_mlp(X, Wg, Wu, Wd, Y=Y)
    launches = [e for e in rec.log if e[0] == "launch"]
    assert len(launches) == 2
    assert all(0 < l[5] <= 232448 for l in launches), [l[5] for l in launches]     # dynamic shared memory

    def words(blob):
        return set(struct.unpack_from(f"<{len(blob) // 8}Q", blob[:len(blob) // 8 * 8]))
    first, second = (words(l[-1]) for l in launches)
    for t in (X, Wg, Wu):
        assert t.__cuda_array_interface__["data"][0] in first
    for t in (Wd, Y):
        assert t.__cuda_array_interface__["data"][0] in second


@needs_dsl
@pytest.mark.cute
def test_sm100_epilogue_subtile_loop_is_unrolled():
    """Issue 22 item 5: the sm_100a epilogue's sub-tile loop is unrolled (cutlass.range_constexpr), as
    in NVIDIA's persistent dense GEMM: a 128x128 tile's 4 sub-tiles are 4 TMEM loads (LDTM) and 4 TMA
    stores (UTMASTG) in the SASS, so each sub-tile's TMEM load overlaps the previous store (the rolled
    loop issued 1 of each)."""
    d = GemmDesc("k_0", "sm100a", Operand("t0", "f16", "row"), Operand("t1", "f16", "col"), "f32",
                 Store("t2", Accum(), "f16"), tile=(128, 128, 64), cluster=(1, 1, 1))
    b = cbuild.build(d, "sm100a", test_cache_root())
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        pytest.skip("no cuobjdump for the SASS check")
    sass = _sass(Path(b.cubin), tc)
    insns = [ln.split(";")[0].split("*/")[-1].split() for ln in sass.splitlines() if "/*" in ln]
    ops = [w[0].split(".")[0] for w in insns if w and not w[0].startswith("@")] + \
          [w[1].split(".")[0] for w in insns if len(w) > 1 and w[0].startswith("@")]
    assert ops.count("UTMASTG") == 4 and ops.count("LDTM") == 4, (ops.count("UTMASTG"), ops.count("LDTM"))
