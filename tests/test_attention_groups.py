"""GQA groups known only at call time (issue 25 item 3): `K[b, h / G, j, e]` with `param G : i32` (or G
a size symbol) over K/V heads KH, and multi-query attention over a symbolic head count, fuse into one
FlashAttention-4 attention; FA4 compiles the group into the kernel, so `kspec compile --sizes` names
the group to build (G=4, or H=32,KH=8), every variant's boxes hold G = H / KH to it, and a call with
another group is refused before launch by name with the command that builds it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FA4_MISSING, needs_fa4, test_cache_root

import kspec
from kspec.backends.registry import Planner
from kspec.compiler import plan_kernel
from kspec.core import KspecError
from kspec.spec_lang import load_spec

GQA_PARAM = """kernel gqa {
  param scale : f32 = 0.125
  param G : i32 = 4
  in  Q : bf16[B, H, S, 64]
  in  K : bf16[B, KH, T, 64]
  in  V : bf16[B, KH, T, 64]
  out O : bf16[B, H, S, 64]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h / G, j, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h / G, j, e]
}"""

MQA = """kernel mqa {
  param scale : f32 = 0.125
  in  Q : bf16[B, H, S, 64]
  in  K : bf16[B, T, 64]
  in  V : bf16[B, T, 64]
  out O : bf16[B, H, S, 64]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, j, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, j, e]
}"""


def _plan(text, archs=("sm90a", "sm100a"), sizes=None):
    """Planned for these `--sizes` (default: ones naming every group these tests use): one fused
    attention, which the registry's FlashAttention-4 route builds.  Without FA4 installed no backend
    builds it, so it is planned structurally (no backend asked): the lowering tests read only its IR."""
    sizes = {"G": 4, "H": 32, "KH": 8, "RR": 4} if sizes is None else sizes
    oracle = None if FA4_MISSING else Planner(sizes=sizes)
    (p,) = plan_kernel(load_spec(text, is_text=True).kernels[0], archs, oracle).plans
    return p


@needs_fa4
@pytest.mark.parametrize("text, sizes, group", [
    (GQA_PARAM, {"G": 4}, 4), (GQA_PARAM, {"H": 32, "KH": 8}, 4), (GQA_PARAM, {"H": 32}, None),
    (MQA, {"H": 16}, 16), (MQA, {"B": 2}, None),
], ids=["gqa-G=4", "gqa-H=32,KH=8", "gqa-H=32", "mqa-H=16", "mqa-B=2"])
def test_a_per_call_group_fuses_where_the_sizes_name_it(text, sizes, group):
    """With the group named, one attention (gqa_group per call); without, the unfused plan, as
    `kspec compile` would build it, and the reason says how to name it."""
    from kspec.backends.cute import attention as A
    sched = plan_kernel(load_spec(text, is_text=True).kernels[0], ("sm90a", "sm100a"), Planner(sizes=sizes))
    if group is None:
        assert "attention" not in [p.kind for p in sched.plans]
        assert any("known only per call" in n and "with --sizes" in n for n in sched.fusion.notes), sched.fusion.notes
        p = _plan(text)                                    # (sizes that name it)
    else:
        (p,) = sched.plans
    assert p.kind == "attention"
    for arch, choice in p.choices.items():
        assert choice.backend == "cute" and dict(choice.config)["gqa_group"].startswith("per call")
    assert A.groups_named(p.ir, sizes) == ((group,) if group else ())


@needs_fa4
def test_lowering_builds_the_named_group_or_says_how_to_name_it():
    from kspec.backends import registry
    from kspec.backends.cute import attention as A
    cute = registry.get("cute")
    p = _plan(GQA_PARAM)
    for arch in ("sm90a", "sm100a"):
        base = cute.default_config(p.ir, arch)
        lp = cute.lower(p.ir, arch, (*base, ("sizes", "H=32,KH=8")))
        d = lp.desc
        assert d.group == 0 and d.groups == (4,) and d.group_param in d.scalars
        assert dict(A.config_items(d))["gqa_group"] == "per call, built for 4"
        assert "G" not in d.dims                   # a param: checked by the glue, not a size
        with pytest.raises(KspecError, match="known only at call time") as e:
            cute.lower(p.ir, arch, base)
        assert "--sizes" in e.value.hint and "G=4 or H=32,KH=8" in e.value.hint
    # the glue of the group-4 kernel checks H = 4 KH and the param
    g4 = A.replace(cute.lower(p.ir, "sm90a", (*cute.default_config(p.ir, "sm90a"), ("sizes", "G=4"))).desc,
                   group=4, groups=())
    checks = "\n".join(A._checks(g4))
    assert "if (H != HK * 4)" in checks and "GQA group param = %lld, but the kernel was built for 4" in checks
    mq = cute.lower(_plan(MQA).ir, "sm100a", (*cute.default_config(_plan(MQA).ir, "sm100a"), ("sizes", "H=16")))
    assert mq.desc.kv_shared and mq.desc.groups == (16,)


def test_grouped_builds_select_by_the_group():
    from kspec.backends.cute import attention as A
    p = _plan(GQA_PARAM, ("sm90a",))
    desc = A.for_groups(A.lower(p.ir, "sm90a")[0], (8, 4))
    assert desc.groups == (4, 8) and [d.group for d in A._per_group(desc)] == [4, 8]
    v = A.Variant("c", "h", "k", (0,), ({"S": [0, None]},), (("variant", "0"),))
    b4 = A.AttnBuild("k4", "d", (v,), (), ())
    b8 = A.AttnBuild("k8", "d", (v, v), (), ())
    out = A._grouped(desc, [b4, b8])
    assert [box["G"] for x in out.variants for box in x.select] == [[4, 4], [8, 8], [8, 8]]
    assert [dict(x.config)["gqa_group"] for x in out.variants] == ["4", "8", "8"]


# ---------------------------------------------------------------------------------------------
# an artifact built for group 4 (sm90a), called through the fake driver
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def group4(tmp_path_factory):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    d = tmp_path_factory.mktemp("groups")
    (d / "gqa.kspec").write_text(GQA_PARAM)
    return compile_spec(d / "gqa.kspec", ("sm90a",), d / "out", cache=CompileCache(test_cache_root()),
                        sizes={"G": 4})


def _call(mod, fake, B, H, KH, S=8, T=256, G=4):
    from kspec.runtime.tensors import DeviceBuffer
    arr = {"Q": (B, H, S, 64), "K": (B, KH, T, 64), "V": (B, KH, T, 64), "O": (B, H, S, 64)}
    d = {n: DeviceBuffer(fake.alloc(int(np.prod(s)) * 2), s, "bf16") for n, s in arr.items()}
    return mod.gqa(d["Q"], d["K"], d["V"], O=d["O"], G=G)


@needs_fa4
@pytest.mark.cute
def test_the_artifact_serves_its_group_and_refuses_another_by_name(group4):
    from kspec.runtime import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver
    m = json.loads((group4 / "manifest.json").read_text())
    (plan,) = m["kernels"][0]["plans"]
    b = plan["binaries"]["sm90a"]
    assert b["config"]["gqa_group"] == "per call, built for 4"
    assert all(box["G"] == [4, 4] for v in b["variants"] for box in v["select"])
    mod = kspec.load(group4)
    with FakeDriver(cc=(9, 0), sm_count=132) as fake:
        _call(mod, fake, 2, 32, 8)
        (launch,) = fake.launches
        assert launch.prepare.dims[:5] == (2, 32, 8, 256, 8)
        with pytest.raises(KspecRuntimeError, match=r"GQA group 4 \(query heads per K/V head\), and this call has "
                                                     r"32 query heads on 4 K/V heads \(group 8\)") as e:
            _call(mod, fake, 2, 32, 4, G=8)
        assert "kspec compile --sizes H=32,KH=4" in e.value.hint
        with pytest.raises(KspecRuntimeError, match="not a whole group per K/V head"):
            _call(mod, fake, 2, 30, 4)
        with pytest.raises(KspecRuntimeError, match="GQA group param = 2, but the kernel was built for 4"):
            _call(mod, fake, 2, 32, 8, G=2)
        assert len(fake.launches) == 1                 # nothing launched by the refused calls
    from kspec.inspect_artifact import launch_choice
    text = launch_choice(group4, {"B": 2, "H": 32, "KH": 4, "S": 8, "T": 256})
    assert "refused: " in text and "kspec compile --sizes H=32,KH=4" in text
    assert "variant 0 (for S >= 0, G 4..4)" in launch_choice(group4, {"B": 2, "H": 32, "KH": 8, "S": 8, "T": 256})


# ---------------------------------------------------------------------------------------------
# heads as two axes: Q[b, g, r, i, e] against K[b, g, j, e] is GQA with group R
# ---------------------------------------------------------------------------------------------

TWO_AXES = """kernel two {
  param scale : f32 = 0.125
  in  Q : bf16[B, KH, RR, S, 64]
  in  K : bf16[B, KH, T, 64]
  in  V : bf16[B, KH, T, 64]
  out O : bf16[B, KH, RR, S, 64]
  s[b, g, r, i, j] : f32 = scale * sum(e) Q[b, g, r, i, e] * K[b, g, j, e]
  p[b, g, r, i, j] = softmax(j) s[b, g, r, i, j]
  O[b, g, r, i, e] = sum(j) p[b, g, r, i, j] * V[b, g, j, e]
}"""

ONE_AXIS = """kernel one {
  param scale : f32 = 0.125
  in  Q : bf16[B, H, S, 64]
  in  K : bf16[B, KH, T, 64]
  in  V : bf16[B, KH, T, 64]
  out O : bf16[B, H, S, 64]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h / 4, j, e]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h / 4, j, e]
}"""


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_two_head_axes_are_the_one_axis_gqa_kernel(arch):
    from kspec.backends.cute import attention as A
    p2, p1 = _plan(TWO_AXES.replace("RR", "4")), _plan(ONE_AXIS)
    assert p2.kind == "attention" and p2.ir.attention.batch == ("b", "g", "r")
    d2, _n2, dims2, _s2 = A.lower(p2.ir, arch)
    d1, _n1, dims1, _s1 = A.lower(p1.ir, arch)
    # the same FlashAttention-4 kernel: one entry source, one configuration, group 4 over KH K/V heads
    assert A.entry_source(d2).replace("two", "one") == A.entry_source(d1)
    assert A.config_items(d2) == A.config_items(d1) and d2.group == d1.group == 4
    assert dict(dims2)["H"] == ("KH", 4) and dict(dims1)["H"] == "H" and dict(dims2)["HK"] == dict(dims1)["HK"] == "KH"
    # the group as a size symbol: per call, named by --sizes RR=4
    p3 = _plan(TWO_AXES)
    assert A.groups_named(p3.ir, {"RR": 4}) == (4,) and A.lower(p3.ir, arch)[0].group == 0


def test_two_head_axes_against_float64():
    rng = np.random.default_rng(7)
    B, KH, R, S, T = 2, 2, 3, 5, 11
    Q = rng.standard_normal((B, KH, R, S, 64)).astype(np.float32)
    K, V = (rng.standard_normal((B, KH, T, 64)).astype(np.float32) for _ in range(2))
    out = kspec.reference(TWO_AXES.replace("bf16", "f16"))(Q=Q.astype(np.float16), K=K.astype(np.float16),
                                                           V=V.astype(np.float16))["O"].astype(np.float64)
    q, k, v = (x.astype(np.float16).astype(np.float64) for x in (Q, K, V))
    s = 0.125 * np.einsum("bgrie,bgje->bgrij", q, k)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bgrij,bgje->bgrie", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out, want, rtol=3e-3, atol=3e-3)


@needs_fa4
@pytest.mark.cute
def test_two_head_axes_launch_with_the_flattened_heads(tmp_path):
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    (tmp_path / "two.kspec").write_text(TWO_AXES.replace("RR", "4"))
    art = compile_spec(tmp_path / "two.kspec", ("sm90a",), tmp_path / "out", cache=CompileCache(test_cache_root()))
    mod = kspec.load(art)
    with FakeDriver(cc=(9, 0), sm_count=132) as fake:
        call = fake_call(mod, "two", {"B": 2, "KH": 8, "S": 16, "T": 300}, fake)
        assert check_call(call, "sm90a", mod) == []
        (launch,) = call.launches
        assert launch.prepare.dims[:5] == (2, 32, 16, 300, 8)          # B, H = KH * 4, S, T, HK


QUOTIENT = GQA_PARAM.replace("  param G : i32 = 4\n", "").replace("h / G", "h / (H / KH)")


def test_the_group_as_a_quotient_of_head_counts():
    """`K[b, h / (H / KH), j, e]`: the group is H / KH, known per call; --sizes H=32,KH=8 names it."""
    from kspec.backends import registry
    from kspec.backends.cute import attention as A
    p = _plan(QUOTIENT)
    assert p.kind == "attention" and p.ir.attention.kv_group == "H/KH" and p.ir.attention.kv_head == "KH"
    assert A.groups_named(p.ir, {"H": 32, "KH": 8}) == (4,) and A.groups_named(p.ir, {"H": 32}) == ()
    cute = registry.get("cute")
    base = cute.default_config(p.ir, "sm90a")
    lp = cute.lower(p.ir, "sm90a", (*base, ("sizes", "H=32,KH=8")))
    assert lp.desc.groups == (4,) and "G" not in lp.desc.dims and not lp.desc.group_param
    with pytest.raises(KspecError, match="known only at call time") as e:
        cute.lower(p.ir, "sm90a", base)
    assert "the head counts H and KH: e.g. H=32,KH=8" in e.value.hint


def test_the_quotient_spelling_against_float64():
    rng = np.random.default_rng(3)
    B, H, KH, S, T = 1, 8, 2, 3, 9
    Q = rng.standard_normal((B, H, S, 64)).astype(np.float16)
    K, V = (rng.standard_normal((B, KH, T, 64)).astype(np.float16) for _ in range(2))
    out = kspec.reference(QUOTIENT.replace("bf16", "f16"))(Q=Q, K=K, V=V)["O"].astype(np.float64)
    g = np.arange(H) // (H // KH)
    q, k, v = (x.astype(np.float64) for x in (Q, K, V))
    s = 0.125 * np.einsum("bhie,bhje->bhij", q, k[:, g])
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(out, np.einsum("bhij,bhje->bhie", p / p.sum(-1, keepdims=True), v[:, g]),
                               rtol=3e-3, atol=3e-3)
