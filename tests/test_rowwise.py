"""Row-wise kernels (issue 15): the label-gather subscript, the row fusion rule and its cost, the
numpy reference against independent float64 numpy, the generated row kernel itself run on the CPU
(tests/rowwise_emu.h), and (nvcc) both archs' binaries: 128-bit loads and warp shuffles in SASS,
the host glue's launch choices."""
from __future__ import annotations

import ctypes
import re
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest

from conftest import SPECS

import kspec
from kspec.backends.rowwise import RowwiseDesc
from kspec.compile import emit_spec
from kspec.compiler import cost, plan_kernel
from kspec.spec_lang import KspecError, load_spec, parse, print_program
from kspec.core import KspecRuntimeError
from kspec.spec_lang.check import format_typed

BF16 = ml_dtypes.bfloat16
ROW_SPECS = ("layernorm", "rmsnorm", "add_rmsnorm", "row_softmax", "cross_entropy")
LENGTHS = (1, 7, 1000, 4097)


def _load(text: str):
    return load_spec(text, is_text=True)


def _error(text: str) -> KspecError:
    with pytest.raises(KspecError) as ei:
        _load(text)
    return ei.value


# ---------------------------------------------------------------- float64 truths (independent of kspec)

def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def truth(stem: str, a: dict, eps: float | None = None) -> dict:
    if stem == "layernorm":
        x = _f64(a["x"])
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        e = 1e-5 if eps is None else eps
        return {"y": (x - mu) / np.sqrt(var + e) * _f64(a["gamma"]) + _f64(a["beta"])}
    if stem == "rmsnorm":
        x = _f64(a["x"])
        e = 1e-6 if eps is None else eps
        return {"y": x / np.sqrt((x * x).mean(-1, keepdims=True) + e) * _f64(a["w"])}
    if stem == "add_rmsnorm":
        h = _f64((_f64(a["x"]) + _f64(a["res"])).astype(BF16))     # h is stored as bf16 and read back
        e = 1e-6 if eps is None else eps
        return {"h": h, "y": h / np.sqrt((h * h).mean(-1, keepdims=True) + e) * _f64(a["w"])}
    if stem == "row_softmax":
        x = _f64(a["x"])
        ex = np.exp(x - x.max(-1, keepdims=True))
        return {"y": ex / ex.sum(-1, keepdims=True)}
    if stem == "cross_entropy":
        x = _f64(a["logits"])
        mx = x.max(-1)
        lse = np.log(np.exp(x - mx[:, None]).sum(-1)) + mx
        return {"loss": lse - x[np.arange(x.shape[0]), a["label"]]}
    raise KeyError(stem)


def inputs(stem: str, m: int, n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def bf(*shape, scale=1.0, shift=0.0):
        return (rng.standard_normal(shape) * scale + shift).astype(BF16)
    if stem == "layernorm":
        return {"x": bf(m, n, scale=2.0, shift=3.0), "gamma": bf(n), "beta": bf(n)}
    if stem == "rmsnorm":
        return {"x": bf(m, n, scale=2.0), "w": bf(n)}
    if stem == "add_rmsnorm":
        return {"x": bf(m, n), "res": bf(m, n), "w": bf(n)}
    if stem == "row_softmax":
        return {"x": bf(m, n, scale=3.0)}
    if stem == "cross_entropy":
        return {"logits": bf(m, n, scale=4.0), "label": rng.integers(0, n, m).astype(np.int32)}
    raise KeyError(stem)


# bf16 outputs: a few bf16 ulps (2^-8 relative) of the largest magnitude; f32 outputs tighter
TOL = {"y": 2e-2, "h": 1e-2, "loss": 2e-5}


def assert_close(got: dict, want: dict):
    for name, w in want.items():
        g = _f64(got[name])
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max()) / scale
        assert err <= TOL[name], f"{name}: error {err:.3g} > {TOL[name]}"


# ---------------------------------------------------------------- the language: integer gathers

CE = (SPECS / "cross_entropy.kspec").read_text()


def test_gather_parses_prints_and_types():
    p = parse(CE)
    assert parse(print_program(p)) == p
    assert "logits[m, label[m]]" in print_program(p)
    typed = format_typed(_load(CE))
    assert "gather logits[m, label[m]] : bf16 [m]" in typed


def test_literal_subscripts_gather_a_fixed_column():
    prog = _load("""kernel first {
  in x : f32[M, N]
  out y : f32[M]
  y[m] = x[m, 0] + x[m, 2]
}""")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(kspec.reference(prog)(x=x)["y"], x[:, 0] + x[:, 2])


@pytest.mark.parametrize("src, msg, hint, col", [
    ("  in f : f32[M]\n  out y : f32[M]\n  y[m] = x[m, f[m]]",
     "subscript tensor 'f' is f32; a subscript must hold integers", "declare 'f' as i32", 15),
    ("  in f : i32[M, N]\n  out y : f32[M]\n  y[m] = x[m, f[m]]",
     "'f' has rank 2 but is used with 1 index", "declared as f: i32[M, N]", 15),
    ("  out y : f32[M]\n  y[m] = x[m, 9]",
     "subscript 9 is out of range for dimension 1 of 'x' (size 4)", "use 0 to 3", 15),
    ("  in l : i32[M]\n  out y : f32[M]\n  y[m] = x[m, l[m], 0]",
     "'x' has rank 2 but is used with 3 subscripts", "declared as x: f32[M, 4]", 10),
    ("  in label : i32[M]\n  out y : f32[M]\n  y[m] = x[m, lable[m]]", "unknown name 'lable'",
     "did you mean `label`?", 15),
    ("  param p : i32\n  out y : f32[M]\n  y[m] = x[m, p[m]]",
     "'p' is a scalar param; a subscript tensor needs indices", None, 15),
])
def test_gather_errors_are_located(src, msg, hint, col):
    text = "kernel k {\n  in x : f32[M, 4]\n" + src + "\n}\n"
    e = _error(text)
    assert e.message == msg
    if hint:
        assert hint in (e.hint or "")
    line = text.splitlines().index(next(l for l in text.splitlines() if l.startswith("  y[m] =")))
    assert (e.span.line, e.span.col) == (line + 1, col)


def test_nested_gather_reads_through_two_tables():
    f = kspec.reference("kernel k {\n  in x : f32[M, N]\n  in a : i32[M]\n  in b : i32[M]\n  out y : f32[M]\n"
                        "  y[m] = x[m, a[b[m]]]\n}\n")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a, b = np.array([3, 0, 2], dtype=np.int32), np.array([2, 2, 0], dtype=np.int32)
    np.testing.assert_array_equal(f(x=x, a=a, b=b)["y"], x[np.arange(3), a[b]])


def test_reference_rejects_an_out_of_range_label():
    f = kspec.reference(SPECS / "cross_entropy.kspec")
    logits = np.zeros((3, 5), dtype=BF16)
    with pytest.raises(KspecRuntimeError, match=r"index out of range: subscript label\[m\] of 'logits' \(axis 1\) "
                                                r"is 5 at m=1, but that axis has size 5 \(valid: 0 to 4\)"):
        f(logits=logits, label=np.array([0, 5, 1], dtype=np.int32))
    with pytest.raises(KspecError, match="is -1 at m=0"):
        f(logits=logits, label=np.array([-1, 0, 1], dtype=np.int32))


def test_random_inputs_give_valid_labels():
    from kspec.cli import random_inputs
    k = load_spec(SPECS / "cross_entropy.kspec").kernels[0]
    a = random_inputs(k, {"M": 50, "V": 3})
    assert a["label"].dtype == np.int32 and a["label"].min() >= 0 and a["label"].max() < 3


# ---------------------------------------------------------------- fusion and cost

def _spec(stem):
    return load_spec(SPECS / f"{stem}.kspec").kernels[0]


def _ideal_bytes(k, sizes) -> int:
    item = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i8": 1}
    total = 0
    for t in (*k.inputs, *k.outputs):
        total += int(np.prod([d if isinstance(d, int) else sizes[d] for d in t.shape])) * item[t.dtype]
    return total


@pytest.mark.parametrize("stem", ROW_SPECS)
def test_row_specs_are_one_kernel_at_ideal_traffic(stem):
    k = _spec(stem)
    sched = plan_kernel(k)
    assert [p.kind for p in sched.plans] == ["rowwise"]
    assert sched.intermediates == []
    sizes = {"M": 16384, "N": 8192, "V": 8192}
    c = cost(sched, sizes)
    assert c.fused_bytes == _ideal_bytes(k, sizes)
    flat = cost(plan_kernel(k, fuse_ops=False), sizes)
    assert len(flat.plans) > 1 and flat.fused_bytes > 2 * c.fused_bytes
    # one kernel per arch, from the row kernel generator
    em = emit_spec(SPECS / f"{stem}.kspec", ("sm90a", "sm100a"))
    (plist,) = em.plans.values()
    assert [type(ep.lowered.desc) for ep in plist] == [RowwiseDesc, RowwiseDesc]
    assert all(dict(ep.emitted.config)["kind"] == "rowwise" for ep in plist)


def test_spellings_of_layernorm_fuse_into_one_kernel():
    # the variance spelt as E[x^2] - E[x]^2, mean as sum / N, f32 input, affine in another statement
    k = _load("""kernel ln2 {
  in x : f32[M, N]
  in g : f32[N]
  out y : f32[M, N]
  s[m] = sum(n) x[m, n]
  q[m] = sum(n) x[m, n] * x[m, n]
  mu[m] = s[m] / 1024.0
  var[m] = q[m] / 1024.0 - mu[m] * mu[m]
  z[m, n] = (x[m, n] - mu[m]) / sqrt(var[m] + 0.00001)
  y[m, n] = z[m, n] * g[n]
}""").kernels[0]
    assert [p.kind for p in plan_kernel(k).plans] == ["rowwise"]


def test_rows_that_are_not_contiguous_do_not_fuse_and_say_why():
    k = _load("""kernel colsm {
  in x : f32[M, N] col
  out y : f32[M, N]
  y[m, n] = softmax(n) x[m, n]
}""").kernels[0]
    sched = plan_kernel(k)
    assert [p.kind for p in sched.plans] == ["softmax"]
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    y = kspec.reference(_load("kernel colsm {\n in x : f32[M, N] col\n out y : f32[M, N]\n"
                              " y[m, n] = softmax(n) x[m, n]\n}"))(x=x)["y"]
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=1e-6)


def test_labels_with_other_extents_do_not_join_a_row_kernel():
    k = _load("""kernel two {
  in x : f32[M, N]
  in z : f32[M, K]
  out y : f32[M]
  a[m] = sum(n) x[m, n]
  b[m] = sum(n) z[m, n]
  y[m] = a[m] + b[m]
}""").kernels[0]
    sched = plan_kernel(k)
    assert sorted(p.kind for p in sched.plans) == ["rowwise", "rowwise"]
    rng = np.random.default_rng(1)
    x, z = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal((3, 9)).astype(np.float32)
    np.testing.assert_allclose(kspec.reference(_load(
        "kernel two {\n in x : f32[M, N]\n in z : f32[M, K]\n out y : f32[M]\n a[m] = sum(n) x[m, n]\n"
        " b[m] = sum(n) z[m, n]\n y[m] = a[m] + b[m]\n}"))(x=x, z=z)["y"], x.sum(1) + z.sum(1), rtol=1e-5)


# ---------------------------------------------------------------- the reference against float64

@pytest.mark.parametrize("stem", ROW_SPECS)
@pytest.mark.parametrize("n", LENGTHS)
def test_reference_matches_float64(stem, n):
    a = inputs(stem, 3, n, seed=n)
    got = kspec.reference(SPECS / f"{stem}.kspec")(**a)
    assert_close(got, truth(stem, a))


@pytest.mark.parametrize("stem", ("layernorm", "cross_entropy"))
def test_reference_takes_strided_rows(stem):
    a = inputs(stem, 4, 37, seed=3)
    big = {k: v for k, v in a.items()}
    key = "x" if stem == "layernorm" else "logits"
    wide = np.zeros((4, 50), dtype=BF16)
    wide[:, 5:42] = a[key]
    big[key] = wide[:, 5:42]                       # rows 50 elements apart, starting at column 5
    assert not big[key].flags.c_contiguous
    got = kspec.reference(SPECS / f"{stem}.kspec")(**big)
    assert_close(got, truth(stem, a))


# ---------------------------------------------------------------- the generated kernel, run on the CPU

EMULATED = pytest.mark.slow


def _emu():
    from rowwise_harness import available
    why = available()
    if why:
        pytest.skip(f"cannot emulate row kernels here: {why}")
    from rowwise_harness import EmuKernel
    return EmuKernel


@EMULATED
@pytest.mark.parametrize("stem", ROW_SPECS)
@pytest.mark.parametrize("n", LENGTHS)
def test_generated_kernel_matches_float64_and_reference(stem, n):
    kern = _emu()(str(SPECS / f"{stem}.kspec"))
    a = inputs(stem, 5, n, seed=n + 1)
    got, facts = kern(a)
    assert_close(got, truth(stem, a))
    ref = kspec.reference(SPECS / f"{stem}.kspec")(**a)
    for name, r in ref.items():
        np.testing.assert_allclose(_f64(got[name]), _f64(r), rtol=2e-2, atol=2e-2 * max(1.0, np.abs(_f64(r)).max()))
    # 8-element vector steps when rows are 16-byte aligned (n a multiple of 8), else element by element
    assert facts["vec"] == (1 if n % 8 == 0 else 0)
    assert facts["cluster"] == 1 and facts["block_x"] % 32 == 0


@EMULATED
@pytest.mark.parametrize("stem", ("layernorm", "add_rmsnorm", "cross_entropy"))
def test_generated_kernel_takes_strided_rows(stem):
    kern = _emu()(str(SPECS / f"{stem}.kspec"))
    a = inputs(stem, 4, 200, seed=7)
    key = "x" if stem != "cross_entropy" else "logits"
    for start, vec in ((0, 1), (1, 0)):            # rows 256 apart; aligned, then 2 bytes off
        wide = np.full((4, 256 + 8), np.nan, dtype=BF16)
        wide[:, start:start + 200] = a[key]
        b = dict(a)
        b[key] = wide[:, start:start + 200]
        outs = None
        if stem == "add_rmsnorm":                  # outputs at a row stride too
            out_wide = np.full((4, 264), np.nan, dtype=BF16)
            outs = {"y": out_wide[:, start:start + 200]}
        got, facts = kern(b, outputs=outs)
        assert facts["vec"] == vec
        assert_close(got, truth(stem, a))
        if outs:
            assert np.isnan(_f64(out_wide[:, start + 200:])).all()    # nothing written past the rows


@EMULATED
@pytest.mark.parametrize("stem, n, budget, cs", [("layernorm", 4097, 2200, 4), ("row_softmax", 1000, 600, 4),
                                                 ("cross_entropy", 3001, 1600, 4), ("add_rmsnorm", 1024, 600, 8)])
def test_long_rows_split_over_a_cluster(stem, n, budget, cs):
    # a small shared-memory budget forces the cluster (DSMEM reduction) path at test sizes
    kern = _emu()(str(SPECS / f"{stem}.kspec"), budget=budget)
    a = inputs(stem, 3, n, seed=11)
    got, facts = kern(a)
    assert facts["cluster"] == cs and facts["cache"] == 1 and 0 < facts["smem"] <= budget
    assert facts["grid"] == 3 * facts["cluster"]
    assert_close(got, truth(stem, a))


@EMULATED
@pytest.mark.parametrize("stem", ("layernorm", "row_softmax"))
def test_rows_too_long_for_a_cluster_are_reread(stem):
    kern = _emu()(str(SPECS / f"{stem}.kspec"), budget=64)
    a = inputs(stem, 2, 3000, seed=5)
    got, facts = kern(a)
    assert facts["cache"] == 0 and facts["cluster"] == 1 and facts["smem"] == 0
    assert_close(got, truth(stem, a))


@EMULATED
def test_out_of_range_label_gives_nan_for_its_row_only():
    kern = _emu()(str(SPECS / "cross_entropy.kspec"))
    a = inputs("cross_entropy", 4, 64, seed=2)
    a["label"] = np.array([3, 64, -1, 63], dtype=np.int32)
    got, _ = kern(a)
    loss = got["loss"]
    assert np.isnan(loss[1]) and np.isnan(loss[2]) and np.isfinite(loss[[0, 3]]).all()
    ok = dict(a, label=np.array([3, 0, 0, 63], dtype=np.int32))
    np.testing.assert_allclose(loss[[0, 3]], truth("cross_entropy", ok)["loss"][[0, 3]], rtol=1e-5)


@EMULATED
@pytest.mark.parametrize("dt", ("f16", "f32", "bf16"))
def test_dtypes_and_several_row_axes(dt):
    src = f"""kernel rms3 {{
  param eps : f32 = 1e-6
  in  x : {dt}[B, S, N]
  in  w : {dt}[N]
  out y : {dt}[B, S, N]
  out r : f32[B, S]
  r[b, s] = rsqrt(mean(n) f32(x[b, s, n]) * f32(x[b, s, n]) + eps)
  y[b, s, n] = f32(x[b, s, n]) * r[b, s] * f32(w[n])
}}"""
    kern = _emu()(src, is_text=True)
    np_dt = {"f16": np.float16, "f32": np.float32, "bf16": BF16}[dt]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 136)).astype(np_dt)
    w = rng.standard_normal(136).astype(np_dt)
    got, facts = kern({"x": x, "w": w})
    assert facts["vec"] == 1
    x64, w64 = _f64(x), _f64(w)
    r = 1 / np.sqrt((x64 * x64).mean(-1) + 1e-6)
    np.testing.assert_allclose(got["r"], r, rtol=1e-5)
    tol = {"f16": 2e-3, "f32": 1e-5, "bf16": 2e-2}[dt]
    np.testing.assert_allclose(_f64(got["y"]), x64 * r[..., None] * w64, rtol=tol, atol=tol)


@EMULATED
def test_empty_rows_and_single_element_rows():
    kern = _emu()(str(SPECS / "row_softmax.kspec"))
    got, _ = kern({"x": np.full((6, 1), 3.0, dtype=BF16)})
    np.testing.assert_array_equal(_f64(got["y"]), np.ones((6, 1)))


# ---------------------------------------------------------------- nvcc: both archs, SASS, host glue

def _sass(cubin) -> str:
    from kspec.backends.toolchain import find_toolchain
    tc = find_toolchain()
    if tc.cuobjdump is None:
        pytest.skip("no cuobjdump")
    return subprocess.run([str(tc.cuobjdump), "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


@pytest.mark.nvcc
@pytest.mark.parametrize("stem", ROW_SPECS)
@pytest.mark.parametrize("arch", ("sm90a", "sm100a"))
def test_row_kernels_compile_with_vector_loads_and_shuffles(stem, arch, kernel_cache):
    from conftest import build_emitted
    em = emit_spec(SPECS / f"{stem}.kspec", (arch,))
    (plist,) = em.plans.values()
    cubin, host, _ = build_emitted(plist[0].emitted, kernel_cache)
    sass = _sass(cubin)
    assert re.search(r"\bLDG\.E\.(128|ENL2\.256)", sass), "no 128-bit global loads"
    assert re.search(r"\bSHFL\.BFLY", sass), "no warp shuffles"
    assert re.search(r"\bSTG\.E\.(128|ENL2\.256)", sass) or stem == "cross_entropy"


def _prepare(host, dims, ptrs, nptr, ndim, nscalar):
    lib = ctypes.CDLL(str(host))
    blob = ctypes.create_string_buffer(4096)
    size = ctypes.c_uint64()
    grid, block, cluster = (ctypes.c_uint32 * 3)(), (ctypes.c_uint32 * 3)(), (ctypes.c_uint32 * 3)()
    smem = ctypes.c_uint32()
    err = ctypes.create_string_buffer(256)
    rc = lib.kspec_prepare((ctypes.c_int64 * len(dims))(*dims), (ctypes.c_void_p * len(ptrs))(*ptrs),
                           (ctypes.c_double * 4)(1e-5, 0, 0, 0), None, 0, 132, blob, ctypes.c_uint64(4096),
                           ctypes.byref(size), grid, block, cluster, ctypes.byref(smem), err, ctypes.c_uint64(256))
    assert rc == 0, err.value
    off = 8 * (max(1, nptr) + max(1, ndim) + max(1, nscalar))
    rows, n, upr, cap, vec, cs, cache = struct.unpack_from("<qqqqiii", blob.raw, off)
    return dict(grid=tuple(grid), block=tuple(block), cluster=tuple(cluster), smem=smem.value, rows=rows, n=n,
                vec=vec, cs=cs, cache=cache, size=size.value)


@pytest.mark.nvcc
def test_host_glue_chooses_vector_path_cluster_and_block(kernel_cache):
    from conftest import build_emitted
    em = emit_spec(SPECS / "layernorm.kspec", ("sm90a",))
    (plist,) = em.plans.values()
    ep = plist[0]
    _, host, _ = build_emitted(ep.emitted, kernel_cache)
    desc = ep.lowered.desc
    roles = [r for r, _ in ep.lowered.dims]
    stride_role = {r for r, _, _ in desc.strides}

    def dims(m, n, stride=None):
        return [m if r == "d0" else n if r == "d1" else (stride or n) if r in stride_role else 1 for r in roles]
    nptr, ndim, nsc = len(desc.args), len(desc.dims), len(desc.scalars)
    aligned = [0x10000 * (i + 1) for i in range(nptr)]
    f = _prepare(host, dims(16384, 8192), aligned, nptr, ndim, nsc)
    assert f["vec"] == 1 and f["cs"] == 1 and f["cache"] == 1
    assert f["grid"] == (16384, 1, 1) and f["block"] == (256, 1, 1) and f["smem"] == 8192 * 2 + 32
    # an odd row length, or a pointer 2 bytes off: element by element
    assert _prepare(host, dims(64, 4097), aligned, nptr, ndim, nsc)["vec"] == 0
    assert _prepare(host, dims(64, 4096), [p + 2 for p in aligned], nptr, ndim, nsc)["vec"] == 0
    # a padded row stride keeps the vector path when it is a multiple of 16 bytes
    assert _prepare(host, dims(64, 4096, stride=4104), aligned, nptr, ndim, nsc)["vec"] == 1
    assert _prepare(host, dims(64, 4096, stride=4097), aligned, nptr, ndim, nsc)["vec"] == 0
    # short rows: several rows per CTA; long rows: a cluster per row
    short = _prepare(host, dims(1000, 64), aligned, nptr, ndim, nsc)
    assert short["block"][0] == 32 and short["block"][1] > 1 and short["grid"][0] * short["block"][1] >= 1000
    long_ = _prepare(host, dims(8, 1 << 17), aligned, nptr, ndim, nsc)
    assert long_["cs"] > 1 and long_["cluster"] == (long_["cs"], 1, 1) and long_["grid"][0] == 8 * long_["cs"]
    assert long_["smem"] <= 96 * 1024


# ---------------------------------------------------------------- compiled artifacts through the runtime

BASE = 0x7F0000000000


@pytest.fixture
def recording(monkeypatch):
    from test_runtime import RecordingDriver

    from kspec.runtime import driver

    class Rec(RecordingDriver):
        def launch(self, func, grid, block, cluster, smem, stream, params_ptr, what):
            self.log.append(("launch", what, grid, block, cluster, smem, stream, ctypes.string_at(params_ptr, 256)))
    rec = Rec()
    monkeypatch.setattr(driver, "_driver", rec)
    return rec


def _blob(mod, stem, raw):
    (plan,) = mod.manifest.kernels[0].plans
    off = 8 * (max(1, len(plan.args)) + max(1, len(plan.dims)) + max(1, len(plan.scalars)))
    rows, n, upr, cap, vec, cs, cache = struct.unpack_from("<qqqqiii", raw, off)
    return dict(rows=rows, n=n, vec=vec, cs=cs, cache=cache)


@pytest.mark.nvcc
def test_layernorm_artifact_launches_one_row_kernel(compiled, recording):
    from kspec.runtime import DeviceBuffer
    mod = kspec.load(compiled("layernorm", ("sm90a",)))
    x = DeviceBuffer(BASE, (4096, 8192), "bf16")
    g, b = DeviceBuffer(BASE + 0x10000000, (8192,), "bf16"), DeviceBuffer(BASE + 0x10010000, (8192,), "bf16")
    out = mod.layernorm(x, g, b, eps=1e-6)
    (launch,) = [e for e in recording.log if e[0] == "launch"]
    _, what, grid, block, cluster, smem, _, raw = launch
    assert (grid, block, cluster, smem) == ((4096, 1, 1), (256, 1, 1), (1, 1, 1), 8208 * 2)
    assert ("smem", 8208 * 2) in recording.log
    assert _blob(mod, "layernorm", raw) == dict(rows=4096, n=8192, vec=1, cs=1, cache=1)
    ptrs = struct.unpack_from("<4Q", raw, 0)
    assert set(ptrs) == {BASE, BASE + 0x10000000, BASE + 0x10010000, out["y"].ptr}
    # a view starting 2 bytes in: the same kernel, element by element
    recording.log.clear()
    mod.layernorm(DeviceBuffer(BASE + 2, (4096, 8192), "bf16"), g, b)
    (launch,) = [e for e in recording.log if e[0] == "launch"]
    assert _blob(mod, "layernorm", launch[7])["vec"] == 0


@pytest.mark.nvcc
def test_long_vocab_cross_entropy_launches_a_cluster_per_row(compiled, recording):
    from kspec.runtime import DeviceBuffer
    mod = kspec.load(compiled("cross_entropy", ("sm90a",)))
    logits = DeviceBuffer(BASE, (64, 256000), "bf16")          # 500 KiB rows
    label = DeviceBuffer(BASE + 0x40000000, (64,), "i32")
    mod.cross_entropy(logits, label)
    (launch,) = [e for e in recording.log if e[0] == "launch"]
    _, _, grid, block, cluster, smem, _, raw = launch
    assert cluster == (8, 1, 1) and grid == (64 * 8, 1, 1) and block == (1024, 1, 1)
    assert 0 < smem <= 96 * 1024
    assert _blob(mod, "cross_entropy", raw) == dict(rows=64, n=256000, vec=1, cs=8, cache=1)


@pytest.mark.nvcc
def test_bad_row_inputs_fail_before_launch(compiled, recording):
    from kspec.runtime import DeviceBuffer, KspecRuntimeError
    ln = kspec.load(compiled("layernorm", ("sm90a",)))
    x = DeviceBuffer(BASE, (64, 128), "bf16")
    with pytest.raises(KspecRuntimeError, match=r"argument 'gamma': dimension 0 \(N\) is 100, but 'x' has N = 128"):
        ln.layernorm(x, DeviceBuffer(BASE + 0x100000, (100,), "bf16"), DeviceBuffer(BASE + 0x200000, (128,), "bf16"))
    ce = kspec.load(compiled("cross_entropy", ("sm90a",)))
    logits = DeviceBuffer(BASE, (64, 1000), "bf16")
    with pytest.raises(KspecRuntimeError, match=r"argument 'label': expected i32"):
        ce.cross_entropy(logits, DeviceBuffer(BASE + 0x100000, (64,), "f32"))
    with pytest.raises(KspecRuntimeError, match=r"argument 'label': dimension 0 \(M\) is 63"):
        ce.cross_entropy(logits, DeviceBuffer(BASE + 0x100000, (63,), "i32"))
    assert not [e for e in recording.log if e[0] == "launch"]


# ---------------------------------------------------------------- gathers outside row kernels

EMBED = """kernel embed {
  in E : bf16[V, D]
  in tok : i32[T]
  in pos : f32[T, D]
  out y : f32[T, D]
  y[t, d] = f32(E[tok[t], d]) + pos[t, d]
}"""


def test_embedding_gather_is_one_elementwise_kernel_and_matches_numpy():
    prog = _load(EMBED)
    sched = plan_kernel(prog.kernels[0])
    assert [p.kind for p in sched.plans] == ["elementwise"]
    rng = np.random.default_rng(9)
    E = rng.standard_normal((11, 6)).astype(BF16)
    tok = rng.integers(0, 11, 5).astype(np.int32)
    pos = rng.standard_normal((5, 6)).astype(np.float32)
    got = kspec.reference(prog)(E=E, tok=tok, pos=pos)["y"]
    np.testing.assert_allclose(got, _f64(E)[tok] + pos, rtol=1e-6)


@pytest.mark.nvcc
def test_embedding_gather_compiles_as_a_generic_kernel(tmp_path, kernel_cache):
    from conftest import build_emitted
    spec = tmp_path / "embed.kspec"
    spec.write_text(EMBED)
    em = emit_spec(spec, ("sm90a",))
    (plist,) = em.plans.values()
    src = plist[0].emitted.source
    assert ": NAN)" in src                       # an out-of-range token reads nothing
    cubin, _, _ = build_emitted(plist[0].emitted, kernel_cache)
    assert "LDG" in _sass(cubin)


@pytest.mark.nvcc
def test_rows_at_a_pitch_reach_the_row_kernel(compiled, recording):
    """The manifest names the plan's stride sizes; the runtime passes a view's real row pitch, so
    row views of wider tensors run without a copy (vector path when the pitch allows it)."""
    from kspec.runtime import DeviceBuffer, KspecRuntimeError
    mod = kspec.load(compiled("layernorm", ("sm90a",)))
    (plan,) = mod.manifest.kernels[0].plans
    assert {t for t, _ in plan.strides.values()} == {"x", "y"}
    g, b = DeviceBuffer(BASE + 0x10000000, (8192,), "bf16"), DeviceBuffer(BASE + 0x10010000, (8192,), "bf16")

    def launch_dims(x, **kw):
        recording.log.clear()
        mod.layernorm(x, g, b, **kw)
        (launch,) = [e for e in recording.log if e[0] == "launch"]
        raw = launch[7]
        dims = struct.unpack_from(f"<{len(plan.dims)}q", raw, 8 * len(plan.args))
        return dict(zip((r for r, _ in plan.dims), dims)), _blob(mod, "layernorm", raw)
    x_role = next(r for r, (t, _) in plan.strides.items() if t == "x")
    y_role = next(r for r, (t, _) in plan.strides.items() if t == "y")
    dims, blob = launch_dims(DeviceBuffer(BASE, (64, 8192), "bf16", strides=(8200, 1)))
    assert dims[x_role] == 8200 and dims[y_role] == 8192 and blob["vec"] == 1
    dims, blob = launch_dims(DeviceBuffer(BASE, (64, 8192), "bf16", strides=(8193, 1)))
    assert dims[x_role] == 8193 and blob["vec"] == 0
    y = DeviceBuffer(BASE + 0x20000000, (64, 8192), "bf16", strides=(16384, 1))       # every other row
    dims, _ = launch_dims(DeviceBuffer(BASE, (64, 8192), "bf16"), y=y)
    assert dims[y_role] == 16384
    with pytest.raises(KspecRuntimeError, match="expected row layout"):
        mod.layernorm(DeviceBuffer(BASE, (64, 8192), "bf16", strides=(16384, 2)), g, b)
    with pytest.raises(KspecRuntimeError, match=r"argument 'y': stride 100 of dimension 0 is smaller than a dense row"):
        mod.layernorm(DeviceBuffer(BASE, (64, 8192), "bf16"), g, b,
                      y=DeviceBuffer(BASE + 0x20000000, (64, 8192), "bf16", strides=(100, 1)))
    with pytest.raises(KspecRuntimeError, match="expected row layout"):            # gamma is not pitched
        mod.layernorm(DeviceBuffer(BASE, (64, 8192), "bf16"), DeviceBuffer(BASE + 0x10000000, (8192,), "bf16",
                                                                            strides=(2,)), b)


# ---------------------------------------------------------------- more row groups, generated and emulated

MORE_GROUPS = {
"chain": """kernel chain {
  in  x : f32[M, N]
  out y : f32[M, N]
  out r : f32[M]
  a[m, n] = softmax(n) x[m, n]
  b[m, n] = softmax(n) a[m, n]
  c[m, n] = softmax(n) b[m, n]
  r[m] = max(n) b[m, n]
  y[m, n] = softmax(n) c[m, n]
}""",
"scores4d": """kernel sc {
  param scale : f32 = 0.125
  in s : f16[B, H, S, T]
  out p : f16[B, H, S, T]
  p[b, h, i, j] = softmax(j) (s[b, h, i, j] * scale)
}""",
"minmax": """kernel mm {
  in x : bf16[M, N]
  out lo : f32[M]
  out hi : bf16[M]
  out z : f32[M, N]
  lo[m] = min(n) f32(x[m, n])
  hi[m] = max(n) x[m, n]
  z[m, n] = (f32(x[m, n]) - lo[m]) / (f32(hi[m]) - lo[m] + 1e-3)
}""",
"dot": """kernel dot {
  in x : f32[M, N]
  in y : f32[M, N]
  out d : f32[M]
  out c : f32[M]
  d[m] = sum(n) x[m, n] * y[m, n]
  c[m] = d[m] / sqrt((sum(n) x[m, n] * x[m, n]) * (sum(n) y[m, n] * y[m, n]))
}""",
"mean_scaled": """kernel r {
  in X : bf16[N, C]
  out m : f32[N]
  m[n] = mean(c) f32(X[n, c]) * 2.0
}""",
"gelu_logsumexp": """kernel g {
  in X : f16[N, C]
  in bias : f16[C]
  out y : f32[N]
  out t : f16[N, C]
  t[n, c] = gelu(X[n, c] + bias[c])
  y[n] = log(sum(c) exp(f32(t[n, c])))
}""",
}


@EMULATED
@pytest.mark.parametrize("name", sorted(MORE_GROUPS))
@pytest.mark.parametrize("odd", (True, False))
def test_more_row_groups_match_the_reference(name, odd):
    """Chains of softmaxes, a 4-D softmax with a scale, min/max with both as outputs, row dot
    products, constants inside the reduced expression, a stored elementwise prologue."""
    from kspec.numerics import storage_dtype
    src = MORE_GROUPS[name]
    prog = _load(src)
    k = prog.kernels[0]
    assert [p.kind for p in plan_kernel(k).plans] == ["rowwise"]
    kern = _emu()(src, is_text=True)
    sizes = {"M": 5, "N": 203 if odd else 208, "B": 2, "H": 2, "S": 3, "T": 77 if odd else 80, "C": 135 if odd else 136}
    rng = np.random.default_rng(len(name))
    arrays = {t.name: rng.standard_normal(tuple(sizes[d] if isinstance(d, str) else d for d in t.shape))
              .astype(storage_dtype(t.dtype)) for t in k.inputs}
    got, facts = kern(arrays)
    assert facts["vec"] == (0 if odd else 1)
    for o, r in kspec.reference(prog)(**arrays).items():
        r64 = _f64(r)
        ulp = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}[k.tensor(o).dtype]     # one rounding step apart at most
        assert np.abs(_f64(got[o]) - r64).max() <= ulp * max(1.0, np.abs(r64).max()), o


def test_integer_values_stay_out_of_row_kernels():
    src = """kernel cnt {
  in x : f32[M, N]
  in k : i32[M]
  out y : f32[M]
  y[m] = sum(n) x[m, n] + f32(k[m] * 2)
}"""
    prog = _load(src)
    sched = plan_kernel(prog.kernels[0])
    assert sorted(p.kind for p in sched.plans) == ["elementwise", "rowwise"]
    assert any("row kernels read integers only as subscripts" in n or "integer (i32) values" in n
               for n in sched.fusion.notes)
    em = emit_spec_text(src)
    assert len(em.plans) == 2
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    k = np.array([1, -2, 3], dtype=np.int32)
    np.testing.assert_allclose(kspec.reference(prog)(x=x, k=k)["y"], x.sum(1) + 2 * k)


def emit_spec_text(src: str):
    import tempfile
    from pathlib import Path
    d = Path(tempfile.mkdtemp(prefix="kspec-row-"))
    (d / "k.kspec").write_text(src)
    return emit_spec(d / "k.kspec", ("sm90a", "sm100a"))


LOGSUMEXP_ROWS = """kernel lse {
  in x : bf16[M, N]
  out L : f32[M]
  out y : bf16[M, N]
  L[m] = logsumexp(n) x[m, n]
  y[m, n] = exp(f32(x[m, n]) - L[m])
}"""


def test_logsumexp_is_one_row_kernel_of_two_passes():
    k = _load(LOGSUMEXP_ROWS).kernels[0]
    sched = plan_kernel(k)
    assert [p.kind for p in sched.plans] == ["rowwise"]
    em = emit_spec_text(LOGSUMEXP_ROWS)
    (plist,) = em.plans.values()
    for ep in plist:
        assert ep.lowered.backend == "rowwise" and isinstance(ep.lowered.desc, RowwiseDesc)
        assert ep.lowered.desc.n_passes == 3      # max, sum of exponentials, the y pass
        assert "logf(" in ep.lowered.desc.body


@EMULATED
@pytest.mark.parametrize("odd", (True, False))
def test_logsumexp_row_kernel_matches_float64(odd):
    """A row of -inf (fully masked) gives -inf; -inf entries drop out; a large entry does not
    overflow (the max shift); y = exp(x - L) reads L in the same kernel."""
    from kspec.numerics import storage_dtype
    kern = _emu()(LOGSUMEXP_ROWS, is_text=True)
    n = 203 if odd else 208
    x = (np.random.default_rng(3).standard_normal((6, n)) * 4).astype(np.float32)
    x[1] = -np.inf
    x[2, ::3] = -np.inf
    x[4, 5] = 60.0                       # exp(60) overflows f32 without the max shift
    xs = x.astype(storage_dtype("bf16"))
    got, _ = kern({"x": xs})
    from test_logsumexp import _lse64           # float64, the max shift written out
    want = _lse64(_f64(xs), (1,))
    assert got["L"][1] == -np.inf
    np.testing.assert_allclose(_f64(got["L"]), want, rtol=1e-5, atol=1e-5)
    with np.errstate(invalid="ignore"):
        y64 = np.exp(_f64(xs) - want[:, None])          # NaN on the -inf row: -inf - (-inf)
    np.testing.assert_allclose(_f64(got["y"]), y64, rtol=8e-3, atol=1e-6)
    ref = kspec.reference(_load(LOGSUMEXP_ROWS))(x=xs)
    np.testing.assert_allclose(_f64(ref["L"]), want, rtol=1e-5, atol=1e-5)
