"""Fused attention from FlashAttention-4 in the CuTe DSL backend (backends/cute/attention.py,
attnmods.py): mask recognition and generated score_mod/mask_mod checked against float64 numpy written
here; offline builds on both archs (tensor-core SASS, size-bucketed variants in the manifest); the
launch ABI through the fake driver with variant dispatch; bad inputs rejected before launch."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import SPECS, checkout_env, cubin_sass, needs_fa4, test_cache_root

from kspec.backends.cute import attention as A
from kspec.backends.cute import attnmods as M
from kspec.backends.cute import compat
from kspec.compiler import plan_kernel
from kspec.compiler.kir import AuxLoad, Const, Index, IRBuffer, Op, Score, Size
from kspec.spec_lang import load_spec

ARCHS = ("sm90a", "sm100a")


def _ir(spec="attention", extra=(), **mods):
    sys.path.insert(0, str(SPECS.parent / "tests"))
    from test_kir import planned
    (p,) = planned(spec)
    ir = p.ir
    return dataclasses.replace(ir, buffers=(*ir.buffers, *extra), attention=dataclasses.replace(ir.attention, **mods))


BR = Op("le", (Index("j"), Op("add", (Index("i"), Op("sub", (Size("T"), Size("S")))))))      # bottom-right causal
TL = Op("le", (Index("j"), Index("i")))                                                       # top-left causal
WIN = Op("and", (BR, Op("gt", (Index("j"), Op("sub", (Index("i"), Const(4.0)))))))            # local, left 3
ALIBI = Op("add", (Score(), Op("mul", (AuxLoad("slope", (Index("h"),), "f32"), Op("sub", (Index("j"), Index("i")))))))
BIAS = Op("add", (Score(), AuxLoad("bias", (Index("h"), Index("i"), Index("j")), "f32")))     # broadcast over b
SOFTCAP = Op("mul", (Const(30.0), Op("tanh", (Op("div", (Score(), Const(30.0))),))))


def _grid(S, T, H=3, B=2):
    b = np.arange(B)[:, None, None, None]
    h = np.arange(H)[None, :, None, None]
    i = np.arange(S)[None, None, :, None]
    j = np.arange(T)[None, None, None, :]
    return b, h, i, j


@pytest.mark.parametrize("S, T", [(7, 7), (5, 9), (9, 5)])
@pytest.mark.parametrize("case", ["plain", "br", "tl_flag", "tl_mask", "window"])
def test_native_masks_match_float64(case, S, T):
    a = _ir(**{"plain": {}, "br": dict(mask=BR), "tl_flag": dict(causal=True), "tl_mask": dict(mask=TL),
               "window": dict(mask=WIN)}[case]).attention
    mods = M.analyse(a, {"S": "S", "T": "T"})
    assert mods.mask_mod is None and mods.score_mod is None          # FA4-native: causal / window
    assert mods.causal == (case == "br")
    b, h, i, j = _grid(S, T)
    want = {"plain": np.ones_like(i + j, bool), "br": j <= i + (T - S), "tl_flag": j <= i, "tl_mask": j <= i,
            "window": (j <= i + (T - S)) & (j > i - 4)}[case]
    _, keep = M.run_numpy(mods, score=np.zeros((1,)), b=b, h=h, i=i, j=j, S=S, T=T)
    assert np.array_equal(keep, np.broadcast_to(want, keep.shape))


def test_generated_mods_match_float64():
    rng = np.random.default_rng(0)
    S, T, H, B = 6, 8, 3, 2
    b, h, i, j = _grid(S, T, H, B)
    score = rng.standard_normal((B, H, S, T)) * 40
    slope = rng.standard_normal(H).astype(np.float32)
    bias = rng.standard_normal((H, S, T)).astype(np.float32)
    doc = np.array([[0, 0, 1, 1, 1, 2, 2, 2]] * B)
    cases = {
        "alibi": (dict(score_mod=ALIBI, aux=("slope",)), (slope,), score + slope[None, :, None, None] * (j - i), None),
        "bias": (dict(score_mod=BIAS, aux=("bias",)), (bias,), score + bias[None], None),
        "softcap": (dict(score_mod=SOFTCAP), (), 30.0 * np.tanh(score / 30.0), None),
        "docmask": (dict(mask=Op("eq", (AuxLoad("doc", (Index("b"), Op("add", (Index("i"), Const(2.0)))), "i32"),
                                         AuxLoad("doc", (Index("b"), Index("j")), "i32"))), aux=("doc",)),
                    (doc,), score, doc[b, i + 2] == doc[b, j]),
        "where": (dict(score_mod=Op("where", (Op("lt", (Op("mod", (Index("j"), Const(3.0))), Const(1.0))),
                                              Op("neg", (Score(),)), Score()))), (), np.where(j % 3 < 1, -score, score),
                  None),
        "tl_and_softcap": (dict(causal=True, score_mod=SOFTCAP), (), 30.0 * np.tanh(score / 30.0), j <= i),
    }
    for name, (mods_kw, aux, want_s, want_keep) in cases.items():
        mods = M.analyse(_ir(**mods_kw).attention, {"S": "S", "T": "T"})
        s, keep = M.run_numpy(mods, score=score, b=b, h=h, i=i, j=j, S=S, T=T, aux=aux)
        np.testing.assert_allclose(s, np.broadcast_to(want_s, s.shape), rtol=2e-6, atol=2e-5, err_msg=name)
        want_keep = np.ones(keep.shape, bool) if want_keep is None else np.broadcast_to(want_keep, keep.shape)
        assert np.array_equal(keep, want_keep), name


def test_mod_source_has_no_user_text_and_distinct_hashes():
    a1 = M.analyse(_ir(score_mod=Op("mul", (Score(), Const(0.5)))).attention, {"S": "S", "T": "T"})
    a2 = M.analyse(_ir(score_mod=Op("mul", (Score(), Const(0.25)))).attention, {"S": "S", "T": "T"})
    assert a1.score_mod != a2.score_mod and "__cute_hash__" in a1.score_mod
    b = M.analyse(_ir(extra=(IRBuffer("my_secret_bias", "input", "f32", ("H", "S", "T")),),
                      score_mod=Op("add", (Score(), AuxLoad("my_secret_bias", (Index("h"), Index("i"), Index("j")),
                                                            "f32"))), aux=("my_secret_bias",)).attention,
                  {"S": "S", "T": "T"})
    assert "my_secret_bias" not in b.score_mod and "aux_tensors[0]" in b.score_mod


def test_unsupported_kernels_have_reasons():
    assert "head dims" in A.unsupported(_ir(head_dims=(192, 192, 192)), "sm100a")
    assert A.unsupported(_ir(head_dims=(192, 192, 192)), "sm90a") is None
    # a group that is a size symbol is built per call (tests/test_attention_groups.py); an f32 param is not a group
    assert A.unsupported(_ir(kv_group="G", kv_head="HK"), "sm90a") is None
    assert "integer literal, a size symbol or an i32 param" in A.unsupported(_ir(kv_group="scale", kv_head="HK"),
                                                                             "sm90a")
    assert "f16 or bf16" in A.unsupported(_ir(dtypes=("f32", "f32", "f32")), "sm90a")


@needs_fa4
def test_head_dim_rule_matches_fa4():
    interface = compat.fa4_interface()
    for arch, cc in (("sm90a", 9), ("sm100a", 10)):
        for d in range(8, 264, 8):
            for dv in (64, 96, 128, 192, 256):
                try:
                    interface._validate_head_dims(d, dv, cc, 8)
                    fa4_ok = True
                except AssertionError:
                    fa4_ok = False
                assert (A.head_dims_reason(arch, d, dv) is None) == fa4_ok, (arch, d, dv)


def test_size_buckets_cover_every_length():
    sel = A.boxes([[(s, 8) for s in ls] for ls in ([1, 2, 64], [65, 128, 129], [200, 4096])])   # one B*H: S only
    assert sel == [[{"S": [0, 64]}], [{"S": [65, 199]}], [{"S": [200, None]}]]


# ---------------------------------------------------------------------------------------------
# offline builds
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fa4_artifacts(tmp_path_factory):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    out = tmp_path_factory.mktemp("fa4")
    cache = CompileCache(test_cache_root())
    done = {}

    def get(stem):
        if stem not in done:
            done[stem] = compile_spec(SPECS / f"{stem}.kspec", ARCHS, out, cache=cache)
        return done[stem]
    return get


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", ["attention", "attention_causal", "attention_lse"])
def test_shipped_attention_specs_build_one_fa4_kernel_per_arch(fa4_artifacts, stem):
    art = fa4_artifacts(stem)
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    assert plan["kind"] == "attention"
    for arch, insn in zip(ARCHS, ("HGMMA", "UTCHMMA")):
        b = plan["binaries"][arch]
        assert b["backend"] == "cute" and b["kind"] == "attention"
        assert b["config"]["kernel"].startswith("FlashAttention-4")
        assert int(b["config"]["sm_count"]) == compat.OFFLINE_SM_COUNT[arch]
        # the size-bucketed single-pass variants; on sm100a also the split-KV pair (split kernel, combine)
        variants = [v for v in b["variants"] if v["config"].get("role") not in ("split", "combine")]
        pair = [v["config"]["role"] for v in b["variants"] if v not in variants]
        # (attention_causal and attention_lse are self-attention, T = S: never decode-shaped)
        assert pair == (["split", "combine"] if arch == "sm100a" and stem == "attention" else [])
        assert variants and variants[0]["cubin"] == b["cubin"]
        lo = [v["select"][0]["S"] for v in variants]
        assert lo[0][0] == 0 and lo[-1][1] is None           # every query length is served
        so = art / b["host"]
        deps = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
        needed = {l.split("[")[1].rstrip("]") for l in deps.splitlines() if "(NEEDED)" in l}
        assert needed <= {"libc.so.6", "ld-linux-x86-64.so.2"}   # no libcute_dsl_runtime, no libtvm_ffi
        assert b["config"]["lse"] == ("yes" if stem == "attention_lse" else "no")
        for v in variants:
            sass = cubin_sass(art / v["cubin"])
            if sass is not None:
                assert f" {insn}" in sass and "UTMALDG" in sass, f"{stem} {arch}: no {insn}"
                if stem == "attention_lse":
                    assert "MUFU.LG2" in sass, f"{stem} {arch}: no log2 for the LSE"


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_launch_abi_and_variant_dispatch_through_the_fake_driver(fa4_artifacts, monkeypatch, arch):
    import struct

    import kspec
    from kspec.runtime import driver
    from kspec.runtime.errors import KspecRuntimeError
    from test_runtime import FakeCAI, MultiParamRecorder
    rec = MultiParamRecorder((9, 0) if arch == "sm90a" else (10, 0), tail=64)
    monkeypatch.setattr(driver, "_driver", rec)
    art = fa4_artifacts("attention")
    mod = kspec.load(art)
    b = json.loads((art / "manifest.json").read_text())["kernels"][0]["plans"][0]["binaries"][arch]
    base = 0x7F0000000000
    for S in (100, 1000):
        B, H, T = 2, 4, 512             # 4 key blocks: never split (split-KV: tests/test_attention_splitkv.py)
        Q = FakeCAI(base, (B, H, S, 128))
        K = FakeCAI(base + 0x10000000, (B, H, T, 128))
        V = FakeCAI(base + 0x20000000, (B, H, T, 128))
        O = FakeCAI(base + 0x30000000, (B, H, S, 128))
        rec.base.log.clear()
        mod.attention(Q, K, V, O=O, scale=0.125)
        (fn,) = [e for e in rec.log if e[0] == "function"]
        (launch,) = [e for e in rec.log if e[0] == "launch"]
        want = next(v for v in b["variants"] if v["select"][0]["S"][0] <= S
                    and (v["select"][0]["S"][1] is None or S <= v["select"][0]["S"][1]))
        assert fn[2] == want["symbol"] and (art / want["cubin"]).read_bytes().startswith(fn[3])
        _, what, grid, block, cluster, smem, stream, offsets, blob = launch
        assert offsets == tuple(int(x) for x in want["config"]["param_offsets"].split(","))
        assert block[0] in (128, 256, 384, 512) and 0 < smem <= 232448 and all(g >= 1 for g in grid)
        # FA4 passes the scale folded into exp2's base (scale * log2(e)) when there is no score_mod
        assert struct.pack("<f", 0.125) in blob or any(
            abs(x - 0.125 * 1.4426950408889634) < 1e-6 for x in struct.unpack_from(f"<{len(blob) // 4}f", blob))
        words = set(struct.unpack_from(f"<{len(blob) // 8}Q", blob[:len(blob) // 8 * 8]))
        # Q/K/V/O go through TMA descriptors; the pointers appear in the blob (descriptors or raw)
        assert any(base <= w < base + 0x40000000 for w in words)
    with pytest.raises(KspecRuntimeError):
        mod.attention(FakeCAI(base, (2, 4, 64, 128)), FakeCAI(base + 0x10000000, (2, 4, 64, 64)),
                      FakeCAI(base + 0x20000000, (2, 4, 64, 128)), O=FakeCAI(base + 0x30000000, (2, 4, 64, 128)))


# ---------------------------------------------------------------------------------------------
# variants over hand-built IR (one size bucket each, to stay quick)
# ---------------------------------------------------------------------------------------------

def _gqa_ir(group=4, mqa=False):
    ir = _ir("attention")
    a = ir.attention
    bufs = []
    for b in ir.buffers:
        if b.name in ("K", "V"):
            b = dataclasses.replace(b, shape=(b.shape[0], b.shape[2], b.shape[3]) if mqa else (b.shape[0], "HK", *b.shape[2:]))
        bufs.append(b)
    if mqa:
        a = dataclasses.replace(a, kv_shared=("h",), dims=tuple((r, 8 if r == "H" else v) for r, v in a.dims))
    else:
        a = dataclasses.replace(a, kv_group=group, kv_head="HK")
    return dataclasses.replace(ir, buffers=tuple(bufs), attention=a)


def _dims_ir(d, dv):
    """Q, K with head dim d; V, O with dv (DeepSeek-style (192, 128) where FA4 supports it)."""
    ir = _ir("attention")
    bufs = tuple(dataclasses.replace(b, shape=(*b.shape[:3], d if b.name in ("Q", "K") else dv))
                 if b.name in ("Q", "K", "V", "O") else b for b in ir.buffers)
    return dataclasses.replace(ir, buffers=bufs, attention=dataclasses.replace(ir.attention, head_dims=(d, d, dv)))


VARIANTS = {
    "plain": lambda: _ir(),
    "dims_192_128": lambda: _dims_ir(192, 128),
    "dims_64": lambda: _dims_ir(64, 64),
    "dims_96": lambda: _dims_ir(96, 96),
    "dims_256": lambda: _dims_ir(256, 256),
    "causal_top_left": lambda: _ir(causal=True),
    "causal_bottom_right": lambda: _ir(mask=BR),
    "sliding_window": lambda: _ir(mask=WIN),
    "bias": lambda: _ir(extra=(IRBuffer("bias", "input", "f32", ("H", "S", "T")),), score_mod=BIAS, aux=("bias",)),
    # broadcast over h instead (a per-sequence padding bias), bf16
    "bias_per_batch": lambda: _ir(extra=(IRBuffer("bias", "input", "bf16", ("B", "S", "T")),), aux=("bias",),
                                  score_mod=Op("add", (Score(), AuxLoad("bias", (Index("b"), Index("i"), Index("j")),
                                                                        "bf16")))),
    "alibi": lambda: _ir(extra=(IRBuffer("slope", "input", "f32", ("H",)),), score_mod=ALIBI, aux=("slope",)),
    "softcap": lambda: _ir(score_mod=SOFTCAP),
    "gqa": lambda: _gqa_ir(4),
    "mqa": lambda: _gqa_ir(mqa=True),
    "lse": lambda: _ir(extra=(IRBuffer("L", "output", "f32", ("B", "H", "S")),), lse="L"),
}


# the whole sweep is 30 cold FlashAttention-4 builds (3 minutes on 2 cores): the default tier
# compiles the plain kernel on both archs, `-m heavy` every variant (the shipped attention specs'
# own builds above and in test_compile_e2e cover masks, mods, GQA and LSE in the default tier)
_DEFAULT_VARIANTS = ("plain",)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [n if n in _DEFAULT_VARIANTS else pytest.param(n, marks=pytest.mark.heavy)
                                  for n in sorted(VARIANTS)])
def test_attention_variants_compile_offline(name, arch):
    ir = VARIANTS[name]()
    assert A.unsupported(ir, arch) is None
    desc, names, dims, scalars = A.lower(ir, arch)
    built = A.build(desc, test_cache_root(), lengths=[4096])
    (v,) = [v for v in built.variants if dict(v.config).get("role") not in ("split", "combine")]
    assert v.symbol.startswith("kernel_cutlass_kernel_flash_attn")
    sass = cubin_sass(v.cubin)
    if sass is not None:
        assert (" HGMMA" if arch == "sm90a" else " UTCHMMA") in sass
    src = A.entry_source(desc)
    for spec_name in (n for n in names.values() if len(n) > 2):
        assert re.search(rf"\b{spec_name}\b", src) is None                 # no user text in generated code
    if name == "lse":
        assert "mLSE" in src
    if name in ("bias", "alibi", "bias_per_batch"):
        assert "kspec_score_mod" in src and "aux_tensors[0]" in src
    if name in ("causal_top_left", "sliding_window"):
        assert "window_right" in src


# ---------------------------------------------------------------------------------------------
# on a GPU: against float64 numpy written here
# ---------------------------------------------------------------------------------------------

def _attention64(q, k, v, scale, keep):
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
    s = np.where(keep, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", np.divide(p, den, out=np.zeros_like(p), where=den > 0), v.astype(np.float64))


@needs_fa4
@pytest.mark.gpu
@pytest.mark.parametrize("stem, S, T", [("attention", 1000, 1000), ("attention", 100, 700),
                                        ("attention_causal", 777, 777), ("attention_causal", 64, 64)])
def test_fa4_attention_on_gpu_matches_float64(compiled, stem, S, T):
    import kspec
    from kspec.runtime import from_device
    from test_gpu_specs import _device_arch
    arch = _device_arch()                  # skips without a device
    mod = kspec.load(compiled(stem, (arch,)))
    rng = np.random.default_rng(3)
    d = 128 if stem == "attention" else 64
    dt = np.float16 if stem == "attention" else __import__("ml_dtypes").bfloat16
    q, k, v = (rng.standard_normal(s).astype(dt) for s in ((2, 3, S, d), (2, 3, T, d), (2, 3, T, d)))
    scale = 1.0 / math.sqrt(d)
    kernel = getattr(mod, stem)
    got = from_device(kernel(**kernel.to_device(Q=q, K=k, V=v), scale=scale)["O"]).astype(np.float64)
    i, j = np.arange(S)[:, None], np.arange(T)[None, :]
    keep = np.broadcast_to(j <= i if stem == "attention_causal" else np.ones((S, T), bool), (2, 3, S, T))
    want = _attention64(q, k, v, scale, keep)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < (2e-2 if stem == "attention_causal" else 5e-3), err


@needs_fa4
@pytest.mark.gpu
@pytest.mark.parametrize("shift, S", [(0, 777), (3, 200)])
def test_fa4_lse_on_gpu_matches_float64(kernel_cache, tmp_path, shift, S):
    """attention_lse (and its mask moved `shift` keys down, so the first `shift` queries keep no key):
    O and L against float64 numpy; L = -inf and O = 0 on the fully masked rows, as kspec defines."""
    import kspec
    from kspec.compile import compile_spec
    from kspec.runtime import from_device
    from test_gpu_specs import _device_arch
    arch = _device_arch()                  # skips without a device
    path = tmp_path / "attention_lse.kspec"
    path.write_text((SPECS / "attention_lse.kspec").read_text().replace("where(j <= i,", f"where(j <= i - {shift},"))
    mod = kspec.load(compile_spec(path, (arch,), tmp_path / "out", cache=kernel_cache))
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, S, 128)).astype(__import__("ml_dtypes").bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(128)
    kernel = mod.attention_lse
    out = kernel(**kernel.to_device(Q=q, K=k, V=v), scale=scale)
    O, L = from_device(out["O"]).astype(np.float64), from_device(out["L"]).astype(np.float64)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    keep = np.broadcast_to(j <= i - shift, (2, 3, S, S))
    want_o = _attention64(q, k, v, scale, keep)
    s64 = np.where(keep, np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale, -np.inf)
    m = s64.max(-1)
    mf = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        want_l = mf + np.log(np.exp(s64 - mf[..., None]).sum(-1))
    assert (L[:, :, :shift] == -np.inf).all() and (O[:, :, :shift] == 0).all()
    assert np.isfinite(L[:, :, shift:]).all()
    assert np.abs(L[:, :, shift:] - want_l[:, :, shift:]).max() < 2e-3 * max(1.0, np.abs(want_l[:, :, shift:]).max())
    assert np.abs(O - want_o).max() / max(np.abs(want_o).max(), 1e-6) < 2e-2


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", ["attention", "attention_causal", "attention_lse"])
def test_launch_abi_checked_against_the_cubin_by_the_fake_driver(fa4_artifacts, stem):
    """kspec.runtime.fakedriver: parameter layout against the cubin, TMA descriptors against the
    tensors, for query lengths served by different variants."""
    import kspec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    mod = kspec.load(fa4_artifacts(stem))
    for arch, cc in (("sm90a", (9, 0)), ("sm100a", (10, 0))):
        with FakeDriver(cc, sm_count=compat.OFFLINE_SM_COUNT[arch]) as fake:
            for S, T in ((100, 100), (200, 200), (1000, 1000), (100, 700)):
                sizes = {"B": 2, "H": 4, "S": S, "T": T}
                call = fake_call(mod, stem, sizes, fake)
                problems = check_call(call, arch, mod)
                # Open on sm100a, to verify on a B200: FA4's kernel launches with 232448 bytes of dynamic
                # shared memory (compiled in, whatever the device reports) beside the DSL's 1 KB-aligned
                # static base section; the fake driver counts both against the 232448-byte limit.
                problems = [p for p in problems if not (arch == "sm100a" and "static shared memory exceed" in p)]
                # (the DSL's launcher encodes its TMA descriptors in host code: check_launch finds every
                # tensor's address in the parameter blob, inside them)
                assert problems == [], f"{stem} {arch} {sizes}:\n" + "\n".join(problems)
                plan = mod[stem].entry.plans[0]
                b = plan.binaries[arch]
                if len(call.launches) == 2:
                    # sm100a splits the key range where FA4's heuristic says so (T = 1000: 8 key blocks)
                    assert arch == "sm100a" and [r.symbol for r in call.launches] == [
                        b.variants[i].symbol for i in mod.split_variants(plan, arch, compat.OFFLINE_SM_COUNT[arch])]
                else:
                    (rec,) = call.launches
                    assert rec.symbol == b.symbol


@needs_fa4
@pytest.mark.cute
def test_lse_output_is_a_launch_argument_checked_by_the_fake_driver(fa4_artifacts):
    """attention_lse's L (f32 [B, H, S], FA4's mLSE) is the plan's fifth tensor: the glue gets its
    pointer, the launch blob holds it as a plain pointer (FA4 stores LSE without TMA), the cubin's
    parameter layout matches, and a wrong L is refused before any launch."""
    import kspec
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    from kspec.runtime.tensors import DeviceBuffer
    mod = kspec.load(fa4_artifacts("attention_lse"))
    (plan,) = mod["attention_lse"].entry.plans
    assert tuple(plan.args) == ("Q", "K", "V", "O", "L")
    for arch, cc in (("sm90a", (9, 0)), ("sm100a", (10, 0))):
        with FakeDriver(cc, sm_count=compat.OFFLINE_SM_COUNT[arch]) as fake:
            # (T = S <= 512: 4 key blocks, never split; the LSE of a split call is the combine's:
            # tests/test_attention_splitkv.py)
            for S in (100, 400):
                sizes = {"B": 2, "H": 4, "S": S}
                call = fake_call(mod, "attention_lse", sizes, fake, pass_outputs=True)
                problems = [p for p in check_call(call, arch, mod)
                            if not (arch == "sm100a" and "static shared memory exceed" in p)]
                assert problems == [], "\n".join(problems)
                (args,) = call.plan_args
                (rec,) = call.launches
                L = args[4]
                assert (L.name, L.dtype, L.shape) == ("L", "f32", (2, 4, S))
                assert L.strides == (4 * S, S, 1)
                assert rec.prepare.ptrs[4] == L.ptr
                words = {int.from_bytes(rec.params[i:i + 8], "little") for i in range(0, len(rec.params) - 7, 8)}
                assert L.ptr in words and L.ptr not in {tm.address for tm in rec.prepare.tensor_maps}
            # a wrong L: refused before a launch, naming it
            shape = {"Q": (2, 4, 64, 128), "K": (2, 4, 64, 128), "V": (2, 4, 64, 128), "O": (2, 4, 64, 128)}
            bufs = {n: DeviceBuffer(fake.alloc(2 * math.prod(sh), n), sh, "bfloat16") for n, sh in shape.items()}
            n_launches = len(fake.launches)
            for bad in (DeviceBuffer(fake.alloc(4 * 2 * 4 * 65, "L"), (2, 4, 65), "float32"),
                        DeviceBuffer(fake.alloc(2 * 2 * 4 * 64, "L"), (2, 4, 64), "bfloat16")):
                with pytest.raises(KspecRuntimeError, match="argument 'L'"):
                    mod.attention_lse(**bufs, L=bad)
            assert len(fake.launches) == n_launches


@needs_fa4
@pytest.mark.cute
def test_warm_attention_compile_imports_neither_fa4_nor_the_dsl(fa4_artifacts, tmp_path):
    fa4_artifacts("attention")             # the cache is warm
    code = ("import sys; from kspec.compile import compile_spec; from kspec.backends.build import CompileCache;"
            f"from conftest import test_cache_root; compile_spec({str(SPECS / 'attention.kspec')!r}, ('sm90a', 'sm100a'), "
            f"{str(tmp_path)!r}, cache=CompileCache(test_cache_root()));"
            "bad = [m for m in ('cutlass', 'flash_attn', 'quack', 'torch') if m in sys.modules]; print(bad)")
    # (from this checkout: an installed kspec elsewhere has other sources, so other cache keys)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(SPECS.parent / "tests"), env=checkout_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


@needs_fa4
@pytest.mark.cute
def test_gqa_head_count_not_a_multiple_of_the_group_is_refused_before_launch():
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.glue import HostGlue
    desc, names, dims, _ = A.lower(VARIANTS["gqa"](), "sm90a")
    assert [r for r, _ in dims][:5] == ["B", "H", "S", "T", "HK"] and dict(dims)["G"] == 4
    (v,) = A.build(desc, test_cache_root(), lengths=[4096]).variants
    glue = HostGlue(v.host, "gqa", [names[a] for a in desc.args])
    ptrs = [0x7F0000000000 + i * 0x10000000 for i in range(len(desc.args))]
    ok = glue.prepare([2, 8, 300, 500, 2, 4], ptrs, [0.1], 0, 0, 132)     # 8 query heads on 2 K/V heads
    assert ok.grid[0] >= 1 and ok.block[0] > 0
    with pytest.raises(KspecRuntimeError, match="6 query heads with 2 K/V heads"):
        glue.prepare([2, 6, 300, 500, 2, 4], ptrs, [0.1], 0, 0, 132)
    with pytest.raises(KspecRuntimeError, match="GQA group 3"):
        glue.prepare([2, 8, 300, 500, 2, 3], ptrs, [0.1], 0, 0, 132)
    empty = glue.prepare([2, 8, 0, 500, 2, 4], ptrs, [0.1], 0, 0, 132)
    assert empty.grid == (0, 0, 0)


def _manifest_json(select):
    h = "ab" * 32
    binary = {"cubin": "p.sm90a.v0.cubin", "host": "p.sm90a.v0.so", "sha256": {"cubin": h, "host": h},
              "symbol": "k0", "config": {"sm_count": "132"},
              "variants": [{"cubin": "p.sm90a.v0.cubin", "host": "p.sm90a.v0.so", "sha256": {"cubin": h, "host": h},
                            "symbol": "k0", "config": {"sm_count": "132"}, "select": select},
                           {"cubin": "p.sm90a.v1.cubin", "host": "p.sm90a.v1.so", "sha256": {"cubin": h, "host": h},
                            "symbol": "k1", "config": {"sm_count": "132"}, "select": [{"S": [129, None]}]}]}
    return {"format": "kspec-artifact", "format_version": 1, "kspec_version": "0.1.0",
            "spec": {"file": "a.kspec", "sha256": h}, "archs": ["sm90a"],
            "kernels": [{"name": "attention",
                         "inputs": [{"name": "Q", "dtype": "f16", "shape": ["B", "H", "S", 64]}],
                         "outputs": [{"name": "O", "dtype": "f16", "shape": ["B", "H", "S", 64]}],
                         "plans": [{"id": "p", "kind": "attention", "dims": [["B", "B"], ["H", "H"], ["S", "S"]],
                                    "args": ["Q", "O"], "binaries": {"sm90a": binary}}]}]}


def test_manifest_variants_round_trip_and_select():
    from kspec.artifact import KspecArtifactError, manifest_from_json, manifest_to_json
    m = manifest_from_json(_manifest_json([{"S": [0, 128]}]))
    b = m.kernels[0].plans[0].binaries["sm90a"]
    assert [v.symbol for v in b.variants] == ["k0", "k1"]
    assert b.variants[0].holds({"S": 128, "B": 2}) and not b.variants[0].holds({"S": 129})
    assert b.variants[1].holds({"S": 1 << 30}) and not b.variants[1].holds({"B": 3})   # a role it needs is missing
    assert manifest_from_json(manifest_to_json(m)) == m
    with pytest.raises(KspecArtifactError, match=r"variants\[0\]\.select\[0\]\.S"):
        manifest_from_json(_manifest_json([{"S": [10, 5]}]))
    no_select = _manifest_json([{"S": [0, 1]}])
    del no_select["kernels"][0]["plans"][0]["binaries"]["sm90a"]["variants"][0]["select"]
    with pytest.raises(KspecArtifactError, match="missing field 'select'"):
        manifest_from_json(no_select)


@pytest.mark.parametrize("S, T, W", [(7, 7, 3), (9, 9, 1), (6, 6, 10)])
def test_a_window_sized_by_an_integer_param_is_fa4_native(S, T, W):
    """`where(j <= i and j > i - W, s, -inf)` with `param W : i32`: FA4's local window, its left
    bound read from the param at launch (no mask_mod), equal to the float64 mask."""
    from kspec.compiler.kir import Load
    win = Op("and", (TL, Op("gt", (Index("j"), Op("sub", (Index("i"), Load("W", "scalar", "i32")))))))
    a = _ir(mask=win).attention
    mods = M.analyse(a, {"S": "S", "T": "S"})
    assert mods.mask_mod is None and not mods.causal and M.window_params(mods.window) == ("W",)
    b, h, i, j = _grid(S, T)
    _, keep = M.run_numpy(mods, score=np.zeros((1,)), b=b, h=h, i=i, j=j, S=S, T=T, params={"W": W})
    assert np.array_equal(keep, np.broadcast_to((j <= i) & (j > i - W), keep.shape))


@needs_fa4
def test_the_shipped_sliding_window_reads_its_width_at_launch():
    sys.path.insert(0, str(SPECS.parent / "tests"))
    from test_kir import planned
    (p,) = planned("attention_sliding_window")
    desc, names, dims, scalars = A.lower(p.ir, "sm90a")
    assert desc.mods.mask_mod is None and desc.mods.window is not None
    w_abi = [c for c, n in names.items() if n == "W"]
    assert w_abi and w_abi[0] in desc.scalars
    glue = A._glue(desc, "ciface", "entry", (0,), (8,))
    assert f"scalars[{desc.scalars.index(w_abi[0])}]" in glue and "window_left" in glue


# ---------------------------------------------------------------------------------------------
# packed variable-length batches (cu_seqlens): specs/attention_varlen.kspec
# ---------------------------------------------------------------------------------------------

def _varlen_call(mod, fake, cu_q, cu_k, rows_q=None, rows_k=None, H=2, rows_o=None):
    """attention_varlen on fake device memory: the offsets uploaded, Q/K/V/O allocated packed."""
    from kspec.runtime.tensors import DeviceBuffer

    def buf(shape, dtype, data=None):
        n = int(np.prod(shape)) * (4 if dtype == "int32" else 2)
        ptr = fake.alloc(max(n, 16))
        if data is not None:
            fake.upload(ptr, np.asarray(data, np.int32).tobytes())
        strides = tuple(int(np.prod(shape[k + 1:])) for k in range(len(shape)))
        return DeviceBuffer(ptr, tuple(shape), dtype, strides=strides)
    rows_q = int(cu_q[-1]) if rows_q is None else rows_q
    rows_k = int(cu_k[-1]) if rows_k is None else rows_k
    args = dict(cu_q=buf((len(cu_q),), "int32", cu_q), cu_k=buf((len(cu_k),), "int32", cu_k),
                Q=buf((rows_q, H, 128), "bfloat16"), K=buf((rows_k, H, 128), "bfloat16"),
                V=buf((rows_k, H, 128), "bfloat16"), O=buf((rows_o or rows_q, H, 128), "bfloat16"))
    return mod.attention_varlen(**args), args


@needs_fa4
@pytest.mark.cute
def test_varlen_attention_is_one_fa4_kernel_per_arch_with_cu_seqlens(fa4_artifacts):
    art = fa4_artifacts("attention_varlen")
    m = json.loads((art / "manifest.json").read_text())
    k = m["kernels"][0]
    (plan,) = k["plans"]
    assert plan["kind"] == "attention" and plan["args"][-2:] == ["cu_q", "cu_k"]
    # the packed tensors are recorded by their storage shape; the offsets bind B
    shapes = {t["name"]: (t["shape"], t.get("packed")) for t in k["inputs"] + k["outputs"]}
    assert shapes["Q"] == (["cu_q_rows", "H", 128], "cu_q") and shapes["O"] == (["cu_q_rows", "H", 128], "cu_q")
    assert shapes["K"] == (["cu_k_rows", "H", 128], "cu_k") and shapes["cu_q"] == (["B+1"], None)
    assert dict(map(tuple, plan["dims"]))["S"] == "cu_q_rows" and dict(map(tuple, plan["dims"]))["T"] == "cu_k_rows"
    ranges = {r["tensor"]: r for r in k["index_ranges"]}
    assert ranges["cu_q"]["extent"] == "cu_q_rows" and ranges["cu_q"]["inclusive"] and ranges["cu_q"]["monotonic"] \
        and ranges["cu_q"]["ends"]
    for arch, insn in zip(ARCHS, ("HGMMA", "UTCHMMA")):
        b = plan["binaries"][arch]
        assert b["backend"] == "cute" and b["config"]["varlen"] == "cu_seqlens_q, cu_seqlens_k"
        assert b["config"]["mask"] == "causal (bottom-right)"
        for v in b["variants"]:
            sass = cubin_sass(art / v["cubin"])
            if sass is not None:
                assert f" {insn}" in sass, f"{arch}: no {insn}"


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_launch_abi_and_offsets_checked_before_launch(fa4_artifacts, arch):
    import kspec
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    mod = kspec.load(fa4_artifacts("attention_varlen"))
    cc = (9, 0) if arch == "sm90a" else (10, 0)
    with FakeDriver(cc, sm_count=compat.OFFLINE_SM_COUNT[arch]) as fake:
        for sizes in ({"B": 3, "H": 4}, {"B": 1, "H": 8, "cu_q_rows": 7, "cu_k_rows": 300},
                      {"B": 4, "H": 2, "cu_q_rows": 4000, "cu_k_rows": 4000}):
            call = fake_call(mod, "attention_varlen", sizes, fake)
            problems = [p for p in check_call(call, arch, mod)
                        if not (arch == "sm100a" and "static shared memory exceed" in p)]   # see above
            assert problems == [], f"{arch} {sizes}:\n" + "\n".join(problems)
            (rec,) = call.launches
            B = sizes["B"]
            # dims: B from the offsets' extent, S and T the packed row counts, FA4's bound on the grid
            assert list(rec.prepare.dims) == [B, sizes["H"], call.sizes["cu_q_rows"], call.sizes["cu_k_rows"],
                                              sizes["H"]]
        # bad offsets: a clear error naming the tensor, and nothing launched
        n = len(fake.launches)
        cases = [
            (([0, 100, 250], [0, 100, 200], 300, None), r"the last offset cu_q\[2\] = 250 must be the row count of Q "
                                                        r"\(cu_q_rows = 300\)"),
            (([0, 100, 300], [0, 150, 100, 200], None, None), "dimension 0 \\(B\\+1\\) is 4, so B = 3, but"),
            (([0, 100, 300], [0, 60, 40], None, 100), r"cu_k\[2\] = 40 is less than cu_k\[1\] = 60"),
            (([0, 400, 300], [0, 100, 200], None, None), r"cu_q\[1\] = 400 is out of range for Q axis 0"),
        ]
        for (cu_q, cu_k, rows_q, rows_k), message in cases:
            with pytest.raises(KspecRuntimeError, match=message):
                _varlen_call(mod, fake, cu_q, cu_k, rows_q, rows_k)
        with pytest.raises(KspecRuntimeError, match=r"dimension 0 \(cu_q_rows\) is 10, but 'Q' has cu_q_rows = 300"):
            _varlen_call(mod, fake, [0, 100, 300], [0, 100, 200], rows_o=10)
        assert len(fake.launches) == n
        # valid offsets launch, with empty sequences allowed
        _varlen_call(mod, fake, [0, 0, 300, 300], [0, 50, 50, 200])
        assert len(fake.launches) == n + 1


@needs_fa4
@pytest.mark.gpu
@pytest.mark.parametrize("lengths_q, lengths_k", [([300, 1, 0, 1000], [300, 700, 5, 1000]), ([128], [4096])])
def test_fa4_varlen_attention_on_gpu_matches_float64(compiled, lengths_q, lengths_k):
    """Packed sequences, causal bottom-right per sequence, against float64 numpy per sequence; a
    sequence with no query writes nothing, one with queries but fewer keys than needed masks rows."""
    import ml_dtypes

    import kspec
    from kspec.runtime import from_device
    from test_gpu_specs import _device_arch
    arch = _device_arch()                  # skips without a device
    mod = kspec.load(compiled("attention_varlen", (arch,)))
    rng = np.random.default_rng(5)
    H, d = 4, 128
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, d)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((cu_k[-1], H, d)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((cu_k[-1], H, d)).astype(ml_dtypes.bfloat16)
    scale = 1.0 / math.sqrt(d)
    kern = mod.attention_varlen
    got = from_device(kern(**kern.to_device(cu_q=cu_q, cu_k=cu_k, Q=q, K=k, V=v), scale=scale)["O"]).astype(np.float64)
    for b, (S, T) in enumerate(zip(lengths_q, lengths_k)):
        if S == 0:
            continue
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2)[None]
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)[None]
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(1, 0, 2)[None]
        i, j = np.arange(S)[:, None], np.arange(T)[None, :]
        want = _attention64(qs, ks, vs, scale, np.broadcast_to(j <= i + (T - S), (1, H, S, T)))[0].transpose(1, 0, 2)
        err = np.abs(got[cu_q[b]:cu_q[b + 1]] - want).max() / max(np.abs(want).max(), 1e-6)
        assert err < 2e-2, (b, err)


BSHD = """kernel attention_bshd {
  param scale : f32 = 0.125
  in  Q : f16[B, S, H, 64]
  in  K : f16[B, T, KH, 64]
  in  V : f16[B, T, KH, 64]
  out O : f16[B, S, H, 64]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, i, h, e] * K[b, j, h / 2, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * V[b, j, h / 2, e]
}
"""


@needs_fa4
@pytest.mark.cute
def test_flashattention_layout_bshd_fuses_and_launches_with_its_strides(tmp_path):
    """Q/K/V/O stored [b, s, h, e] (FlashAttention's own layout), GQA group 2: one FA4 kernel whose
    TMA descriptors the fake driver checks against the tensors' real strides."""
    import kspec
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    spec = tmp_path / "attention_bshd.kspec"
    spec.write_text(BSHD)
    art = compile_spec(spec, ARCHS, tmp_path / "out", cache=CompileCache(test_cache_root()))
    m = json.loads((art / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    assert plan["kind"] == "attention"
    assert plan["binaries"]["sm90a"]["config"]["layout"] == "BSHD BTHD BTHD BSHD"
    mod = kspec.load(art)
    for arch, cc in (("sm90a", (9, 0)), ("sm100a", (10, 0))):
        with FakeDriver(cc, sm_count=compat.OFFLINE_SM_COUNT[arch]) as fake:
            for sizes in ({"B": 2, "H": 4, "KH": 2, "S": 100, "T": 300}, {"B": 1, "H": 8, "KH": 4, "S": 1000, "T": 1000}):
                call = fake_call(mod, "attention_bshd", sizes, fake)
                problems = [p for p in check_call(call, arch, mod)
                            if not (arch == "sm100a" and "static shared memory exceed" in p)]
                assert problems == [], f"{arch} {sizes}:\n" + "\n".join(problems)
    # the DSL encodes FA4's TMA descriptors in its own host code (not through kspec's encoder), so
    # the strides the glue hands it are checked here: FA4's (b, s, h) modes of each [b, s, h, e] buffer
    (p,) = plan_kernel(load_spec(BSHD, is_text=True).kernels[0]).plans
    desc = A.lower(p.ir, "sm90a")[0]
    modes = {name: (shape, strides) for name, _i, _dt, shape, strides in A._tensors(desc)}
    assert modes["mQ"] == (("B", "S", "H"), (("S", "H", "64"), ("H", "64"), ("64",)))
    assert modes["mK"] == (("B", "T", "HK"), (("T", "HK", "64"), ("HK", "64"), ("64",)))
    assert modes["mO"] == modes["mQ"]
    canonical = A.lower(_ir(), "sm90a")[0]          # [b, h, s, e]: as before storage orders existed
    modes = {name: (shape, strides) for name, _i, _dt, shape, strides in A._tensors(canonical)}
    assert modes["mQ"] == (("B", "S", "H"), (("H", "S", "128"), ("128",), ("S", "128")))


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_varlen_alibi_compiles_offline_with_a_generated_score_mod(arch):
    """Packed sequences with ALiBi (a generated score_mod over per-sequence positions) and FA4's
    own causal mask: one kernel with tensor-core SASS."""
    sys.path.insert(0, str(SPECS.parent / "tests"))
    from test_attention_varlen import ALIBI_VARLEN
    (p,) = plan_kernel(load_spec(ALIBI_VARLEN, is_text=True).kernels[0]).plans
    desc, names, _dims, _scalars = A.lower(p.ir, arch)
    assert desc.cu_seqlens_q and desc.mods.causal and desc.mods.score_mod
    built = A.build(desc, test_cache_root(), lengths=[4096])
    (v,) = built.variants
    sass = cubin_sass(v.cubin)
    if sass is not None:
        assert (" HGMMA" if arch == "sm90a" else " UTCHMMA") in sass
    assert "slope" not in A.entry_source(desc)               # names mapped


def test_bshd_attention_with_a_log_sum_exp_output_is_one_kernel():
    src = BSHD.replace("out O : f16[B, S, H, 64]", "out O : f16[B, S, H, 64]\n  out L : f32[B, H, S]").replace(
        "  p[b, h, i, j] = softmax(j)", "  L[b, h, i] = logsumexp(j) s[b, h, i, j]\n  p[b, h, i, j] = softmax(j)")
    (p,) = plan_kernel(load_spec(src, is_text=True).kernels[0]).plans
    assert p.ir.kind == "attention" and p.ir.attention.lse == "L"
    assert A.unsupported(p.ir, "sm100a") is None
    modes = {name: (shape, strides) for name, _i, _dt, shape, strides in A._tensors(A.lower(p.ir, "sm100a")[0])}
    assert modes["mLSE"] == (("B", "H", "S"), (("H", "S"), ("S",)))


VARLEN_LSE = (SPECS / "attention_varlen.kspec").read_text().replace(
    "  out O : bf16[B, S, H, 128] packed(cu_q)",
    "  out O : bf16[B, S, H, 128] packed(cu_q)\n  out L : f32[B, S, H] packed(cu_q)").replace(
    "  p[b, h, i, j] = softmax(j) m[b, h, i, j]",
    "  L[b, i, h] = logsumexp(j) m[b, h, i, j]\n  p[b, h, i, j] = softmax(j) m[b, h, i, j]")


@needs_fa4
@pytest.mark.cute
def test_varlen_log_sum_exp_is_written_by_the_fa4_varlen_kernel(tmp_path):
    """L packed like the queries ([rows, H]) is FA4's varlen LSE ([H, rows] modes, strides (1, H))."""
    import kspec
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    (p,) = plan_kernel(load_spec(VARLEN_LSE, is_text=True).kernels[0]).plans
    assert p.ir.attention.lse == "L" and p.ir.attention.orders[4] == ("b", "i", "h")
    desc = A.lower(p.ir, "sm90a")[0]
    modes = {name: (shape, strides) for name, _i, _dt, shape, strides in A._tensors(desc)}
    assert modes["mLSE"] == (("H", "S"), (("1",), ("H",)))
    spec = tmp_path / "varlen_lse.kspec"
    spec.write_text(VARLEN_LSE)
    art = compile_spec(spec, ARCHS, tmp_path / "out", cache=CompileCache(test_cache_root()))
    mod = kspec.load(art)
    outs = {t.name: (t.shape, t.packed) for t in mod.attention_varlen.entry.outputs}
    assert outs["L"] == (("cu_q_rows", "H"), "cu_q")
    for arch, cc in (("sm90a", (9, 0)), ("sm100a", (10, 0))):
        with FakeDriver(cc, sm_count=compat.OFFLINE_SM_COUNT[arch]) as fake:
            for sizes in ({"B": 3, "H": 4}, {"B": 2, "H": 2, "cu_q_rows": 1000, "cu_k_rows": 1000}):
                call = fake_call(mod, "attention_varlen", sizes, fake)
                problems = [p for p in check_call(call, arch, mod)
                            if not (arch == "sm100a" and "static shared memory exceed" in p)]
                assert problems == [], f"{arch} {sizes}:\n" + "\n".join(problems)


@needs_fa4
@pytest.mark.gpu
def test_fa4_varlen_lse_on_gpu_matches_float64(tmp_path):
    import ml_dtypes

    import kspec
    from kspec.compile import compile_spec
    from kspec.runtime import from_device
    from test_gpu_specs import _device_arch
    arch = _device_arch()                  # skips without a device
    spec = tmp_path / "varlen_lse.kspec"
    spec.write_text(VARLEN_LSE)
    mod = kspec.load(compile_spec(spec, (arch,), tmp_path / "out"))
    rng = np.random.default_rng(6)
    lq, lk, H, d = [200, 3, 700], [200, 0, 900], 2, 128
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], H, d)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((cu_k[-1], H, d)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((cu_k[-1], H, d)).astype(ml_dtypes.bfloat16)
    kern = mod.attention_varlen
    out = kern(**kern.to_device(cu_q=cu_q, cu_k=cu_k, Q=q, K=k, V=v), scale=0.125)
    L = from_device(out["L"]).astype(np.float64)
    for b, (S, T) in enumerate(zip(lq, lk)):
        s = np.einsum("ihd,jhd->hij", q[cu_q[b]:cu_q[b + 1]].astype(np.float64),
                      k[cu_k[b]:cu_k[b + 1]].astype(np.float64)) * 0.125
        i, j = np.arange(S)[:, None], np.arange(T)[None, :]
        s = np.where(j <= i + (T - S), s, -np.inf)
        m = s.max(-1, initial=-np.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            want = np.where(np.isfinite(m), m + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)[..., None]).sum(-1)),
                            -np.inf).T                                      # [S, H]
        got = L[cu_q[b]:cu_q[b + 1]]
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), b       # rows with no key: -inf
        fin = np.isfinite(want)
        assert np.abs(got[fin] - want[fin]).max(initial=0) < 2e-2, b


# ---------------------------------------------------------------------------------------------
# split-KV decoding on sm100a (backends/cute/splitkv.py): one call, two launches
# ---------------------------------------------------------------------------------------------

def _split_call(mod, kernel, sizes, sms):
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    with FakeDriver((10, 0), sm_count=sms) as fake:
        call = fake_call(mod, kernel, sizes, fake)
        # (FA4's sm100a kernels declare 1 KiB of static shared memory beside the full dynamic opt-in,
        # which the fake's limit check counts against every FA4 sm100a kernel alike: see test_fa4_skus)
        problems = [p for p in check_call(call, "sm100a", mod) if "static shared memory exceed" not in p]
    return call, problems


@needs_fa4
@pytest.mark.cute
def test_decoding_launches_the_split_kernel_and_the_combine(fa4_artifacts, stem="attention"):
    # (with a log-sum-exp output: tests/test_attention_splitkv.py, the combine writes it)
    import kspec
    from kspec.backends.cute import splitkv
    art = fa4_artifacts(stem)
    mod = kspec.load(art)
    (plan,) = mod[stem].entry.plans
    b = plan.binaries["sm100a"]
    split, combine = mod.split_variants(plan, "sm100a", 148)
    assert b.variants[split].config["role"] == "split" and b.variants[combine].config["role"] == "combine"
    for sms, (B, H, S, T) in ((148, (1, 8, 1, 32768)), (132, (1, 8, 1, 32768)), (148, (2, 4, 3, 4096))):
        call, problems = _split_call(mod, stem, {"B": B, "H": H, "S": S, "T": T}, sms)
        assert problems == [], problems
        ns = splitkv.num_splits(B, H, S, T, H, sms)
        assert ns > 1 and call.plan_ids == [plan.id, plan.id]
        rs, rc = call.launches
        assert (rs.symbol, rc.symbol) == (b.variants[split].symbol, b.variants[combine].symbol)
        assert rs.prepare.workspace == rc.prepare.workspace != 0 and rs.prepare.sm_count == sms
        # the partial buffers the pair shares: NS splits of f32 O and LSE in one workspace
        o_partial, lse_partial = call.plan_args[0][3], call.plan_args[0][4]
        assert o_partial.shape == (ns, B, S, H, 128) and lse_partial.shape == (ns, B, H, S)
        assert call.plan_args[1][:2] == [o_partial, lse_partial]
        assert math.prod(rs.grid) == B * H * -(-S // 128) * ns              # (sequence, head, split) CTAs
        assert rc.grid == (-(-S * H // 8), 1, B) and rc.block == (256, 1, 1)
        # the spec's O (and LSE) are written by the combine only; the split kernel reads Q, K, V
        outs = [t.name for t in mod[stem].entry.outputs]
        assert [a.name for a in call.plan_args[1][2:]] == outs
        assert {a.name for a in call.plan_args[0]} & set(outs) == set()
        words = {int.from_bytes(rc.params[i:i + 8], "little") for i in range(0, len(rc.params) - 7, 8)}
        assert all(a.ptr in words for a in call.plan_args[1])                 # combine: raw pointers
    # prefill-shaped calls keep the single-pass variants: one launch
    call, problems = _split_call(mod, stem, {"B": 64, "H": 8, "S": 1, "T": 32768}, 148)
    assert problems == [] and len(call.launches) == 1 and b.variants[mod.variant(
        plan, "sm100a", call.binding.dims(plan), 148)].symbol == call.launches[0].symbol


@needs_fa4
@pytest.mark.cute
def test_inspect_lists_the_split_kv_pair(fa4_artifacts):
    # the labels `kspec inspect` prints per variant (its SASS summaries are tests/test_inspect.py's)
    from kspec.artifact import read_manifest
    from kspec.inspect_artifact import _serves
    (plan,) = read_manifest(fa4_artifacts("attention")).kernels[0].plans
    labels = [_serves(v) for v in plan.binaries["sm100a"].variants]
    assert labels[-2:] == ["split-KV (num_splits auto: taken when the call splits, S >= 1)",
                           "split-KV combine (after the split kernel)"]
    assert all(x.startswith("for S ") for x in labels[:-2])
    assert all(x.startswith("for S ") for x in map(_serves, plan.binaries["sm90a"].variants))


@needs_fa4
@pytest.mark.cute
def test_inspect_sizes_says_what_a_call_launches(fa4_artifacts, capsys):
    from kspec.cli import main
    art = fa4_artifacts("attention")
    assert main(["inspect", str(art), "--sizes", "B=1,H=8,S=1,T=32768"]) == 0
    out = capsys.readouterr().out.splitlines()
    sm90, sm100 = (next(x for x in out if f" {a} on " in x) for a in ("sm90a", "sm100a"))
    assert "sm90a on 132 SMs: variant 0 (for S" in sm90
    assert "sm100a on 148 SMs: variants" in sm100 and "split-KV kernel, then the combine" in sm100
    assert main(["inspect", str(art), "--sizes", "B=64,H=8,S=1,T=512", "--arch", "sm100a", "--sm-count", "132"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "plan" in x]
    assert "on 132 SMs: variant " in line and "split" not in line
