"""The row-kernel backend (`RowwiseBackend`): its capabilities, its answer to `can_implement`, and
the lower -> emit steps, which gen.py and source.py do."""
from __future__ import annotations

from kspec.backends.api import Capabilities, LoweredPlan
from kspec.backends.build import NvccBuilt
from kspec.backends.desc import EmittedKernel
from kspec.backends.generic import KspecLoweringError
from kspec.compiler.kir import KernelIR
from kspec.core import ARCHS

from .desc import COLSUM_TX, COLSUM_TY, MAX_CLUSTER, V
from .colsum import lower_colsum
from .gen import lower_rowwise
from .source import emit_rowwise


class RowwiseBackend(NvccBuilt):
    """Row kernels (this package): chains of row reductions, softmaxes and elementwise maps, with the
    column partials of sums over the rows, and the kernel that finishes those ("colsum")."""
    name = "rowwise"
    capabilities = Capabilities(archs=ARCHS, kinds=("rowwise", "colsum"))

    def identity(self) -> str:
        return "kspec-rowwise 1"

    def can_implement(self, ir: KernelIR, arch: str) -> str | None:
        if arch not in ARCHS:
            return f"the row-kernel backend does not target {arch}"
        if ir.kind not in ("rowwise", "colsum"):
            return f"the row-kernel backend builds row-wise and column-sum kernels, not {ir.kind} kernels"
        # what the generator cannot express is refused when the kernel is planned, so `kspec graph`
        # never plans a row kernel that `kspec compile` then rejects (generation is cheap)
        try:
            self.lower(ir, arch)
        except KspecLoweringError as e:
            return e.message.split(": ", 1)[1] if e.message.startswith("kernel ") and ": " in e.message else e.message
        return None

    def setting_problem(self, ir: KernelIR, arch: str) -> None:
        return None          # row kernels take no tile, cluster or stage settings: they ignore them

    def is_fallback(self, ir: KernelIR) -> str | None:
        return None

    def default_config(self, ir: KernelIR, arch: str) -> tuple[tuple[str, str], ...]:
        if ir.kind == "colsum":
            return (("block", f"{COLSUM_TX}x{COLSUM_TY}"),)
        return (("vector", f"{V}"), ("cluster", f"<= {MAX_CLUSTER}"))

    def candidates(self, ir: KernelIR, arch: str) -> list[tuple[tuple[str, str], ...]]:
        return [self.default_config(ir, arch)]

    def lower(self, ir: KernelIR, arch: str) -> LoweredPlan:
        return lower_colsum(ir, arch) if ir.kind == "colsum" else lower_rowwise(ir, arch)

    def emit(self, lowered: LoweredPlan) -> EmittedKernel:
        return emit_rowwise(lowered.desc)
