"""FlashAttention-4 kernel variants chosen by query length and batch x heads, and built per GPU SKU
(SM count): the select boxes partition every size and give FA4's own choice (checked against fresh FA4
calls at points on and off the sweep grid); `kspec compile --sm-count`; the runtime's SKU rule
(kspec.runtime.module.sku_for); launches at two batch sizes and at several SM counts through the
fake driver."""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest

from conftest import SPECS, needs_fa4, test_cache_root

from kspec.artifact import Variant, manifest_from_json
from kspec.backends.cute import attention as A
from kspec.backends.cute import compat
from kspec.core import KspecError
from kspec.runtime.module import sku_for

# ---------------------------------------------------------------------------------------------
# boxes over B * H, without FA4
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lo, hi", [(0, 74), (75, None), (0, None), (5, 6), (37, 37), (1, 300), (296, None)])
def test_product_boxes_hold_exactly_the_products_in_range(lo, hi):
    bxs = A.product_boxes(lo, hi)
    assert len(bxs) <= 2 + 2 * int((hi or lo) ** 0.5) + 2           # O(sqrt) boxes
    for b in range(0, 90):
        for h in range(0, 90):
            n = sum(all(r0 <= x and (r1 is None or x <= r1) for x, (r0, r1) in ((b, bx["B"]), (h, bx["H"])))
                    for bx in bxs)
            assert n == (lo <= b * h and (hi is None or b * h <= hi)), (lo, hi, b, h, n)


def test_boxes_split_a_grid_by_length_and_by_batch_times_heads():
    # S rows 1 and 200, B*H columns 4 and 76: variant 0 below S 200 and B*H 76, variant 1 beside it
    sel = A.boxes([[(1, 4), (200, 4), (200, 76)], [(1, 76)]])
    assert sel[0][0] == {"S": [0, 199], "B": [0, 0], "H": [0, None]} and sel[0][-1] == {"S": [200, None]}
    assert all(set(b) == {"S", "B", "H"} and b["S"] == [0, 199] for b in sel[1])
    with pytest.raises(Exception, match="not a grid"):
        A.boxes([[(1, 4), (200, 4)], [(1, 76)]])


# ---------------------------------------------------------------------------------------------
# the runtime's SKU rule, on a hand-written manifest
# ---------------------------------------------------------------------------------------------

def _sku_manifest(variants):
    """A one-plan artifact manifest whose sm90a binary has `variants` [(sm_count text, select)]."""
    h = "cd" * 32

    def entry(k, skus, select):
        return {"cubin": f"p.v{k}.cubin", "host": f"p.v{k}.so", "sha256": {"cubin": h, "host": h},
                "symbol": f"k{k}", "config": {"sm_count": skus}, "select": select}
    vs = [entry(k, skus, select) for k, (skus, select) in enumerate(variants)]
    binary = {**{k: vs[0][k] for k in ("cubin", "host", "sha256", "symbol")}, "config": {}, "variants": vs}
    plan = {"id": "p", "kind": "attention", "dims": [["B", "B"], ["H", "H"], ["S", "S"]], "args": ["Q", "O"],
            "binaries": {"sm90a": binary}}
    return manifest_from_json({
        "format": "kspec-artifact", "format_version": 1, "kspec_version": "0.1.0",
        "spec": {"file": "a.kspec", "sha256": h}, "archs": ["sm90a"],
        "kernels": [{"name": "attention", "inputs": [{"name": "Q", "dtype": "f16", "shape": ["B", "H", "S", 64]}],
                     "outputs": [{"name": "O", "dtype": "f16", "shape": ["B", "H", "S", 64]}], "plans": [plan]}]})


def test_the_runtime_picks_the_sku_then_the_box():
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.module import Module
    small = [{"S": [0, None], **b} for b in A.product_boxes(0, 74)]
    large = [{"S": [0, None], **b} for b in A.product_boxes(75, None)]
    m = _sku_manifest([("132", small), ("132", large), ("114,78", [{"S": [0, None]}])])
    (plan,) = m.kernels[0].plans
    b = plan.binaries["sm90a"]
    assert [sku_for(b, n) for n in (132, 114, 78, 120, 200, 60, None)] == [132, 114, 78, 114, 132, 78, 132]
    mod = Module(Path(tempfile.gettempdir()), m)
    assert mod.variant(plan, "sm90a", [2, 8, 100], 132) == 0            # B*H 16 <= 74
    assert mod.variant(plan, "sm90a", [10, 8, 100], 132) == 1           # B*H 80
    assert mod.variant(plan, "sm90a", [10, 8, 100], 140) == 1           # unbuilt SKU: the nearest below, 132
    assert mod.variant(plan, "sm90a", [10, 8, 100], 114) == 2
    assert mod.variant(plan, "sm90a", [10, 8, 100], 100) == 2           # between: 78
    assert mod.variant(plan, "sm90a", [10, 8, 100], 40) == 2            # below every SKU: the smallest, 78
    holes = _sku_manifest([("132", small)])
    with pytest.raises(KspecRuntimeError, match="no kernel variant built for 132 SMs"):
        Module(Path(tempfile.gettempdir()), holes).variant(holes.kernels[0].plans[0], "sm90a", [10, 8, 1], 132)


def test_sm_count_option_parses_and_refuses_bad_text():
    from kspec.cli import parse_sm_counts
    assert parse_sm_counts(["sm_90a=132,114", "sm100a=148", "sm90a=78,132"], ("sm90a", "sm100a")) == \
        {"sm90a": (132, 114, 78), "sm100a": (148,)}
    assert parse_sm_counts([], ("sm90a",)) == {}
    for bad, msg in (("sm90a", "ARCH=N"), ("sm100a=148", "not compiled for"), ("sm90a=1x", "integers"),
                     ("sm90a=0", "from 1 to 1024"), ("sm80=100", "unknown arch")):
        with pytest.raises(KspecError, match=msg):
            parse_sm_counts([bad], ("sm90a",))


def test_the_sm_count_reaches_only_kernels_whose_configuration_records_one():
    from kspec.compile import with_sm_counts

    class Fake:
        def __init__(self, cfg):
            self.cfg = cfg

        def default_config(self, ir, arch):
            return self.cfg
    fa4 = Fake((("kernel", "FlashAttention-4"), ("sm_count", "132")))
    gemm = Fake((("tile", "128x128x64"),))
    assert with_sm_counts(fa4, None, "sm90a", None, {"sm90a": (132, 114)}) == \
        (("kernel", "FlashAttention-4"), ("sm_count", "132,114"))
    assert with_sm_counts(fa4, None, "sm100a", None, {"sm90a": (132, 114)}) is None
    assert with_sm_counts(gemm, None, "sm90a", None, {"sm90a": (114,)}) is None


# ---------------------------------------------------------------------------------------------
# against FA4's own choice
# ---------------------------------------------------------------------------------------------

def _planned_desc(stem, arch, dims=None):
    import sys
    sys.path.insert(0, str(SPECS.parent / "tests"))
    from test_fa4_attention import _dims_ir, _gqa_ir
    from test_kir import planned
    if stem == "gqa3_256":                     # GQA group 3 (128 % 3 != 0) with head dims 256: pack-GQA by B*H
        import dataclasses
        ir = _gqa_ir(3)
        d = _dims_ir(256, 256)
        ir = dataclasses.replace(ir, buffers=tuple(
            dataclasses.replace(b, shape=(*b.shape[:-1], 256)) if b.name in ("Q", "K", "V", "O") else b
            for b in ir.buffers), attention=dataclasses.replace(ir.attention, head_dims=d.attention.head_dims))
    else:
        (p,) = planned(stem)
        ir = p.ir
    return A.lower(ir, arch)[0]


def _entry(desc):
    work = Path(tempfile.mkdtemp(prefix="kspec-sku-test-"))
    (work / "entry.py").write_text(A.entry_source(desc))
    with compat.fa4_target(desc.arch, desc.sm_count):
        return A._import_entry(work / "entry.py")


@needs_fa4
@pytest.mark.parametrize("stem, arch, sms", [("attention_softcap", "sm100a", 148), ("attention_softcap", "sm100a", 78),
                                             ("gqa3_256", "sm100a", 148), ("attention_gqa", "sm100a", 148),
                                             ("attention", "sm90a", 132), ("attention_varlen", "sm100a", 148)])
def test_boxes_partition_every_size_and_give_fa4s_choice(stem, arch, sms):
    """Every size (on the sweep grid, between its points, at other splits of B * HK) is held by exactly
    one variant's boxes, and that variant is the kernel a fresh FA4 call chooses there."""
    desc = A.for_skus(_planned_desc(stem, arch), [sms])
    mod = _entry(desc)
    found = A.choose_variants(desc, mod)
    heads = 1 if desc.kv_shared else desc.group
    sel = A.boxes([[(s, b * hk * heads) for s, b, hk in pts] for _sig, _fa, pts in found])
    variants = [Variant("c", "h", {}, select=tuple({r: tuple(x) for r, x in box.items()} for box in boxes))
                for boxes in sel]
    assert 1 <= len(found) <= 4
    if stem in ("attention_softcap", "gqa3_256"):
        assert any(set(box) == {"S", "B", "H"} for boxes in sel for box in boxes)   # B*H matters here
    rng = random.Random(sms)
    grid = [pt for _sig, _fa, pts in found for pt in pts]
    checks = rng.sample(grid, 25)
    for _ in range(25):                                     # off the grid, B * HK split other ways
        # at most 256 sequences: FA4 gives packed batches beyond it a host-built lookup (sweep_points)
        checks.append((rng.randint(1, 5000), rng.randint(1, 256), rng.choice((1, 2, 3, 4, 8, 16))))
    for s, b, hk in checks:
        h = heads * hk if not desc.kv_shared else desc.group
        values = {"S": s, "B": b, "H": h, "HK": hk}
        holding = [k for k, v in enumerate(variants) if v.holds(values)]
        ((sig, _fa, _pts),) = A.choose_variants(desc, mod, points=[(s, b, hk)])
        assert [found[k][0] for k in holding] == [sig], (stem, sms, values, holding)
    for s, b, h in ((0, 2, 8), (5, 0, 8), (5, 2, 0)):      # empty calls are held too (the glue returns early)
        assert sum(v.holds({"S": s, "B": b, "H": h}) for v in variants) == 1


# ---------------------------------------------------------------------------------------------
# per-SKU builds, launched through the fake driver
# ---------------------------------------------------------------------------------------------

@needs_fa4
@pytest.mark.cute
def test_sm_independent_kernels_compile_once_for_several_skus():
    desc = _planned_desc("attention", "sm90a")
    built = A.build(A.for_skus(desc, (132, 114)), test_cache_root(), lengths=[4096])
    (v,) = built.variants                        # FA4's sm90a launcher never asks the SM count
    assert dict(v.config)["sm_count"] == "132,114" and dict(built.config)["sm_count"] == "132,114"
    key, d = A._dir(test_cache_root(), A.for_skus(desc, [114]), [4096])
    (meta,) = [json.loads((d / "meta.json").read_text())["variants"]]
    assert meta[0]["sm_independent"] and meta[0]["compile_seconds"] == 0.0     # copied from the 132 build


@pytest.fixture(scope="module")
def softcap_two_skus(tmp_path_factory):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    return compile_spec(SPECS / "attention_softcap.kspec", ("sm100a",), tmp_path_factory.mktemp("sku"),
                        cache=CompileCache(test_cache_root()), sm_counts={"sm100a": (148, 120)})


@needs_fa4
@pytest.mark.cute
def test_two_skus_two_batch_sizes_through_the_fake_driver(softcap_two_skus):
    """Head dims 256 on sm100a: FA4 picks a 2-CTA kernel while 2 * B * H fits one wave of the SKU's
    SMs and a 1-CTA one beyond; the persistent launcher's grid is the SKU's SM count."""
    import kspec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    art = softcap_two_skus
    mod = kspec.load(art)
    (plan,) = mod.attention_softcap.entry.plans
    b = plan.binaries["sm100a"]
    assert b.config["sm_count"] == "148,120"
    assert sorted(v.config["sm_count"] for v in b.variants) == ["120", "120", "148", "148"]
    small, large = {"B": 1, "H": 8, "S": 64, "T": 64}, {"B": 40, "H": 8, "S": 64, "T": 64}   # B*H 8 and 320
    for device_sms, sku in ((148, 148), (120, 120), (132, 120), (100, 120), (160, 148)):
        with FakeDriver((10, 0), sm_count=device_sms) as fake:
            launched = {}
            for name, sizes in (("small", small), ("large", large)):
                call = fake_call(mod, "attention_softcap", sizes, fake)
                problems = [p for p in check_call(call, "sm100a", mod) if "static shared memory exceed" not in p]
                assert problems == [], problems
                (rec,) = call.launches
                k = mod.variant(plan, "sm100a", call.binding.dims(plan), device_sms)
                v = b.variants[k]
                assert v.config["sm_count"] == str(sku) and rec.symbol == v.symbol
                assert (art / v.cubin).read_bytes().startswith(rec.image[:4096])
                launched[name] = (v, rec)
            (vs, rs), (vl, rl) = launched["small"], launched["large"]
            assert vs.config["2cta"] == "true" and rs.cluster[0] == 2
            assert vl.config["2cta"] == "false" and rl.cluster[0] == 1
            assert rl.grid[0] == sku                       # persistent: one CTA per SM of the SKU built for


@needs_fa4
@pytest.mark.cute
def test_inspect_lists_each_variant_with_its_skus(softcap_two_skus):
    from kspec.inspect_artifact import inspect_artifact
    try:
        text = inspect_artifact(softcap_two_skus)
    except KspecError as e:
        pytest.skip(f"no inspect tools: {e.message}")
    lines = [line for line in text.splitlines() if line.lstrip().startswith("variant ")]
    assert [line.split(" for ")[0].strip() for line in lines] == [
        "variant 0 on 148 SMs", "variant 1 on 148 SMs", "variant 2 on 120 SMs", "variant 3 on 120 SMs"]
    assert "S 0..128, B 1..1, H 1..74 or" in lines[0] and "S 0..128, B 1..1, H 1..60 or" in lines[2]
