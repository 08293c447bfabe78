"""Gathers and integer index arithmetic in generic elementwise kernels (issue 23, build item 3):
RoPE in its usual spellings plans as one kernel that `kspec compile` builds (graph == compile), the
reference matches an independent float64 numpy rotary embedding, and the generated CUDA text itself,
compiled with g++ against a sequential CUDA shim (one thread at a time, blockIdx/threadIdx globals),
matches it too."""
from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kspec.backends.reference import reference
from kspec.numerics import storage_dtype
from kspec.compile import emit_spec
from kspec.core import KspecRuntimeError

HERE = Path(__file__).parent

_HEAD = "kernel rope {\n  in  Q : bf16[B, S, H, 128]\n  in  cos : f32[S, 128]\n  in  sin : f32[S, 128]\n" \
        "  out Y : bf16[B, S, H, 128]\n"
SPELLINGS = {
    # rotate-half, the sign from a comparison of the index
    "rotate_half_mod": _HEAD + "  Y[b, s, h, e] = f32(Q[b, s, h, e]) * cos[s, e] + where(e < 64, "
    "-f32(Q[b, s, h, (e + 64) % 128]), f32(Q[b, s, h, (e + 64) % 128])) * sin[s, e]\n}\n",
    # rotate-half, each half gathered by its own offset: each gather is out of range where its
    # branch is not taken (the reference and the kernel read it only where it is)
    "rotate_half_where": _HEAD + "  Y[b, s, h, e] = f32(Q[b, s, h, e]) * cos[s, e] + where(e < 64, "
    "-f32(Q[b, s, h, e + 64]), f32(Q[b, s, h, e - 64])) * sin[s, e]\n}\n",
}

# interleaved pairs: (x[2i], x[2i+1]) rotate by the angle of pair i
INTERLEAVED = """kernel rope_interleaved {
  in  X : bf16[T, 64]
  in  cos : f32[T, 32]
  in  sin : f32[T, 32]
  out Y0 : bf16[T, 32]
  out Y1 : bf16[T, 32]
  Y0[t, i] = f32(X[t, 2 * i]) * cos[t, i] - f32(X[t, 2 * i + 1]) * sin[t, i]
  Y1[t, i] = f32(X[t, 2 * i]) * sin[t, i] + f32(X[t, 2 * i + 1]) * cos[t, i]
}
"""


def _rope64(q, cos, sin):
    q = np.asarray(q, dtype=np.float64)
    rot = np.concatenate([-q[..., 64:], q[..., :64]], axis=-1)
    return q * cos[None, :, None, :].astype(np.float64) + rot * sin[None, :, None, :].astype(np.float64)


def _write(tmp_path, text, name="rope"):
    p = tmp_path / f"{name}.kspec"
    p.write_text(text)
    return p


def _shim_build(emitted, tmp_path: Path):
    """Compile a generic kernel's own text (device code and host glue) on the host with g++."""
    cuda_inc = None
    for base in (Path("/usr/local/cuda/include"), *sorted(Path("/usr/local").glob("cuda-*/include"))):
        if (base / "cuda_bf16.h").is_file():
            cuda_inc = base
    if shutil.which("g++") is None or cuda_inc is None:
        pytest.skip("no g++ or CUDA headers to run the generated kernel on the host")
    # KSPEC_ASSUME (the compiler hints of the index decode and the 16-byte moves) is checked here
    shim = ("#include <vector_types.h>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda_fp8.h>\n"
            "#include <cmath>\nstatic uint3 blockIdx, threadIdx; static dim3 blockDim;\n"
            "static long long emu_assume_failures = 0;\n"
            "#define KSPEC_ASSUME(c) do { if (!(c)) ++emu_assume_failures; } while (0)\n"
            "#define __global__\n#define __launch_bounds__(n)\n")
    run = r"""
extern "C" int emu_run(const int64_t* dims, void* const* ptrs, const double* sc, char* err, int64_t* info,
                       int index64) {
  alignas(16) unsigned char blob[sizeof(Params)]; uint64_t ps = 0;
  uint32_t grid[3], block[3], cluster[3], smem = 0;
  int rc = kspec_prepare(dims, ptrs, sc, nullptr, 0, 132, blob, sizeof(blob), &ps, grid, block, cluster, &smem, err, 256);
  if (rc) return rc;
  Params p; std::memcpy(&p, blob, sizeof(p));
  if (index64) p.idx32 = 0;      // the 64-bit index code, as for 2^32 elements or more
  blockDim.x = block[0]; blockDim.y = 1; blockDim.z = 1;
  emu_assume_failures = 0;
  for (unsigned b = 0; b < grid[0]; ++b) for (unsigned t = 0; t < block[0]; ++t) {
    blockIdx.x = b; threadIdx.x = t; kspec_kernel(p);
  }
  info[0] = p.vec; info[1] = grid[0]; info[2] = block[0]; info[3] = emu_assume_failures; info[4] = p.idx32;
  return 0;
}
"""
    key = abs(hash(emitted.source)) % 10 ** 12
    cpp = tmp_path / f"k{key}.cpp"
    so = tmp_path / f"k{key}.so"
    cpp.write_text(shim + emitted.source + run)
    subprocess.run(["g++", "-std=c++17", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-DKSPEC_HOST",
                    "-DKSPEC_DEVICE", f"-I{cuda_inc}", str(cpp), "-o", str(so)], check=True, capture_output=True,
                   text=True)
    return ctypes.CDLL(str(so))


def _shim_call(lib, lowered, arrays: dict, outs: dict, sizes: dict, index64: bool = False) -> dict:
    """Run every thread of the kernel's launch (as its own kspec_prepare sets it up) sequentially;
    returns the path taken (vec: the vector width, 0 for one element per thread), the grid and
    block.  `index64` runs the 64-bit index code the kernel takes for 2^32 elements or more."""
    desc, names = lowered.desc, lowered.names
    every = {**arrays, **outs}
    dims = [math.prod(x if isinstance(x, int) else sizes[x] for x in (v if isinstance(v, tuple) else (v,)))
            for _, v in lowered.dims]
    c_dims = (ctypes.c_int64 * max(1, len(dims)))(*dims)
    c_ptrs = (ctypes.c_void_p * max(1, len(desc.args)))(*[every[names[a]].ctypes.data for a in desc.args])
    c_sc = (ctypes.c_double * 1)()
    err = ctypes.create_string_buffer(256)
    info = (ctypes.c_int64 * 5)()
    assert lib.emu_run(c_dims, c_ptrs, c_sc, err, info, int(index64)) == 0, err.value
    assert info[3] == 0, f"{info[3]} KSPEC_ASSUME conditions failed"
    return {"vec": info[0], "grid": info[1], "block": info[2], "idx32": info[4]}


def _shim_run(emitted, lowered, arrays: dict, outs: dict, sizes: dict, tmp_path: Path) -> dict:
    """Compile a generic kernel's own text on the host and run every thread sequentially."""
    return _shim_call(_shim_build(emitted, tmp_path), lowered, arrays, outs, sizes)


_GUARDED: list = []


def _guarded(a: np.ndarray, where: str) -> np.ndarray:
    """A copy of `a` that starts right after (where="start") or ends right before (where="end") an
    inaccessible page: a read of any byte outside it, a 16-byte word included, faults."""
    import mmap
    page = mmap.PAGESIZE
    body = -(-a.nbytes // page) * page
    buf = mmap.mmap(-1, body + 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    for at in (base, base + page + body):
        assert libc.mprotect(ctypes.c_void_p(at), ctypes.c_size_t(page), 0) == 0, ctypes.get_errno()
    offset = page if where == "start" else page + body - a.nbytes
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=offset).reshape(a.shape)
    out[...] = a
    _GUARDED.append(buf)                # (the mapping outlives the call)
    return out


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of `a` whose data pointer is one element past a 16-byte boundary."""
    raw = np.empty(a.size + 16, dtype=a.dtype)
    skip = (-raw.ctypes.data % 16) // a.itemsize + 1
    out = raw[skip:skip + a.size].reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 16 != 0
    return out


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_rope_one_kernel_reference_and_generated_text(spelling, tmp_path):
    path = _write(tmp_path, SPELLINGS[spelling])
    em = emit_spec(path, ("sm90a", "sm100a"))
    assert len(em.plans) == 1, f"{spelling}: {len(em.plans)} kernels"
    (plist,) = em.plans.values()
    assert sorted(ep.lowered.arch for ep in plist) == ["sm100a", "sm90a"]
    assert {ep.lowered.backend for ep in plist} == {"generic"}
    ep = plist[0]
    rng = np.random.default_rng(1)
    B, S, H = 2, 3, 2
    q = rng.standard_normal((B, S, H, 128)).astype(storage_dtype("bf16"))
    cos = rng.standard_normal((S, 128)).astype(np.float32)
    sin = rng.standard_normal((S, 128)).astype(np.float32)
    want = _rope64(q, cos, sin)
    ref = np.asarray(reference(path)(Q=q, cos=cos, sin=sin)["Y"], dtype=np.float64)
    assert np.abs(ref - want).max() <= 2 ** -7 * np.abs(want).max() + 1e-6
    y = np.full((B, S, H, 128), np.nan, dtype=storage_dtype("bf16"))
    _shim_run(ep.emitted, ep.lowered, {"Q": q, "cos": cos, "sin": sin}, {"Y": y}, {"B": B, "S": S, "H": H}, tmp_path)
    got = np.asarray(y, dtype=np.float64)
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max() + 1e-6


def test_interleaved_pairs_reference_and_generated_text(tmp_path):
    path = _write(tmp_path, INTERLEAVED, "rope_interleaved")
    em = emit_spec(path, ("sm90a", "sm100a"))
    assert len(em.plans) == 1, f"interleaved: {len(em.plans)} kernels"
    (plist,) = em.plans.values()
    rng = np.random.default_rng(2)
    T = 5
    x = rng.standard_normal((T, 64)).astype(storage_dtype("bf16"))
    cos = rng.standard_normal((T, 32)).astype(np.float32)
    sin = rng.standard_normal((T, 32)).astype(np.float32)
    xf = np.asarray(x, dtype=np.float64)
    w0 = xf[:, 0::2] * cos - xf[:, 1::2] * sin
    w1 = xf[:, 0::2] * sin + xf[:, 1::2] * cos
    ref = reference(path)(X=x, cos=cos, sin=sin)
    for got, want in ((ref["Y0"], w0), (ref["Y1"], w1)):
        _close(got, want)
    (ep,) = [ep for ep in plist if ep.lowered.arch == "sm100a"]
    lib = _shim_build(ep.emitted, tmp_path)
    # the vector path: 16 elements along i per thread, cos, sin, Y0, Y1 contiguous along it, and the
    # pairs X[t, 2 * i], X[t, 2 * i + 1] read as the 4 words of a window (A = 2); with X between
    # inaccessible pages, and one element per thread where X is misaligned
    for xx, vec in ((x, 16), (_guarded(x, "start"), 16), (_guarded(x, "end"), 16), (_misaligned(x), 0)):
        y0 = np.full((T, 32), np.nan, dtype=storage_dtype("bf16"))
        y1 = np.full((T, 32), np.nan, dtype=storage_dtype("bf16"))
        info = _shim_call(lib, ep.lowered, {"X": xx, "cos": cos, "sin": sin}, {"Y0": y0, "Y1": y1}, {"T": T})
        assert info["vec"] == vec and info["grid"] == math.ceil(T * 32 / (vec or 1) / 256)
        _close(y0, w0)
        _close(y1, w1)


def _rope_arrays(rng, shape, E):
    q = rng.standard_normal(shape).astype(storage_dtype("bf16"))
    cos = rng.standard_normal((shape[-3] if len(shape) == 4 else shape[0], E)).astype(np.float32)
    sin = rng.standard_normal(cos.shape).astype(np.float32)
    return q, cos, sin


def _rope_any(q, cos, sin):
    """float64 rotate-half RoPE of q [.., S or T, H, E] with cos/sin [S or T, E]."""
    q = np.asarray(q, dtype=np.float64)
    half = q.shape[-1] // 2
    rot = np.concatenate([-q[..., half:], q[..., :half]], axis=-1)
    c = cos.astype(np.float64)[:, None, :]
    s = sin.astype(np.float64)[:, None, :]
    return q * c + rot * s


def _close(got, want):
    got = np.asarray(got, dtype=np.float64)
    assert not np.isnan(got).any(), "elements never written"
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max() + 1e-6


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_rope_vector_path_and_scalar_fallback(spelling, tmp_path):
    """The kernel's vector path (16 elements per thread, 128-bit moves of Q, cos, sin, Y and of the
    rotated half) runs where every pointer it moves is 16-byte aligned; a misaligned Q, cos or Y
    takes the one-element-per-thread path.  Both match float64 numpy, every element written, the
    grid sized to the path; each path also with its 64-bit index code (2^32 elements or more)."""
    path = _write(tmp_path, SPELLINGS[spelling])
    (plist,) = emit_spec(path, ("sm90a",)).plans.values()
    ep = plist[0]
    assert ep.lowered.desc.vec == (16, 8) and dict(ep.emitted.config)["vec"] == "16,8"
    lib = _shim_build(ep.emitted, tmp_path)
    B, S, H = 2, 3, 3
    count = B * S * H * 128
    q, cos, sin = _rope_arrays(np.random.default_rng(4), (B, S, H, 128), 128)
    want = _rope64(q, cos, sin)
    for case, index64 in (("aligned", False), ("aligned", True), ("start", False), ("end", False), ("Q", False),
                          ("Q", True), ("cos", False), ("Y", False)):
        args = {"Q": q, "cos": cos, "sin": sin}
        y = np.full((B, S, H, 128), np.nan, dtype=storage_dtype("bf16"))
        if case == "Y":
            y = _misaligned(y)
        elif case in ("start", "end"):  # nothing outside Q is read (e + 64 where e >= 64: masked)
            args["Q"] = _guarded(q, case)
        elif case != "aligned":
            args[case] = _misaligned(args[case])
        info = _shim_call(lib, ep.lowered, args, {"Y": y}, {"B": B, "S": S, "H": H}, index64)
        vec = 16 if case in ("aligned", "start", "end") else 0
        assert (info["vec"], info["grid"], info["block"]) == (vec, math.ceil(count / (vec or 1) / 256), 256), case
        _close(y, want)


ROPE_SYM = """kernel rope_sym {
  in  Q : bf16[T, H, E]
  in  cos : f32[T, E]
  in  sin : f32[T, E]
  out Y : bf16[T, H, E]
  Y[t, h, e] = f32(Q[t, h, e]) * cos[t, e] + where(e < E / 2, -f32(Q[t, h, e + E / 2]), f32(Q[t, h, e - E / 2])) * sin[t, e]
}
"""


@pytest.fixture(scope="module")
def rope_sym(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rope_sym")
    (plist,) = emit_spec(_write(tmp, ROPE_SYM, "rope_sym"), ("sm100a",)).plans.values()
    return plist[0], _shim_build(plist[0].emitted, tmp)


@pytest.mark.parametrize("E, vec", [
    (64, 16),    # 16 elements per thread, each rotated half two aligned 128-bit loads
    (48, 16),    # halves of 24: aligned where a vector lies within one half, scalar gathers where not
    (40, 8),     # E a multiple of 8, not 16: 8 elements per thread; halves of 20 start off a 16-byte boundary
    (72, 8),     # likewise, halves of 36
    (36, 0),     # E not a multiple of 8: one element per thread
    (6, 0),      # E smaller than a vector
])
def test_rope_head_dim_as_a_size(rope_sym, E, vec):
    ep, lib = rope_sym
    T, H = 5, 3
    q, cos, sin = _rope_arrays(np.random.default_rng(E), (T, H, E), E)
    y = np.full((T, H, E), np.nan, dtype=storage_dtype("bf16"))
    info = _shim_call(lib, ep.lowered, {"Q": q, "cos": cos, "sin": sin}, {"Y": y}, {"T": T, "H": H, "E": E})
    assert info["vec"] == vec and info["grid"] == math.ceil(T * H * E / (vec or 1) / 256)
    _close(y, _rope_any(q, cos, sin))


def test_literal_extent_no_multiple_of_the_vector_has_no_vector_path(tmp_path):
    text = SPELLINGS["rotate_half_mod"].replace("128", "100").replace("64", "50")
    (plist,) = emit_spec(_write(tmp_path, text), ("sm90a",)).plans.values()
    ep = plist[0]
    assert ep.lowered.desc.vec == () and "kspec_vector" not in ep.emitted.source
    assert "kspec_mod(v7, 100LL)" in ep.emitted.source          # literal extents are constants
    B, S, H = 1, 2, 3
    q, cos, sin = _rope_arrays(np.random.default_rng(5), (B, S, H, 100), 100)
    y = np.full((B, S, H, 100), np.nan, dtype=storage_dtype("bf16"))
    info = _shim_run(ep.emitted, ep.lowered, {"Q": q, "cos": cos, "sin": sin}, {"Y": y}, {"B": B, "S": S, "H": H},
                     tmp_path)
    assert info["vec"] == 0
    _close(y, _rope_any(q[0], cos, sin)[None])


GPTJ = """kernel rope_gptj {
  in  Q : bf16[B, S, H, 128]
  in  cos : f32[S, 64]
  in  sin : f32[S, 64]
  out Y : bf16[B, S, H, 128]
  Y[b, s, h, e] = f32(Q[b, s, h, e]) * cos[s, e / 2]
                + where(e % 2 == 0, -f32(Q[b, s, h, e + 1]), f32(Q[b, s, h, e - 1])) * sin[s, e / 2]
}
"""


def test_interleaved_rope_over_half_tables_is_one_kernel(tmp_path):
    """GPT-J's interleaved RoPE written over one output, the angle tables [S, 64] read at `e / 2`: the
    table gathers (over s, e) join the kernel over (b, s, h, e) instead of running as kernels of
    their own; the vector path reads Q and writes Y 128 bits at a time, the pair and table gathers
    element by element; both paths match float64 numpy."""
    path = _write(tmp_path, GPTJ, "rope_gptj")
    em = emit_spec(path, ("sm90a", "sm100a"))
    assert len(em.plans) == 1, f"{len(em.plans)} kernels"
    (plist,) = em.plans.values()
    assert {ep.lowered.backend for ep in plist} == {"generic"}
    ep = plist[0]
    assert ep.lowered.desc.vec == (16, 8)
    rng = np.random.default_rng(6)
    B, S, H = 2, 3, 2
    q = rng.standard_normal((B, S, H, 128)).astype(storage_dtype("bf16"))
    cos = rng.standard_normal((S, 64)).astype(np.float32)
    sin = rng.standard_normal((S, 64)).astype(np.float32)
    x = np.asarray(q, dtype=np.float64)
    c, sn = cos.astype(np.float64)[None, :, None, :], sin.astype(np.float64)[None, :, None, :]
    want = np.empty_like(x)
    want[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * sn
    want[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * sn
    _close(reference(path)(Q=q, cos=cos, sin=sin)["Y"], want)
    lib = _shim_build(ep.emitted, tmp_path)
    # (Q between inaccessible pages: the words around its first and last elements are not read)
    for qq, vec in ((q, 16), (_guarded(q, "start"), 16), (_guarded(q, "end"), 16), (_misaligned(q), 0)):
        y = np.full((B, S, H, 128), np.nan, dtype=storage_dtype("bf16"))
        info = _shim_call(lib, ep.lowered, {"Q": qq, "cos": cos, "sin": sin}, {"Y": y}, {"B": B, "S": S, "H": H})
        assert info["vec"] == vec
        _close(y, want)


def test_graph_strict_prints_what_compile_builds(tmp_path, capsys):
    """`kspec graph --strict` and `kspec compile --emit-only` agree on RoPE: both succeed, one kernel."""
    from kspec.cli import main
    path = _write(tmp_path, SPELLINGS["rotate_half_mod"])
    assert main(["graph", "--strict", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 fused kernel" in out and "generic elementwise (block=256 vec=16,8)" in out
    assert main(["compile", "--emit-only", "-o", str(tmp_path / "out"), str(path)]) == 0
    srcs = list((tmp_path / "out").rglob("*.cu"))
    assert srcs and all("kspec_mod(" in s.read_text() for s in srcs)


CE_IGNORE = """kernel ce_ignore {
  in  logits : bf16[M, V]
  in  label  : i32[M]
  out loss   : f32[M]

  lse[m]  = logsumexp(v) f32(logits[m, v])
  loss[m] = where(label[m] == -100, 0.0, lse[m] - f32(logits[m, label[m]]))
}
"""


@pytest.mark.parametrize("fused", [True, False])
def test_cross_entropy_ignore_index_reads_the_gather_only_where_taken(fused, tmp_path):
    path = _write(tmp_path, CE_IGNORE, "ce_ignore")
    rng = np.random.default_rng(3)
    M, V = 6, 10
    logits = rng.standard_normal((M, V)).astype(storage_dtype("bf16"))
    label = np.array([3, -100, 9, -100, 0, 5], dtype=np.int32)
    got = reference(path, fused=fused)(logits=logits, label=label)["loss"]
    x = np.asarray(logits, dtype=np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    want = np.array([0.0 if l == -100 else lse[i] - x[i, l] for i, l in enumerate(label)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got[1] == 0.0 and got[3] == 0.0
    # an out-of-range label on a row where the branch IS taken is still the located error
    with pytest.raises(KspecRuntimeError, match=r"index out of range: subscript label\[m\] of 'logits'.* is 10 at m=2"):
        reference(path, fused=fused)(logits=logits, label=np.array([3, -100, 10, 0, 0, 0], dtype=np.int32))


def test_a_discarded_gather_summed_over_is_still_an_error(tmp_path):
    """Poison is carried only through elementwise ops and the taken branch of where: a reduction over
    an out-of-range gather raises even if a later where would discard the row."""
    path = _write(tmp_path, """kernel s {
  in  x : f32[M, V]
  in  label : i32[M, K]
  out y : f32[M]
  t[m] = sum(k) x[m, label[m, k]]
  y[m] = where(label[m, 0] < 0, 0.0, t[m])
}
""", "s")
    x = np.ones((2, 4), np.float32)
    with pytest.raises(KspecRuntimeError, match="index out of range"):
        reference(path)(x=x, label=np.array([[0, 1], [-1, 2]], np.int32))
    np.testing.assert_array_equal(reference(path)(x=x, label=np.array([[0, 1], [3, 2]], np.int32))["y"], [2, 2])


# ---------------------------------------------------------------- the runtime's pre-launch check agrees

def _ranges(text):
    from kspec.compiler import plan_kernel
    from kspec.compiler.indices import guarded_sentinels, index_ranges, merge_index_ranges, with_sentinels
    from kspec.spec_lang import load_spec
    sched = plan_kernel(load_spec(text, is_text=True).kernels[0])
    return with_sentinels(merge_index_ranges(r for p in sched.plans for r in index_ranges(p.ir)),
                          guarded_sentinels(sched.graph))


def test_an_ignore_index_passes_the_pre_launch_check_like_the_reference():
    """The index check before a launch allows exactly what the reference allows: -100 where
    where(label[m] == -100, ..) discards the gather, any other out-of-range label is refused; the
    range round-trips through the manifest reader."""
    from kspec.artifact import _range_json
    from kspec.runtime.indexcheck import check_index_values
    (r,) = _ranges(CE_IGNORE)
    assert (r.tensor, r.target, r.axis, r.ignore) == ("label", "logits", 1, -100)
    assert r.describe() == "0 <= label < V or label == -100 (logits axis 1)"
    assert _range_json(r)["ignore"] == -100
    check_index_values("ce_ignore", (r,), {"M": 4, "V": 10}, {"label": np.array([3, -100, 9, 0], np.int32)})
    with pytest.raises(KspecRuntimeError, match=r"label\[2\] = 10 is out of range"):
        check_index_values("ce_ignore", (r,), {"M": 4, "V": 10}, {"label": np.array([3, -100, 10, 0], np.int32)})
    with pytest.raises(KspecRuntimeError, match=r"label\[1\] = -99 is out of range"):
        check_index_values("ce_ignore", (r,), {"M": 4, "V": 10}, {"label": np.array([3, -99, 1, 0], np.int32)})


@pytest.mark.parametrize("loss", [
    "lse[m] - f32(logits[m, label[m]])",                                            # no guard
    "where(label[m] == -100, f32(logits[m, label[m]]), 0.0)",                       # the wrong branch
    "where(label[m] != -100, 0.0, lse[m] - f32(logits[m, label[m]]))",              # the wrong branch
    "where(label[0] == -100, 0.0, lse[m] - f32(logits[m, label[m]]))",              # another row's label
])
def test_no_ignore_index_unless_every_read_is_guarded(loss):
    text = CE_IGNORE.replace("where(label[m] == -100, 0.0, lse[m] - f32(logits[m, label[m]]))", loss)
    (r,) = _ranges(text)
    assert r.ignore is None and r.describe() == "0 <= label < V (logits axis 1)"


# ---------------------------------------------------------------- the shipped spec, compiled

@pytest.mark.nvcc
def test_shipped_rope_sass_is_vectorised_and_launches_cover_the_elements(compiled):
    """specs/rope.kspec compiles to one generic kernel per arch whose SASS moves Q, cos, sin, the
    rotated half and Y with 128-bit loads and stores; through the fake driver the glue picks the
    16-wide vector path for aligned tensors (grid = elements / 16 / 256) and one element per thread
    for a misaligned Q (grid = elements / 256), the parameter blob saying which."""
    import json
    import struct

    import kspec
    from conftest import cubin_sass
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    from kspec.runtime import dtypes
    from kspec.runtime.tensors import DeviceBuffer
    art = compiled("rope")
    (plan,) = json.loads((art / "manifest.json").read_text())["kernels"][0]["plans"]
    for arch in ("sm90a", "sm100a"):
        b = plan["binaries"][arch]
        assert b["backend"] == "generic" and b["config"]["vec"] == "16,8"
        sass = cubin_sass(art / b["cubin"])
        if sass is None:
            pytest.skip("no cuobjdump")
        # the 16-wide path: Q, the rotated half (2 words each), cos and sin (4 each), Y (2); the
        # 8-wide one half that; each for 32- and 64-bit indices.  The only 2-byte loads are the
        # one-element-per-thread path's Q and rotated Q: the vector paths read nothing element-wise
        assert sass.count("LDG.E.128") >= 2 * (12 + 6) - 4, f"{arch}: too few 128-bit loads"
        assert sass.count("STG.E.128") >= 2 * (2 + 1) - 1, f"{arch}: Y is not stored 128 bits at a time"
        assert sass.count("LDG.E.U16") <= 2, f"{arch}: element-wise loads of Q in a vector path"
    mod = kspec.load(art)
    B, S, H = 2, 64, 8
    count = B * S * H * 128
    for arch, cc in (("sm90a", (9, 0)), ("sm100a", (10, 0))):
        with FakeDriver(cc, sm_count=132) as fake:
            call = fake_call(mod, "rope", {"B": B, "S": S, "H": H}, fake)
            assert check_call(call, arch, mod) == []
            (rec,) = call.launches
            assert len(rec.params) == 96
            n, vec, idx32 = struct.unpack_from("<qii", rec.params, 80)
            assert (n, vec, idx32) == (count, 16, 1)
            assert rec.grid == (count // 16 // 256, 1, 1) and rec.block == (256, 1, 1)
            # Q one element past a 16-byte boundary: the glue picks one element per thread
            q = fake.alloc(count * 2 + 16, "Q")
            args = {"Q": DeviceBuffer(q + 2, (B, S, H, 128), dtypes.storage("bf16")),
                    "cos": DeviceBuffer(fake.alloc(S * 128 * 4), (S, 128), dtypes.storage("f32")),
                    "sin": DeviceBuffer(fake.alloc(S * 128 * 4), (S, 128), dtypes.storage("f32"))}
            before = len(fake.launches)
            mod.rope(**args)
            (rec,) = fake.launches[before:]
            assert struct.unpack_from("<qii", rec.params, 80) == (count, 0, 1)
            assert rec.grid == (count // 256, 1, 1)


MIXED = """kernel mix {
  in  a : f8e4m3[N, C]
  in  b : i8[N, C]
  in  w : f16[C]
  out y : f16[N, C]
  out z : i32[N, C]
  y[n, c] = f32(a[n, c]) * f32(w[c]) + f32(b[n, c])
  z[n, c] = i32(b[n, c]) * 3 + c
}
"""


@pytest.mark.parametrize("C, vec", [(48, 16), (40, 0)])
def test_vector_path_over_one_byte_and_integer_tensors_matches_the_reference(C, vec, tmp_path):
    """1-byte inputs (e4m3, i8) make the vector 16 elements (one word of them, two of f16 and four of
    i32): only a multiple of 16 takes it.  Both kernels' generated text matches the reference."""
    path = _write(tmp_path, MIXED, "mix")
    em = emit_spec(path, ("sm100a",))
    rng = np.random.default_rng(C)
    N = 3
    a = rng.standard_normal((N, C)).astype(storage_dtype("f8e4m3"))
    b = rng.integers(-128, 128, (N, C)).astype(np.int8)
    w = rng.standard_normal(C).astype(np.float16)
    want = reference(path)(a=a, b=b, w=w)
    y = np.full((N, C), np.nan, dtype=np.float16)
    z = np.full((N, C), -1, dtype=np.int32)
    for (ep,) in em.plans.values():
        assert ep.lowered.desc.vec == (16,)
        info = _shim_run(ep.emitted, ep.lowered, {"a": a, "b": b, "w": w}, {"y": y, "z": z}, {"N": N, "C": C},
                         tmp_path)
        assert info["vec"] == vec
    np.testing.assert_array_equal(z, want["z"])
    np.testing.assert_array_equal(y, want["y"])
    zf = b.astype(np.int64) * 3 + np.arange(C)[None, :]
    np.testing.assert_array_equal(z, zf)
    yf = a.astype(np.float64) * w.astype(np.float64)[None, :] + b
    np.testing.assert_allclose(y.astype(np.float64), yf, rtol=2 ** -10, atol=1e-3)


AFFINE = """kernel aff {
  in  X : f32[T, 256]
  out Y : f32[T, 64]
  Y[t, i] = X[t, (3 * i + 1) / 2] + X[t, 2 * i + 3] * 2.0 + X[t, 191 - i] * 3.0
}
"""


def test_window_gathers_with_odd_slopes_offsets_and_a_reversal(tmp_path):
    """Gathers at floor((3 i + 1) / 2), 2 i + 3 and 191 - i (a negative slope) are windows of whole
    words at compile-time positions: the same values as float64 numpy, X between inaccessible
    pages."""
    path = _write(tmp_path, AFFINE, "aff")
    (plist,) = emit_spec(path, ("sm90a",)).plans.values()
    ep = plist[0]
    assert ep.lowered.desc.vec == (8, 4) and ep.emitted.source.count("of a window of 16-byte words") == 3
    rng = np.random.default_rng(7)
    T = 3
    x = rng.standard_normal((T, 256)).astype(np.float32)
    i = np.arange(64)
    want = x[:, (3 * i + 1) // 2] + x[:, 2 * i + 3] * 2.0 + x[:, 191 - i] * 3.0
    _close(reference(path)(X=x)["Y"], want)
    lib = _shim_build(ep.emitted, tmp_path)
    for xx in (x, _guarded(x, "start"), _guarded(x, "end")):
        y = np.full((T, 64), np.nan, dtype=np.float32)
        assert _shim_call(lib, ep.lowered, {"X": xx}, {"Y": y}, {"T": T})["vec"] == 8
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
