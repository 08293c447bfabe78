"""CUTLASS GEMM emission (backends/cutlass/gemm.py, evt.py).

Fast tests check the emitted C++ for both archs without nvcc.  `nvcc` tests compile
relu(accum + bias) for sm90a and sm100a (device cubin + host glue, once each per module) and check
the SASS (HGMMA on sm90a, UTCHMMA on sm100a) and the host library's exports and dependencies."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from kspec.backends.cutlass.gemm import emit_gemm
from kspec.backends.desc import Accum, Const, GemmDesc, Load, Op, Operand, ReductionStore, Store
from kspec.spec_lang.errors import KspecError

ARCHS = ("sm90a", "sm100a")
ARCH_TAG = {"sm90a": "cutlass::arch::Sm90", "sm100a": "cutlass::arch::Sm100"}


def gemm(arch, out_value=None, *, a="f16", b="f16", la="row", lb="row", out_dtype="f16",
         name="k0", **kw) -> GemmDesc:
    return GemmDesc(name=name, arch=arch, a=Operand("t0", a, la), b=Operand("t1", b, lb),
                    acc_dtype="f32", output=Store("t9", out_value or Accum(), out_dtype), **kw)


BIAS = Load("t2", "row", "f16")
RELU_BIAS = Op("relu", (Op("add", (Accum(), BIAS)),))


def relu_bias(arch: str) -> GemmDesc:
    return gemm(arch, RELU_BIAS)


def _builders(src: str) -> list[str]:
    return re.findall(r"(cutlass::(?:gemm|epilogue)::collective::CollectiveBuilder<\s*[\w:]+)", src)


def _mainloop(src: str) -> str:
    return src[src.index("using CollectiveMainloop"):src.index("using GemmKernel")]


# ---------------------------------------------------------------------------------------------
# fast emission tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_plain_gemm(arch):
    k = emit_gemm(gemm(arch))
    src = k.source
    builders = _builders(src)
    assert len(builders) == 2 and all(b.endswith(ARCH_TAG[arch]) for b in builders)
    assert k.dims == ("M", "N", "K", "L")
    assert k.args == ("t0", "t1", "t9") and k.scalars == () and k.init == ()
    assert dict(k.alignment) == {"t0": 16, "t1": 16, "t9": 16}
    assert 'extern "C" __global__ void' in src and "kspec_kernel(CUTLASS_GRID_CONSTANT" in src
    assert src.index("#if defined(KSPEC_DEVICE)") < src.index("kspec_kernel(")
    assert src.index("#if defined(KSPEC_HOST)") < src.index('extern "C" int kspec_prepare(')
    assert 'extern "C" int kspec_workspace_size(' in src
    for call in ("can_implement(args)", "to_underlying_arguments(args, workspace)",
                 "get_grid_shape(p)", "get_block_shape()", "SharedStorageSize",
                 "std::memcpy(params, &p, sizeof(Params))"):
        assert call in src
    assert "GemmUniversalMode::kGemm" in src and "if (L != 1)" in src
    assert "Sm90AccFetch" in src
    cfg = dict(k.config)
    assert set(cfg) >= {"tile", "cluster", "stages", "kernel_schedule", "epilogue_schedule"}
    assert cfg["stages"] == "auto"
    assert "-std=c++17" in k.flags and "--expt-relaxed-constexpr" in k.flags
    assert not any("lcuda" in f for f in k.flags)
    if arch == "sm90a":
        assert cfg["kernel_schedule"].startswith("TmaWarpSpecialized") and cfg["mma"] == "wgmma"
        assert "cutlass::gemm::KernelTmaWarpSpecialized" in src
        assert "detail::EpilogueDescriptor<" in src
    else:
        assert cfg["kernel_schedule"].endswith("Sm100") and cfg["mma"] in ("1sm", "2sm")
        assert "detail::Sm100EpilogueDescriptor<" in src


@pytest.mark.parametrize("arch", ARCHS)
def test_relu_bias(arch):
    k = emit_gemm(relu_bias(arch))
    src = k.source
    assert k.args == ("t0", "t1", "t2", "t9")
    assert "cutlass::epilogue::fusion::Sm90RowBroadcast<" in src
    assert "cutlass::epilogue::thread::ReLu, cutlass::half_t, float" in src
    assert "cutlass::plus, float, float" in src
    assert "static_cast<cutlass::half_t const*>(ptrs[2])" in src


@pytest.mark.parametrize("arch", ARCHS)
def test_gelu_scaled_bias_residual_f16(arch):
    alpha = Load("alpha", "scalar", "f32")
    value = Op("add", (Op("gelu", (Op("add", (Op("mul", (alpha, Accum())), BIAS)),)),
                       Load("t3", "full", "f16")))
    k = emit_gemm(gemm(arch, value, out_dtype="f16"))
    src = k.source
    assert k.args == ("t0", "t1", "t2", "t3", "t9")
    assert k.scalars == ("alpha",)
    assert "Sm90ScalarBroadcast<" in src and "static_cast<float>(scalars[0])" in src
    assert "cutlass::epilogue::thread::GELU," in src
    assert "Sm90AuxLoad<" in src and "static_cast<cutlass::half_t const*>(ptrs[3])" in src
    assert "Sm90RowBroadcast<" in src
    assert "using ElementD = cutlass::half_t;" in src


@pytest.mark.parametrize("arch", ARCHS)
def test_row_max_reduction(arch):
    value = Op("mul", (Accum(), Const(0.5)))
    k = emit_gemm(gemm(arch, value, reductions=(ReductionStore("t5", "max", "n", value, "f32"),)))
    src = k.source
    assert k.args == ("t0", "t1", "t9", "t5")
    assert k.init == (("t5", "neg_inf"),)
    assert dict(k.alignment)["t5"] == 4
    # a row max (over n) is a column vector: CUTLASS's ColReduction with an atomic max
    assert "Sm90ColReduction<" in src and "cutlass::atomic_maximum" in src
    assert "-cutlass::platform::numeric_limits<float>::infinity()" in src
    # the reduction store passes the scaled value through to D, so the epilogue stays a tree
    assert "using EVTRed0 = cutlass::epilogue::fusion::Sm90EVT<\n    Red0,\n    EVTCompute0>;" in src
    assert "static_cast<float>(0.5)" in src


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_value_becomes_topological_visitor(arch):
    x = Op("add", (Accum(), BIAS))
    k = emit_gemm(gemm(arch, Op("mul", (x, Op("sigmoid", (x,))))))     # x * sigmoid(x)
    src = k.source
    assert "Sm90TopologicalVisitor<" in src
    assert k.args == ("t0", "t1", "t2", "t9")
    init = src[src.index("*out = Arguments{"):src.index("hw_info\n  };")]
    assert init.count("{") == init.count("}") + 1      # the window ends inside Arguments{
    assert "ptrs[2]" in init


@pytest.mark.parametrize("arch", ARCHS)
def test_aux_store(arch):
    pre = Op("add", (Accum(), BIAS))
    k = emit_gemm(gemm(arch, Op("relu", (pre,)), aux_stores=(Store("t4", pre, "f16"),)))
    src = k.source
    assert k.args == ("t0", "t1", "t2", "t9", "t4")
    assert "Sm90AuxStore<" in src and "static_cast<cutlass::half_t*>(ptrs[4])" in src
    assert "Sm90TopologicalVisitor" not in src   # the stored value passes through: still a tree


@pytest.mark.parametrize("arch", ARCHS)
def test_batched(arch):
    k = emit_gemm(gemm(arch, RELU_BIAS, batched=True))
    src = k.source
    assert "GemmUniversalMode::kBatched" in src and "if (L != 1)" not in src
    assert "using StrideD = cute::Stride<int64_t, cute::Int<1>, int64_t>;" in src
    assert "static_cast<int64_t>(M * N)" in src


PER_BATCH = Op("relu", (Op("add", (Op("mul", (Load("t3", "col_batched", "f32"), Accum())),
                                   Load("t2", "row_batched", "f16"))),))


@pytest.mark.parametrize("arch", ARCHS)
def test_per_batch_vectors_are_broadcasts_with_a_batch_stride(arch):
    """bias[l, n] / scale[l, m]: EVT row/column broadcasts whose L stride is N / M (a runtime int)."""
    k = emit_gemm(gemm(arch, PER_BATCH, batched=True))
    src = k.source
    assert re.search(r"Sm90RowBroadcast<[^;]*cute::Stride<cute::Int<0>, cute::Int<1>, int>\s*>;", src)
    assert re.search(r"Sm90ColBroadcast<[^;]*cute::Stride<cute::Int<1>, cute::Int<0>, int>\s*>;", src)
    assert "cute::make_stride(cute::Int<0>{}, cute::Int<1>{}, static_cast<int>(N))" in src
    assert "cute::make_stride(cute::Int<1>{}, cute::Int<0>{}, static_cast<int>(M))" in src
    assert k.args == ("t0", "t1", "t3", "t2", "t9")


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_e4m3_with_two_scales(arch):
    sa, sb = Load("sa", "scalar", "f32"), Load("sb", "scalar", "f32")
    value = Op("mul", (Op("mul", (sa, sb)), Accum()))
    k = emit_gemm(gemm(arch, value, a="f8e4m3", b="f8e4m3", la="row", lb="col", out_dtype="bf16"))
    src = k.source
    assert k.scalars == ("sa", "sb")
    main = _mainloop(src)
    assert main.count("cutlass::float_e4m3_t") == 2 and ", 16," in main
    assert "scalars[0]" in src and "scalars[1]" in src
    assert "using ElementD = cutlass::bfloat16_t;" in src
    assert "FP8FastAccum" not in dict(k.config)["kernel_schedule"]


def test_fp8_layouts_without_kernel_are_rejected_on_sm90():
    with pytest.raises(KspecError, match=r"sm90a.*supported layouts: A row / B col"):
        emit_gemm(gemm("sm90a", a="f8e4m3", b="f8e4m3", la="row", lb="row", out_dtype="bf16"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("la,lb", [("row", "row"), ("row", "col"), ("col", "row"), ("col", "col")])
def test_layout_combinations(arch, la, lb):
    k = emit_gemm(gemm(arch, RELU_BIAS, la=la, lb=lb))
    main = _mainloop(k.source)
    tag = {"row": "cutlass::layout::RowMajor", "col": "cutlass::layout::ColumnMajor"}
    assert re.search(rf"cutlass::half_t, {tag[la]}, 8,\s*cutlass::half_t, {tag[lb]}, 8,", main)


@pytest.mark.parametrize("arch", ARCHS)
def test_dtypes_bf16_and_tf32(arch):
    k = emit_gemm(gemm(arch, a="bf16", b="bf16", out_dtype="bf16"))
    assert _mainloop(k.source).count("cutlass::bfloat16_t") == 2
    k = emit_gemm(gemm(arch, a="tf32", b="tf32", la="row", lb="col", out_dtype="f32"))
    main = _mainloop(k.source)
    assert re.search(r"float, cutlass::layout::RowMajor, 4,\s*float, cutlass::layout::ColumnMajor, 4,", main)


def test_f32_operands_ask_for_tf32():
    with pytest.raises(KspecError, match="tf32"):
        emit_gemm(gemm("sm90a", a="f32", b="f32", out_dtype="f32"))


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_tile_lists_nearest_choices(arch):
    with pytest.raises(KspecError) as e:
        emit_gemm(gemm(arch, tile=(96, 200, 64)))
    assert "tile=96x200x64 is not a CUTLASS configuration" in e.value.message
    assert "nearest valid CUTLASS choices: tile=" in (e.value.hint or "")
    # kspec/compile.py reports it at the spec's `tile` setting
    from kspec.backends.api import SettingError
    assert isinstance(e.value, SettingError) and e.value.setting == "tile"


def test_explicit_valid_tile_cluster_and_stages():
    k = emit_gemm(gemm("sm90a", RELU_BIAS, tile=(128, 128, 64), cluster=(2, 1, 1), stages=4))
    cfg = dict(k.config)
    assert (cfg["tile"], cfg["cluster"], cfg["stages"]) == ("128x128x64", "2x1x1", "4")
    assert "cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>" in k.source
    assert "StageCount<4>" in k.source
    with pytest.raises(KspecError, match="stages"):
        emit_gemm(gemm("sm90a", tile=(128, 128, 64), cluster=(2, 1, 1), stages=40))


@pytest.mark.parametrize("arch", ARCHS)
def test_ops_without_evt_equivalent_name_op_and_arch(arch):
    with pytest.raises(KspecError, match=rf"epilogue op 'log' has no EVT equivalent on {arch}"):
        emit_gemm(gemm(arch, Op("log", (Accum(),))))


def test_decomposed_ops_and_cast():
    x = Op("add", (Accum(), BIAS))
    value = Op("cast:f16", (Op("clamp", (Op("abs", (Op("neg", (x,)),)), Const(-1.0), Const(6.0))),))
    src = emit_gemm(gemm("sm90a", Op("silu", (Op("sigmoid", (Op("tanh", (Op("exp", (
        Op("gelu_tanh", (value,)),)),)),)),)))).source
    for tag in ("cutlass::maximum", "cutlass::minimum", "cutlass::multiplies", "GELU_taylor",
                "cutlass::fast_exp_op", "thread::Tanh", "thread::Sigmoid", "thread::SiLu",
                "thread::Identity, cutlass::half_t"):
        assert tag in src, tag


def test_unsupported_arch_and_reduction_dtype():
    with pytest.raises(KspecError, match="arch 'sm80'"):
        emit_gemm(gemm("sm80"))
    with pytest.raises(KspecError, match="must be f32"):
        emit_gemm(gemm("sm90a", reductions=(ReductionStore("t5", "sum", "m", Accum(), "f16"),)))


def test_emission_is_deterministic_across_processes():
    """Same descriptor -> byte-identical source, also under different string-hash seeds (the EVT
    passes iterate Python sets of node names)."""
    code = (
        "import hashlib\n"
        "from kspec.backends.desc import *\n"
        "from kspec.backends.cutlass.gemm import emit_gemm\n"
        "x = Op('add', (Accum(), Load('b', 'row', 'f16')))\n"
        "v = Op('mul', (Op('mul', (x, Op('sigmoid', (x,)))), Load('s', 'scalar', 'f32')))\n"
        "d = GemmDesc(name='k0', arch='sm90a', a=Operand('t0','f16'), b=Operand('t1','f16','col'),"
        " acc_dtype='f32', output=Store('t9', Op('relu', (v,)), 'f16'),"
        " aux_stores=(Store('t4', v, 'f16'),),"
        " reductions=(ReductionStore('t5','max','n',v,'f32'), ReductionStore('t6','sum','m',v,'f32')))\n"
        "print(hashlib.sha256(emit_gemm(d).source.encode()).hexdigest())\n")
    digests = set()
    for seed in ("1", "2", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_same_desc_same_source_in_process():
    d = gemm("sm90a", RELU_BIAS, reductions=(ReductionStore("t5", "sum", "m", RELU_BIAS, "f32"),))
    assert emit_gemm(d).source == emit_gemm(d).source


# ---------------------------------------------------------------------------------------------
# nvcc: compile relu(accum + bias) once per arch
# ---------------------------------------------------------------------------------------------

def _tool_bin() -> str | None:
    import nvidia
    for root in nvidia.__path__:
        d = os.path.join(root, "cu13", "bin")
        if os.path.isfile(os.path.join(d, "cuobjdump")):
            return d
    return None


@pytest.fixture(scope="module")
def compiled(kernel_cache):
    """{arch: (cubin path, host .so path, seconds)} for relu(accum + bias); built once, through the
    build layer's cache (so CI reuses earlier builds)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    from conftest import build_emitted
    results = {}

    def build(arch):
        if arch not in results:
            cubin, so, secs = build_emitted(emit_gemm(relu_bias(arch)), kernel_cache)
            results[arch] = (cubin, so, secs, 0.0)
            print(f"\n[kspec] {arch} relu(accum+bias): nvcc {secs:.1f} s (0 = cached)")
        return results[arch]

    return build


def _sass(cubin) -> str:
    tools = _tool_bin()
    if tools is None:
        pytest.skip("pip nvidia-cuda-cuobjdump/nvidia-cuda-nvdisasm not installed")
    env = dict(os.environ, PATH=tools + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", str(cubin)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.nvcc
@pytest.mark.heavy
@pytest.mark.parametrize("arch,mma", [("sm90a", "HGMMA"), ("sm100a", "UTCHMMA")])
def test_compiled_kernel_uses_tensor_core_mma(compiled, arch, mma):
    cubin, _, _, _ = compiled(arch)
    sass = _sass(cubin)
    assert "kspec_kernel" in sass
    assert mma in sass


@pytest.mark.nvcc
@pytest.mark.heavy
@pytest.mark.parametrize("arch", ARCHS)
def test_host_glue_exports_abi_without_libcuda(compiled, arch):
    _, so, _, _ = compiled(arch)
    nm = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    assert re.search(r"\bT kspec_prepare\b", nm) and re.search(r"\bT kspec_workspace_size\b", nm)
    ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    assert "libcuda.so" not in ldd and "libcudart.so" not in ldd


@pytest.mark.nvcc
@pytest.mark.heavy
@pytest.mark.parametrize("arch,mma", [("sm90a", "HGMMA"), ("sm100a", "UTCHMMA")])
def test_per_batch_vectors_compile(kernel_cache, arch, mma):
    """The batch-strided row/column broadcasts pass CUTLASS's static checks and nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    from conftest import build_emitted
    cubin, so, _ = build_emitted(emit_gemm(gemm(arch, PER_BATCH, batched=True)), kernel_cache)
    assert mma in _sass(cubin)
