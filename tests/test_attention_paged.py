"""Paged KV cache (specs/attention_paged.kspec): the checker infers the key extent from `j / P`,
fusion lifts the block-table read into the kernel IR (`AttentionStructure.page_table/page_size/
kv_len`), the CuTe DSL backend builds FlashAttention-4 with page_table and seqused_k on both archs,
and bad block-table entries or key counts are refused before launch (fake driver).  The reference
semantics against float64 numpy: tests/test_reference.py::test_attention_paged."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import FA4_MISSING, SPECS, cubin_sass, test_cache_root

import kspec
from kspec.compiler import plan_kernel
from kspec.compiler.indices import index_ranges
from kspec.compiler.kir import format_ir, ir_from_json, ir_to_json, verify
from kspec.core import KspecError, KspecInternalError, format_extent
from kspec.spec_lang import load_spec

ARCHS = ("sm90a", "sm100a")
PAGED = SPECS / "attention_paged.kspec"


def _planned(src=PAGED, archs=ARCHS, oracle=None):
    prog = load_spec(src) if not isinstance(src, str) else load_spec(src, is_text=True)
    return plan_kernel(prog.kernels[0], archs, oracle)


# ---------------------------------------------------------------- checker

def test_the_key_extent_comes_from_the_page_subscript():
    k = load_spec(PAGED).kernels[0]
    s = k.stmts[0]
    assert s.extent("j") == ("MP", "P") and format_extent(s.extent("j")) == "MP*P"
    assert k.tensor("s").describe() == "s: f32[B, H, S, MP*P]"
    lit = load_spec(PAGED.read_text().replace("j / P", "j / 16").replace("j % P", "j % 16")
                    .replace("NP, P, H", "NP, 16, H"), is_text=True).kernels[0]
    assert lit.stmts[0].extent("j") == ("MP", 16)


def test_an_index_only_inside_computed_subscripts_asks_for_a_page_subscript():
    src = """kernel k {
  in  Q  : bf16[B, S, 128]
  in  Kc : bf16[NP, P, 128]
  out O : f32[B, S]
  s[b, i, j] : f32 = sum(e) Q[b, i, e] * Kc[3, j % P, e]
  O[b, i] = max(j) s[b, i, j]
}"""
    with pytest.raises(KspecError) as e:
        load_spec(src, is_text=True)
    text = str(e.value)
    assert e.value.span is not None and (e.value.span.line, e.value.span.col) == (5, 11)
    assert "index 'j' of 's' has no extent" in text and "as a plain subscript" in text
    assert "`j / P`" in text and "N*P" in text


# ---------------------------------------------------------------- fusion and kernel IR

def test_paged_attention_is_one_kernel_with_page_table_fields():
    (plan,) = _planned().plans
    a = plan.ir.attention
    assert plan.ir.kind == "attention"
    assert (a.k_buffer, a.v_buffer, a.page_table, a.page_size, a.kv_len) == ("Kc", "Vc", "bt", "P", "kv_len")
    assert dict(a.dims)["T"] == ("MP", "P")
    text = format_ir(plan.ir)
    assert "paged kv: j -> page bt[b, j // P], row j % P" in text and "keys used: j < kv_len[b]" in text
    assert "T=MP*P" in text
    back = ir_from_json(json.loads(json.dumps(ir_to_json(plan.ir))))
    assert back == plan.ir and back.digest() == plan.ir.digest()


def test_the_verifier_checks_the_paged_fields():
    (plan,) = _planned().plans
    ir, a = plan.ir, plan.ir.attention
    for bad, msg in ((dict(page_size=None), "both the page table and the page size"),
                     (dict(page_size=16), "is not a page pool"),
                     (dict(page_table="Q"), "is not an integer input"),
                     (dict(kv_len="bt"), "not an integer vector"),
                     (dict(mask=None), "does not bound the keys")):
        with pytest.raises(KspecInternalError, match=msg):
            verify(dataclasses.replace(ir, attention=dataclasses.replace(a, **bad)))


@pytest.mark.parametrize("change, reason", [
    (("Vc[bt[b, j / P], j % P, h, e]", "Vc[bt[b, j / P], 0, h, e]"), "only one of K and V is read through a block table"),
    (("Vc[bt[b, j / P]", "Vc[bt2[b, j / P]"), "different block tables"),
])
def test_mismatched_paged_reads_do_not_fuse(change, reason):
    src = PAGED.read_text().replace(*change).replace("in  kv_len", "in  bt2 : i32[B, MP]\n  in  kv_len")
    sched = _planned(src)
    assert any(reason in n for n in sched.fusion.notes)


def test_index_ranges_bound_the_block_table_and_the_key_counts():
    (plan,) = _planned().plans
    got = {(r.tensor, r.target, r.axis, r.extent, r.inclusive) for r in index_ranges(plan.ir)}
    assert got == {("bt", "Kc", 0, "NP", False), ("bt", "Vc", 0, "NP", False),
                   ("kv_len", "bt", 1, ("MP", "P"), True)}


# ---------------------------------------------------------------- backends

def test_backends_that_cannot_page_decline_with_a_reason():
    from kspec.backends.cutlass.backend import CutlassBackend
    (plan,) = _planned().plans
    why = CutlassBackend().can_implement(plan.ir, "sm90a")
    assert why and ("mask" in why or "paged" in why)
    a = plan.ir.attention
    no_mask = dataclasses.replace(plan.ir, attention=dataclasses.replace(a, mask=None, kv_len=None, aux=()))
    assert "paged KV cache" in CutlassBackend().can_implement(no_mask, "sm90a")


def test_fa4_lowering_and_its_reasons():
    from kspec.backends.cute import attention as A
    (plan,) = _planned().plans
    ir, a = plan.ir, plan.ir.attention
    for arch in ARCHS:
        assert A.unsupported(ir, arch) is None
        desc, names, dims, _ = A.lower(ir, arch)
        # the mask `j < kv_len[b] and j <= i + (kv_len[b] - S)` is FA4's own bottom-right causal
        # mask over seqused_k: no mask_mod, no aux tensor
        assert desc.mods.causal and desc.mods.mask_mod is None and desc.aux == ()
        assert [names[x] for x in desc.args] == ["Q", "Kc", "Vc", "O", "bt", "kv_len"]
        assert dict(dims)["T"] == ("MP", "P") and dict(dims)["P"] == "P"
        src = A.entry_source(desc)
        assert "mPageTable=mPT" in src and "mSeqUsedK=mSK" in src
    bufs = tuple(dataclasses.replace(b, dtype="i8") if b.name == "bt" else b for b in ir.buffers)
    assert "i32 page table" in A.unsupported(dataclasses.replace(ir, buffers=bufs), "sm90a")
    odd = dataclasses.replace(ir, attention=dataclasses.replace(a, head_dims=(72, 72, 72)))
    assert "multiples of 16" in A.unsupported(odd, "sm90a")


@pytest.fixture(scope="module")
def paged_artifact(tmp_path_factory):
    from kspec.backends.build import CompileCache
    if FA4_MISSING:
        pytest.skip(f"FlashAttention-4 unavailable: {FA4_MISSING}")
    from kspec.compile import compile_spec
    return compile_spec(PAGED, ARCHS, tmp_path_factory.mktemp("paged"), cache=CompileCache(test_cache_root()))


@pytest.mark.cute
def test_paged_spec_builds_one_fa4_kernel_per_arch_with_tensor_cores(paged_artifact):
    m = json.loads((paged_artifact / "manifest.json").read_text())
    (k,) = m["kernels"]
    (plan,) = k["plans"]
    assert plan["kind"] == "attention" and plan["args"] == ["Q", "Kc", "Vc", "O", "bt", "kv_len"]
    assert {r["tensor"]: r["extent"] for r in k["index_ranges"]} == {"bt": "NP", "kv_len": ["MP", "P"]}
    for arch, insn in zip(ARCHS, (" HGMMA", " UTCHMMA")):
        b = plan["binaries"][arch]
        assert b["backend"] == "cute" and b["config"]["paged_kv"] == "page_size=P"
        for v in b["variants"]:
            if v["config"].get("role") == "combine":
                continue                                        # split-KV's combine reads no K/V
            assert v["config"]["kv_loads"] == "cp.async"        # any page size at run time
            sass = cubin_sass(paged_artifact / v["cubin"])
            if sass is not None:
                assert insn in sass, f"{arch}: no{insn}"


def _call(fake, mod, bt, kv_len, B=2, H=4, S=3, NP=6, P=16):
    from kspec.runtime import DeviceBuffer
    MP = bt.shape[1]
    d = {}
    for name, shape in (("Q", (B, H, S, 128)), ("Kc", (NP, P, H, 128)), ("Vc", (NP, P, H, 128)),
                        ("O", (B, H, S, 128))):
        d[name] = DeviceBuffer(fake.alloc(int(np.prod(shape)) * 2), shape, "bf16")
    for name, arr in (("bt", bt), ("kv_len", kv_len)):
        ptr = fake.alloc(arr.nbytes)
        fake.upload(ptr, np.ascontiguousarray(arr, np.int32).tobytes())
        d[name] = DeviceBuffer(ptr, arr.shape, "i32")
    assert MP * P >= 0
    return mod.attention_paged(d["Q"], d["Kc"], d["Vc"], d["bt"], d["kv_len"], O=d["O"])


@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
def test_launch_through_the_fake_driver_and_checks_before_launch(paged_artifact, arch):
    from kspec.runtime import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver
    mod = kspec.load(paged_artifact)
    bt = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    with FakeDriver(cc=(9, 0) if arch == "sm90a" else (10, 0), sm_count=132 if arch == "sm90a" else 148) as fake:
        _call(fake, mod, bt, np.array([40, 0], np.int32))
        (launch,) = fake.launches
        assert launch.prepare.dims[:5] == (2, 4, 3, 48, 4)         # B, H, S, T = MP * P, HK
        bad = bt.copy()
        bad[1, 2] = 6
        with pytest.raises(KspecRuntimeError, match=r"bt\[1, 2\] = 6 is out of range for Kc axis 0 \(NP = 6\)"):
            _call(fake, mod, bad, np.array([40, 0], np.int32))
        with pytest.raises(KspecRuntimeError, match=r"kv_len\[0\] = 49 is out of range .*MP\*P = 48"):
            _call(fake, mod, bt, np.array([49, 0], np.int32))
        with pytest.raises(KspecRuntimeError, match=r"kv_len\[1\] = -1 is out of range"):
            _call(fake, mod, bt, np.array([4, -1], np.int32))
        assert len(fake.launches) == 1                              # nothing launched after the first call


# ---------------------------------------------------------------- paged GQA (decoding's usual cache)

def _paged_gqa_text():
    src = PAGED.read_text()
    for old, new in (("Kc : bf16[NP, P, H, 128]", "Kc : bf16[NP, P, KH, 128]"),
                     ("Vc : bf16[NP, P, H, 128]", "Vc : bf16[NP, P, KH, 128]"),
                     ("j % P, h, e]", "j % P, h / 4, e]")):
        assert src.count(old) >= 1, old
        src = src.replace(old, new)
    return src.replace("kernel attention_paged", "kernel attention_paged_gqa")


def test_paged_gqa_is_one_kernel_with_the_group_and_the_pool_heads():
    from kspec.backends.cute import attention as A
    (plan,) = _planned(_paged_gqa_text()).plans
    a = plan.ir.attention
    assert plan.kind == "attention" and (a.kv_group, a.kv_head, a.page_table, a.page_size) == (4, "KH", "bt", "P")
    for arch in ARCHS:
        assert A.unsupported(plan.ir, arch) is None
        desc, names, dims, _ = A.lower(plan.ir, arch)
        assert desc.group == 4 and dict(dims)["HK"] == "KH" and dict(dims)["G"] == 4
        assert [names[x] for x in desc.args] == ["Q", "Kc", "Vc", "O", "bt", "kv_len"]
    # K read at h / 4 and V at h / 2 are two groupings: not one kernel
    two = _paged_gqa_text().replace("Vc[bt[b, j / P], j % P, h / 4, e]", "Vc[bt[b, j / P], j % P, h / 2, e]")
    sched = _planned(two)
    assert "attention" not in [p.kind for p in sched.plans]
    assert any("different head groupings" in n for n in sched.fusion.notes)


@pytest.fixture(scope="module")
def paged_gqa_artifact(tmp_path_factory):
    from kspec.backends.build import CompileCache
    if FA4_MISSING:
        pytest.skip(f"FlashAttention-4 unavailable: {FA4_MISSING}")
    from kspec.compile import compile_spec
    d = tmp_path_factory.mktemp("paged_gqa")
    (d / "attention_paged_gqa.kspec").write_text(_paged_gqa_text())
    return compile_spec(d / "attention_paged_gqa.kspec", ("sm90a",), d / "out", cache=CompileCache(test_cache_root()))


@pytest.mark.cute
def test_paged_gqa_launches_with_the_pool_head_count(paged_gqa_artifact):
    from kspec.runtime import DeviceBuffer, KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver
    mod = kspec.load(paged_gqa_artifact)
    B, H, KH, S, NP, P = 2, 8, 2, 3, 6, 16
    bt = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    with FakeDriver(cc=(9, 0), sm_count=132) as fake:
        def call(h=H, kh=KH):
            d = {}
            for name, shape in (("Q", (B, h, S, 128)), ("Kc", (NP, P, kh, 128)), ("Vc", (NP, P, kh, 128)),
                                ("O", (B, h, S, 128))):
                d[name] = DeviceBuffer(fake.alloc(int(np.prod(shape)) * 2), shape, "bf16")
            for name, arr in (("bt", bt), ("kv_len", np.array([40, 7], np.int32))):
                ptr = fake.alloc(arr.nbytes)
                fake.upload(ptr, arr.tobytes())
                d[name] = DeviceBuffer(ptr, arr.shape, "i32")
            return mod.attention_paged_gqa(d["Q"], d["Kc"], d["Vc"], d["bt"], d["kv_len"], O=d["O"])
        call()
        (launch,) = fake.launches
        assert launch.prepare.dims[:5] == (B, H, S, 48, KH)        # B, H, S, T = MP * P, HK
        with pytest.raises(KspecRuntimeError, match=r"8 query heads with 3 K/V heads: this kernel needs exactly 4"):
            call(h=8, kh=3)
        assert len(fake.launches) == 1


@pytest.mark.cute
def test_paged_decoding_splits_the_key_range_on_sm100a(paged_artifact):
    """A long paged cache and one query token: the split-KV kernel (page table and key counts in its
    parameters) then the combine, sharing the partials in one workspace; a short cache: one launch."""
    from kspec.backends.cute import splitkv
    from kspec.runtime.fakedriver import FakeDriver
    mod = kspec.load(paged_artifact)
    (plan,) = mod.attention_paged.entry.plans
    B, H, MP, P = 2, 8, 64, 16
    bt = np.arange(B * MP, dtype=np.int32).reshape(B, MP)
    with FakeDriver(cc=(10, 0), sm_count=148) as fake:
        _call(fake, mod, bt, np.array([1000, 7], np.int32), B=B, H=H, S=1, NP=B * MP, P=P)
        rs, rc = fake.launches
        ns = splitkv.num_splits(B, H, 1, MP * P, H, 148)
        assert ns == 8 and rs.prepare.dims[:5] == (B, H, 1, MP * P, H)
        roles = [plan.binaries["sm100a"].variants[int(r.what.rsplit(" ", 1)[1].rstrip(")"))].config["role"]
                 for r in (rs, rc)]
        assert roles == ["split", "combine"] and rs.prepare.workspace == rc.prepare.workspace
        assert ns in rs.grid and rc.grid == (1, 1, B)
        bt_ptr, kv_ptr = rs.prepare.ptrs[4], rs.prepare.ptrs[5]
        words = {int.from_bytes(rs.params[i:i + 8], "little") for i in range(0, len(rs.params) - 7, 8)}
        assert bt_ptr in words and kv_ptr in words                           # page table, seqused_k
        words = {int.from_bytes(rc.params[i:i + 8], "little") for i in range(0, len(rc.params) - 7, 8)}
        assert rc.prepare.ptrs[3] in words and bt_ptr not in words          # the combine writes O only
        assert rs.prepare.ptrs[3] not in {int.from_bytes(rs.params[i:i + 8], "little")
                                          for i in range(0, len(rs.params) - 7, 8)}
        fake.launches.clear()
        _call(fake, mod, bt[:, :4], np.array([60, 7], np.int32), B=B, H=H, S=1, NP=B * MP, P=P)
        assert len(fake.launches) == 1                                       # 64 keys: no split
