"""Reading what nvcc produced: SASS of a cubin, summarized per kernel function.

`sass_summary` runs `cuobjdump -sass` and `cuobjdump -res-usage` (pip's nvidia-cuda-cuobjdump;
`-sass` needs nvdisasm on PATH, which `Toolchain.env()` arranges) and counts the instruction
families that show which hardware paths a kernel really uses:
  HGMMA/QGMMA/IGMMA  Hopper warpgroup MMA (PTX wgmma.mma_async) on f16/bf16/tf32, fp8, int8
  UTCHMMA/UTCQMMA/UTCIMMA  Blackwell tcgen05.mma, kind f16/tf32, f8f6f4 (and block-scaled), i8
  UTCBAR             tcgen05.commit (MMA completion -> mbarrier)
  UTMALDG/UTMASTG/UTMAPF   TMA tensor load / store / prefetch (cp.async.bulk.tensor)
  LDTM/STTM          tcgen05.ld / tcgen05.st (tensor memory <-> registers)
  MUFU.EX2           hardware exp2 (softmax, exp, sigmoid, gelu epilogues)
The parsers work on text, so they are tested without nvcc.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kspec.spec_lang.errors import KspecError

from .toolchain import Toolchain, find_toolchain

FAMILIES: tuple[str, ...] = ("HGMMA", "QGMMA", "IGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCBAR", "UTMALDG",
                             "UTMASTG", "UTMAPF", "LDTM", "STTM", "MUFU.EX2")
MMA_FAMILIES: tuple[str, ...] = ("HGMMA", "QGMMA", "IGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA")
PTX_NAME = {"HGMMA": "wgmma.mma_async", "QGMMA": "wgmma.mma_async (fp8)", "IGMMA": "wgmma.mma_async (int8)",
            "UTCHMMA": "tcgen05.mma kind::f16/tf32",
            "UTCQMMA": "tcgen05.mma kind::f8f6f4", "UTCIMMA": "tcgen05.mma kind::i8"}

_FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$")
_ARCH_RE = re.compile(r"^\s*code for (sm_\w+)")
# "/*0390*/   @!P0 UTCHMMA gdesc[UR12], ... ;   /* 0x00ff... */"
_INSN_RE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_RES_FUNC_RE = re.compile(r"^\s*Function\s+(\S+?):\s*$")
_RES_FIELD_RE = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")


@dataclass(frozen=True)
class KernelSass:
    """One device function of a cubin.  shared_bytes is static shared memory (dynamic shared
    memory is set at launch and not in the cubin); instructions excludes NOP padding."""
    name: str
    arch: str = ""
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    local_bytes: int = 0
    instructions: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, family: str) -> int:
        return self.counts.get(family, 0)

    @property
    def mma_families(self) -> tuple[str, ...]:
        return tuple(f for f in MMA_FAMILIES if self.count(f))

    @property
    def tensor_core(self) -> str | None:
        """The tensor-core MMA family this kernel issues most (None: no tensor-core MMA)."""
        fams = self.mma_families
        return max(fams, key=self.count) if fams else None


@dataclass(frozen=True)
class SassSummary:
    path: str
    kernels: tuple[KernelSass, ...]

    def kernel(self, name: str) -> KernelSass:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    def count(self, family: str) -> int:
        return sum(k.count(family) for k in self.kernels)

    @property
    def tensor_core(self) -> str | None:
        """The MMA family issued most across all kernels (None: no tensor-core MMA at all)."""
        fams = [f for f in MMA_FAMILIES if self.count(f)]
        return max(fams, key=self.count) if fams else None


def family_of(opcode: str) -> str | None:
    """The counted family of a full SASS opcode ("HGMMA.64x8x16.F32" -> "HGMMA"), or None."""
    for fam in FAMILIES:
        if opcode == fam or opcode.startswith(fam + "."):
            return fam
    return None


def parse_sass(text: str) -> list[KernelSass]:
    """Per-function instruction counts from `cuobjdump -sass` (or `nvdisasm`) output."""
    kernels: list[KernelSass] = []
    arch, name = "", None
    counts: dict[str, int] = {}
    total = 0

    def flush() -> None:
        if name is not None:
            kernels.append(KernelSass(name=name, arch=arch, instructions=total, counts=dict(counts)))

    for line in text.splitlines():
        m = _ARCH_RE.match(line)
        if m:
            arch = m.group(1)
            continue
        m = _FUNC_RE.match(line)
        if m:
            flush()
            name, counts, total = m.group(1), {}, 0
            continue
        m = _INSN_RE.match(line)
        if m and name is not None:
            opcode = m.group(1)
            if opcode == "NOP":
                continue
            total += 1
            fam = family_of(opcode)
            if fam:
                counts[fam] = counts.get(fam, 0) + 1
    flush()
    return kernels


def parse_res_usage(text: str) -> dict[str, dict[str, int]]:
    """{function: {"REG": .., "SHARED": .., "STACK": .., "LOCAL": .., ...}} from
    `cuobjdump -res-usage` output (the fields are on the line after "Function NAME:")."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        m = _RES_FUNC_RE.match(line)
        if m:
            current = m.group(1)
            out[current] = {}
            continue
        if current is not None:
            fields = _RES_FIELD_RE.findall(line)
            if fields:
                out[current].update({k: int(v) for k, v in fields})
                current = None
    return out


def summarize(path: str, sass_text: str, res_text: str) -> SassSummary:
    """Merge parsed SASS and resource usage into one summary."""
    res = parse_res_usage(res_text)
    kernels = []
    for k in parse_sass(sass_text):
        r = res.get(k.name, {})
        kernels.append(KernelSass(name=k.name, arch=k.arch, registers=r.get("REG", 0),
                                  shared_bytes=r.get("SHARED", 0), stack_bytes=r.get("STACK", 0),
                                  local_bytes=r.get("LOCAL", 0), instructions=k.instructions,
                                  counts=k.counts))
    return SassSummary(path=path, kernels=tuple(sorted(kernels, key=lambda k: k.name)))


def _cuobjdump(cubin: Path, option: str, toolchain: Toolchain) -> str:
    if not cubin.is_file():
        raise KspecError(f"no such cubin: {cubin}")
    cuobjdump, _ = toolchain.require_inspect_tools()
    try:
        out = subprocess.run([str(cuobjdump), option, str(cubin)], capture_output=True, text=True,
                             env=toolchain.env(), timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KspecError(f"cannot run cuobjdump on {cubin}: {e}") from None
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()
        raise KspecError(f"cuobjdump {option} failed on {cubin}" + (f": {detail[-1]}" if detail else ""),
                         hint="is it a cubin built by nvcc -cubin?")
    return out.stdout


def dump_sass(cubin: str | Path, toolchain: Toolchain | None = None) -> str:
    """The full SASS listing of a cubin (`cuobjdump -sass`)."""
    return _cuobjdump(Path(cubin), "-sass", toolchain or find_toolchain())


def sass_summary(cubin_path: str | Path, toolchain: Toolchain | None = None) -> SassSummary:
    """Registers, shared memory and instruction-family counts of every kernel in a cubin."""
    tc = toolchain or find_toolchain()
    path = Path(cubin_path)
    return summarize(str(path), _cuobjdump(path, "-sass", tc), _cuobjdump(path, "-res-usage", tc))


def short_name(name: str, width: int = 64) -> str:
    """A kernel's symbol for display: generated names (the CuTe DSL mangles every argument type into
    it) are cut in the middle to `width` characters, keeping the start and the distinguishing tail
    (`--sass` prints the whole symbol)."""
    if len(name) <= width:
        return name
    keep = width - 1
    return f"{name[:keep - 16]}…{name[-16:]}"


def format_summary(summary: SassSummary) -> str:
    """A short human-readable report, one block per kernel."""
    lines = [f"{summary.path}:"]
    if not summary.kernels:
        lines.append("  (no device functions)")
    for k in summary.kernels:
        tc = k.tensor_core
        tc_text = f"{tc} ({PTX_NAME[tc]})" if tc else "none"
        lines.append(f"  {short_name(k.name)} [{k.arch}]: {k.registers} registers, {k.shared_bytes} B static shared, "
                     f"{k.instructions} instructions, tensor core: {tc_text}")
        if k.stack_bytes or k.local_bytes:
            lines.append(f"    stack {k.stack_bytes} B, local {k.local_bytes} B (register spills?)")
        fams = "  ".join(f"{f} {k.count(f)}" for f in FAMILIES if k.count(f))
        if fams:
            lines.append("    " + fams)
    return "\n".join(lines)
