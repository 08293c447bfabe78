"""Structural fuzzer for the planner: random valid spec TEXT (DAGs of contractions, elementwise maps,
reductions, softmax, literals, params, casts and broadcasts) goes through the parser and checker,
then through planning fused and unfused, the numpy reference and lowering for both archs.

Per case: no internal error anywhere; every operator node in exactly one group and groups in
dependency order (fused and unfused); the fused and the unfused reference agree bit for bit (the
reference rounds per node, so fusion must not change a single value); a kernel no backend builds
is refused at planning with a located `KspecError` (as `kspec graph` refuses it), and every plan
that is planned lowers and emits on the backend it names, for sm90a and sm100a (what `kspec graph`
prints is what `kspec compile` builds: a refusal after planning fails the case).

The default run covers `N_DEFAULT` seeds in a few seconds; `-m slow` runs `N_SLOW` (run this file
directly, `python tests/test_fusion_fuzz.py [N]`, to see timings and the mix of outcomes).
"""
from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter

import numpy as np
import pytest

from kspec.backends import registry
from kspec.backends.registry import Planner
from kspec.backends.reference import ReferenceKernel
from kspec.compiler import cost, plan_kernel
from kspec.compiler.fusion import is_operator
from kspec.compiler.graph import op
from kspec.compiler.report import format_cost, format_plan
from kspec.spec_lang import KspecError, KspecInternalError, load_spec


SEED = 20261203
N_DEFAULT = 100
N_SLOW = 2500
N_SLOW_EMIT = 60
ARCHS = ("sm90a", "sm100a")
LABELS = {"i": "I", "j": "J", "k": "K", "l": "L", "b": "B", "h": "H", "s": "S", "t": "T", "e": "E", "n": "N"}
RANDOM_LABELS = ("i", "j", "k", "l")
UNARY = ("relu", "tanh", "sigmoid", "silu", "gelu", "gelu_tanh", "abs", "exp")
LITERALS = ("0.5", "2.0", "0.125", "1.0", "3.0")


class _Spec:
    """A random kernel built statement by statement; `text()` renders it."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.inputs: list[tuple[str, str, tuple[str, ...], str]] = []   # name, dtype, labels, layout
        self.params: list[tuple[str, str]] = []
        self.tensors: list[tuple[str, tuple[str, ...]]] = []            # readable: name, labels
        self.stmts: list[str] = []
        self.outputs: list[tuple[str, str, tuple[str, ...]]] = []
        self.dtypes = (rng.choice(("f16", "bf16")), "f32")   # f16 and bf16 do not mix without casts
        self.bound: set = set()                               # labels reduced in the current statement
        self.extent = dict(LABELS)                            # label -> size symbol (or literal)

    def build(self) -> _Spec:
        rng = self.rng
        labels = list(RANDOM_LABELS)
        if rng.random() < 0.35:
            rng.choice((self.attention, self.linear, self.mlp))()
        for i in range(rng.randint(2, 4)):
            rank = rng.choice((1, 2, 2, 2, 3))
            axes = tuple(rng.sample(labels, rank))
            layout = "col" if rank == 2 and rng.random() < 0.2 else "row"
            self.inputs.append((f"X{i}", rng.choice(self.dtypes), axes, layout))
            self.tensors.append((f"X{i}", axes))
        for i in range(rng.randint(0, 2)):
            self.params.append((f"p{i}", rng.choice(LITERALS)))
        n_stmts = rng.randint(0 if self.outputs else 1, 4)
        for s in range(n_stmts):
            for _ in range(20):
                self.bound = set()
                expr, free = self.expr(rng.randint(1, 3))
                if free and not self.bound & set(free):
                    break       # (a statement's value needs indices; a reduced index cannot stay free)
            else:
                continue
            lhs = list(free)
            rng.shuffle(lhs)
            name = f"t{s}"
            is_out = s == n_stmts - 1 or rng.random() < 0.25
            dtype = rng.choice(self.dtypes)
            if is_out:
                self.outputs.append((name, dtype, tuple(lhs)))
                self.stmts.append(f"{name}[{', '.join(lhs)}] = {expr}")
            else:
                ann = f" : {dtype}" if rng.random() < 0.5 else ""
                self.stmts.append(f"{name}[{', '.join(lhs)}]{ann} = {expr}")
            self.tensors.append((name, tuple(lhs)))
        return self

    # ---- motifs: the shapes of real inference kernels, with random variations
    def _input(self, name, axes, dtype=None, layout="row"):
        self.inputs.append((name, dtype or self.dtypes[0], tuple(axes), layout))
        self.tensors.append((name, tuple(axes)))

    def _scale(self) -> str:
        if self.rng.random() < 0.5:
            self.params.append(("sc", self.rng.choice(LITERALS)))
            return "sc"
        return self.rng.choice(LITERALS)

    def attention(self):
        rng = self.rng
        mqa = rng.random() < 0.25
        if rng.random() < 0.5:
            self.extent["e"] = "64"         # a literal head dim: the fused attention kernel can take it
        kv = ("b", "t", "e") if mqa else ("b", "h", "t", "e")
        self._input("Q", ("b", "h", "s", "e"))
        self._input("K", kv)
        self._input("V", kv)
        kvi = ", ".join(kv)
        kk, vv = f"K[{kvi}]".replace("t", "j"), f"V[{kvi}]".replace("t", "j")
        qk = f"Q[b, h, i, e] * {kk}"
        sc = self._scale()
        where = rng.choice(("before", "inside", "div"))
        score = {"before": f"{sc} * sum(e) {qk}", "inside": f"sum(e) {qk} * {sc}",
                 "div": f"sum(e) {qk} / {sc}"}[where]
        if rng.random() < 0.25:
            self._input("mask", ("b", "t"), "f32")
            score = f"{score} + mask[b, j]"
        self.stmts.append(f"sc0[b, h, i, j] : f32 = {score}")
        ann = f" : {rng.choice((self.dtypes[0], 'f32'))}" if rng.random() < 0.5 else ""
        self.stmts.append(f"pr[b, h, i, j]{ann} = softmax(j) sc0[b, h, i, j]")
        self.stmts.append(f"O[b, h, i, e] = sum(j) pr[b, h, i, j] * {vv}")
        self.outputs.append(("O", self.dtypes[0], ("b", "h", "s", "e")))
        self.tensors.append(("O", ("b", "h", "s", "e")))

    def linear(self):
        rng = self.rng
        self._input("Xl", ("b", "s", "k"))
        self._input("Wl", ("n", "k") if rng.random() < 0.8 else ("k", "n"))
        w = "Wl[n, k]" if self.inputs[-1][2] == ("n", "k") else "Wl[k, n]"
        body = f"sum(k) Xl[b, s, k] * {w}"
        if rng.random() < 0.5:
            self._input("bl", ("n",), rng.choice(self.dtypes))
            body = f"{body} + {rng.choice(('', 'f32'))}(bl[n])"
        if rng.random() < 0.5:
            body = f"{rng.choice(UNARY)}({body})"
        self.stmts.append(f"Yl[b, s, n] = {body}")
        self.outputs.append(("Yl", self.dtypes[0], ("b", "s", "n")))
        self.tensors.append(("Yl", ("b", "s", "n")))

    def mlp(self):
        rng = self.rng
        self._input("Xm", ("s", "k"))
        self._input("W1", ("e", "k"))
        self._input("W2", ("n", "e"))
        if rng.random() < 0.5:
            self._input("W3", ("e", "k"))
            hid = "silu(sum(k) Xm[s, k] * W1[e, k]) * sum(k) Xm[s, k] * W3[e, k]"
        else:
            hid = f"{rng.choice(UNARY)}({self._scale()} * sum(k) Xm[s, k] * W1[e, k])"
        self.stmts.append(f"hm[s, e] : {self.dtypes[0]} = {hid}")
        self.stmts.append("Ym[s, n] = sum(e) hm[s, e] * W2[n, e]")
        self.outputs.append(("Ym", self.dtypes[0], ("s", "n")))
        self.tensors.append(("Ym", ("s", "n")))

    # ---- expressions: (text, free labels in order of first appearance)
    def access(self) -> tuple[str, tuple[str, ...]]:
        name, axes = self.rng.choice(self.tensors)
        return f"{name}[{', '.join(axes)}]" if axes else f"{name}[]", axes

    def expr(self, depth: int) -> tuple[str, tuple[str, ...]]:
        rng = self.rng
        if depth <= 0:
            r = rng.random()
            if r < 0.75:
                return self.access()
            if r < 0.88 and self.params:
                return rng.choice(self.params)[0], ()
            return rng.choice(LITERALS), ()
        kind = rng.choices(("leaf", "unary", "binary", "cast", "reduce", "contract", "softmax", "minmax"),
                           (2, 2, 4, 1.5, 1.5, 3, 1, 1))[0]
        if kind == "leaf":
            return self.expr(0)
        if kind == "unary":
            x, f = self.expr(depth - 1)
            if rng.random() < 0.15:
                return f"(-{x})", f
            return f"{rng.choice(UNARY)}({x})", f
        if kind == "binary":
            (a, fa), (b, fb) = self.expr(depth - 1), self.expr(depth - 1)
            return f"({a} {rng.choice('+-*/')} {b})", _union(fa, fb)
        if kind == "cast":
            x, f = self.expr(depth - 1)
            return f"{rng.choice(self.dtypes)}({x})", f
        if kind == "minmax":
            (a, fa), (b, fb) = self.expr(depth - 1), self.expr(depth - 1)
            if rng.random() < 0.3:
                return f"clamp({a}, -1.0, 2.0)", fa
            return f"{rng.choice(('maximum', 'minimum'))}({a}, {b})", _union(fa, fb)
        if kind == "reduce":
            x, f = self.expr(depth - 1)
            if not f:
                return x, f
            axis = rng.choice(f)
            self.bound.add(axis)
            return f"({rng.choice(('sum', 'max', 'min', 'mean'))}({axis}) ({x}))", tuple(a for a in f if a != axis)
        if kind == "softmax":
            x, f = self.expr(depth - 1)
            if not f:
                return x, f
            return f"(softmax({rng.choice(f)}) ({x}))", f
        # a contraction of two accesses over a shared label, maybe with scalar or vector factors
        for _ in range(6):
            (a, fa), (b, fb) = self.access(), self.access()
            shared = [x for x in fa if x in fb]
            if shared:
                break
        else:
            return self.expr(depth - 1)
        red = rng.sample(shared, 1 if len(shared) == 1 or rng.random() < 0.8 else 2)
        self.bound |= set(red)
        factors = [a, b]
        if rng.random() < 0.35:
            factors.append(rng.choice([p for p, _ in self.params] + list(LITERALS)))
        if rng.random() < 0.1:
            c, fc = self.access()
            if not set(fc) & set(red):
                factors.append(c)
                fb = _union(fb, fc)
        rng.shuffle(factors)
        free = tuple(x for x in _union(fa, fb) if x not in red)
        return f"(sum({', '.join(red)}) {' * '.join(factors)})", free

    def text(self) -> str:
        lines = ["kernel fz {"]
        for name, default in self.params:
            lines.append(f"  param {name} : f32 = {default}")
        for name, dtype, axes, layout in self.inputs:
            lay = " col" if layout == "col" else ""
            lines.append(f"  in {name} : {dtype}[{', '.join(self.extent[a] for a in axes)}]{lay}")
        for name, dtype, axes in self.outputs:
            shape = f"[{', '.join(self.extent[a] for a in axes)}]" if axes else ""
            lines.append(f"  out {name} : {dtype}{shape}")
        lines += [f"  {s}" for s in self.stmts]
        lines.append("}")
        return "\n".join(lines) + "\n"


def _union(a: tuple, b: tuple) -> tuple:
    return tuple(dict.fromkeys(a + b))


def random_spec(seed: int) -> str:
    return _Spec(random.Random(seed)).build().text()


def check_plan(sched) -> None:
    """Every operator node in exactly one group; a group only reads groups that run before it."""
    g = sched.graph
    where: dict = {}
    for i, p in enumerate(sched.plans):
        for n in p.group.nodes:
            assert n not in where, f"node {n} ({op(g, n).label()}) is in two kernels"
            where[n] = i
    missing = {n for n in g if is_operator(g, n)} - set(where)
    assert not missing, f"operator nodes in no kernel: {[op(g, n).label() for n in missing]}"
    for u, v in g.edges:
        if u in where and v in where:
            assert where[u] <= where[v], f"kernel {where[v]} reads {op(g, u).label()} from later kernel {where[u]}"
    written: set = set()
    for p in sched.plans:
        for b in p.reads:
            assert sched.buffers[b].kind in ("input", "param") or b in written, f"{p.id} reads {b} before it is written"
        written |= set(p.writes)
    assert {t.name for t in sched.kernel.outputs} <= written, "an output is never written"


def _arrays(kernel, rng: np.random.Generator) -> dict:
    from kspec.numerics import to_storage
    sizes = {s: int(rng.integers(2, 5)) for s in LABELS.values()}
    out = {}
    for t in kernel.inputs:
        shape = tuple(d if isinstance(d, int) else sizes[d] for d in t.shape)
        out[t.name] = to_storage(rng.standard_normal(shape).astype(np.float32), t.dtype)
    return out


def run_case(seed: int, emit_all: bool = False) -> str:
    """One fuzz case; returns its outcome ("rejected" by the checker, "ok", or "ok+refused" when no
    backend builds the kernel and planning refuses it with a located error).  Raises on any violation."""
    text = random_spec(seed)
    try:
        prog = load_spec(text, is_text=True)
    except KspecError:
        return "rejected"
    kernel = prog.kernels[0]
    try:
        fused = plan_kernel(kernel, ARCHS)
        flat = plan_kernel(kernel, ARCHS, fuse_ops=False)
        check_plan(fused)
        check_plan(flat)
        args = _arrays(kernel, np.random.default_rng(seed))
        with np.errstate(all="ignore"):
            a = ReferenceKernel(kernel, True)(**args)
            b = ReferenceKernel(kernel, False)(**args)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
            assert a[name].tobytes() == b[name].tobytes(), f"fused and unfused reference differ in {name}"
        try:
            compiled = plan_kernel(kernel, ARCHS, Planner())    # what `kspec compile` plans
        except KspecError as e:
            # a kernel no backend can build (e.g. a loop GEMM with an epilogue reduction): located
            assert e.span is not None or e.message.startswith("kernel "), f"unlocated: {e.message}"
            return "ok+refused"
        check_plan(compiled)
        for sched in (compiled, flat):                                   # what `kspec graph` prints
            c = cost(sched, {})
            assert c.fused_bytes >= c.ideal_bytes > 0 or not sched.plans
            format_plan(sched)
            format_cost(c)
        for p in compiled.plans:
            for arch in ARCHS:
                # graph == compile: the backend the plan names lowers and emits it (a refusal here
                # would be an error `kspec graph` never showed: a planning bug)
                backend = registry.get(p.choices[arch].backend)
                lp = backend.lower(p.ir, arch)
                if emit_all or backend.name in ("generic", "rowwise", "cute"):
                    backend.emit(lp)                # (CUTLASS emission costs ~0.5 s a kernel: sampled)
    except (AssertionError, KspecInternalError, Exception) as e:
        raise AssertionError(f"fuzz case {seed} failed: {type(e).__name__}: {e}\n{text}") from e
    return "ok"


def test_generator_makes_mostly_valid_specs():
    outcomes = Counter(run_case(SEED + i) for i in range(40))
    assert outcomes["rejected"] < 20, outcomes


@pytest.mark.parametrize("block", range(4))
def test_fuzz_default(block):
    per = N_DEFAULT // 4
    for i in range(block * per, (block + 1) * per):
        run_case(SEED + i)


@pytest.mark.slow
def test_fuzz_slow(request):
    if "slow" not in (request.config.getoption("-m") or "") and not os.environ.get("KSPEC_SLOW_TESTS"):
        pytest.skip("the long fuzz run: select it with `-m slow` or KSPEC_SLOW_TESTS=1")
    outcomes = Counter(run_case(SEED + 10_000 + i) for i in range(N_SLOW))
    assert outcomes["ok"] + outcomes["ok+refused"] >= N_SLOW // 2, outcomes


@pytest.mark.slow
def test_fuzz_slow_emits_every_kernel(request):
    """A sample whose every plan is emitted (CUTLASS C++ through cutlass_cppgen too), as `kspec
    compile` does before nvcc runs."""
    if "slow" not in (request.config.getoption("-m") or "") and not os.environ.get("KSPEC_SLOW_TESTS"):
        pytest.skip("the long fuzz run: select it with `-m slow` or KSPEC_SLOW_TESTS=1")
    for i in range(N_SLOW_EMIT):
        run_case(SEED + 50_000 + i, emit_all=True)


# fuzz case 20272444 (the slow run): a column reduction (the mean over k of a dot product over i)
# that is also stored to an aliasing output, `t2[l] = t1[l]`: one reduction node, two stores
ALIASED_COLUMN_SUM = """
kernel fz {
  param p0 : f32 = 3.0
  in X0 : f16[L]
  in X1 : f16[K, I, L]
  out t0 : f32[I, K]
  out t1 : f32[L]
  out t2 : f32[L]
  t0[i, k] = (sum(l) 2.0 * X0[l] * X1[k, i, l])
  t1[l] = (mean(k) ((sum(i) t0[i, k] * X1[k, i, l] * 3.0)))
  t2[l] = t1[l]
}
"""


def test_column_reduction_stored_to_two_outputs(tmp_path):
    """The generic backend's column kernel stores its reduction to every buffer that holds it (it
    unpacked exactly one store: `too many values to unpack`); each output is zeroed and added to
    atomically, and on the CPU emulation of the kernel both equal numpy."""
    from generic_emu import emulate
    from kspec.compile import emit_spec
    assert run_case(20272444, emit_all=True) == "ok"
    path = tmp_path / "fz.kspec"
    path.write_text(ALIASED_COLUMN_SUM)
    em = emit_spec(path, ARCHS)
    (col,) = [eps for eps in em.plans.values() if len(eps[0].emitted.init) == 2]
    for ep in col:
        names = ep.lowered.names
        assert {names[x] for x, _ in ep.emitted.init} == {"t1", "t2"}
        assert ep.emitted.source.count("atomicAdd(") == 2
    sizes = {"I": 3, "K": 600, "L": 45}          # 2 column blocks; the 600 rows split over CTAs
    ep = col[0]
    arrays, names, grid, _ = emulate(ep, sizes, np.random.default_rng(5), tmp_path,
                                     scalars=(3.0,) * len(ep.lowered.scalars))
    zeroed = {names[x] for x, _ in ep.emitted.init}
    assert grid == 6                             # 2 column blocks x 3 row splits: partials added atomically
    # what the kernel reads: the dot product over i (an earlier kernel's [K, L] result)
    (x,) = [arrays[n] for n in arrays if n not in zeroed]
    assert x.shape == (sizes["K"], sizes["L"])
    want = 3.0 * x.astype(np.float64).mean(axis=0)
    for out in ("t1", "t2"):
        np.testing.assert_allclose(arrays[out], want, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else N_DEFAULT
    t0 = time.perf_counter()
    outcomes = Counter(run_case(SEED + 10_000 + i) for i in range(n))
    print(f"{n} cases in {time.perf_counter() - t0:.1f} s: {dict(outcomes)}")
