"""Differential test of kspec's GEMM synchronisation against a GPU-validated implementation, in the
same run: QuACK 0.6.5's GemmSm90 / GemmSm100 (through its epilogue frontend, `EpiMod.plan`, which
compiles without launching) and kspec's CuTe DSL kernels, compiled for sm_90a and sm_100a with the
same tile, cluster and dtypes, compared by the synchronisation skeleton of their SASS:

- mbarrier inits (SYNCS.EXCH.64): each side's count is derived from its own pipeline stage
  counts (kspec's from backends/cute/sync.py, QuACK's from its kernel object after the trace), so
  both are shown to create exactly the barriers of the same rings, and the rings they share
  (A/B, accumulator) are sized by the same rule;
- the set of synchronisation instruction kinds (mbarrier init/arrive/wait, proxy fences, TMA
  loads/stores and their bulk-group commits, named barriers, tcgen05 commits, TMEM allocation):
  equal, except the kinds pinned below with the design difference that explains each;
- per-kernel counts of TMEM allocation/relinquish/free, TMEM loads (LDTM), TMA stores (UTMASTG)
  and bulk-group commits: equal, except where pinned.

QuACK's kernels are cached (compiling one takes 10-30 s): test_cache_root()/upstream-sass/.
Epilogues compared: plain (D = acc), residual (D = acc + R), an auxiliary output (D = acc,
H = relu(acc)) and a row reduction (kspec: rmax[m] = max(n) acc, combined across tiles with atomics;
QuACK: `amax_epi`'s per-tile column-vector partials).
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import test_cache_root
from test_cute_backend import needs_dsl

from kspec.backends.cute import compat, sync

ARCHS = ("sm90a", "sm100a")
EPILOGUES = ("plain", "residual", "aux", "reduction")
# the configurations both sides compile, f16 operands and D, K-major A and B: sm_90a 128x256 (two
# consumer warpgroups, cooperative in both), sm_100a 128x128 on one CTA, cluster 1x1; and, for the
# plain epilogue, the cluster paths: sm_90a with a 2x1 cluster (B multicast), sm_100a's 2-CTA MMA
# (256x128 over a 2x1 cluster)
TILE = {"sm90a": (128, 256), "sm100a": (128, 128)}
CLUSTERED = {"sm90a": ((128, 256), (2, 1), False), "sm100a": ((256, 128), (2, 1), True)}


def _config(arch, epi):
    """(tile, cluster, 2-CTA) of a case: `epi` "plain+cluster" is the clustered plain case."""
    return CLUSTERED[arch] if epi.endswith("+cluster") else (TILE[arch], (1, 1), False)

_INSN_RE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
# synchronisation instruction kinds (SASS opcode with its modifiers, as cuobjdump prints them)
SYNC_RE = re.compile(r"^(SYNCS\.|FENCE\.|UTMALDG|UTMASTG|UTMACMDFLUSH|UTMACCTL|BAR\.|UTCBAR|UTCATOMSWS|ACQBULK|"
                     r"WARPGROUP\.|MEMBAR)")


def _quack_missing() -> str | None:
    why = compat.fa4_available()
    if why:
        return why
    try:
        from kspec.backends.toolchain import find_toolchain
        if find_toolchain().cuobjdump is None:
            return "no cuobjdump"
    except Exception as e:  # noqa: BLE001
        return f"no CUDA toolchain for cuobjdump: {e}"
    return None


needs_quack = pytest.mark.skipif(_quack_missing() is not None, reason=f"QuACK differential SASS test: {_quack_missing()}")


def sass_ops(cubin: Path) -> list[str]:
    from kspec.backends.toolchain import find_toolchain
    tc = find_toolchain()
    r = subprocess.run([str(tc.cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, env=tc.env())
    assert r.returncode == 0, r.stderr
    return [m.group(1) for m in map(_INSN_RE.match, r.stdout.splitlines()) if m]


def skeleton(cubin: Path) -> collections.Counter:
    """The synchronisation instructions of a cubin's kernel, by kind (TMA loads/stores by family:
    kspec's tensors are 3-D (M, K, L), QuACK's unbatched ones 2-D)."""
    out = collections.Counter()
    for op in sass_ops(cubin):
        if op in ("LDTM",) or op.startswith("LDTM."):
            out["LDTM"] += 1
        elif SYNC_RE.match(op):
            out[re.sub(r"^(UTMALDG|UTMASTG)\.\d+D", r"\1", op)] += 1
    return out


# ------------------------------------------------------------------------------------------ kspec's side
def kspec_kernel(arch: str, epi: str):
    """(cubin, sync.SmemBudget) of kspec's kernel for the epilogue."""
    from kspec.backends.cute import build as cbuild
    from kspec.backends.cute import gemm
    from kspec.backends.desc import Accum, GemmDesc, Load, Op, Operand, ReductionStore, Store
    acc = Accum()
    kw = {}
    if epi == "residual":
        out = Store("D", Op("add", (acc, Load("R", "full", "f16"))), "f16")
    elif epi == "aux":
        out = Store("D", acc, "f16")
        kw["aux_stores"] = (Store("H", Op("relu", (acc,)), "f16"),)
    elif epi == "reduction":
        out = Store("D", acc, "f16")
        kw["reductions"] = (ReductionStore("rmax", "max", "n", acc, "f32"),)
    else:
        out = Store("D", acc, "f16")
    d = GemmDesc("k_0", arch, Operand("A", "f16", "row"), Operand("B", "f16", "col"), "f32", out, **kw)
    cfg = gemm.CuteConfig(*_config(arch, epi))
    b = cbuild.build(d, arch, test_cache_root(), cfg)
    return Path(b.cubin), gemm.smem_budget(d, arch, cfg)


# ------------------------------------------------------------------------------------------ QuACK's side
def quack_kernel(arch: str, epi: str) -> tuple[Path, dict]:
    """(cubin, pipeline facts) of QuACK's kernel for the epilogue, compiled once into the cache."""
    from importlib.metadata import version
    (tm, tn), (cm, cn), _ = _config(arch, epi)
    tag = f"quack{version('quack-kernels')}-dsl{compat.dsl_version()}-{arch}-{epi}-{tm}x{tn}-{cm}x{cn}"
    root = test_cache_root() / "upstream-sass" / tag
    facts_path = root / "facts.json"
    if facts_path.exists():
        return root / "kernel.cubin", json.loads(facts_path.read_text())
    dump = root.with_name(root.name + f".tmp{os.getpid()}")
    dump.mkdir(parents=True, exist_ok=True)
    try:
        facts = _compile_quack(arch, epi, dump)
        (cubin,) = dump.glob("*.cubin")
        cubin.rename(dump / "kernel.cubin")
        (dump / "facts.json").write_text(json.dumps(facts))
        try:
            dump.rename(root)
        except OSError:              # another process cached it first
            pass
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    return root / "kernel.cubin", json.loads(facts_path.read_text())


def _compile_quack(arch: str, epi: str, dump: Path) -> dict:
    compat.fa4_interface()                           # `import quack` without triton
    import cutlass.cute as cute
    import quack.cache
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    seen = {}
    original = cute.compile

    def keep(obj, *args, options="", **kw):          # QuACK's compile, keeping the cubin
        seen["obj"] = obj
        return original(obj, *args, options=f"{options} --gpu-arch {compat.dsl_arch(arch)} --keep-cubin "
                                            f"--dump-dir {dump}", **kw)
    with compat.fa4_target(arch, compat.OFFLINE_SM_COUNT[arch]):
        old = os.environ.get("QUACK_ARCH")
        os.environ["QUACK_ARCH"] = compat.dsl_arch(arch)
        from quack import cute_dsl_utils
        from quack.epilogue import library as lib
        from quack.gemm_config import GemmConfig
        caches = [f for f in vars(cute_dsl_utils).values() if hasattr(f, "cache_clear")]
        for f in caches:                             # QuACK caches the arch it read first
            f.cache_clear()
        (tm, tn), (cm, cn), _ = _config(arch, epi)
        # (QuACK takes an even cluster M with a 256-row tile on sm_100a as a 2-CTA MMA, like kspec)
        cfg = GemmConfig(tile_m=tm, tile_n=tn, pingpong=False, is_dynamic_persistent=False,
                         cluster_m=cm, cluster_n=cn, device_capacity=9 if arch == "sm90a" else 10)
        cute.compile = keep
        # QuACK's disk cache: its keys leave out the arch, and a hit would skip the compile this
        # test keeps the cubin of (QuACK reads the flag per call; its env var only at import)
        enabled, quack.cache.CACHE_ENABLED = quack.cache.CACHE_ENABLED, False
        try:
            with FakeTensorMode():
                M, N, K = 1024, 1024, 512
                f16 = dict(dtype=torch.float16, device="cuda")
                A = torch.empty(M, K, **f16)
                B = torch.empty_strided((K, N), (1, K), **f16)            # K-major, as kspec's B
                D = torch.empty(M, N, **f16)
                if epi.startswith("plain"):
                    lib.identity_epi.plan(A, B, out={"D": D}, config=cfg)
                elif epi == "residual":
                    lib.residual_epi.plan(A, B, out={"D": D}, res=torch.empty(M, N, **f16), config=cfg)
                elif epi == "aux":
                    mod = lib.linear_act_mod("relu", gated=False, has_c=False, has_rowvec=False, has_colvec=False)
                    mod.plan(A, B, None, out={"D": D, "mAuxOut": torch.empty(M, N, **f16)}, config=cfg)
                else:
                    lib.amax_epi.plan(A, B, out={"D": D}, config=cfg)
        finally:
            cute.compile = original
            quack.cache.CACHE_ENABLED = enabled
            for f in caches:
                f.cache_clear()
            if old is None:
                os.environ.pop("QUACK_ARCH", None)
            else:
                os.environ["QUACK_ARCH"] = old
    o = seen["obj"]
    # plain ints only (the kernel object's other attributes are MLIR values, dead after the trace)
    return {k: int(getattr(o, k)) for k in ("ab_stage", "epi_c_stage", "sched_stage", "num_acc_stage")
            if isinstance(getattr(o, k, None), int)}


# ------------------------------------------------------------------------------------------ the comparison
def kspec_barriers(arch, epi, budget) -> dict[str, int]:
    """kspec's mbarriers by ring, from sync.py."""
    out = {"A/B ring": 2 * budget.stages}
    if arch == "sm100a":
        out["accumulator ring"] = 2 * sync.ACC_STAGES
    if _config(arch, epi)[2]:
        out["2-CTA TMEM release"] = 1        # the DSL's TmemAllocator: the peer's dealloc handshake
    if epi == "residual":
        out["residual ring"] = sync.RESIDUAL_STAGES
    return out


def quack_barriers(arch, epi, facts) -> dict[str, int]:
    """QuACK's mbarriers by ring, from its kernel object."""
    out = {"A/B ring": 2 * facts["ab_stage"]}
    if arch == "sm100a":
        out["accumulator ring"] = 2 * facts["num_acc_stage"]
    if facts.get("epi_c_stage"):
        out["C load ring"] = 2 * facts["epi_c_stage"]
    out["tile scheduler ring"] = 2 * facts["sched_stage"]
    if _config(arch, epi)[2]:
        out["2-CTA TMEM release"] = 1
    return out


# Design differences, each with its reason: (arch, epilogue or "*") -> {kind: reason}.
ONLY_QUACK = {
    ("*", "*"): {
        "ACQBULK": "QuACK waits for the previous grid (programmatic dependent launch, griddepcontrol.wait); "
                   "kspec launches without PDL",
    },
    ("sm100a", "*"): {
        "BAR.ARV": "QuACK's MMA warp arrives on a named barrier before the epilogue frees TMEM (and its C "
                   "load warp on another); kspec frees TMEM after the last accumulator-full wait, which the "
                   "last MMA's commit completes, and its epilogue loads residuals itself",
    },
}
ONLY_QUACK[("sm90a", "plain+cluster")] = {
    "SYNCS.ARRIVE.TRANS64.RED": "QuACK's tile-scheduler pipeline is released into CTA 0's barrier from every CTA of "
                                "the cluster (a remote arrive); kspec's warps each step their own static scheduler",
}
ONLY_KSPEC: dict = {}
_C_LOAD = "QuACK's C tiles come from its load warp through a named barrier; kspec's epilogue warp 0 loads them"
_RED = ("kspec's reductions fill their shared-memory rows once and flush them after each tile behind a "
        "named barrier; QuACK writes per-tile partials from registers")
COUNT_PINS = {  # (arch, epilogue, kind): (kspec, QuACK, reason)
    ("sm90a", "residual", "BAR.SYNC.DEFER_BLOCKING"): (17, 18, _C_LOAD),
    ("sm100a", "residual", "BAR.SYNC.DEFER_BLOCKING"): (12, 13, _C_LOAD),
    ("sm90a", "reduction", "BAR.SYNC.DEFER_BLOCKING"): (19, 17, _RED),
    ("sm100a", "reduction", "BAR.SYNC.DEFER_BLOCKING"): (14, 12, _RED),
}
# Counts compared (TMA loads, tcgen05 commits and fences are not: the two mainloops and epilogues are
# unrolled differently, which changes how often the same instruction appears, not the protocol).
SAME_COUNT = ("UTCATOMSWS.FIND_AND_SET.ALIGN", "UTCATOMSWS.AND", "LDTM", "UTMASTG", "UTMACMDFLUSH",
              "BAR.SYNC.DEFER_BLOCKING")


def _pins(table, arch, epi):
    out = {}
    for (a, e), kinds in table.items():
        if a in ("*", arch) and e in ("*", epi):
            out.update(kinds)
    return out


@needs_dsl
@needs_quack
@pytest.mark.cute
@pytest.mark.parametrize("epi", [e if e in ("plain", "residual") else pytest.param(e, marks=pytest.mark.slow)
                                 for e in EPILOGUES] + ["plain+cluster"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sync_skeleton_matches_quack(arch, epi):
    kc, budget = kspec_kernel(arch, epi)
    qc, facts = quack_kernel(arch, epi)
    ks, qs = skeleton(kc), skeleton(qc)
    report = f"\nkspec {dict(sorted(ks.items()))}\nQuACK {dict(sorted(qs.items()))}\nQuACK facts {facts}"
    # every mbarrier each side creates belongs to a ring its own stage counts account for
    kb, qb = kspec_barriers(arch, epi, budget), quack_barriers(arch, epi, facts)
    assert ks["SYNCS.EXCH.64"] == sum(kb.values()), (kb, report)
    assert qs["SYNCS.EXCH.64"] == sum(qb.values()), (qb, report)
    # the same kinds of synchronisation, except the pinned design differences
    only_q = {k for k in qs if k not in ks}
    only_k = {k for k in ks if k not in qs}
    assert only_q == set(_pins(ONLY_QUACK, arch, epi)), report
    assert only_k == set(_pins(ONLY_KSPEC, arch, epi)), report
    for kind in SAME_COUNT:
        pin = COUNT_PINS.get((arch, epi, kind))
        want = (pin[0], pin[1]) if pin else (qs[kind], qs[kind])
        assert (ks[kind], qs[kind]) == want, (kind, report)
