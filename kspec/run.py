"""`kspec run` on a GPU: compile (or load) an artifact, run each kernel on random inputs and compare
every output with the numpy reference backend.  (A CLI command, not part of the lean runtime: it
needs the spec language and the reference backend, imported when it runs.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kspec.core import DEFAULT_OUT_DIR, KspecError, select_archs

# max |gpu - ref| / max(1, max |ref|) allowed per output dtype (the reference rounds per node, the
# GPU keeps epilogue values in registers and accumulates in a different order)
TOLERANCE = {"f32": 2e-3, "tf32": 2e-3, "f16": 1e-2, "bf16": 3e-2, "f8e4m3": 1.3e-1, "f8e5m2": 2.6e-1,
             "i8": 0.0, "i32": 0.0}


def relative_error(got, ref) -> float:
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(r)
    if not np.array_equal(np.isfinite(g), finite):
        return float("inf")
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(g[finite] - r[finite])) / max(1.0, float(np.max(np.abs(r[finite])))))


def run_on_gpu(args, sizes: dict[str, int]) -> int:
    from kspec.backends.reference import reference
    from kspec.runtime import cuda_available, from_device, load
    from kspec.spec_lang import load_spec

    ok, why = cuda_available()
    if not ok:
        raise KspecError(f"no CUDA device: {why}",
                         hint="use `kspec run FILE --reference` to run the numpy reference on the CPU")
    path = Path(args.file)
    if path.is_dir():
        artifact = path
        specs = list(path.glob("*.kspec"))
        if not specs:
            raise KspecError(f"{path} holds no copy of its spec, so there is no reference to compare with")
        spec_path = specs[0]
    else:
        from kspec.compile import Progress, compile_spec
        spec_path = path
        artifact = compile_spec(path, select_archs(args.arch, load_spec(path).targets), args.output or DEFAULT_OUT_DIR, args.kernel,
                                progress=Progress())
    program = load_spec(spec_path)
    mod = load(artifact)
    status = 0
    for name in mod.kernels:
        if args.kernel and name != args.kernel:
            continue
        k = program.kernel(name)
        host = random_inputs(k, sizes, args.seed)
        want = reference(program, name)(**host)
        kernel = getattr(mod, name)
        got = kernel(**kernel.to_device(**host))       # each input in its spec's layout
        print(f"kernel {name}:")
        for out in k.outputs:
            err = relative_error(from_device(got[out.name]), want[out.name])
            tol = TOLERANCE[out.dtype]
            verdict = "ok" if err <= tol else "MISMATCH"
            if err > tol:
                status = 1
            print(f"  {out.name}: max relative error {err:.3g} (tolerance {tol:g}) {verdict}")
    return status


def random_inputs(kernel, sizes: dict[str, int], seed: int = 0) -> dict:
    """Random arrays for every input of a kernel, at the given symbol sizes (default 64)."""
    import numpy as np

    from kspec.numerics import is_int, to_storage
    from kspec.core import split_offset_dim, split_quotient_dim
    from kspec.spec_lang.check import index_bounds
    rng = np.random.default_rng(seed)
    out = {}
    fixed = dict(kernel.bindings)
    bounds = index_bounds(kernel)       # subscript tensors get valid indices
    # a quotient dimension `K / 128` needs K a multiple of 128: round such sizes up
    sizes = dict(sizes)
    for t in (*kernel.inputs, *kernel.outputs):
        for d in t.shape:
            quo = split_quotient_dim(d)
            if quo is not None and quo[0] not in fixed:
                v = sizes.get(quo[0], 64)
                sizes[quo[0]] = -(-v // quo[1]) * quo[1]
    def extent(d) -> int:
        if isinstance(d, int):
            return d
        off = split_offset_dim(d)
        quo = split_quotient_dim(d)
        if quo is not None:
            return extent(quo[0]) // quo[1]
        return extent(off[0]) + off[1] if off else fixed.get(d, sizes.get(d, 64))

    # varlen: each packing's offsets from random lengths (the first sequence the longest), and the
    # packed tensors as [rows, ...] arrays
    rows = {}
    for t in (*kernel.inputs, *kernel.outputs):
        if t.packed and t.packed not in rows:
            lengths = rng.integers(0, extent(t.shape[1]) + 1, size=extent(t.shape[0]))
            lengths[:1] = extent(t.shape[1])
            out[t.packed] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            rows[t.packed] = int(out[t.packed][-1])
    for t in kernel.inputs:
        if t.name in out:
            continue
        shape = [extent(d) for d in t.shape]
        if t.packed:
            shape = [rows[t.packed], *shape[2:]]
        if t.name in bounds:
            hi = min(d if isinstance(d, int) else fixed.get(d, sizes.get(d, 64)) for d in bounds[t.name])
            out[t.name] = rng.integers(0, max(hi, 1), size=shape).astype(np.int8 if t.dtype == "i8" else np.int32)
        elif is_int(t.dtype):
            out[t.name] = rng.integers(-4, 5, size=shape).astype(np.int8 if t.dtype == "i8" else np.int32)
        elif t.dtype == "f8e8m0":         # MX scales: powers of two (no zero, no sign)
            out[t.name] = to_storage((2.0 ** rng.integers(-4, 5, size=shape)).astype(np.float32), t.dtype)
        else:
            out[t.name] = to_storage(rng.standard_normal(shape).astype(np.float32), t.dtype)
    return out
