"""The backend registry: which backends exist, in which order kspec prefers them, and the planner
the compiler asks (`Planner` implements `compiler.kir.Oracle`).

Adding a backend = one folder under `backends/` with a class following `backends.api.Backend`,
plus one entry below.  Nothing is imported until it is used.

Preference order (the first backend whose `can_implement(ir, arch)` is None builds the kernel):
    cute      the CuTe DSL (pinned nvidia-cutlass-dsl): kspec's own sm90a/sm100a GEMM kernels, built in seconds
    cutlass   CUTLASS C++ (cutlass_cppgen + nvcc): tensor-core GEMMs with EVT epilogues, fused attention
    rowwise   kspec's own plain-CUDA row kernels: norms, softmax, cross-entropy, row reductions
    generic   plain CUDA loop kernels: elementwise kernels, and the fallback for everything else
A kernel that only the generic backend can build as a loop kernel (a GEMM it cannot put on tensor
cores, a softmax, ...) is a *fallback*: `kspec graph`/`compile` print it with the reasons the
faster backends gave, and `--strict` turns it into an error.
"""
from __future__ import annotations

import importlib
from dataclasses import replace
from functools import lru_cache

from kspec.compiler.kir import BackendChoice, KernelIR
from kspec.core import KspecError, NoBackendError

from .api import Backend, SettingProblem

# name -> (module, class); the order is the preference order
_ENTRIES: tuple[tuple[str, str, str], ...] = (
    ("cute", "kspec.backends.cute.backend", "CuteBackend"),
    ("cutlass", "kspec.backends.cutlass.backend", "CutlassBackend"),
    ("rowwise", "kspec.backends.rowwise", "RowwiseBackend"),
    ("generic", "kspec.backends.generic", "GenericBackend"),
)
PREFERENCE: tuple[str, ...] = tuple(n for n, _, _ in _ENTRIES)


@lru_cache(maxsize=None)
def get(name: str) -> Backend:
    for n, module, cls in _ENTRIES:
        if n == name:
            return getattr(importlib.import_module(module), cls)()
    raise KspecError(f"unknown backend '{name}'", hint=f"backends: {', '.join(PREFERENCE)}")


def backends() -> list[Backend]:
    return [get(n) for n in PREFERENCE]


def get_checked(name: str, ir: KernelIR) -> Backend:
    """get(name), with an unknown name reported at the kernel that pins it."""
    try:
        return get(name)
    except KspecError as e:
        raise KspecError(f"kernel {ir.spec_kernel}: {e.message}", ir.span, e.hint) from None


def _kinds(b: Backend) -> tuple[str, ...]:
    return b.capabilities.kinds + b.capabilities.fallback_kinds


def _can_implement(b: Backend, ir: KernelIR, arch: str) -> str | None:
    """b.can_implement, after the capability every backend declares as data: packed (varlen)
    buffers, which a backend reading [B, S, ...] densely would misread."""
    packed = [x for x in ir.buffers if x.packed]
    if packed and not b.capabilities.packed:
        x = packed[0]
        return (f"{x.name} is packed({x.packed}) (a variable-length batch stored back to back); this backend "
                "reads and writes dense [batch, seq, ...] tensors only")
    return b.can_implement(ir, arch)


def opt_in_reason(b: Backend, ir: KernelIR, arch: str) -> str | None:
    """Why `b` builds `ir` on `arch` only when asked (its optional `needs_opt_in`), with how to ask."""
    gate = getattr(b, "needs_opt_in", None)
    why = gate(ir, arch) if gate is not None else None
    if why is None:
        return None
    return (f"{why}; built only when asked: `backend = {b.name}` in the spec's schedule for {arch}, "
            f"or --backend {b.name}")


def _judge(b: Backend, ir: KernelIR, arch: str, opted: bool = False,
           sizes: dict[str, int] | None = None) -> tuple[str | None, SettingProblem | None]:
    """(why b does not build ir on arch as the spec asks, or None; the schedule setting b cannot
    honour when that is why).  opted: the spec or the command line asked for b (opt-in paths).
    sizes: the `--sizes` the build is for; a backend whose kernel needs a size the spec leaves open
    (`size_problem`: a GQA group FlashAttention-4 compiles in) says so."""
    why = _can_implement(b, ir, arch)
    if why is None and hasattr(b, "size_problem"):
        why = b.size_problem(ir, arch, sizes or {})
    if why is None and not opted:
        why = opt_in_reason(b, ir, arch)
    h = ir.hint(arch)
    if why is not None or (h.tile is None and h.cluster is None and h.stages is None):
        return why, None
    bad = b.setting_problem(ir, arch)
    return (None, None) if bad is None else (f"{h.setting(bad.setting)}: {bad.reason}", bad)


def _unhonoured(ir: KernelIR, arch: str, problems: list[tuple[str, SettingProblem]], pinned: bool,
                what: str | None = None) -> KspecError:
    """A located error: the backends that build this kernel cannot honour its schedule setting."""
    h = ir.hint(arch)
    key = problems[0][1].setting
    who = f"backend {problems[0][0]} cannot build" if pinned else "no backend builds"
    return KspecError(f"kernel {ir.spec_kernel}: {who} {what or f'kernel {ir.id} ({ir.kind})'} on {arch} with "
                      f"`{h.setting(key).replace(' ', ' = ', 1)}`", h.span_of(key) or ir.span,
                      "; ".join(f"{n}: {p.reason}" for n, p in problems)
                      + "; change the setting, or drop it to let the backend choose")


class Planner:
    """What the compiler asks while fusing and scheduling (compiler.kir.Oracle).

    pinned: the backend preferred for every kernel it can build (`--backend NAME`); a spec's
    `backend = NAME` schedule setting pins one kernel.  strict: a fallback is an error."""

    def __init__(self, pinned: str | None = None, strict: bool = False, sizes: dict[str, int] | None = None):
        if pinned == "auto":
            pinned = None                    # the preference order
        if pinned is not None:
            get(pinned)                      # unknown names fail here, before any planning
        self.pinned = pinned
        self.strict = strict
        self.sizes = dict(sizes or {})       # `--sizes`: what a kernel may need that the spec leaves open

    def _fast(self) -> list[Backend]:
        """The backends that may implement fused kernels (not the loop-kernel fallback)."""
        fast = [b for b in backends() if not b.capabilities.fallback_kinds]
        if self.pinned:
            fast.sort(key=lambda b: b.name != self.pinned)      # the preferred backend first
        return fast

    def _gemm_capability(self, field: str, archs: tuple[str, ...]) -> frozenset[str]:
        """What some GEMM backend offers (capabilities.<field>) on every arch in `archs`."""
        sets = []
        for arch in archs:
            s: set[str] = set()
            for b in self._fast():
                if arch in b.capabilities.archs and "gemm" in b.capabilities.kinds:
                    s |= getattr(b.capabilities, field)
            sets.append(s)
        return frozenset(set.intersection(*sets)) if sets else frozenset()

    def epilogue_fns(self, archs: tuple[str, ...]) -> frozenset[str] | None:
        """Elementwise fns some GEMM backend fuses into epilogues on every arch."""
        return self._gemm_capability("epilogue_fns", archs)

    def epilogue_reductions(self, archs: tuple[str, ...]) -> frozenset[str]:
        return self._gemm_capability("epilogue_reductions", archs)

    def epilogue_loads(self, archs: tuple[str, ...]) -> frozenset[str]:
        """Epilogue input kinds (compiler.kir.LOAD_KINDS) some GEMM backend reads on every arch."""
        return self._gemm_capability("epilogue_loads", archs)

    def can_fuse(self, ir: KernelIR, archs: tuple[str, ...]) -> str | None:
        """None when a non-fallback backend implements this candidate kernel on every arch (the
        backend a spec's `backend = NAME` pins, where it pins this kind of kernel).  A fused
        attention that backends implement but not with the spec's schedule setting is an error at
        the setting: the settings are written for it, and the unfused plan is no way to honour them."""
        for arch in archs:
            reasons = []
            unhonoured: list[tuple[str, SettingProblem]] = []
            pin = ir.hint(arch).backend
            pinned = pin and ir.kind in _kinds(get_checked(pin, ir))
            for b in ([get(pin)] if pinned else self._fast()):
                why, bad = _judge(b, ir, arch, opted=bool(pinned) or b.name == self.pinned, sizes=self.sizes)
                if why is None:
                    break
                if bad is not None:
                    unhonoured.append((b.name, bad))
                reasons.append(f"{b.name}: {why}")
            else:
                if unhonoured and ir.kind == "attention":
                    raise _unhonoured(ir, arch, unhonoured, pinned=bool(pinned), what="the fused attention kernel")
                return f"{arch}: " + "; ".join(reasons or ["no backend"])
        return None

    def choose(self, ir: KernelIR, arch: str) -> BackendChoice:
        """The backend for `ir` on `arch`.  A spec's `backend = NAME` schedule setting pins the kernel:
        that backend builds it or it is an error.  `--backend NAME` (self.pinned) puts NAME first
        in the preference order: it builds every kernel it can, the others are chosen as usual."""
        pin = ir.hint(arch).backend
        # a pin applies to the kinds of kernel the pinned backend builds at all; other kernels of
        # the spec (e.g. an elementwise one next to a pinned GEMM) are chosen as usual
        if pin and ir.kind in _kinds(get_checked(pin, ir)):
            b = get(pin)
            why, bad = _judge(b, ir, arch, opted=True, sizes=self.sizes)
            if bad is not None:
                raise _unhonoured(ir, arch, [(pin, bad)], pinned=True)
            if why:
                raise KspecError(f"backend {pin} cannot build kernel {ir.id} ({ir.kind}) on {arch}: {why}", ir.span,
                                 "drop the backend pin to let kspec choose")
            return self._choice(b, ir, arch, ())
        order = backends()
        if self.pinned:
            order = [get(self.pinned)] + [b for b in order if b.name != self.pinned]
        rejected: list[tuple[str, str]] = []
        unhonoured: list[tuple[str, SettingProblem]] = []
        opt_in: list[tuple[str, str]] = []
        for b in order:
            why, bad = _judge(b, ir, arch, opted=b.name == self.pinned, sizes=self.sizes)
            if why is None:
                if unhonoured and b.is_fallback(ir):
                    # a schedule setting is never dropped for a loop kernel: it is an error at the setting
                    raise _unhonoured(ir, arch, unhonoured, pinned=False)
                return replace(self._choice(b, ir, arch, tuple(rejected)), opt_in=tuple(opt_in))
            if b.name != self.pinned and _can_implement(b, ir, arch) is None and opt_in_reason(b, ir, arch):
                opt_in.append((b.name, why))
            if bad is not None:
                unhonoured.append((b.name, bad))
            if ir.kind in _kinds(b):             # a backend for other kinds of kernel has nothing to say
                rejected.append((b.name, why))
        if unhonoured:
            raise _unhonoured(ir, arch, unhonoured, pinned=False)
        raise NoBackendError(ir.id, ir.kind, arch, tuple(rejected), ir.span)

    def _choice(self, b: Backend, ir: KernelIR, arch: str, rejected) -> BackendChoice:
        fallback = b.is_fallback(ir)
        if fallback and rejected:
            fallback += " because " + "; ".join(f"{n}: {w}" for n, w in rejected)
        elif fallback:
            fallback += f": no other backend implements {ir.kind} kernels"
        if fallback and self.strict:
            raise KspecError(f"kernel {ir.id} ({ir.kind}) on {arch} would run as {fallback}", ir.span,
                             "--strict forbids loop-kernel fallbacks; change the spec, or drop --strict")
        return BackendChoice(b.name, ir.kind, fallback, b.default_config(ir, arch), tuple(rejected))
