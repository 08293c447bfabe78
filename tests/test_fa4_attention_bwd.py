"""The attention backward as FlashAttention-4's own three backward kernels (backends/cute/attention_bwd.py):
`kspec grad`'s backward of the plain and causal attention specs plans as one attention_bwd kernel built
by the CuTe backend on both archs (and what FA4 cannot take is refused with the reason); the offline
build (tensor-core SASS in the main kernel, parameter offsets from the cubins); the runtime's plan
running preprocess, main and postprocess in order with one correctly sized workspace under the fake
driver; bad sizes refused before launch; a warm compile importing neither FA4 nor the DSL."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import (FAKE_ARCHS, SPECS, check_fa4_bwd_binaries, checkout_env, fa4_fake_call, grad_artifacts, needs_fa4,
                      one_fa4_bwd_plan)

from kspec.compile import plan_spec
from kspec.core import KspecError, attention_bwd_workspace
from kspec.spec_lang import load_spec
from kspec.spec_lang.grad import grad_program

ARCHS = ("sm90a", "sm100a")
STEMS = ("attention", "attention_causal")


def _grad_text(stem: str, edit=None) -> str:
    text = (SPECS / f"{stem}.kspec").read_text()
    return grad_program(load_spec(edit(text) if edit else text, is_text=True))


def _plan(stem: str, strict: bool = True, edit=None):
    prog = load_spec(_grad_text(stem, edit), is_text=True, file=f"{stem}_grad.kspec")
    (sched,) = plan_spec(prog, ARCHS, f"{stem}_bwd", strict=strict)
    return sched


@needs_fa4
@pytest.mark.parametrize("stem", STEMS)
def test_backward_plans_as_one_fa4_attention_bwd_kernel_on_both_archs(stem):
    one_fa4_bwd_plan(_plan(stem))                       # --strict: no loop fallback, no unfused note


@pytest.mark.parametrize("edit, why", [
    (lambda t: t.replace("128", "96").replace("0.08838834764831845", "0.1"), "head dim 96"),
    (lambda t: t.replace(": f16", ": f32").replace("f16[", "f32["), "not FlashAttention-4's backward"),
])
def test_what_fa4_cannot_take_is_printed_and_refused_by_strict(edit, why):
    sched = _plan("attention", strict=False, edit=edit)
    assert any("attention backward" in n and why in n for n in sched.fusion.notes), sched.fusion.notes
    with pytest.raises(KspecError, match="attention backward"):
        _plan("attention", edit=edit)


def test_causal_backward_over_keys_that_may_differ_from_queries_is_refused():
    # FA4 aligns its causal mask bottom-right, the spec's j <= i top-left: equal only when S = T
    def edit(t):
        return t.replace("K : bf16[B, H, S, 64]", "K : bf16[B, H, T, 64]").replace(
            "V : bf16[B, H, S, 64]", "V : bf16[B, H, T, 64]").replace(
            "softmax(j, causal=i) s[b, h, i, j]", "softmax(j) where(j <= i, s[b, h, i, j], -inf)")
    sched = _plan("attention_causal", strict=False, edit=edit)
    assert any("bottom-right" in n for n in sched.fusion.notes), sched.fusion.notes


@needs_fa4
@pytest.mark.parametrize("stem, varlen", [("attention_varlen", "cu_seqlens_q, cu_seqlens_k"),
                                          ("attention_decode", None)])
def test_bottom_right_causal_and_packed_backwards_plan_as_one_fa4_kernel(stem, varlen):
    """`j <= i + (T - S)` is FA4's own causal alignment (any S, T); over packed (varlen) sequences
    with its per-sequence lengths, with [b, seq, h, e] tensors, the packed LSE a [h, rows] view."""
    p = one_fa4_bwd_plan(_plan(stem))                   # --strict
    for arch in ARCHS:
        cfg = dict(p.choices[arch].config)
        assert cfg["mask"] == "causal (bottom-right)" and cfg.get("varlen") == varlen
    a = p.ir.attention_bwd
    assert a.bottom_right and a.causal
    if varlen:
        assert a.layouts[0] == ("B", "S", "H", "E") and a.layouts[5] == ("B", "S", "H")


def test_top_left_causal_over_packed_sequences_is_refused():
    # j <= i over sequences whose query and key counts differ is not FA4's (bottom-right) causal mask
    # (unfused, nothing builds packed tensors: --strict names the reason first)
    with pytest.raises(KspecError, match="attention backward.*bottom-right"):
        _plan("attention_varlen", edit=lambda t: t.replace("j <= i + (T - S)", "j <= i"))


def test_gqa_backward_is_refused_with_the_reason():
    sched = _plan("attention_gqa", strict=False)
    assert any("attention backward" in n and "no GQA" in n for n in sched.fusion.notes), sched.fusion.notes


# ---------------------------------------------------------------------------------------------
# offline builds
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bwd_artifacts(tmp_path_factory):
    return grad_artifacts(tmp_path_factory.mktemp("fa4bwd"), _grad_text, lambda stem: f"{stem}_bwd")


def _bwd_plan(mod, stem):
    (plan,) = mod[f"{stem}_bwd"].entry.plans
    return plan


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", STEMS + ("attention_varlen",))
def test_backward_builds_three_fa4_kernels_per_arch_with_tensor_core_sass(bwd_artifacts, stem):
    import kspec
    art = bwd_artifacts(stem)
    check_fa4_bwd_binaries(art, _bwd_plan(kspec.load(art), stem))


def _fake_call(mod, stem, sizes, cc, sms, arch):
    return fa4_fake_call(mod, f"{stem}_bwd", sizes, cc, sms, arch)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("stem", STEMS)
@pytest.mark.parametrize("arch, cc, sms", FAKE_ARCHS)
def test_one_call_launches_preprocess_main_postprocess_with_one_workspace(bwd_artifacts, stem, arch, cc, sms):
    import kspec
    mod = kspec.load(bwd_artifacts(stem))
    plan = _bwd_plan(mod, stem)
    b = plan.binaries[arch]
    assert mod.step_variants(plan, arch) == [0, 1, 2]
    for B, H, S in ((2, 3, 300), (1, 1, 1), (3, 2, 1000)):
        sizes = {"B": B, "H": H, "S": S, "T": S}
        call, problems = _fake_call(mod, stem, sizes, cc, sms, arch)
        assert problems == [], problems
        assert call.plan_ids == [plan.id] * 3
        assert [r.symbol for r in call.launches] == [v.symbol for v in b.variants]
        cfg = b.variants[0].config
        tile_m, dr = int(cfg["ws_tile_m"]), int(cfg["ws_head_dim"])
        lay = attention_bwd_workspace(B, H, S, tile_m, dr)
        want = lay["total"][0]
        assert mod.launches(plan, arch, call.binding.dims(plan), 0, sms) == ([0, 1, 2], want)
        ws = {r.prepare.workspace for r in call.launches}
        assert len(ws) == 1 and 0 not in ws
        (ws,) = ws
        assert all(rec.prepare.sm_count == sms for rec in call.launches)
        pre, main, post = call.plan_args
        assert [a.name for a in pre] == ["O", "dO", "<dpsum>", _lse(mod, stem), "<lse_log2>", "<dq_accum>"]
        assert [a.name for a in post] == ["<dq_accum>", "dQ"]
        assert [a.name for a in main][7:] == ["dK", "dV"]
        # the accumulator and row buffers FA4 allocates, inside the one workspace, as kspec sized it
        assert pre[5].ptr == ws and pre[5].shape == (B, H, -(-S // tile_m) * tile_m * dr)
        assert pre[2].ptr == ws + lay["dpsum"][0] and pre[4].ptr == ws + lay["lse_log2"][0]
        assert lay["lse_log2"][0] + 4 * B * H * -(-S // tile_m) * tile_m <= want
        # the preprocess and postprocess run one CTA per (query tile, head, sequence)
        assert call.launches[0].grid == (-(-S // tile_m), H, B)


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch, cc, sms", FAKE_ARCHS)
def test_packed_backward_passes_the_offsets_and_sizes_the_padded_workspace(bwd_artifacts, arch, cc, sms):
    """Over packed sequences each kernel gets FA4's varlen views ([rows, H, E], the LSE [H, rows] of
    the packed [rows, H] array) and the offsets; the workspace is FA4's varlen one ([H, n], n the
    rows padded per sequence: rows + B tiles, rounded up to a tile)."""
    import kspec
    stem = "attention_varlen"
    mod = kspec.load(bwd_artifacts(stem))
    plan = _bwd_plan(mod, stem)
    b = plan.binaries[arch]
    assert [v.config["packed"] for v in b.variants] == ["q,k"] * 3
    tile_m, dr = int(b.variants[0].config["ws_tile_m"]), int(b.variants[0].config["ws_head_dim"])
    for B, H in ((3, 2), (1, 1), (5, 4)):
        call, problems = _fake_call(mod, stem, {"B": B, "H": H}, cc, sms, arch)
        assert problems == [], problems
        rows = sum(100 + 17 * x for x in range(B))        # fake_call's sequence lengths
        n = (rows + (B + 1) * tile_m - 1) // tile_m * tile_m
        lay = attention_bwd_workspace(B, H, rows, tile_m, dr, packed=True)
        assert lay["dq_accum"][1] == (H, n * dr) and lay["dpsum"][1] == (H, n)
        assert mod.launches(plan, arch, call.binding.dims(plan), 0, sms) == ([0, 1, 2], lay["total"][0])
        pre, main, post = call.plan_args
        assert [a.name for a in pre] == ["O", "dO", "<dpsum>", "p_lse", "<lse_log2>", "<dq_accum>", "cu_q"]
        assert [a.name for a in main][-4:] == ["dK", "dV", "cu_q", "cu_k"]
        assert [a.name for a in post] == ["<dq_accum>", "dQ", "cu_q"]
        (ws,) = {r.prepare.workspace for r in call.launches}
        assert pre[5].ptr == ws and pre[5].shape == (H, n * dr) and pre[2].ptr == ws + lay["dpsum"][0]
        assert pre[0].shape == (rows, H, 128) and pre[3].shape == (rows, H)


def _lse(mod, stem):
    return [t.name for t in mod[f"{stem}_bwd"].entry.inputs if t.name.endswith("lse")][0]


@needs_fa4
@pytest.mark.cute
def test_bad_sizes_are_refused_before_launch(bwd_artifacts):
    import kspec
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.glue import HostGlue
    art = bwd_artifacts("attention")
    mod = kspec.load(art)
    plan = _bwd_plan(mod, "attention")
    v = plan.binaries["sm90a"].variants[1]
    glue = HostGlue(art / v.host, "attention_bwd", plan.args)
    ptrs = [0x7F0000000000 + i * 0x10000000 for i in range(len(plan.args))]
    ws = 0x7E0000000000
    ok = glue.prepare([2, 4, 300, 500], ptrs, [0.1], ws, 0, 132)          # S != T: fine without a mask
    assert ok.grid[0] >= 1 and ok.block[0] > 0
    with pytest.raises(KspecRuntimeError, match="at least one of each"):
        glue.prepare([2, 4, 0, 500], ptrs, [0.1], ws, 0, 132)
    with pytest.raises(KspecRuntimeError, match="without its workspace"):
        glue.prepare([2, 4, 300, 500], ptrs, [0.1], 0, 0, 132)
    assert glue.prepare([0, 4, 300, 500], ptrs, [0.1], ws, 0, 132).grid == (0, 0, 0)


@needs_fa4
@pytest.mark.cute
def test_warm_backward_compile_imports_neither_fa4_nor_the_dsl(bwd_artifacts, tmp_path):
    bwd_artifacts("attention_causal")            # the cache is warm
    spec = tmp_path / "g.kspec"
    spec.write_text(_grad_text("attention_causal"))
    code = ("import sys; from kspec.compile import compile_spec; from kspec.backends.build import CompileCache;"
            f"from conftest import test_cache_root; compile_spec({str(spec)!r}, ('sm90a', 'sm100a'), "
            f"{str(tmp_path / 'out')!r}, cache=CompileCache(test_cache_root()), kernel='attention_causal_bwd');"
            "bad = [m for m in ('cutlass', 'flash_attn', 'quack', 'torch') if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(SPECS.parent / "tests"),
                       env=checkout_env())
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


@needs_fa4
@pytest.mark.cute
def test_inspect_says_a_call_launches_the_three_kernels_in_order(bwd_artifacts, capsys):
    from kspec.cli import main
    art = bwd_artifacts("attention_causal")
    assert main(["inspect", str(art), "--sizes", "B=2,H=8,S=4096,T=4096"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "attention_causal_bwd_0" in x]
    want = attention_bwd_workspace(2, 8, 4096, 128, 64)["total"][0]          # head dim 64: tile_m 128 on both
    assert len(lines) == 2 and all(f"variants 0, 1, 2 in order (the attention backward's preprocess, main and "
                                   f"postprocess kernels; {want} bytes of workspace)" in x for x in lines), lines


@needs_fa4
@pytest.mark.cute
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stem", ["attention_causal", "attention_varlen"])
def test_selftest_fake_checks_each_of_the_three_launches(bwd_artifacts, capsys, arch, stem):
    """`kspec selftest --fake` (what a CPU machine checks before a GPU run) matches the three launches
    of one attention backward call to the plan and checks each against its own kernel's ABI and the
    tensors it reads and writes (the workspace's buffers included); it once zipped one launch per
    plan and reported Q, K, V, dQ, dK, dV missing from the preprocess kernel's parameters."""
    from kspec.cli import main
    art = bwd_artifacts(stem)
    rc = main(["selftest", str(art), "--fake", arch, "--no-bench"])
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if f"{stem}_bwd" in x and "bad-index" not in x]
    assert rc == 0 and lines and all("PASS" in x and "3 launch(es) recorded, ABI ok" in x for x in lines), out
