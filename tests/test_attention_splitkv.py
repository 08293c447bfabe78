"""Split-KV decoding (backends/cute/splitkv.py): the split-count chooser as a pure function against
FlashAttention-4's own heuristic (`interface._get_fwd_config` with num_splits=0), the same function
in the host glue of the split kernel and of the combine (workspace sizes and launch grids, through
ctypes), the SASS of both kernels, and where split-KV is not built and why.  Launches of whole
artifacts through the fake driver: tests/test_fa4_attention.py (dense, LSE) and
tests/test_attention_paged.py (paged)."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from conftest import FA4_MISSING, SPECS, cubin_sass, needs_fa4, test_cache_root

from kspec.backends.registry import Planner
from kspec.compiler import plan_kernel
from kspec.spec_lang import load_spec

splitkv = pytest.importorskip("kspec.backends.cute.splitkv")


def _desc(spec, arch="sm100a", text=False):
    """The FlashAttention-4 descriptor of the spec's one fused attention.  The registry plans it where
    FA4 is installed; without it no backend builds most of these attentions, so they are planned
    structurally (no backend asked): the descriptor is kspec's lowering, which needs no FA4."""
    from kspec.backends.cute import attention as A
    oracle = None if FA4_MISSING else Planner()
    (p,) = plan_kernel(load_spec(spec, is_text=text).kernels[0], (arch,), oracle).plans
    return A.lower(p.ir, arch)[0]


GRID = dict(B=(1, 8, 64), HK=(1, 8), G=(1, 8), S=(1, 4, 64), T=(512, 640, 32768, 131072), sms=(132, 148))


@needs_fa4
def test_the_chooser_is_flashattention_4s_heuristic(monkeypatch):
    from kspec.backends.cute import compat
    interface = compat.fa4_interface()
    checked = 0
    for B, HK, G, S, T, sms in itertools.product(*GRID.values()):
        monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", str(sms))
        cfg = interface._get_fwd_config(
            arch=100, head_dim=128, head_dim_v=128, causal=False, local=False, window_size_left=None,
            window_size_right=None, max_seqlen_q=S, max_seqlen_k=T, qhead_per_kvhead=G, pack_gqa=G > 1,
            batch_size=B, num_head_kv=HK, num_splits=0, device=SimpleNamespace(index=0), seqlen_q=S)
        assert splitkv.num_splits(B, HK * G, S, T, HK, sms) == cfg.num_splits, (B, HK, G, S, T, sms)
        checked += 1
    assert checked == math.prod(len(v) for v in GRID.values())
    # decoding shapes split; prefill and short caches do not
    assert splitkv.num_splits(1, 32, 1, 131072, 8, 132) == 16          # 8 tiles: 132 // 8
    assert splitkv.num_splits(1, 32, 1, 512, 8, 132) == 1              # 4 key blocks
    assert splitkv.num_splits(64, 32, 1, 131072, 8, 132) == 1          # 512 tiles fill the GPU


def test_a_tuned_count_is_clamped_to_the_key_blocks():
    assert splitkv.num_splits(64, 32, 1, 131072, 8, 132, override=8) == 8          # fixed, even where FA4 says 1
    assert splitkv.num_splits(1, 32, 1, 300, 8, 132, override=8) == 3              # ceil(300 / 128) key blocks
    assert splitkv.num_splits(1, 32, 1, 1 << 20, 8, 132, override=500) == splitkv.MAX_SPLITS


def test_the_workspace_holds_both_partials_aligned():
    o, off, total = splitkv.partial_bytes(16, 1, 32, 1, 128)
    assert o == 16 * 32 * 128 * 4 and off == o and total == off + 16 * 32 * 4
    o, off, total = splitkv.partial_bytes(3, 1, 1, 1, 8)        # 96 bytes: the LSE partials start at 256
    assert (o, off, total) == (96, 256, 512)


@pytest.mark.parametrize("arch, spec, why", [
    ("sm90a", "attention_decode", "no split-KV forward on sm90a"),
    ("sm100a", "attention_varlen", "packed (varlen) queries"),
    ("sm100a", "attention_sliding_window", "self-attention"),
    ("sm100a", "attention_causal", "self-attention (the keys are the queries, T = S)"),
    ("sm100a", "decode_window", "a sliding window"),
])
def test_where_there_is_no_split_and_why(arch, spec, why):
    from kspec.backends.cute import attention as A
    if spec == "decode_window":      # decoding against a cache through a window of W keys
        desc = _desc((SPECS / "attention_decode.kspec").read_text().replace(
            "j <= i + (T - S)", "j <= i + (T - S) and j > i + (T - S) - 256"), text=True)
    else:
        desc = _desc(SPECS / f"{spec}.kspec", arch)
    assert why in splitkv.split_unsupported(desc)
    assert dict(A.config_items(desc))["split_kv"].startswith("none (")


@needs_fa4
def test_graph_says_which_archs_split(capsys):
    from kspec.cli import main
    assert main(["graph", str(SPECS / "attention_decode.kspec"), "--sizes", "B=1,H=32,S=1,T=131072"]) == 0
    out = capsys.readouterr().out
    assert "sm90a: cute attention" in out and "split_kv=none (FlashAttention-4 4.0.0b36 has no split-KV" in out
    assert "split_kv=auto (FlashAttention-4 heuristic, per call)" in out
    # at the given sizes: how many splits each SKU gets (32 tiles on 148 SMs: 4)
    assert "[attention_decode_0] sm100a: split-KV at B=1, H=32, S=1, T=131072, HK=32: 4 splits (the split-KV " \
           "kernel, then the combine) on 148 SMs" in out
    assert "[attention_decode_0] sm90a: split-KV: none on sm90a" in out
    assert main(["graph", str(SPECS / "attention_decode.kspec"), "--sizes", "B=64,H=32,S=1,T=4096"]) == 0
    assert "no split (a single-pass kernel) on 148 SMs" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# the glue's chooser, workspace and grids (one build: the S = 1 variants, the split kernel, the combine)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decode_build():
    from kspec.backends.cute import attention as A
    desc = _desc(SPECS / "attention_decode.kspec")
    built = A.build(desc, test_cache_root(), lengths=[1])
    roles = {dict(v.config).get("role"): v for v in built.variants}
    return desc, roles


@needs_fa4
@pytest.mark.cute
def test_the_glue_chooses_as_the_python_chooser(decode_build):
    from kspec.runtime.glue import HostGlue
    desc, roles = decode_build
    split, combine = (HostGlue(roles[r].host, r) for r in ("split", "combine"))
    assert desc.dims[:5] == ("B", "H", "S", "T", "HK")
    for B, H, S, T, sms in itertools.product((1, 2, 8, 64), (8, 32), (1, 4), (100, 640, 4096, 131072), (132, 148)):
        dims = [B, H, S, T, H]
        ns = splitkv.num_splits(B, H, S, T, H, sms)
        want = 0 if ns == 1 else splitkv.partial_bytes(ns, B, H, S, 128)[2]
        assert split.workspace_size(dims, 0, sms) == combine.workspace_size(dims, 0, sms) == want, (dims, sms)


@needs_fa4
@pytest.mark.cute
def test_split_and_combine_launch_shapes(decode_build):
    from kspec.runtime.errors import KspecRuntimeError
    from kspec.runtime.glue import HostGlue
    desc, roles = decode_build
    split, combine = (HostGlue(roles[r].host, r) for r in ("split", "combine"))
    ptrs = [0x7F0000000000 + i * 0x10000000 for i in range(len(desc.args))]
    B, H, S, T = 2, 8, 1, 65536
    ns = splitkv.num_splits(B, H, S, T, H, 148)
    assert ns == 148 // (B * H)
    a = split.prepare([B, H, S, T, H], ptrs, [0.1], 0x7E0000000000, 0, 148)
    c = combine.prepare([B, H, S, T, H], ptrs, [0.1], 0x7E0000000000, 0, 148)
    assert ns in a.grid and math.prod(a.grid) == B * H * ns          # one CTA per (sequence, head, split)
    tile_m, _k = splitkv.combine_params(128)
    assert c.grid == (-(-S * H // tile_m), 1, B) and c.block == (256, 1, 1)
    with pytest.raises(KspecRuntimeError, match="does not split"):
        split.prepare([64, H, S, 512, H], ptrs, [0.1], 0x7E0000000000, 0, 148)
    with pytest.raises(KspecRuntimeError, match="without its workspace"):
        combine.prepare([B, H, S, T, H], ptrs, [0.1], 0, 0, 148)


@needs_fa4
@pytest.mark.cute
def test_split_and_combine_sass(decode_build):
    _desc_, roles = decode_build
    s, c = cubin_sass(roles["split"].cubin), cubin_sass(roles["combine"].cubin)
    if s is None:
        pytest.skip("no cuobjdump")
    # the split kernel: tcgen05 MMAs over TMA-loaded K/V, the LSE partials (log2), the O partials by TMA
    assert " UTCHMMA" in s and "UTMALDG" in s and "MUFU.LG2" in s and "UTMASTG" in s
    # the combine: cp.async loads of the partials, exp2 rescaling, no tensor cores
    assert "LDGSTS" in c and "MUFU.EX2" in c and "UTCHMMA" not in c
    assert dict(roles["split"].config)["num_splits"] == "auto"
    assert dict(roles["combine"].config)["max_splits"] == str(splitkv.MAX_SPLITS)


LSE_DECODE = """kernel decode_lse {
  param scale : f32 = 0.08838834764831845
  in  Q : bf16[B, H, S, 128]
  in  K : bf16[B, KH, T, 128]
  in  V : bf16[B, KH, T, 128]
  out O : bf16[B, H, S, 128]
  out L : f32[B, H, S]
  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h / 4, j, e]
  L[b, h, i] = logsumexp(j) s[b, h, i, j]
  p[b, h, i, j] = softmax(j) s[b, h, i, j]
  O[b, h, i, e] = sum(j) p[b, h, i, j] * V[b, h / 4, j, e]
}"""


@needs_fa4
@pytest.mark.cute
def test_gqa_with_a_log_sum_exp_packs_the_group_and_combines_the_lse():
    """GQA (group 4, pack-GQA: a K/V head's 4 query heads share a tile) with an LSE output: the split
    kernel writes LSE partials for every query head, the combine reads them and writes the spec's L
    (its pointer is a raw parameter of the combine, not of the split kernel)."""
    from kspec.backends.cute import attention as A
    from kspec.runtime.glue import HostGlue
    desc = _desc(LSE_DECODE, text=True)
    assert desc.group == 4 and desc.lse and splitkv.split_unsupported(desc) is None
    built = A.build(desc, test_cache_root(), lengths=[1])
    roles = {dict(v.config).get("role"): v for v in built.variants}
    assert dict(roles["split"].config)["pack_gqa"] == "true"
    split, combine = (HostGlue(roles[r].host, r) for r in ("split", "combine"))
    B, KH, S, T = 1, 8, 1, 131072
    dims = [B, 4 * KH, S, T, KH, *([4] if "G" in desc.dims else [])]
    ns = splitkv.num_splits(B, 4 * KH, S, T, KH, 132)
    assert ns == 132 // KH                                  # 8 tiles (one per K/V head, packed)
    ws = 0x7E0000000000
    assert split.workspace_size(dims, 0, 132) == splitkv.partial_bytes(ns, B, 4 * KH, S, 128)[2]
    ptrs = [0x7F0000000000 + i * 0x10000000 for i in range(len(desc.args))]
    a = split.prepare(dims, ptrs, [0.1], ws, 0, 132)
    c = combine.prepare(dims, ptrs, [0.1], ws, 0, 132)
    assert math.prod(a.grid) == B * KH * ns
    words = {int.from_bytes(c.params_bytes()[i:i + 8], "little") for i in range(0, c.params_size - 7, 8)}
    assert ptrs[3] in words and ptrs[4] in words            # O and L: written by the combine
    lse_off = splitkv.partial_bytes(ns, B, 4 * KH, S, 128)[1]
    assert ws in words and ws + lse_off in words            # the O and LSE partials
    words = {int.from_bytes(a.params_bytes()[i:i + 8], "little") for i in range(0, a.params_size - 7, 8)}
    assert ptrs[4] not in words and ws + lse_off in words   # the split kernel writes only partials


def test_the_glue_chooser_c_is_the_python_chooser(tmp_path):
    """splitkv.chooser_c (what both glues compile) against num_splits, heuristic and tuned, with gcc."""
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    grid = list(itertools.product((1, 3, 64), (8, 32), (1, 8), (1, 5, 200), (100, 640, 70000), (132, 148)))
    for dv, override in ((128, 0), (64, 0), (128, 12)):
        src = ["#include <stdint.h>", "#include <stdio.h>", splitkv.chooser_c(dv, True, override),
               "int main(void) {", "  static const int64_t g[][6] = {"]
        src += [f"    {{{B}, {HK * G}, {S}, {T}, {HK}, {sms}}}," for B, HK, G, S, T, sms in grid] + ["  };"]
        src += [f"  for (int k = 0; k < {len(grid)}; k++)",
                "    printf(\"%lld\\n\", (long long)ks_num_splits(g[k][0], g[k][1], g[k][2], g[k][3], g[k][4], "
                "(int32_t)g[k][5]));", "  return 0;", "}"]
        (tmp_path / "c.c").write_text("\n".join(src))
        subprocess.run([cc, "-O1", "-o", str(tmp_path / "c"), str(tmp_path / "c.c")], check=True)
        got = [int(x) for x in subprocess.run([str(tmp_path / "c")], capture_output=True, text=True).stdout.split()]
        want = [splitkv.num_splits(B, HK * G, S, T, HK, sms, head_dim_v=dv, override=override)
                for B, HK, G, S, T, sms in grid]
        assert got == want, (dv, override)
        assert (max(want) > 1) and (min(want) == 1 or override)


@needs_fa4
def test_a_tuning_winner_fixes_the_split_count(tmp_path, capsys):
    """A tuning-database entry for the kernel and size bucket whose config has num_splits: the kernel
    is lowered with that count (config split_kv "8 (tuned)"), and graph/the glue use it."""
    from kspec.backends import registry
    from kspec.backends.cute import attention as A
    from kspec.compile import emit_spec
    from kspec.tune import MODEL_DRIVER, TuneEntry, TuningDB, bucket_key, toolchain_identity
    spec = SPECS / "attention_decode.kspec"
    (p,) = plan_kernel(load_spec(spec).kernels[0], ("sm100a",), Planner()).plans
    sizes = {"B": 64, "H": 32, "S": 1, "T": 131072}
    cute = registry.get("cute")
    config = (*cute.default_config(p.ir, "sm100a"), ("num_splits", "8"))
    db = TuningDB(tmp_path / "tuning.json")
    db.put([TuneEntry(p.ir.digest(), "sm100a", bucket_key(sizes), "cute", toolchain_identity("cute"), MODEL_DRIVER,
                      config, 1e-3)])
    emitted = emit_spec(spec, ("sm100a",), tuned=db.chooser(sizes))
    (ep,) = next(iter(emitted.plans.values()))
    assert ep.lowered.desc.splits == 8 and dict(A.config_items(ep.lowered.desc))["split_kv"] == "8 (tuned)"
    assert "ks_num_splits" in A._glue(A.replace(ep.lowered.desc, split=True), "c", "e", (0,), (8,)) \
        and "int64_t ns = 8;" in splitkv.chooser_c(128, True, 8)
    # where FA4's heuristic gives 1 (64 sequences fill the GPU), the tuned kernel still splits 8 ways
    assert cute.call_notes(p.ir, "sm100a", {**sizes, "KH": 32}, config) == [
        "split-KV at B=64, H=32, S=1, T=131072, HK=32: 8 splits (the split-KV kernel, then the combine) on 148 SMs"]
    assert "no split" in cute.call_notes(p.ir, "sm100a", sizes)[0]
