"""`kspec doctor`: what kspec sees on this machine, the first thing to run when something is off.

Reports kspec and Python, the packages kspec uses, the CUDA driver and every GPU with the kspec
arch its compute capability maps to, the nvcc toolchain and the inspect tools, the host C++
compiler, the compile cache, and which backends can compile here.  Every probe is isolated: a
broken or missing component is reported as such and the rest still runs, so the command always
finishes (exit 0) on any machine, with or without a GPU or a toolchain.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class Section:
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)

    def add(self, key: str, value: Any) -> None:
        self.rows.append((key, str(value)))


@dataclass
class Report:
    sections: list[Section]
    can_compile: bool
    can_run: bool
    notes: list[str]

    def to_json(self) -> dict:
        return {"sections": {s.title: dict(s.rows) for s in self.sections},
                "can_compile": self.can_compile, "can_run": self.can_run, "notes": self.notes}

    def render(self) -> str:
        width = max((len(k) for s in self.sections for k, _ in s.rows), default=10)
        out = []
        for s in self.sections:
            out.append(f"{s.title}:")
            out += [f"  {k:<{width}}  {v}" for k, v in s.rows]
        out.append("summary:")
        out.append(f"  {'compile here':<{width}}  {'yes' if self.can_compile else 'no'}")
        out.append(f"  {'run here':<{width}}  {'yes' if self.can_run else 'no'}")
        out += [f"  - {n}" for n in self.notes]
        return "\n".join(out)


def _probe(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(result, None) or (None, why): a diagnostic never stops at a broken component."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reporting the failure is the point
        text = getattr(e, "message", None) or str(e) or type(e).__name__
        return None, text.strip().splitlines()[0]


def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _packages() -> Section:
    s = Section("packages")
    # distribution metadata only: importing torch or cutlass here would cost seconds
    for label, dists, role in (
            ("numpy", ("numpy",), "runtime"),
            ("cuda-python", ("cuda-bindings", "cuda-python"), "runtime: launches through cuda.bindings"),
            ("torch", ("torch",), "optional: torch tensors and custom ops"),
            ("ml_dtypes", ("ml_dtypes",), "bf16/fp8 host arrays, reference backend"),
            ("lark", ("lark",), "compiler: spec parser"),
            ("networkx", ("networkx",), "compiler: dataflow graph"),
            ("nvidia-cutlass", ("nvidia-cutlass",), "compiler: CUTLASS backend"),
            ("flash-attn-4", ("flash-attn-4",), "compiler, optional: fused attention (CuTe DSL backend); "
                                                "artifacts do not need it"),
            ("quack-kernels", ("quack-kernels",), "compiler, optional: imported by flash-attn-4")):
        version = next((v for v in map(_dist_version, dists) if v), None)
        s.add(label, f"{version}  ({role})" if version else f"not installed  ({role})")
    from kspec.backends.cute import compat
    fa4 = compat.fa4_available()
    s.add("attention", f"FlashAttention-4 {compat.FA4_VERSION} through the CuTe DSL backend (artifacts need no FA4, "
          "DSL or TVM-FFI at run time)" if fa4 is None else f"CUTLASS FMHA only: {fa4}")
    return s


def _installed(prefix: str) -> dict[str, str]:
    """{distribution name: version} of the installed distributions whose name starts with `prefix`."""
    from importlib import metadata
    out = {}
    for d in metadata.distributions():
        name = (d.metadata.get("Name") or "").lower().replace("_", "-")
        if name.startswith(prefix):
            out[name] = d.version
    return out


def _cute_dsl(notes: list[str]) -> Section:
    """The CuTe DSL's version and CUDA flavours, and the attention extra's pieces, each problem a note
    with the command that fixes it."""
    from kspec.backends import cute
    from kspec.backends.cute import compat
    s = Section("cute dsl")
    dists = _installed("nvidia-cutlass-dsl")
    base = dists.get("nvidia-cutlass-dsl-libs-base")
    pin = compat.DSL_VERSION
    fix_dsl = f'pip install "nvidia-cutlass-dsl-libs-{cute.FLAVOUR}=={pin}" "nvidia-cutlass-dsl-libs-base=={pin}"'
    s.add("version", f"{base}" if base else "not installed")
    if base is None:
        notes.append(f"the CuTe DSL is not installed (GEMMs and attention fall back to CUTLASS C++): {fix_dsl}")
        return s
    if base != pin:
        notes.append(f"CuTe DSL {base} is installed; kspec needs {pin}: {fix_dsl}")
    flavours = sorted(d.rsplit("-", 1)[1] for d in dists if d.startswith("nvidia-cutlass-dsl-libs-cu"))
    s.add("flavours", ", ".join(flavours) or "none")
    s.add("builds with", f"{cute.FLAVOUR} (loaded by kspec whatever else is installed)"
          if cute.FLAVOUR in flavours else f"nothing: the {cute.FLAVOUR} libraries are missing")
    if cute.FLAVOUR not in flavours:
        notes.append(f"the CuTe DSL's {cute.FLAVOUR} libraries are missing: {fix_dsl}")
    others = [f for f in flavours if f != cute.FLAVOUR]
    if others:
        extra = " ".join(f"nvidia-cutlass-dsl-libs-{f}" for f in others)
        meta = " nvidia-cutlass-dsl" if "nvidia-cutlass-dsl" in dists else ""
        notes.append(f"the CuTe DSL's {', '.join(others)} libraries are installed beside {cute.FLAVOUR} "
                     f"(FlashAttention-4's dependency on the nvidia-cutlass-dsl meta wheel brings them): kspec "
                     f"builds with {cute.FLAVOUR} regardless; to remove them: pip uninstall -y{meta} {extra}")
    fa4 = compat.fa4_available()
    s.add("attention", "FlashAttention-4 ready" if fa4 is None else f"not ready: {fa4}")
    if fa4 is not None and _dist_version("flash-attn-4") is not None:
        notes.append(f"FlashAttention-4 is installed but cannot be used: {fa4}")
    from importlib import metadata
    torch = _dist_version("torch")
    if torch is not None and not _probe_gpu_torch_wanted():
        reqs = metadata.requires("torch") or []
        if any(r.lower().startswith("nvidia-") for r in reqs):
            notes.append(f"torch {torch} is a CUDA build (gigabytes of CUDA libraries); building needs only a CPU "
                         "build: pip install torch --index-url https://download.pytorch.org/whl/cpu")
    return s


def _probe_gpu_torch_wanted() -> bool:
    """A machine with a CUDA driver runs kernels through torch: a CUDA torch build belongs there."""
    from kspec.runtime import driver as drv_mod
    return drv_mod.Driver().available()[0]


def _driver_and_gpus(notes: list[str]) -> tuple[Section, bool]:
    from kspec.core import ARCH_TABLE, arch_of_cc
    s = Section("driver")
    from kspec.runtime import driver as drv_mod
    drv = drv_mod.Driver()              # a fresh probe: doctor must not reuse a cached verdict
    ok, why = drv.available()
    if not ok:
        s.add("status", f"unavailable: {why}")
        s.add("gpus", "none visible")
        notes.append("no usable CUDA driver/GPU: kernels can be compiled and loaded here, not launched")
        return s, False

    def version() -> str:
        v = int(drv.call("cuDriverGetVersion"))
        return f"{v // 1000}.{(v % 1000) // 10} (CUDA driver API {v})"
    v, err = _probe(version)
    s.add("status", "ok")
    s.add("version", v if err is None else f"unknown ({err})")
    count, err = _probe(drv.device_count)
    if err is not None:
        s.add("gpus", f"cannot count devices: {err}")
        return s, False
    runnable = False
    for i in range(count):
        facts, err = _probe(lambda i=i: drv.facts(i))
        if err is not None:
            s.add(f"cuda:{i}", f"cannot query: {err}")
            continue
        major, minor, sms, name = facts
        arch = arch_of_cc(major * 10 + minor)
        if arch:
            runnable = True
            where = f"kspec arch {arch}"
        else:
            where = f"not a kspec target (kspec runs on {', '.join(ARCH_TABLE)})"
        s.add(f"cuda:{i}", f"{name}, compute capability {major}.{minor}, {sms} SMs -> {where}")
    if count and not runnable:
        notes.append("no GPU here is sm_90 (Hopper) or sm_100 (Blackwell): kernels cannot run on it")
    return s, runnable


def _toolchain(notes: list[str]) -> tuple[Section, Any]:
    from kspec.core import ARCH_TABLE
    s = Section("toolchain")
    from kspec.backends.toolchain import find_toolchain
    tc, err = _probe(find_toolchain)
    if err is not None:
        s.add("nvcc", f"not found: {err}")
        notes.append('no nvcc: artifacts can be loaded and run here, not compiled '
                     '(pip install "kspec[toolchain]")')
    else:
        s.add("nvcc", f"{tc.version} ({tc.nvcc}, found via {tc.source})")
        have = tuple(int(x) for x in tc.version.split(".")[:2])
        ok = [a.name for a in ARCH_TABLE.values() if have >= a.min_nvcc]
        too_old = [f"{a.name} needs {a.min_nvcc[0]}.{a.min_nvcc[1]}" for a in ARCH_TABLE.values()
                   if have < a.min_nvcc]
        s.add("targets", ", ".join(ok) + (f" (not: {'; '.join(too_old)})" if too_old else ""))
        s.add("cuobjdump", tc.cuobjdump or "not found (kspec inspect needs nvidia-cuda-cuobjdump)")
        s.add("nvdisasm", tc.nvdisasm or "not found (kspec inspect needs nvidia-cuda-nvdisasm)")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    s.add("host C++", cxx or "not found (nvcc needs a host compiler)")
    if tc is not None and cxx is None:
        notes.append("nvcc found but no host C++ compiler: host glue cannot be built")
    return s, (tc if cxx else None)


def _cache() -> Section:
    s = Section("cache")
    from kspec.backends.build import CompileCache
    cache = CompileCache(writable=False)          # the configured directory, not a fallback
    s.add("dir", f"{cache.root}" + ("  ($KSPEC_CACHE_DIR)" if os.environ.get("KSPEC_CACHE_DIR") else ""))
    if cache.root.is_dir():
        info, err = _probe(cache.info)
        if err is None:
            s.add("entries", f"{info['entries']} binaries, {info['bytes'] / 2**20:.1f} MiB"
                  + (f", {info['failed_logs']} failed-build logs" if info["failed_logs"] else ""))
        else:
            s.add("entries", f"unreadable: {err}")
        s.add("writable", "yes" if os.access(cache.root, os.W_OK) else
              "no (compiles use a temporary cache for the run, with a warning)")
    else:
        parent = next((p for p in cache.root.parents if p.exists()), Path("/"))
        s.add("entries", "none yet (created on the first compile)")
        s.add("writable", "yes" if os.access(parent, os.W_OK) else f"no ({parent} is not writable)")
    return s


def _backends(toolchain) -> tuple[Section, bool]:
    """Each registered backend, in preference order, and whether it can build on this machine."""
    from kspec.backends import registry
    s = Section("backends")
    usable = False
    for b in registry.backends():
        reason, err = _probe(b.available)
        reason = err if err is not None else reason
        usable |= reason is None
        s.add(b.name, "usable" if reason is None else f"unavailable: {reason}")
    return s, usable


def collect() -> Report:
    import kspec
    notes: list[str] = []
    head = Section("kspec")
    head.add("version", kspec.__version__)
    from kspec.artifact import FORMAT_VERSION
    from kspec.core import ABI_VERSION
    head.add("artifacts", f"manifest format {FORMAT_VERSION}, host-glue ABI {ABI_VERSION}")
    head.add("location", Path(kspec.__file__).resolve().parent.parent)
    head.add("python", f"{platform.python_version()} ({sys.executable})")
    head.add("platform", f"{platform.system()} {platform.machine()}")
    sections = [head, _packages()]
    dsl, err = _probe(lambda: _cute_dsl(notes))
    sections.append(dsl if err is None else Section("cute dsl", [("status", f"probe failed: {err}")]))
    driver, err = _probe(lambda: _driver_and_gpus(notes))
    if err is not None:
        driver = (Section("driver", [("status", f"probe failed: {err}")]), False)
    sections.append(driver[0])
    tc_section, err = _probe(lambda: _toolchain(notes))
    toolchain = None
    if err is not None:
        sections.append(Section("toolchain", [("status", f"probe failed: {err}")]))
    else:
        sections.append(tc_section[0])
        toolchain = tc_section[1]
    cache, err = _probe(_cache)
    sections.append(cache if err is None else Section("cache", [("status", f"probe failed: {err}")]))
    backends, err = _probe(lambda: _backends(toolchain))
    if err is not None:
        backends = (Section("backends", [("status", f"probe failed: {err}")]), False)
    sections.append(backends[0])
    return Report(sections, can_compile=backends[1], can_run=driver[1], notes=notes)


def main(as_json: bool = False) -> int:
    report = collect()
    print(json.dumps(report.to_json(), indent=2) if as_json else report.render())
    return 0


def register(sub) -> None:
    p = sub.add_parser("doctor", help="show what kspec sees: driver, GPUs, toolchain, cache, backends",
                       description="Report kspec's environment: packages, the CUDA driver and each GPU with its "
                                   "kspec arch, nvcc and the inspect tools, the compile cache, and which backends "
                                   "can compile here. Always exits 0; run it first when something is off.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=lambda args: main(as_json=args.json))
