"""SASS summaries: parsing of captured cuobjdump output (fast, no tools needed) and real cubins
with tensor-core instructions written as inline PTX (nvcc-marked, about a second each)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kspec.backends.build import BuildJob, CompileCache
from kspec.backends.inspect import (FAMILIES, dump_sass, family_of, format_summary, parse_res_usage,
                                    parse_sass, sass_summary, short_name, summarize)
from kspec.backends.toolchain import Toolchain, find_toolchain
from kspec.spec_lang.errors import KspecError

# Lines captured from `cuobjdump -sass` (CUDA 13.0) of the two kernels below; encoding lines
# and most ordinary instructions left out.
SASS_SM90A = """
	code for sm_90a
	.target	sm_90a

		Function : kspec_kernel
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                /* 0x00000a00ff017b82 */
                                                                                         /* 0x000fe20000000800 */
        /*00c0*/                   UTMALDG.2D [UR8], [UR6] ;                             /* 0x00000008060075b4 */
                                                                                         /* 0x0001d80008008000 */
        /*0100*/                   WARPGROUP.ARRIVE ;                                    /* 0x00000000000079c5 */
        /*0160*/                   HGMMA.64x8x16.F32 R24, gdesc[UR16], RZ, !UPT, gsb0 ;  /* 0x00000000101879f0 */
                                                                                         /* 0x000fe2000c0008ff */
        /*01a0*/                   UTMAPF.L2.2D [UR4], [UR6] ;                           /* 0x00000004060075b8 */
        /*01f0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                       /* 0x00008000000079c5 */
        /*0210*/                   UTMASTG.2D [UR8], [UR6] ;                             /* 0x00000008060073b5 */
        /*0270*/                   MUFU.EX2 R27, R27 ;                                   /* 0x0000001b001b7308 */
        /*02a0*/                   EXIT ;                                                /* 0x000000000000794d */
        /*02b0*/                   BRA 0x2b0;                                            /* 0xfffffffc00fc7947 */
        /*02c0*/                   NOP;                                                  /* 0x0000000000007918 */
        /*02d0*/                   NOP;                                                  /* 0x0000000000007918 */
		..........
"""

SASS_SM100A = """
	code for sm_100a
	.target	sm_100a

		Function : _Z2k2Pf
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM100 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM100)"
        /*0000*/                   LDC R1, c[0x0][0x37c] ;          /* 0x0000df00ff017b82 */
        /*0090*/                   EXIT ;                           /* 0x000000000000794d */
		..........

		Function : kspec_kernel
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM100 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM100)"
        /*0030*/               @P0 BRA 0x260 ;                                                                /* 0x0000000000880947 */
        /*0120*/                   UTCATOMSWS.FIND_AND_SET.ALIGN UP0, UR4, UR4 ;                              /* 0x00000004000475e3 */
        /*0390*/                   UTCHMMA gdesc[UR12], gdesc[UR14], tmem[UR6], tmem[UR4], idesc[UR5], UP0 ;  /* 0x00ff040e0c0075ea */
        /*0391*/              @!UP1 UTCQMMA gdesc[UR12], gdesc[UR14], tmem[UR6], tmem[UR4], idesc[UR5], UP0 ;  /* 0x00ff040e0c0075ea */
        /*0392*/                   UTCHMMA gdesc[UR12], gdesc[UR14], tmem[UR6], tmem[UR4], idesc[UR5], UP0 ;  /* 0x00ff040e0c0075ea */
        /*0410*/                   UTCBAR [UR4], URZ ;                                                        /* 0x000000ff040073e9 */
        /*0480*/                   LDTM R0, tmem[UR6] ;                                                       /* 0x00000006000079ee */
        /*0490*/                   NOP ;                                                                      /* 0x0000000000007918 */
        /*04e0*/                   STTM tmem[UR6+0x1], R0 ;                                                   /* 0x00000100000079ed */
        /*0510*/                   MUFU.EX2 R5, R4 ;                                                          /* 0x0000000400057308 */
        /*0520*/                   MUFU.RCP R5, R4 ;                                                          /* 0x0000000400057308 */
        /*0550*/               @P0 EXIT ;                                                                     /* 0x000000000000094d */
		..........
"""

RES_USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function _Z2k2Pf:
  REG:10 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:904 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function kspec_kernel:
  REG:168 STACK:16 SHARED:1040 LOCAL:8 CONSTANT[0]:928 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_family_of_opcodes():
    assert family_of("HGMMA.64x8x16.F32") == "HGMMA"
    assert family_of("QGMMA.64x128x32.F32.E4M3.E4M3") == "QGMMA" and family_of("IGMMA.64x64x32.S8.S8") == "IGMMA"
    assert family_of("UTCHMMA") == "UTCHMMA" and family_of("UTCQMMA.2CTA") == "UTCQMMA"
    assert family_of("MUFU.EX2") == "MUFU.EX2" and family_of("MUFU.RCP") is None
    assert family_of("UTMALDG.2D") == "UTMALDG" and family_of("UTCATOMSWS.AND") is None
    assert family_of("LDTM.x16") == "LDTM" and family_of("LDS") is None
    assert set(FAMILIES) >= {"HGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCBAR", "UTMALDG",
                             "UTMASTG", "UTMAPF", "LDTM", "STTM", "MUFU.EX2"}


def test_fp8_and_int8_warpgroup_mma_count_as_tensor_core():
    text = SASS_SM90A.replace("HGMMA.64x8x16.F32", "QGMMA.64x8x32.F32.E4M3.E4M3")
    [k] = parse_sass(text)
    assert k.count("QGMMA") == 1 and k.tensor_core == "QGMMA" and k.mma_families == ("QGMMA",)
    [k] = parse_sass(SASS_SM90A.replace("HGMMA.64x8x16.F32", "IGMMA.64x8x32.S32.S8.S8"))
    assert k.tensor_core == "IGMMA"


def test_parse_sm90a_sass():
    [k] = parse_sass(SASS_SM90A)
    assert k.name == "kspec_kernel" and k.arch == "sm_90a"
    assert k.counts == {"UTMALDG": 1, "HGMMA": 1, "UTMAPF": 1, "UTMASTG": 1, "MUFU.EX2": 1}
    assert k.instructions == 10                     # NOP padding is not counted
    assert k.tensor_core == "HGMMA"


def test_parse_sm100a_sass_multiple_functions_and_predicates():
    ks = {k.name: k for k in parse_sass(SASS_SM100A)}
    assert set(ks) == {"_Z2k2Pf", "kspec_kernel"}
    plain, k = ks["_Z2k2Pf"], ks["kspec_kernel"]
    assert plain.instructions == 2 and plain.counts == {} and plain.tensor_core is None
    assert k.arch == "sm_100a"
    assert (k.count("UTCHMMA"), k.count("UTCQMMA"), k.count("UTCIMMA")) == (2, 1, 0)
    assert k.mma_families == ("UTCHMMA", "UTCQMMA") and k.tensor_core == "UTCHMMA"
    assert (k.count("UTCBAR"), k.count("LDTM"), k.count("STTM"), k.count("MUFU.EX2")) == (1, 1, 1, 1)
    assert k.count("HGMMA") == 0 and k.instructions == 11


def test_parse_res_usage_and_merge():
    res = parse_res_usage(RES_USAGE)
    assert res["kspec_kernel"]["REG"] == 168 and res["kspec_kernel"]["SHARED"] == 1040
    assert res["_Z2k2Pf"]["CONSTANT[0]"] == 904
    s = summarize("x.cubin", SASS_SM100A, RES_USAGE)
    k = s.kernel("kspec_kernel")
    assert (k.registers, k.shared_bytes, k.stack_bytes, k.local_bytes) == (168, 1040, 16, 8)
    assert s.kernel("_Z2k2Pf").registers == 10
    assert s.tensor_core == "UTCHMMA" and s.count("UTCHMMA") == 2
    with pytest.raises(KeyError):
        s.kernel("nope")
    text = format_summary(s)
    assert "kspec_kernel [sm_100a]: 168 registers, 1040 B static shared" in text
    assert "tensor core: UTCHMMA (tcgen05.mma" in text and "UTCBAR 1" in text
    assert "_Z2k2Pf [sm_100a]: 10 registers" in text and "tensor core: none" in text
    assert "register spills?" in text


def test_empty_output_gives_empty_summary():
    s = summarize("empty.cubin", "", "")
    assert s.kernels == () and s.tensor_core is None
    assert "no device functions" in format_summary(s)


def test_missing_tools_and_files_are_kspec_errors(tmp_path):
    no_tools = Toolchain(nvcc=tmp_path / "nvcc", version="13.0.88", cuda_home=tmp_path, bin_dir=tmp_path)
    (tmp_path / "k.cubin").write_bytes(b"\x7fELF")
    with pytest.raises(KspecError, match="cuobjdump and nvdisasm not found"):
        sass_summary(tmp_path / "k.cubin", no_tools)
    with pytest.raises(KspecError, match="no such cubin"):
        dump_sass(tmp_path / "missing.cubin", no_tools)


# ---- real cubins ----

WGMMA_SM90A = r"""
#include <cstdint>
struct Params { const void* tmap; float* out; unsigned long long da, db; int scale; };
extern "C" __global__ void kspec_kernel(const __grid_constant__ Params p) {
  __shared__ alignas(128) char tile[4096];
  __shared__ alignas(8) unsigned long long bar;
  uint32_t s = (uint32_t)__cvta_generic_to_shared(tile);
  uint32_t b = (uint32_t)__cvta_generic_to_shared(&bar);
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
               :: "r"(s), "l"(p.tmap), "r"(b), "r"(0), "r"(0) : "memory");
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global [%0, {%1, %2}];" :: "l"(p.tmap), "r"(0), "r"(0) : "memory");
  float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %6, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, q, 1, 1, 0, 0;\n}\n"
               : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "l"(p.da), "l"(p.db), "r"(p.scale));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               :: "l"(p.tmap), "r"(s), "r"(0), "r"(0) : "memory");
  int i = threadIdx.x;
  p.out[4*i] = d0; p.out[4*i+1] = d1; p.out[4*i+2] = d2; p.out[4*i+3] = __expf(d3);
}
"""

# tcgen05: allocate tensor memory, one MMA (KIND = f16 | f8f6f4 | i8), commit to an mbarrier,
# load/store tensor memory.  Never launched: descriptors are runtime values.
TCGEN05_SM100A = r"""
#include <cstdint>
struct Params { float* out; unsigned long long da, db; uint32_t idesc; int scale; };
extern "C" __global__ void kspec_kernel(const __grid_constant__ Params p) {
  __shared__ uint32_t tmem_base;
  __shared__ alignas(8) unsigned long long bar;
  uint32_t sb = (uint32_t)__cvta_generic_to_shared(&tmem_base);
  uint32_t b = (uint32_t)__cvta_generic_to_shared(&bar);
  if (threadIdx.x < 32)
    asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;" :: "r"(sb), "r"(32) : "memory");
  __syncthreads();
  uint32_t tmem = tmem_base;
  if (threadIdx.x == 0) {
    uint32_t m0 = 0, m1 = 0, m2 = 0, m3 = 0;
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %4, 0;\n\t"
                 "tcgen05.mma.cta_group::1.kind::KIND [%0], %1, %2, %3, {%5, %6, %7, %8}, q;\n\t}\n"
                 :: "r"(tmem), "l"(p.da), "l"(p.db), "r"(p.idesc), "r"(p.scale), "r"(m0), "r"(m1), "r"(m2), "r"(m3));
    asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];" :: "r"(b) : "memory");
  }
  __syncthreads();
  uint32_t v;
  asm volatile("tcgen05.ld.sync.aligned.32x32b.x1.b32 {%0}, [%1];" : "=r"(v) : "r"(tmem));
  asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory");
  asm volatile("tcgen05.st.sync.aligned.32x32b.x1.b32 [%0], {%1};" :: "r"(tmem + 1), "r"(v + 1));
  asm volatile("tcgen05.wait::st.sync.aligned;" ::: "memory");
  p.out[threadIdx.x] = __expf(__uint_as_float(v));
  if (threadIdx.x < 32)
    asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;" :: "r"(tmem), "r"(32) : "memory");
}
"""


@pytest.fixture
def inspect_tc() -> Toolchain:
    try:
        tc = find_toolchain()
    except KspecError as e:
        pytest.skip(f"no nvcc: {e.message}")
    if tc.cuobjdump is None or tc.nvdisasm is None:
        pytest.skip("cuobjdump/nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return tc


def _cubin(tmp_path: Path, tc: Toolchain, source: str, arch: str) -> Path:
    return CompileCache(tmp_path / "cache").build(BuildJob(f"kernel probe on {arch}", source, arch), tc).path


@pytest.mark.nvcc
def test_real_wgmma_kernel_has_hgmma_and_tma(tmp_path, inspect_tc):
    cubin = _cubin(tmp_path, inspect_tc, WGMMA_SM90A, "sm90a")
    s = sass_summary(cubin, inspect_tc)
    k = s.kernel("kspec_kernel")
    assert k.arch == "sm_90a" and s.tensor_core == "HGMMA" and k.count("HGMMA") >= 1
    assert k.count("UTMALDG") == 1 and k.count("UTMASTG") == 1 and k.count("UTMAPF") == 1
    assert k.count("MUFU.EX2") == 1 and k.count("UTCHMMA") == 0
    assert k.registers > 0 and k.shared_bytes >= 4096 and k.instructions > 10
    assert "HGMMA.64x8x16.F32" in dump_sass(cubin, inspect_tc)


@pytest.mark.nvcc
@pytest.mark.parametrize("kind,family", [("f16", "UTCHMMA"), ("f8f6f4", "UTCQMMA"), ("i8", "UTCIMMA")])
def test_real_tcgen05_kernel_has_utc_mma(tmp_path, inspect_tc, kind, family):
    cubin = _cubin(tmp_path, inspect_tc, TCGEN05_SM100A.replace("KIND", kind), "sm100a")
    k = sass_summary(cubin, inspect_tc).kernel("kspec_kernel")
    assert k.arch == "sm_100a" and k.tensor_core == family and k.count(family) == 1
    assert k.count("UTCBAR") == 1 and k.count("LDTM") == 1 and k.count("STTM") == 1
    assert k.count("HGMMA") == 0 and k.count("MUFU.EX2") == 1


@pytest.mark.nvcc
def test_cuobjdump_failure_is_a_kspec_error(tmp_path, inspect_tc):
    junk = tmp_path / "junk.cubin"
    junk.write_bytes(b"not an elf file at all")
    with pytest.raises(KspecError, match="cuobjdump -sass failed"):
        sass_summary(junk, inspect_tc)


def test_long_generated_kernel_names_are_shortened_for_display():
    long = "kernel_cutlass_kernel_" + "_".join(f"tensorptrf16gmemalign16o{i}" for i in range(8)) + "_0123456789abcdef"
    short = short_name(long)
    assert len(long) > 200 and len(short) == 64
    assert short.startswith("kernel_cutlass_kernel_") and short.endswith("0123456789abcdef") and "…" in short
    assert short_name("kspec_kernel") == "kspec_kernel"
