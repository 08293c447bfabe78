"""Nothing launches on a bad call (issue 27, item 3): for compiled shipped specs, on the fake
driver, every bad argument — wrong dtype, rank, shape, strides, alignment, aliasing, extents past
the launch grid's limits and 32 bits, bad varlen offsets — is a KspecRuntimeError naming the argument, and
no kernel is launched."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import SHIPPED, needs_fa4, shipped_params, spec_archs
from test_cute_backend import needs_dsl

import kspec
from kspec.artifact import layout_strides
from kspec.core import ARCH_TABLE, KspecRuntimeError, extent_value, is_int
from kspec.runtime import dtypes
from kspec.runtime.fakedriver import FakeDriver, _packed_offsets, fake_call
from kspec.runtime.tensors import DeviceBuffer
from kspec.selftest import call_sizes

ARCH = ("sm90a",)
SIZES = {"M": 64, "N": 64, "K": 64, "V": 64, "B": 2, "H": 4, "KH": 1, "S": 16, "T": 16, "L": 2, "G": 1, "P": 16}


def _sizes(k) -> dict[str, int]:
    """SIZES (8 for a symbol it does not name) with what kernel entry k's artifact declares it needs:
    whole blocks of a block-scale quotient, a plan's size multiples, aligned row pitches."""
    return call_sizes(k, SIZES, default=8)


def _good_args(mod, name: str, fake: FakeDriver, sizes: dict[str, int]) -> dict:
    """Inputs and outputs in their declared layouts at `sizes` (valid offsets for packed batches),
    checked to launch."""
    k = mod[name].entry
    sizes = dict(sizes)
    offsets = _packed_offsets(k, sizes)
    args: dict = {}
    for t in (*k.inputs, *k.outputs):
        shape = tuple(extent_value(e, sizes) for e in t.shape)
        args[t.name] = _buffer(fake, shape, t.dtype, layout_strides(shape, t.layout))
        if t.name in offsets:
            fake.upload(args[t.name].ptr, offsets[t.name].tobytes())
    before = len(fake.launches)
    mod[name](**args)
    assert len(fake.launches) > before, f"{name}: the good call launched nothing"
    return args


def _buffer(fake, shape, dtype, strides=None, offset=0) -> DeviceBuffer:
    strides = strides or layout_strides(tuple(shape), "row")
    n = (sum((a - 1) * s for a, s in zip(shape, strides)) + 1) * dtypes.itemsize(dtype) if all(shape) else 1
    return DeviceBuffer(fake.alloc(n + 64) + offset, shape, dtypes.storage(dtype), strides=strides)


def _bad_cases(k, sizes):
    """(label, argument it names, function(args, fake) -> args) for this kernel's signature."""
    cases = []
    ins = [t for t in k.inputs if not is_int(t.dtype)] or list(k.inputs)
    t = ins[0]
    shape = tuple(extent_value(e, sizes) for e in t.shape)
    other = "f16" if dtypes.storage(t.dtype) == "f32" else "f32"
    cases.append(("dtype", t.name, lambda a, f: {**a, t.name: _buffer(f, shape, other)}))
    cases.append(("rank", t.name, lambda a, f: {**a, t.name: _buffer(f, (*shape, 1), t.dtype)}))
    if len(shape) >= 2:
        wide = layout_strides(shape, t.layout)
        inner = min(range(len(wide)), key=lambda i: wide[i])
        bad = tuple(s * 2 if i == inner else s * 2 for i, s in enumerate(wide))
        cases.append(("strides", t.name, lambda a, f: {**a, t.name: _buffer(f, shape, t.dtype, bad)}))
    o = k.outputs[0]
    oshape = tuple(extent_value(e, sizes) for e in o.shape)
    cases.append(("shape", o.name, lambda a, f: {**a, o.name: _buffer(f, (oshape[0] + 1, *oshape[1:]), o.dtype,
                                                                      layout_strides((oshape[0] + 1, *oshape[1:]),
                                                                                     o.layout))}))
    align = max((p.alignment.get(t.name, 1) for p in k.plans), default=1)
    if align > 1:
        cases.append(("alignment", t.name,
                      lambda a, f: {**a, t.name: _buffer(f, shape, t.dtype, layout_strides(shape, t.layout),
                                                         offset=align // 2)}))
    same = [x for x in k.inputs if x.dtype == o.dtype and tuple(extent_value(e, sizes) for e in x.shape) == oshape
            and x.layout == o.layout]
    if same:
        x = same[0]
        cases.append(("aliasing", o.name, lambda a, f: {**a, o.name: a[x.name]}))
    return cases


def _refuses(mod, name, args, fake, match: str):
    before = len(fake.launches)
    with pytest.raises(KspecRuntimeError) as e:
        mod[name](**args)
    assert match in str(e.value), str(e.value)
    assert len(fake.launches) == before, f"{name}: launched on a bad call: {e.value}"
    return str(e.value)


def _table(art):
    mod = kspec.load(art)
    cc = ARCH_TABLE[mod.archs[0]].cc
    for k in mod.manifest.kernels:
        sizes = _sizes(k)
        _packed_offsets(k, sizes)          # (the row counts of packed batches)
        with FakeDriver((cc // 10, cc % 10), sm_count=132) as fake:
            good = _good_args(mod, k.name, fake, sizes)
            for label, arg, bad in _bad_cases(k, sizes):
                _refuses(mod, k.name, bad(good, fake), fake, f"'{arg}'")


FEW = ["rmsnorm", "cross_entropy", "gemm_bias_relu", "attention"]


@needs_dsl
@pytest.mark.cute
@pytest.mark.nvcc
@pytest.mark.parametrize("stem", FEW)
def test_bad_arguments_never_launch(compiled, stem):
    _table(compiled(stem, spec_archs(stem, ARCH)))


@needs_dsl
@pytest.mark.slow
@pytest.mark.cute
@pytest.mark.nvcc
@pytest.mark.parametrize("stem", shipped_params(sorted(set(SHIPPED) - set(FEW))))
def test_bad_arguments_never_launch_for_every_shipped_spec(compiled, stem):
    _table(compiled(stem, spec_archs(stem, ARCH)))     # sm90a, unless the spec targets other archs only


@needs_dsl
@pytest.mark.cute
@pytest.mark.nvcc
def test_an_odd_bf16_row_pointer_is_refused(compiled):
    """Row kernels read their rows element by element or with 16-byte vectors: a bf16 row at an
    odd address is neither, and is refused, not launched."""
    mod = kspec.load(compiled("rmsnorm", ARCH))
    (plan,) = mod.manifest.kernels[0].plans
    assert plan.alignment == {"x": 2, "w": 2, "y": 2}
    with FakeDriver((9, 0), sm_count=132) as fake:
        args = _good_args(mod, "rmsnorm", fake, {"M": 64, "N": 64})
        args["x"] = _buffer(fake, (64, 64), "bf16", offset=1)
        _refuses(mod, "rmsnorm", args, fake, "'x': data pointer")


@needs_dsl
@pytest.mark.cute
def test_attention_beyond_the_grid_limit_is_refused_by_name(compiled):
    # FlashAttention-4's kernel (the CuTe DSL backend) where it is installed: its glue prepares the grid
    # and the runtime refuses it; else the CUTLASS FMHA kernel, whose glue refuses the sizes itself
    mod = kspec.load(compiled("attention", ARCH))
    (plan,) = mod.manifest.kernels[0].plans
    backend = plan.binaries["sm90a"].backend
    assert backend in ("cute", "cutlass"), backend
    with FakeDriver((9, 0), sm_count=132) as fake:
        for B, H in ((65536, 1), (1, 65536)):
            args = {n: _buffer(fake, (B, H, 1, 128), "f16") for n in ("Q", "K", "V", "O")}
            if backend == "cute":
                msg = _refuses(mod, "attention", args, fake, "beyond CUDA's limit of 65,535 blocks")
                assert f"B={B}" in msg or f"{B * H}" in msg, msg
            else:
                msg = _refuses(mod, "attention", args, fake, f"B = {B} and H = {H} must both be <= 65535 (grid limit)")
            assert "attention_0" in msg, msg
        # at the limit: launches (CUTLASS's sm90a kernel takes whole tiles of 8 queries)
        S = 1 if backend == "cute" else 8
        fake_call(mod, "attention", {"B": 65535, "H": 1, "S": S, "T": S}, fake)


@needs_fa4
@needs_dsl
@pytest.mark.cute
def test_varlen_offsets_must_start_at_zero(compiled):
    mod = kspec.load(compiled("attention_varlen", ARCH))
    with FakeDriver((9, 0), sm_count=132) as fake:
        args = _good_args(mod, "attention_varlen", fake, {"B": 2, "H": 2, "cu_q_rows": 32, "cu_k_rows": 32})
        for name, offsets, match in (("cu_q", [1, 16, 32], "first offset cu_q[0] = 1 must be 0"),
                                     ("cu_k", [0, 20, 16], "less than"),
                                     ("cu_q", [0, 16, 30], "last offset"),
                                     ("cu_k", [0, 16, 40], "out of range")):
            cu = _buffer(fake, (3,), "i32")
            fake.upload(cu.ptr, np.asarray(offsets, dtype=np.int32).tobytes())
            _refuses(mod, "attention_varlen", {**args, name: cu}, fake, match)


@needs_dsl
@pytest.mark.nvcc
def test_row_counts_past_the_launch_limits_are_refused_by_the_glue(compiled):
    """Extents that need no memory to test: the row kernel's host glue sizes its grid at the 32-bit
    limit of grid x and refuses past it (the runtime prepares every plan before any launch, so the
    refusal comes before anything is queued)."""
    from kspec.runtime.module import GRID_MAX
    mod = kspec.load(compiled("rmsnorm", ARCH))
    k = mod.manifest.kernels[0]
    (plan,) = k.plans

    def dims(sizes):
        out = []
        for role, ext in plan.dims:
            if role in plan.strides:
                t, axis = plan.strides[role]
                spec = k.tensor(t)
                out.append(layout_strides(tuple(extent_value(e, sizes) for e in spec.shape), spec.layout)[axis])
            else:
                out.append(extent_value(ext, sizes))
        return out
    glue = mod.glue(plan, "sm90a")
    ptrs = [0x7F0000000000 + i * 2**40 for i in range(len(plan.args))]
    pr = glue.prepare(dims({"M": 2**31, "N": 8}), ptrs, [1e-6], 0, 0, 132)
    assert 0 < pr.grid[0] <= GRID_MAX[0] and pr.grid[1:] == (1, 1)
    with pytest.raises(KspecRuntimeError, match="rmsnorm_0.*too many rows for one launch"):
        glue.prepare(dims({"M": 2**40, "N": 8}), ptrs, [1e-6], 0, 0, 132)


def test_non_portable_cluster_launch_refused_by_the_runtime():
    """Issue 22 item 4, the runtime's side: kspec never sets CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
    so a prepared launch with more than 8 CTAs per cluster (an artifact from before the plan-time rule)
    is refused by name instead of failing in cuLaunchKernelEx; 8 CTAs still launch."""
    from types import SimpleNamespace
    from kspec.runtime.module import _check_launch_shape
    plan = SimpleNamespace(id="gemm_0", dims=(("M", None), ("N", None)))
    ok = SimpleNamespace(grid=(8, 4, 1), block=(384, 1, 1), cluster=(4, 2, 1))
    _check_launch_shape(ok, plan, "sm100a", [1024, 512])
    bad = SimpleNamespace(grid=(8, 4, 1), block=(384, 1, 1), cluster=(4, 4, 1))
    with pytest.raises(KspecRuntimeError, match=r"a cluster of \(4, 4, 1\) .* CUDA cannot launch"):
        _check_launch_shape(bad, plan, "sm100a", [1024, 512])


@needs_dsl
@pytest.mark.cute
def test_gemm_extents_past_32_bits_are_refused_by_the_glue(compiled):
    """The CuTe DSL GEMM's glue takes every extent up to INT32_MAX (its grid is persistent: at most
    the SM count; 2**31 - 8 keeps 16-byte TMA rows) and refuses one past it by name, before anything
    is queued."""
    from kspec.runtime.module import GRID_MAX
    mod = kspec.load(compiled("gemm_bias_relu", ARCH))
    (plan,) = mod.manifest.kernels[0].plans
    glue = mod.glue(plan, "sm90a")
    ptrs = [0x7F0000000000 + i * 2**40 for i in range(len(plan.args))]
    scalars = [1.0] * len(plan.scalars)
    for role in ("M", "N", "K"):
        dims = [{role: 2**31 - 8}.get(r, 64) if isinstance(e, str) else e for r, e in plan.dims]
        pr = glue.prepare(dims, ptrs, scalars, 0, 0, 132)
        assert all(0 < g <= m for g, m in zip(pr.grid, GRID_MAX)) and pr.grid[0] * pr.grid[1] * pr.grid[2] <= 132
        dims = [{role: 2**31}.get(r, 64) if isinstance(e, str) else e for r, e in plan.dims]
        with pytest.raises(KspecRuntimeError, match=f"gemm_bias_relu_0.*sizes must fit in 32 bits.*{role}=2147483648"):
            glue.prepare(dims, ptrs, scalars, 0, 0, 132)


@pytest.mark.nvcc
@pytest.mark.parametrize("stem", ["gemm_bias_relu", "cross_entropy", "attention", "gemm_rowmax"])
def test_reductions_over_nothing_are_refused_before_any_launch(compiled, stem):
    """Issue 22 item 3: a size that only inputs have (K of a GEMM, the vocabulary of a cross-entropy,
    T of attention) at 0 with the outputs not empty would make every output value a reduction over
    nothing: refused by name on the fake driver with zero launches, for every backend's kernel
    (the rule is the runtime's, before any plan).  The language defines the values (the reference
    computes a GEMM's D at K = 0 as its epilogue of a zero accumulator, a max over nothing as -inf).
    An empty output (M = 0) is no error: nothing is launched."""
    mod = kspec.load(compiled(stem, ARCH))
    k = mod.manifest.kernels[0]
    out_syms = {e for t in k.outputs for e in t.shape if isinstance(e, str)}
    reduced = sorted({e for t in k.inputs for e in t.shape if isinstance(e, str)} - out_syms)
    assert reduced, f"{stem}: no size that only inputs have"
    for sym in reduced:
        sizes = {**_sizes(k), sym: 0}
        with FakeDriver((9, 0), sm_count=132) as fake:
            args = {}
            for t in (*k.inputs, *k.outputs):
                shape = tuple(extent_value(e, sizes) for e in t.shape)
                args[t.name] = _buffer(fake, shape, t.dtype, layout_strides(shape, t.layout))
            msg = _refuses(mod, k.name, args, fake, f"{sym} = 0")
            assert f"kernel '{k.name}'" in msg and "reductions over nothing" in msg, msg
            assert fake.launches == [] and fake.fills == []
    # an empty output launches nothing and is no error
    first = sorted(out_syms)[0]
    with FakeDriver((9, 0), sm_count=132) as fake:
        sizes = {**_sizes(k), first: 0}
        args = {}
        for t in k.inputs:
            shape = tuple(extent_value(e, sizes) for e in t.shape)
            args[t.name] = _buffer(fake, shape, t.dtype, layout_strides(shape, t.layout))
        mod[k.name](**args)
        assert fake.launches == []


def test_the_reference_defines_gemms_and_maxima_over_nothing():
    """What the kernels refuse (K = 0), the language defines: the reference gives a GEMM's epilogue
    of a zero accumulator, and a max over nothing is -inf (as logsumexp's), against numpy."""
    from conftest import SPECS
    bias = np.linspace(-2, 2, 16).astype(np.float16)
    A, B = np.zeros((5, 0), np.float16), np.zeros((0, 16), np.float16)
    got = kspec.reference(SPECS / "gemm_bias_relu.kspec")(A=A, B=B, bias=bias)["D"]
    np.testing.assert_array_equal(got, np.broadcast_to(np.maximum(bias, 0), (5, 16)))
    out = kspec.reference(SPECS / "gemm_rowmax.kspec")(A=A, B=B, bias=bias.astype(np.float32))
    np.testing.assert_array_equal(out["rowmax"], np.full(5, bias.max(), np.float32))
    r = kspec.reference("kernel k {\n  in x : f32[M, N]\n  out y : f32[M]\n  out z : f32[M]\n"
                        "  y[m] = max(n) x[m, n]\n  z[m] = min(n) x[m, n]\n}\n")
    o = r(x=np.zeros((3, 0), np.float32))
    assert (o["y"] == -np.inf).all() and (o["z"] == np.inf).all()
