"""The backend protocol: what every code generator under `backends/` provides.

A backend is one folder under `backends/` plus one entry in `backends/registry.py`.  It declares
its capabilities as data (`Capabilities`), answers `can_implement(ir, arch)` with None or a reason,
owns its tile/cluster heuristic (`default_config`) and autotuning candidates (`candidates`), owns
its toolchain, and turns a `KernelIR` into binaries plus the launch metadata the manifest records.

Stages of one kernel on one arch (kspec/compile.py drives them):
    lower(ir, arch, config) -> LoweredPlan      the backend's own descriptor + ABI facts (no toolchain)
    emit(lowered)           -> EmittedKernel    generated source + launch facts (cached by content)
    build_jobs(emitted)     -> [BuildJob]       compiler invocations, run by the shared builder
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kspec.compiler.kir import KernelIR
from kspec.core import KspecError


@dataclass(frozen=True)
class Capabilities:
    """What a backend implements, as data the planner reads and `kspec doctor`/`graph` print."""
    archs: tuple[str, ...]
    kinds: tuple[str, ...]                              # IR kinds it implements as real kernels
    fallback_kinds: tuple[str, ...] = ()                # kinds it runs only as naive loop kernels
    gemm_operands: tuple[tuple[str, str], ...] = ()     # (A dtype, B dtype) pairs
    layouts: tuple[str, ...] = ("row", "col")
    epilogue_fns: frozenset[str] = frozenset()
    epilogue_reductions: frozenset[str] = frozenset()
    epilogue_loads: frozenset[str] = frozenset()        # compiler.kir.LOAD_KINDS
    attention: tuple[tuple[str, str], ...] = ()          # (arch, "f16/bf16 head dims 64,128; causal") summaries
    packed: bool = False                                 # reads/writes packed (varlen) buffers (IRBuffer.packed)

    def describe(self) -> list[str]:
        out = [f"archs: {', '.join(self.archs)}", f"kernels: {', '.join(self.kinds) or '-'}"]
        if self.fallback_kinds:
            out.append(f"loop-kernel fallback for: {', '.join(self.fallback_kinds)}")
        if self.gemm_operands:
            out.append("GEMM operands: " + ", ".join(f"{a}x{b}" for a, b in self.gemm_operands))
        if self.epilogue_fns:
            out.append("epilogue: " + ", ".join(sorted(self.epilogue_fns)))
        if self.epilogue_reductions:
            out.append("epilogue reductions: " + ", ".join(sorted(self.epilogue_reductions)))
        out += [f"attention on {a}: {s}" for a, s in self.attention]
        return out


@dataclass(frozen=True)
class SettingProblem:
    """A spec's schedule setting (`tile`, `cluster`, `stages`) a backend cannot honour for a kernel:
    which setting, and a reason that names what the backend accepts instead.  The registry reports
    it at the setting's span (the front end checks only that the setting is well-formed)."""
    setting: str
    reason: str



# The most CTAs a cluster may hold at launch without CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
# which no kspec launch sets (sm_100a hardware allows 16 only with it): every backend refuses more at plan time.
MAX_CLUSTER_CTAS = 8

class SettingError(KspecError):
    """A schedule setting found wrong only when the backend emits the kernel (against its exact
    configuration list or shared-memory budget); kspec/compile.py reports it at the setting."""

    def __init__(self, setting: str, message: str, hint: str | None = None):
        self.setting = setting
        super().__init__(message, None, hint)


@dataclass(frozen=True)
class LoweredPlan:
    """A kernel IR lowered for one backend and arch: the backend's descriptor plus the ABI facts
    the manifest records (names are C identifiers mapped back to spec buffer names)."""
    ir: KernelIR
    arch: str
    backend: str
    desc: object
    names: dict[str, str]                       # C identifier -> spec buffer name
    dims: tuple[tuple[str, object], ...]        # ABI dim role -> spec symbol / int literal / (symbols..) product
    scalars: dict[str, object]                  # C identifier of a scalar -> param name or constant
    config: tuple[tuple[str, str], ...] = field(default=())


@runtime_checkable
class Backend(Protocol):
    name: str
    capabilities: Capabilities

    def available(self) -> str | None:
        """None when this machine can build with the backend, else why not (missing toolchain)."""

    def identity(self) -> str:
        """Version string of the generator and its toolchain, for cache keys and manifests."""

    def can_implement(self, ir: KernelIR, arch: str) -> str | None:
        """None when the backend implements `ir` on `arch`, else a reason a user can act on."""

    def setting_problem(self, ir: KernelIR, arch: str) -> SettingProblem | None:
        """For a kernel it implements: None when the backend honours the spec's schedule settings
        (ir.hint(arch)) or has none to honour, else the setting it cannot."""

    def is_fallback(self, ir: KernelIR) -> str | None:
        """A reason when this backend runs `ir` only as a slow loop kernel (reported; --strict)."""

    # Optional: `needs_opt_in(ir, arch) -> str | None`, a reason when the backend builds `ir` only
    # when asked (`backend = NAME` in the spec's schedule, or `--backend NAME`): a path nothing has
    # validated on a GPU.  Otherwise the planner takes the next backend and `kspec graph` says why.

    def default_config(self, ir: KernelIR, arch: str) -> tuple[tuple[str, str], ...]:
        """The configuration (tile, cluster, stages, ...) the heuristic picks, as printable items."""

    def candidates(self, ir: KernelIR, arch: str) -> list[tuple[tuple[str, str], ...]]:
        """Configurations worth autotuning over; the default first."""

    def lower(self, ir: KernelIR, arch: str, config: tuple[tuple[str, str], ...] | None = None) -> LoweredPlan:
        """config: one of `candidates(ir, arch)` (a tuning winner); None means `default_config`."""

    def emit(self, lowered: LoweredPlan): ...

    def build_jobs(self, emitted, label: str) -> list: ...
