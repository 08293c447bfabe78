"""`kspec selftest ARTIFACT_DIR...`: every kernel of each artifact on the present GPU against the
numpy reference, then a short benchmark against torch in the same run.

For each kernel: several size sets (tile multiples, sizes that are not multiples of any tile, and a
problem smaller than one tile; `--sizes` adds one), each in two layouts variants: the layouts the
artifact declares with outputs allocated by the runtime, and every input and output placed at a
256-byte offset inside a larger allocation and passed explicitly (the runtime accepts offset
pointers that keep the plan's alignment; padded leading dimensions it rejects by design, so they
are not tried).  Inputs are random (kspec.run.random_inputs), uploaded in their declared layout
(a `col` tensor's storage is the transpose of its last two axes); outputs are compared with the
reference backend run on the same inputs, with the dtype-aware tolerance of `kspec run`
(kspec.run.TOLERANCE: max |got - ref| / max(1, max |ref|)).

The reference needs the spec (a copy travels in the artifact), hence lark, networkx and ml_dtypes;
the launch path itself is the lean runtime.  `--fake ARCH` runs everything up to the launches
against the recording fake driver (kspec.runtime.fakedriver) and checks the launch ABI instead of
numbers: the CPU test of this command.

Exit status: 0 every check passed; 1 a mismatch, an error or a kernel that could not run; 3 no
usable CUDA device (nothing was run).
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kspec.core import KspecInternalError, split_offset_dim, split_quotient_dim
from kspec.runtime import dtypes as rt_dtypes

EXIT_OK, EXIT_FAIL, EXIT_NO_GPU = 0, 1, 3

# K and N (contiguous extents of the shipped layouts) stay multiples of 16 elements: TMA needs
# 16-byte aligned rows for every dtype down to fp8.
# Attention: H is a multiple of 4 (attention_gqa's literal group) over KH K/V heads; a paged KV
# cache has NP pages of P keys, MP pages per sequence.  Mixture of experts: E experts, D the hidden
# size (a GEMM's K).  A kernel's own constraints (block scales over whole blocks of K, kernels
# without a K tail) round these up per kernel: call_sizes.
SIZE_SETS: dict[str, dict[str, int]] = {
    "tiles": {"M": 256, "N": 384, "K": 256, "L": 2, "B": 2, "H": 4, "KH": 1, "S": 256, "T": 256, "F": 512, "V": 512,
              "NP": 32, "P": 16, "MP": 16, "E": 4, "D": 256},
    "ragged": {"M": 200, "N": 144, "K": 80, "L": 3, "B": 1, "H": 8, "KH": 2, "S": 136, "T": 200, "F": 136, "V": 1000,
               "NP": 40, "P": 16, "MP": 13, "E": 3, "D": 80},
    "small": {"M": 8, "N": 16, "K": 16, "L": 1, "B": 1, "H": 4, "KH": 1, "S": 8, "T": 24, "F": 16, "V": 24,
              "NP": 4, "P": 8, "MP": 3, "E": 1, "D": 16},
}
DEFAULT_SIZE = 16            # a size symbol no size set names (call_sizes)
OFFSET = 256

# CUDA errors after which the context is unusable: every later call in the process fails the same
# way, so `run` goes on with the remaining artifacts in a fresh process (`_continue_elsewhere`)
STICKY = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
          "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_HARDWARE_STACK_ERROR",
          "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT",
          "CUDA_ERROR_ECC_UNCORRECTABLE",
          # the same faults as torch words them (a benchmark's baseline or allocation after one)
          "illegal instruction was encountered", "illegal memory access was encountered", "misaligned address",
          "unspecified launch failure")


def context_lost(detail: str) -> bool:
    """Whether a check's failure left the CUDA context unusable (STICKY)."""
    return any(code in detail for code in STICKY)

# What the checks of an artifact settle on a GPU that no CPU test can (issue 22): by artifact name
# (bench/risks/*.kspec and shipped specs; bench/prebuild.py builds both), printed with its results.
RISKS: dict[str, str] = {
    "risk_residual_64x128": "sm_100a residual ring parity at a 64x128 tile (2 epilogue sub-tiles; issue 22 item 1)",
    "risk_big_epilogue": "the largest epilogue: f32 D + f32 aux + f32 residual, 2 A/B stages at 128x256 on sm_100a "
                         "(issue 22 item 2)",
    "risk_tf32_cute": "kspec's own tf32 WGMMA on sm_90a, built only when asked (issue 22)",
    "risk_mixed_fp8_cute": "e4m3 x e5m2 on tcgen05 (sm_100a), built only when asked (issue 22)",
    "swiglu_mlp": "the dual GEMM's second B operand (issue 22)",
    "gemm_rowmax": "epilogue reductions: shared-memory and global atomics (issue 22)",
}
# The arch on which a risk exists (kspec's sm_100a code, or its sm_90a tf32 atom); absent: both.
# On another arch the artifact's checks still run, but they settle nothing about that risk.
RISK_ARCHS: dict[str, tuple[str, ...]] = {
    "risk_residual_64x128": ("sm100a",), "risk_big_epilogue": ("sm100a",), "risk_mixed_fp8_cute": ("sm100a",),
    "risk_tf32_cute": ("sm90a",),
}
FA4_SMEM_RISK = ("FlashAttention-4 on sm_100a (and its sm_90a backward at head dim 128): 232,448 B of dynamic "
                 "shared memory beside a 1,024 B static section (issue 22)")


def fa4_smem_open(plans, arch: str) -> bool:
    """Whether FA4_SMEM_RISK is open for these plans on `arch`: an FA4 forward on sm_100a, or an FA4
    attention backward (its variants are the steps kspec.core.STEP_ROLES) on either arch."""
    from kspec.core import STEP_ROLES
    for p in plans:
        if arch == "sm100a" and p.kind == "attention":
            return True
        if any(v.config.get("role") in STEP_ROLES for b in p.binaries.values() for v in b.variants):
            return True
    return False


@dataclass
class Check:
    artifact: str
    kernel: str
    sizes: str
    variant: str
    ok: bool
    detail: str
    errors: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    risk: str = ""               # the issue-22 risk this check settles on a GPU (RISKS)
    open: bool = False           # fake mode: a question only a GPU answers (not a failure here)


@dataclass
class BenchRow:
    artifact: str
    kernel: str
    shape: str
    kspec_ms: float | None
    torch_ms: float | None
    baseline: str
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.kspec_ms and self.torch_ms:
            return self.torch_ms / self.kspec_ms
        return None


# ------------------------------------------------------------------------------------------ memory

class _Memory:
    """Synchronous device memory for the test data, through the runtime's driver object: the same
    calls on a GPU and on the fake driver (whose "device" memory is host memory it owns)."""

    def __init__(self, drv):
        self.drv = drv
        self.ctx = drv.primary_context(0)
        self.owned: list[int] = []

    @staticmethod
    def _ptr(ptr: int):
        from cuda.bindings import driver as cu
        return cu.CUdeviceptr(ptr)

    def alloc(self, nbytes: int) -> int:
        with self.drv.current(self.ctx):
            ptr = int(self.drv.call("cuMemAlloc", max(int(nbytes), 1)))
        self.owned.append(ptr)
        return ptr

    def upload(self, ptr: int, data: bytes) -> None:
        import numpy as np
        buf = np.frombuffer(data, dtype=np.uint8)
        with self.drv.current(self.ctx):
            self.drv.call("cuMemcpyHtoD", self._ptr(ptr), buf, len(data))

    def download(self, ptr: int, nbytes: int) -> bytes:
        import numpy as np
        out = np.empty(nbytes, dtype=np.uint8)
        with self.drv.current(self.ctx):
            self.drv.call("cuCtxSynchronize")
            self.drv.call("cuMemcpyDtoH", out, self._ptr(ptr), nbytes)
        return out.tobytes()

    def free_all(self) -> None:
        with self.drv.current(self.ctx):
            self.drv.call("cuCtxSynchronize")
            for p in self.owned:
                self.drv.call("cuMemFree", self._ptr(p))
        self.owned.clear()


def _storage(a, layout: str, dtype: str) -> bytes:
    """Bytes of a logical host array in the declared layout (col: last two axes swapped in memory),
    as an upload copies them (kspec.runtime.hostimage.device_image: f4e2m1 packed two values a byte
    along the contiguous axis, value 2i in the low nibble)."""
    from kspec.artifact import layout_strides
    from kspec.runtime.hostimage import device_image
    return device_image(a, layout_strides(tuple(a.shape), layout), dtype).tobytes()


# ------------------------------------------------------------------------------------------ checks

def _to_host(x, dtype: str):
    """A runtime-allocated output (DeviceArray, or a torch tensor when torch is in use) as numpy."""
    if hasattr(x, "to_numpy"):
        return x.to_numpy()
    import torch
    npd = _np_dtype(dtype)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[npd.itemsize]
    return x.contiguous().view(ints).cpu().numpy().view(npd)


def _np_dtype(name: str):
    from kspec.runtime import dtypes
    from kspec.runtime.hostimage import numpy_dtype
    return numpy_dtype(dtypes.storage(name))


def run_kernel_check(mod, program, kname: str, sizes: dict[str, int], variant: str, drv, arch: str,
                     seed: int, fake: bool) -> tuple[bool, str, dict[str, float]]:
    import numpy as np

    from kspec.artifact import layout_strides
    from kspec.backends.reference import reference
    from kspec.runtime import DeviceBuffer, dtypes
    from kspec.runtime.hostimage import host_array
    from kspec.run import TOLERANCE, random_inputs, relative_error

    kernel = mod[kname]
    entry = kernel.entry
    ck = program.kernel(kname)
    host = within_index_ranges(entry, random_inputs(ck, sizes, seed))
    # params: the declared default, else 1.5; the same values go to the reference
    params = {p.name: (p.default if p.default is not None else 1.5) for p in entry.params}
    mem = _Memory(drv)
    try:
        args: dict[str, Any] = {**params, **_place_inputs(mem, entry, host, OFFSET if variant == "offset" else 0)}
        placed: dict[str, tuple[int, tuple[int, ...], str, str]] = {}
        if variant == "offset":
            sym = host_sizes(entry, host)
            for t in entry.outputs:
                shape = tuple(e if isinstance(e, int) else sym.get(e, sizes.get(e, 64)) for e in t.shape)
                nbytes = math.prod(shape) * dtypes.itemsize(t.dtype)
                base = mem.alloc(nbytes + OFFSET)
                mem.upload(base, bytes([0x7F]) * (nbytes + OFFSET))          # garbage the kernel must overwrite
                args[t.name] = DeviceBuffer(base + OFFSET, shape, dtypes.storage(t.dtype),
                                            strides=layout_strides(shape, t.layout))
                placed[t.name] = (base + OFFSET, shape, t.layout, t.dtype)
        first = len(getattr(drv, "launches", ()))
        result = kernel(**args)
        if fake:
            from kspec.runtime.fakedriver import check_call, record_call
            launches = drv.launches[first:]
            try:
                call = record_call(mod, kname, sizes, kernel.check(**args), launches, result, args, drv)
                problems = check_call(call, arch, mod)
            except KspecInternalError as e:             # launches that match no plan sequence
                problems = [str(e)]
            # the open FA4 question: the fake driver counts FA4's static section against the limit;
            # whether a GPU does is what the run on one settles (FA4_SMEM_RISK)
            fa4 = [p for p in problems if "static shared memory exceed" in p and fa4_smem_open(entry.plans, arch)]
            if fa4 and len(fa4) == len(problems):
                return True, "OPEN (a GPU settles it): " + fa4[0], {"open": 1.0}
            if problems or getattr(drv, "on_launch", None) is None:
                return not problems, "; ".join(problems) or f"{len(launches)} launch(es) recorded, ABI ok", {}
            # an emulating fake driver computed the outputs: compare them like a GPU's
        want = reference(program, kname)(**host, **params)
        errors: dict[str, float] = {}
        bad = []
        for t in entry.outputs:
            ref = np.asarray(want[t.name])
            if t.name in placed:
                ptr, shape, layout, dt = placed[t.name]
                strides = layout_strides(shape, layout)
                got = host_array(mem.download(ptr, dtypes.span_bytes(dt, shape, strides)), 0, shape, strides, dt)
            else:
                got = _to_host(result[t.name], t.dtype)
            if tuple(got.shape) != tuple(ref.shape):
                bad.append(f"{t.name}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}")
                continue
            err = relative_error(got, ref)
            errors[t.name] = err
            tol = TOLERANCE[t.dtype]
            if not err <= tol:
                bad.append(f"{t.name}: max relative error {err:.3g} > {tol:g}")
        detail = "; ".join(bad) or ", ".join(f"{n} err {e:.2g}" for n, e in errors.items())
        return not bad, detail, errors
    finally:
        mem.free_all()


def host_sizes(entry, host: dict) -> dict[str, int]:
    """Each size symbol of the entry's inputs at the extent its host array has."""
    return {e: n for t in entry.inputs for e, n in zip(t.shape, host[t.name].shape) if isinstance(e, str)}


def within_index_ranges(entry, host: dict) -> dict:
    """The random inputs with every value of a recorded index range (`KernelEntry.index_ranges`:
    subscripts, and key lengths such as a paged cache's `kv_len`, which the spec alone does not
    bound) folded into its valid range, so the checks compare numbers rather than meet the runtime's
    refusal; offsets (monotonic) are drawn valid by kspec.run.random_inputs already."""
    import numpy as np
    sizes = host_sizes(entry, host)
    for r in entry.index_ranges or ():
        if r.monotonic or r.ends or r.tensor not in host:
            continue
        a = host[r.tensor]
        span = r.bound(sizes) + (1 if r.inclusive else 0)
        if span <= 0:
            continue
        bad = (a >= span) | ((a < 0) if not r.negative else False)
        if r.ignore is not None:
            bad &= a != r.ignore
        host[r.tensor] = np.where(bad, np.abs(a) % span, a).astype(a.dtype)
    return host


def _place_inputs(mem: _Memory, entry, host: dict, offset: int = 0) -> dict[str, Any]:
    """Every input uploaded in its declared layout, `offset` bytes into an allocation of its own."""
    from kspec.artifact import layout_strides
    from kspec.runtime import DeviceBuffer, dtypes
    args: dict[str, Any] = {}
    for t in entry.inputs:
        a = host[t.name]
        data = _storage(a, t.layout, t.dtype)
        base = mem.alloc(len(data) + offset)
        mem.upload(base + offset, data)
        args[t.name] = DeviceBuffer(base + offset, a.shape, dtypes.storage(t.dtype),
                                    strides=layout_strides(a.shape, t.layout))
    return args


def call_sizes(entry, base: dict[str, int], *, default: int = DEFAULT_SIZE, keep=()) -> dict[str, int]:
    """`base` completed and adjusted for one call of kernel `entry` (a manifest KernelEntry), as the
    artifact's own declarations require: every size symbol of its arguments' shapes gets a value
    (the B of an offsets extent `B+1` and the K of a block-scale extent `K/32` too), from `base`,
    else `default`; and each is rounded up to a multiple of what the artifact says it needs:
    q for a `K/q` extent (block scales cover whole blocks), a plan's `multiples` for the size it
    binds to that role (no tail handling there), and, for a tensor a plan wants `alignment`-byte
    aligned, a row pitch that keeps the alignment (the runtime checks every non-unit stride).
    Packed row counts (`cu_rows`) are not invented: kspec.runtime.fakedriver._packed_offsets derives
    them from the offsets.  Symbols in `keep` keep base's value (sizes a user gave).  The other keys
    of `base` are kept as they are."""
    from kspec.core import packed_rows_symbol, split_offset_dim
    packed = {packed_rows_symbol(t.packed) for t in (*entry.inputs, *entry.outputs) if t.packed}
    need: dict[str, int] = {}

    def symbol(e) -> tuple[str, int] | None:
        """(size symbol, q) of an extent whose value is symbol / q; None for anything else."""
        if not isinstance(e, str):
            return None                       # an int literal or a product
        if split_offset_dim(e) is not None:
            need.setdefault(split_offset_dim(e)[0], 1)     # `B+1` binds B, whatever it is
            return None
        return split_quotient_dim(e) or (e, 1)

    def require(e, m: int) -> None:
        s = symbol(e)
        if s is not None:
            need[s[0]] = math.lcm(need.get(s[0], 1), m * s[1])

    for t in (*entry.inputs, *entry.outputs, *entry.intermediates):
        for e in t.shape:
            require(e, 1)
    for plan in entry.plans:
        dims = dict(plan.dims)
        for role, m in plan.multiples.items():
            require(dims[role], m)
        for name, align in plan.alignment.items():
            t = entry.tensor(name)
            if t is None or len(t.shape) < 2:
                continue
            # the least non-unit stride of a dense tensor is its contiguous extent; the rest are multiples
            inner = t.shape[-2] if t.layout == "col" else t.shape[-1]
            # (in values: 32 of a 4-bit dtype fill 16 bytes)
            require(inner, align * 8 // math.gcd(align * 8, rt_dtypes.bits(t.dtype)))
    out = dict(base)
    for sym, m in need.items():
        if sym in packed:
            continue
        v = base.get(sym, default)
        out[sym] = v if sym in keep else -(-v // m) * m
    return out


def reduced_sizes(entry) -> list[str]:
    """Size symbols only inputs have (a GEMM's K, a softmax's vocabulary, attention's T): at 0 with
    the outputs not empty, every output value would be a reduction over nothing.  Derived extents
    (`E+1` offsets, `K/128` block-scale counts) and packed row counts are not symbols of their own."""
    from kspec.core import split_offset_dim
    def own(e) -> bool:
        return isinstance(e, str) and "+" not in e and "/" not in e
    outs = {e for t in entry.outputs for e in t.shape if own(e)}
    # a packed output ranges over its packing's sequences: the `B` of offsets `[B+1]`
    for t in entry.outputs:
        if t.packed:
            outs |= {split_offset_dim(e)[0] for e in entry.tensor(t.packed).shape
                     if isinstance(e, str) and split_offset_dim(e)}
    return sorted({e for t in entry.inputs for e in t.shape if own(e) and not (t.packed and e == t.shape[0])} - outs)


def run_empty_check(mod, program, kname: str, sizes: dict[str, int], sym: str, drv, seed: int) -> tuple[bool, str]:
    """`sym` = 0 is refused by name before any launch (issue 22 item 3; kspec.runtime.emptycheck).
    The inputs are those of the other checks (kspec.run.random_inputs: block-scale extents rounded
    up, varlen offsets drawn) at `sym` = 0."""
    from kspec.run import random_inputs
    from kspec.runtime import KspecRuntimeError
    kernel = mod[kname]
    entry = kernel.entry
    host = within_index_ranges(entry, random_inputs(program.kernel(kname), {**sizes, sym: 0}, seed))
    mem = _Memory(drv)
    first = len(getattr(drv, "launches", ()))
    try:
        params = {p.name: (p.default if p.default is not None else 1.5) for p in entry.params}
        kernel(**params, **_place_inputs(mem, entry, host))
    except KspecRuntimeError as e:
        launched = len(getattr(drv, "launches", ())) - first
        ok = f"{sym} = 0" in e.message and not launched
        return ok, e.message if ok else f"expected '{sym} = 0' refused with no launch, got: {e.message}"
    finally:
        mem.free_all()
    return False, f"{sym} = 0 was launched, not refused"


def run_index_check(mod, program, kname: str, sizes: dict[str, int], drv, seed: int) -> tuple[bool, str]:
    """An index out of range is refused before the launch (kspec.runtime.indexcheck): the first
    recorded index tensor gets its bound (-1 where that does not fit) at its middle element."""
    import numpy as np

    from kspec.run import random_inputs
    from kspec.runtime import KspecRuntimeError
    kernel = mod[kname]
    entry = kernel.entry
    r = entry.index_ranges[0]
    host = random_inputs(program.kernel(kname), sizes, seed)
    idx = host[r.tensor]
    if idx.size == 0:
        return True, f"'{r.tensor}' is empty at these sizes"
    bound = r.bound(host_sizes(entry, host))
    pos = tuple(int(i) for i in np.unravel_index(idx.size // 2, idx.shape))
    bad = bound + 1 if r.inclusive else bound        # the first value out of range
    idx[pos] = bad if bad <= np.iinfo(idx.dtype).max else -1
    params = {p.name: (p.default if p.default is not None else 1.5) for p in entry.params}
    where = f"{r.tensor}[{', '.join(map(str, pos))}] = {int(idx[pos])}"
    mem = _Memory(drv)
    first = len(getattr(drv, "launches", ()))
    saved, kernel.check_indices = kernel.check_indices, True
    try:
        kernel(**params, **_place_inputs(mem, entry, host))
    except KspecRuntimeError as e:
        text = e.message
        launched = len(getattr(drv, "launches", ())) - first
        ok = f"{where} is out of range" in text and not launched
        return ok, text if ok else f"expected '{where} is out of range' and no launch, got: {text}"
    finally:
        kernel.check_indices = saved
        mem.free_all()
    return False, f"{where} was launched, not refused"


def _check_artifact(mod, program, art: Path, arch: str, risk: str, size_sets: dict, drv, seed: int,
                    fake: str | None, checks: list[Check], say, given=()) -> None:
    """Every check of one artifact, appended to `checks`; raises _ContextLost after a check whose
    failure left the CUDA context unusable.  `given`: the size symbols a user gave (`--sizes`),
    kept as given."""
    import kspec
    for kname in mod.kernels:
        entry = mod[kname].entry
        small = call_sizes(entry, size_sets["small"])
        for sname, base in size_sets.items():
            # the kernel's own constraints on top of the set (not on the sizes a user gave)
            sizes = call_sizes(entry, base, keep=given if sname == "given" else ())
            for variant in ("declared", "offset"):
                t0 = time.perf_counter()
                try:
                    good, detail, errs = run_kernel_check(mod, program, kname, sizes, variant, drv, arch,
                                                          seed, fake is not None)
                except kspec.KspecError as e:
                    good, detail, errs = False, str(e).splitlines()[0], {}
                dt = time.perf_counter() - t0
                is_open = bool(errs.pop("open", 0.0))
                checks.append(Check(art.name, kname, sname, variant, good, detail, errs, dt, risk, is_open))
                tag = "OPEN" if is_open else "PASS" if good else "FAIL"
                say(f"  {tag} {kname:<24} {sname:<7} {variant:<8} {detail}")
                if not good and context_lost(detail) and not fake:
                    raise _ContextLost(art.name)
        for sym in reduced_sizes(entry):
            try:
                good, detail = run_empty_check(mod, program, kname, small, sym, drv, seed)
            except kspec.KspecError as e:
                good, detail = False, str(e).splitlines()[0]
            checks.append(Check(art.name, kname, "small", f"{sym}=0", good, detail,
                                risk="a reduction over nothing is refused before launch (issue 22 item 3)"))
            say(f"  {'PASS' if good else 'FAIL'} {kname:<24} {'small':<7} {sym + '=0':<8} {detail.splitlines()[0][:120]}")
        if entry.index_ranges:
            try:
                good, detail = run_index_check(mod, program, kname, small, drv, seed)
            except kspec.KspecError as e:
                good, detail = False, str(e).splitlines()[0]
            checks.append(Check(art.name, kname, "small", "bad-index", good, detail))
            say(f"  {'PASS' if good else 'FAIL'} {kname:<24} {'small':<7} {'bad-index':<8} {detail}")


class _ContextLost(Exception):
    """A check faulted the CUDA context (STICKY): nothing more can run in this process."""


def _continue_elsewhere(paths: list[str], sizes_extra, bench: bool, reps: int, seed: int, say):
    """`kspec selftest` on `paths` in a fresh process (a faulted context cannot be recovered in
    this one); its output is passed on, its checks and benchmark rows returned."""
    import subprocess
    import tempfile
    if not paths:
        return [], [], EXIT_OK
    with tempfile.TemporaryDirectory(prefix="kspec-selftest-") as tmp:
        js = str(Path(tmp) / "rest.json")
        cmd = [sys.executable, "-m", "kspec", "selftest", *paths, "--reps", str(reps), "--seed", str(seed),
               "--json", js]
        if sizes_extra:
            cmd += ["--sizes", ",".join(f"{k}={v}" for k, v in sizes_extra.items())]
        if not bench:
            cmd.append("--no-bench")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tables = False                  # the combined benchmark table and count are the caller's to print
        for line in proc.stdout.splitlines():
            tables = tables or line.startswith("benchmark (mean of")
            if not (tables or line.startswith("selftest on ")):
                say(line)
        try:
            data = json.loads(Path(js).read_text())
        except (OSError, ValueError) as e:
            say(f"selftest: the fresh process wrote no results (exit {proc.returncode}: {e})")
            return [Check(Path(p).name, "*", "-", "-", False, "not run: the fresh process failed") for p in paths], [], EXIT_FAIL
    checks = [Check(**c) for c in data["checks"]]
    rows = [BenchRow(**{k: v for k, v in r.items() if k != "ratio"}) for r in data["bench"]]
    return checks, rows, proc.returncode


# ------------------------------------------------------------------------------------------ bench

def bench_artifact(mod, art: str, reps: int) -> list[BenchRow]:
    """kspec against torch on one size per kernel; GEMM-like kernels against torch.matmul, attention
    against scaled_dot_product_attention, everything else timed alone."""
    try:
        import torch
    except ImportError:
        return [BenchRow(art, k, "", None, None, "", "torch not installed") for k in mod.kernels]
    rows = []
    for kname in mod.kernels:
        entry = mod[kname].entry
        kinds = {p.kind for p in entry.plans}
        sizes = {"M": 4096, "N": 4096, "K": 4096, "L": 8, "B": 4, "H": 16, "KH": 4, "S": 2048, "T": 2048,
                 "NP": 512, "P": 16, "MP": 128, "E": 8}  # a paged KV cache: 2048 keys per sequence; GQA group 4
        # packed (varlen, grouped) tensors: 1024 rows per sequence, offsets evenly spaced (valid: the
        # timed calls skip the index checks, and a garbage offset faults the context)
        seq_rows = 1024
        offsets: dict[str, int] = {}                      # offsets tensor -> its sequence count
        if "attention" in kinds:
            pass
        elif entry.inputs and len(entry.inputs[0].shape) == 3:
            sizes.update(M=2048, N=2048, K=2048)
        try:
            args, shapes = {}, {}
            bounds: dict[str, int] = {}                     # index tensor -> the least extent it indexes
            for r in entry.index_ranges or ():
                hi = math.prod(e if isinstance(e, int) else sizes.get(e, 1024)
                               for e in (r.extent if isinstance(r.extent, tuple) else (r.extent,)))
                bounds[r.tensor] = min(hi, bounds.get(r.tensor, hi))
            def extent(e):
                if isinstance(e, int):
                    return e
                off, quo = split_offset_dim(e), split_quotient_dim(e)      # `B+1` offsets, `K/32` block scales
                return extent(off[0]) + off[1] if off else sizes.get(quo[0], 1024) // quo[1] if quo else sizes.get(e, 1024)
            for t in (*entry.inputs, *entry.outputs):
                if t.packed:
                    offsets[t.packed] = extent(entry.tensor(t.packed).shape[0]) - 1
                    sizes.setdefault(t.shape[0], offsets[t.packed] * seq_rows)
            for t in (*entry.inputs, *entry.outputs):      # outputs passed: allocation is not timed
                shape = tuple(extent(e) for e in t.shape)
                if t.name in offsets:
                    args[t.name] = (torch.arange(offsets[t.name] + 1, device="cuda") * seq_rows).to(torch.int32)
                    shapes[t.name] = shape
                    continue
                tdt = getattr(torch, rt_dtypes.DTYPES[t.dtype].torch)
                if t.dtype == "f8e8m0":                     # MX scales: positive powers of two
                    args[t.name] = (torch.rand(shape, device="cuda") + 0.5).to(tdt)
                    shapes[t.name] = shape
                    continue
                if t.layout == "col" and len(shape) >= 2:
                    s = list(shape)
                    s[-1], s[-2] = s[-2], s[-1]
                    x = torch.randn(s, device="cuda").to(tdt).transpose(-1, -2)
                elif t.name in bounds:                      # index tensors: valid values
                    x = torch.randint(0, max(bounds[t.name], 1), shape, device="cuda").to(tdt)
                else:
                    x = torch.randn(shape, device="cuda").to(tdt)
                args[t.name] = x
                if t in entry.inputs:
                    shapes[t.name] = shape
            fn = mod[kname]
            saved, fn.check_indices = fn.check_indices, False    # the kernel alone (the check syncs)
            try:
                k_ms = _time(torch, lambda: fn(**args), reps)
            finally:
                fn.check_indices = saved
            base, t_ms = "", None
            ins = [args[t.name] for t in entry.inputs]
            causal = any(str(b.config.get("mask", "")).startswith("causal")
                         for p in entry.plans for b in p.binaries.values())
            if "attention" in kinds and len(ins) >= 3 and ins[1].shape[0] == ins[0].shape[0] \
                    and ins[1].shape[1] == ins[0].shape[1]:           # SDPA: dense K/V with Q's heads
                import torch.nn.functional as F
                q, k_, v = ins[:3]
                base = "torch sdpa" + (" causal" if causal else "")
                t_ms = _time(torch, lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=causal), reps)
            elif "gemm" in kinds and len(ins) >= 2 and ins[0].dtype in (torch.float16, torch.bfloat16, torch.float32):
                a, b = ins[0], ins[1]
                base = "torch.matmul"
                t_ms = _time(torch, lambda: torch.matmul(a, b), reps)
            shape = " ".join(f"{n}{list(s)}" for n, s in shapes.items())
            rows.append(BenchRow(art, kname, shape, k_ms, t_ms, base or "(no torch baseline)"))
        except Exception as e:  # noqa: BLE001 - a benchmark failure is reported, not fatal
            rows.append(BenchRow(art, kname, "", None, None, "", f"{type(e).__name__}: {str(e)[:120]}"))
    return rows


def _time(torch, fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


# ------------------------------------------------------------------------------------------ driver

def run(paths: list[str], *, fake: str | None = None, sizes_extra: dict[str, int] | None = None,
        bench: bool = True, reps: int = 20, seed: int = 0, json_path: str | None = None,
        out=None, driver=None) -> int:
    """The command; `driver` (tests) is a FakeDriver to use instead of `--fake`'s; `out` defaults to
    the sys.stdout of the call (not of the import)."""
    out = sys.stdout if out is None else out
    import kspec
    from kspec.core import ARCH_TABLE, normalize_arch
    from kspec.runtime import driver as rt_driver
    from kspec.spec_lang import load_spec

    out = out if out is not None else sys.stdout      # looked up per call (pytest swaps sys.stdout)

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    fake_drv = driver
    if driver is not None:
        fake = fake or "injected"
        driver.__enter__()
    elif fake:
        from kspec.runtime.fakedriver import FakeDriver
        arch = normalize_arch(fake)
        cc = ARCH_TABLE[arch].cc
        fake_drv = FakeDriver((cc // 10, cc % 10), name=f"fake {arch}")
        fake_drv.__enter__()
    try:
        drv = rt_driver.get()
        ok, why = drv.available()
        if not ok:
            say(f"selftest: no CUDA device: {why}")
            say("selftest: nothing was run (exit 3); run it on an sm_90a (Hopper) or sm_100a (Blackwell) GPU, "
                "or use --fake sm90a|sm100a to check the launches on this machine")
            _write_json(json_path, [], [], "no-gpu", why)
            return EXIT_NO_GPU
        major, minor, sms, name = drv.facts(0)
        say(f"selftest on {name} (compute capability {major}.{minor}, {sms} SMs)" + (" [fake driver]" if fake else ""))
        size_sets = dict(SIZE_SETS)
        if sizes_extra:
            size_sets["given"] = {**SIZE_SETS["tiles"], **sizes_extra}
        checks: list[Check] = []
        rows: list[BenchRow] = []
        for i, p in enumerate(paths):
            art = Path(p)
            try:
                mod = kspec.load(art)
                arch = mod.arch_for((major, minor), name, 0)
                program = load_spec(art / mod.manifest.spec.file)
            except kspec.KspecError as e:
                checks.append(Check(str(art), "*", "-", "-", False, str(e).splitlines()[0]))
                say(f"FAIL {art}: {str(e).splitlines()[0]}")
                continue
            risk = RISKS.get(art.name, "")
            elsewhere = risk and arch not in RISK_ARCHS.get(art.name, (arch,))
            if elsewhere:
                risk = ""
            if not risk and fa4_smem_open([p for k in mod.manifest.kernels for p in k.plans], arch):
                risk = FA4_SMEM_RISK
            say(f"{art.name} ({arch}):" + (f"  [settles: {risk}]" if risk else "")
                + (f"  [settles nothing on {arch}: its risk is on {', '.join(RISK_ARCHS[art.name])}]" if elsewhere else ""))
            lost = ""
            try:
                _check_artifact(mod, program, art, arch, risk, size_sets, drv, seed, fake, checks, say,
                                given=tuple(sizes_extra or ()))
            except _ContextLost:
                lost = "a kernel faulted; its remaining checks are not run"
            else:
                if bench and not fake:
                    bench_rows = bench_artifact(mod, art.name, reps)
                    rows += bench_rows
                    if any(context_lost(r.note) for r in bench_rows):
                        lost = "in its benchmark"
            if lost:
                rest = paths[i + 1:]
                say(f"  {art.name}: the CUDA context is lost ({lost})"
                    + (f"; the other {len(rest)} artifact(s) run in a fresh process" if rest else ""))
                more_checks, more_rows, _rc = _continue_elsewhere(rest, sizes_extra, bench, reps, seed, say)
                checks += more_checks
                rows += more_rows
                break
        if rows:
            say("benchmark (mean of %d calls after warm-up; ratio = torch time / kspec time):" % reps)
            for r in rows:
                if r.kspec_ms is None:
                    say(f"  {r.artifact}/{r.kernel}: {r.note}")
                    continue
                t = f"{r.torch_ms:8.3f} ms" if r.torch_ms is not None else "       -   "
                ratio = f"x{r.ratio:.2f}" if r.ratio else "-"
                say(f"  {r.artifact + '/' + r.kernel:<40} kspec {r.kspec_ms:8.3f} ms  {r.baseline:<18} {t}  {ratio}")
        failed = [c for c in checks if not c.ok]
        opened = sum(c.open for c in checks)
        say(f"selftest: {len(checks) - len(failed)}/{len(checks)} checks passed"
            + (f" ({opened} open: only a GPU answers them)" if opened else ""))
        _write_json(json_path, checks, rows, "fail" if failed else "pass", "", fake=fake is not None)
        return EXIT_FAIL if failed else EXIT_OK
    finally:
        if fake_drv is not None:
            fake_drv.__exit__(None, None, None)


def _write_json(path: str | None, checks: list[Check], rows: list[BenchRow], status: str, why: str,
                fake: bool = False) -> None:
    if not path:
        return
    data = {"status": status, "why": why, "fake": fake, "checks": [asdict(c) for c in checks],
            "bench": [{**asdict(r), "ratio": r.ratio} for r in rows]}
    Path(path).write_text(json.dumps(data, indent=1, default=str))


def register(sub) -> None:
    import argparse
    p = sub.add_parser(
        "selftest", help="run every kernel of compiled artifacts on this GPU against the reference",
        description=__doc__.split("\n\n")[0].replace("`", ""),
        epilog="exit status: 0 all checks passed; 1 a mismatch or error; 3 no usable CUDA device (nothing run)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+", metavar="ARTIFACT_DIR")
    p.add_argument("--fake", metavar="ARCH", help="check the launches against the recording fake driver "
                                                  "(sm90a or sm100a) instead of a GPU")
    p.add_argument("--sizes", help="one more size set, e.g. M=512,N=256,K=128")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark against torch")
    p.add_argument("--reps", type=int, default=20, help="timed calls per benchmark (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from kspec.core import parse_sizes
    return run(args.artifacts, fake=args.fake, sizes_extra=parse_sizes(args.sizes) or None,
               bench=not args.no_bench, reps=args.reps, seed=args.seed, json_path=args.json)
