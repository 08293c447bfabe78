"""Shared fixtures: the shipped specs, and kernels compiled once per session through the real
pipeline (nvcc results live in the compile cache, so later runs and other tests reuse them)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
SHIPPED = sorted(p.stem for p in SPECS.glob("*.kspec"))

# Shipped attention variants (issue 16) whose one fused kernel comes from the FlashAttention-4
# route of the CuTe DSL backend: without FA4 installed, no backend implements their lifted
# score_mod/mask/GQA/paging, so they plan as several kernels, some of which (index arithmetic,
# masks) no other backend lowers.  Tests over every shipped spec expect them to fail then.
NEED_FA4 = frozenset({"attention_gqa", "attention_alibi", "attention_sliding_window", "attention_bias",
                      "attention_softcap", "attention_decode", "attention_varlen_padded", "attention_paged",
                      "attention_varlen", "attention_lse"})
# Shipped GEMM specs only the CuTe DSL backend builds with tensor cores (int8 operands, float epilogues
# on i32 accumulators, full m-and-n epilogue reductions: CUTLASS C++ declines them).
CUTE_ONLY = frozenset({"gemm_int8", "gemm_int8_dequant", "fp8_gemm_amax", "fp8_gemm_blockwise",
                       "moe_grouped_gemm", "moe_gather_gemm", "mxfp8_gemm", "nvfp4_gemm"})
# Shipped specs no backend builds at all (none today).
NO_BACKEND_YET: frozenset[str] = frozenset()


def spec_archs(stem: str, archs: tuple[str, ...] = ("sm90a", "sm100a")) -> tuple[str, ...]:
    """The archs of `archs` that specs/<stem>.kspec's `target` line allows (all of them without one),
    as bench/prebuild.py builds it; where it allows none of them, the first arch it targets."""
    from kspec.spec_lang import load_spec
    targets = load_spec(SPECS / f"{stem}.kspec").targets
    return tuple(a for a in archs if not targets or a in targets) or tuple(targets[:1])


def _fa4_missing() -> str | None:
    from kspec.backends.cute import compat
    return compat.fa4_available()


FA4_MISSING = _fa4_missing()              # why the FlashAttention-4 route is unavailable (None: it is)
needs_fa4 = pytest.mark.skipif(FA4_MISSING is not None, reason=f"FlashAttention-4 unavailable: {FA4_MISSING}")
AWAITING_ATTENTION_BACKEND = NO_BACKEND_YET | (NEED_FA4 if FA4_MISSING else frozenset())


def shipped_params(stems):
    """`stems` as pytest params; the attention variants that only FlashAttention-4 builds are skipped,
    with the reason, where it is not installed (`pip install -e ".[attention]"` brings it), and
    specs no backend builds yet are strict xfails."""
    def marks(stem):
        if stem in NO_BACKEND_YET:
            return [pytest.mark.xfail(reason="needs a backend that is not written yet", strict=True)]
        if stem in NEED_FA4 and FA4_MISSING:
            return [needs_fa4]
        return []
    return [pytest.param(s, marks=marks(s.removesuffix(".kspec"))) for s in stems]


def _slow_selected(config) -> bool:
    """`slow` tests run when KSPEC_SLOW_TESTS=1 or the `-m` expression names `slow` (not `not slow`)."""
    import re
    return bool(os.environ.get("KSPEC_SLOW_TESTS")) or bool(
        re.search(r"(?<!not )\bslow\b", config.getoption("markexpr") or ""))


def pytest_collection_modifyitems(config, items):
    if _slow_selected(config):
        return
    skip = pytest.mark.skip(reason="slow: select it with `-m slow` or KSPEC_SLOW_TESTS=1")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


def test_cache_root() -> Path:
    """KSPEC_TEST_CACHE_DIR, else the user's compile cache: CUTLASS kernels cost a minute each."""
    root = os.environ.get("KSPEC_TEST_CACHE_DIR") or os.environ.get("KSPEC_CACHE_DIR") or "~/.cache/kspec"
    return Path(root).expanduser()


test_cache_root.__test__ = False  # a helper, not a test


def checkout_env() -> dict[str, str]:
    """The environment for a Python subprocess that must import kspec from this checkout (and the
    tests' helpers), not from wherever kspec is installed: under a second worktree, an editable
    install of the main checkout would otherwise serve the subprocess other sources (and so other
    compile-cache keys) than the test process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def cubin_sass(cubin) -> str | None:
    """cuobjdump's SASS of a cubin; None where the toolchain or its cuobjdump is missing."""
    import subprocess

    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        return None
    if tc.cuobjdump is None:
        return None
    r = subprocess.run([str(tc.cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, env=tc.env())
    assert r.returncode == 0, r.stderr
    return r.stdout


cubin_sass.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def kernel_cache():
    from kspec.backends.build import CompileCache
    return CompileCache(test_cache_root())


@pytest.fixture(scope="session")
def compiled(tmp_path_factory, kernel_cache):
    """compiled(stem, archs=None, backend="auto") -> artifact directory of specs/<stem>.kspec; archs
    None: sm90a and sm100a, as far as the spec's `target` line allows (spec_archs)."""
    out = tmp_path_factory.mktemp("artifacts")
    done: dict = {}

    def get(stem: str, archs: tuple[str, ...] | None = None, backend: str = "auto") -> Path:
        archs = spec_archs(stem) if archs is None else archs
        key = (stem, tuple(archs), backend)
        if key not in done:
            from kspec.compile import compile_spec
            done[key] = compile_spec(SPECS / f"{stem}.kspec", tuple(archs), out / backend / "-".join(archs),
                                     cache=kernel_cache, backend=backend)
        return done[key]
    return get


def build_emitted(em, cache) -> tuple[Path, Path, float]:
    """Compile an EmittedKernel (device cubin + host glue) through the build layer and its cache;
    returns (cubin, host .so, seconds nvcc took when the entries were built)."""
    from kspec.backends.build import BuildJob, build_all
    from kspec.backends.cutlass.compat import cutlass_version
    from kspec.backends.toolchain import find_toolchain
    identity = f"nvidia-cutlass {cutlass_version()}"
    jobs = [BuildJob(f"test kernel {em.name} on {em.arch}", em.source, em.arch, kind, em.include_dirs, em.flags,
                     identity) for kind in ("cubin", "host")]
    cubin, host = build_all(jobs, find_toolchain(), cache)
    return cubin.path, host.path, cubin.compile_seconds + host.compile_seconds


def grad_artifacts(out: Path, grad_text, kernel_of, archs=("sm90a", "sm100a")):
    """get(stem, edit=None, sizes=None, name=None): the artifact of `kspec grad`'s backward of stem
    (grad_text(stem) or grad_text(stem, edit): the spec text; kernel_of(stem): its backward kernel),
    compiled once per name (default: stem) for archs, at `kspec compile --sizes` sizes, through the
    test cache."""
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    cache = CompileCache(test_cache_root())
    done = {}

    def get(stem, edit=None, sizes=None, name=None):
        name = name or stem
        if name not in done:
            spec = out / f"{name}_grad.kspec"
            spec.write_text(grad_text(stem) if edit is None else grad_text(stem, edit))
            done[name] = compile_spec(spec, archs, out / name, cache=cache, kernel=kernel_of(stem), sizes=sizes)
        return done[name]
    return get


FA4_BWD_MAIN = {"sm90a": "FlashAttentionBackwardSm90", "sm100a": "FlashAttentionBackwardSm100"}


def check_fa4_bwd_binaries(art: Path, plan, archs=("sm90a", "sm100a"), steps=None) -> None:
    """An attention backward plan's binaries are FA4's kernels in launch order on each arch (steps:
    kspec.core.ATTENTION_BWD_STEPS, or the GQA sequence: preprocess, main, then the postprocesses),
    never chosen by size, the manifest's parameter offsets the cubins' own, tensor cores and TMA loads
    in the main kernel only (skips where there is no cuobjdump)."""
    import pytest

    from kspec.core import ATTENTION_BWD_STEPS
    from kspec.runtime.cubin import read_cubin
    steps = steps or ATTENTION_BWD_STEPS
    post = "FlashAttentionBackwardPostprocess"
    for arch in archs:
        mma = {"sm90a": " HGMMA", "sm100a": " UTCHMMA"}[arch]
        b = plan.binaries[arch]
        assert [v.config["role"] for v in b.variants] == list(steps)
        assert [v.config["fa4_class"] for v in b.variants] == [
            "FlashAttentionBackwardPreprocess", FA4_BWD_MAIN[arch]] + [post] * (len(steps) - 2)
        assert all(not v.select for v in b.variants)              # never chosen by size
        for v in b.variants:
            # the manifest's parameter offsets are the cubin's own (EIATTR_KPARAM_INFO)
            k = read_cubin(art / v.cubin).kernel(v.symbol)
            base = k.params[0].offset
            assert tuple(p.offset - base for p in k.params) == tuple(
                int(x) for x in v.config["param_offsets"].split(","))
        sass = [cubin_sass(art / v.cubin) for v in b.variants]
        if sass[0] is None:
            pytest.skip("no cuobjdump")
        assert mma in sass[1] and "UTMALDG" in sass[1]            # the main kernel: tensor cores, TMA loads
        assert not any(mma in x for k, x in enumerate(sass) if k != 1)


def one_fa4_bwd_plan(sched, archs=("sm90a", "sm100a")):
    """The one plan of an attention backward's schedule: FA4's attention_bwd by the cute backend on
    every arch (no fallback), writing dQ, dK, dV."""
    (p,) = sched.plans
    assert p.kind == "attention_bwd" and set(p.writes) == {"dQ", "dK", "dV"}
    for arch in archs:
        c = p.choices[arch]
        assert c.backend == "cute" and not c.fallback
        assert FA4_BWD_MAIN[arch] in dict(c.config)["kernel"]
    return p


FAKE_ARCHS = [("sm90a", (9, 0), 132), ("sm100a", (10, 0), 148)]     # (arch, compute capability, SMs)


def fa4_fake_call(mod, kernel: str, sizes: dict, cc, sms: int, arch: str, params=None):
    """One call of `kernel` under the fake driver: (the FakeCall, the launch ABI problems found, the
    FakeDriver, for its fills).  FA4's kernels declare 1 KiB of static shared memory beside the full
    dynamic opt-in, which the fake's limit check counts against every FA4 kernel alike (see
    test_fa4_attention's _split_call): not a problem here."""
    from kspec.runtime.fakedriver import FakeDriver, check_call, fake_call
    with FakeDriver(cc, sm_count=sms) as fake:
        call = fake_call(mod, kernel, sizes, fake, params=params)
        problems = [p for p in check_call(call, arch, mod) if "static shared memory exceed" not in p]
    return call, problems, fake
