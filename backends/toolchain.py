"""Finding the CUDA toolchain: nvcc (to build kernels) and cuobjdump/nvdisasm (to inspect them).

Search order for nvcc, first hit wins:
  1. `$KSPEC_NVCC` (an explicit choice: if it is wrong that is an error, not a fall-through),
  2. `$CUDA_HOME/bin/nvcc`, then `$CUDA_PATH/bin/nvcc`,
  3. `nvcc` on `$PATH`,
  4. pip's CUDA toolkit wheels in the Python site dirs: `nvidia/cu13/bin/nvcc` (CUDA 13
     `cuda-toolkit[nvcc,...]`), `nvidia/cu12/bin/nvcc`, `nvidia/cuda_nvcc/bin/nvcc` (CUDA 12
     `nvidia-cuda-nvcc-cu12`).
cuobjdump and nvdisasm are looked for beside nvcc, on `$PATH`, then in the same wheel layouts
(`nvidia-cuda-cuobjdump` / `nvidia-cuda-nvdisasm` put them in `nvidia/cu13/bin`).  They are
optional: only `kspec inspect` needs them.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from kspec.core import ARCH_TABLE, KspecError

INSTALL_HINT = 'install a CUDA toolchain with `pip install "kspec[toolchain]"`, or set KSPEC_NVCC to an nvcc binary'

# Oldest nvcc that can target each arch ("a" features: wgmma needs 12.0, tcgen05 needs 12.8).
MIN_NVCC = {a.name: a.min_nvcc for a in ARCH_TABLE.values()}

# Wheel layouts under a site dir's `nvidia/` folder, newest CUDA first.
_WHEEL_BIN_DIRS = {
    "nvcc": ("cu13/bin", "cu12/bin", "cuda_nvcc/bin"),
    "cuobjdump": ("cu13/bin", "cu12/bin", "cuda_cuobjdump/bin"),
    "nvdisasm": ("cu13/bin", "cu12/bin", "cuda_nvdisasm/bin"),
}


@dataclass(frozen=True)
class Toolchain:
    """A located nvcc and the tools beside it.  `source` says how nvcc was found
    ("KSPEC_NVCC", "CUDA_HOME", "CUDA_PATH", "PATH" or "pip")."""
    nvcc: Path
    version: str               # e.g. "13.0.88"
    cuda_home: Path            # the toolkit root (its bin/ holds the real nvcc)
    bin_dir: Path              # the directory of the real nvcc binary
    cuobjdump: Path | None = None
    nvdisasm: Path | None = None
    source: str = "PATH"

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.version.split("."))

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for running nvcc or cuobjdump: the toolkit's bin dir and nvdisasm's dir
        first on PATH (`cuobjdump -sass` execs `nvdisasm` from PATH)."""
        env = dict(os.environ if base is None else base)
        dirs = [str(self.bin_dir)]
        for tool in (self.nvdisasm, self.cuobjdump):
            if tool is not None and str(tool.parent) not in dirs:
                dirs.append(str(tool.parent))
        env["PATH"] = os.pathsep.join(dirs + ([env["PATH"]] if env.get("PATH") else []))
        return env

    def host_link_flags(self) -> tuple[str, ...]:
        """Extra nvcc flags for linking host code (the static CUDA runtime).  pip's wheels keep
        libcudart_static.a in `cu13/lib`, but their nvcc.profile only searches
        `targets/<arch>-linux/lib`, so without this a `-shared` host build fails to link."""
        lib = self.cuda_home / "lib"
        if (lib / "libcudart_static.a").is_file() and not (self.cuda_home / "targets").is_dir():
            return (f"-L{lib}",)
        return ()

    def check_arch(self, arch: str) -> None:
        """Raise a KspecError if this nvcc is too old to build for `arch`."""
        need = MIN_NVCC.get(arch)
        if need is None:
            raise KspecError(f"unknown arch '{arch}'", hint="use one of: " + ", ".join(MIN_NVCC))
        if self.version_tuple[:2] < need:
            raise KspecError(
                f"nvcc {self.version} ({self.nvcc}) cannot build for {arch}: it needs CUDA "
                f"{need[0]}.{need[1]} or newer", hint=INSTALL_HINT)

    def require_inspect_tools(self) -> tuple[Path, Path]:
        """cuobjdump and nvdisasm, or a KspecError saying how to get them."""
        if self.cuobjdump is None or self.nvdisasm is None:
            missing = [n for n, p in (("cuobjdump", self.cuobjdump), ("nvdisasm", self.nvdisasm)) if p is None]
            raise KspecError(f"{' and '.join(missing)} not found (needed to read SASS)",
                             hint='`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` '
                                  '(included in `pip install "kspec[toolchain]"`)')
        return self.cuobjdump, self.nvdisasm

    def describe(self) -> dict[str, str]:
        """What a manifest or `kspec --version` records about the toolchain."""
        return {"nvcc": str(self.nvcc), "nvcc_version": self.version, "source": self.source,
                "cuobjdump": str(self.cuobjdump) if self.cuobjdump else "",
                "nvdisasm": str(self.nvdisasm) if self.nvdisasm else ""}


def python_site_dirs() -> list[Path]:
    """Directories that may hold pip's `nvidia/` namespace: where Python would import
    `nvidia` from (covers venvs, --user installs and PYTHONPATH), then the site dirs."""
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p).parent for p in spec.submodule_search_locations]
    try:
        dirs += [Path(p) for p in site.getsitepackages()]
    except AttributeError:   # some virtualenv versions lack it
        pass
    if site.ENABLE_USER_SITE:
        dirs.append(Path(site.getusersitepackages()))
    dirs += [Path(p) for p in sys.path if p]
    return _dedupe(dirs)


def wheel_tool_candidates(tool: str, site_dirs: Iterable[Path]) -> list[Path]:
    """Paths where a pip wheel would put `tool`, in preference order (existing or not)."""
    out = []
    for layout in _WHEEL_BIN_DIRS[tool]:
        for d in site_dirs:
            out.append(Path(d) / "nvidia" / layout / tool)
    return out


def find_toolchain(env: Mapping[str, str] | None = None,
                   site_dirs: Sequence[os.PathLike | str] | None = None) -> Toolchain:
    """Locate nvcc (see the module docstring for the order) and the inspect tools.

    env: the environment to read KSPEC_NVCC/CUDA_HOME/CUDA_PATH/PATH from (default os.environ).
    site_dirs: directories holding pip's `nvidia/` folder (default: this Python's site dirs).
    """
    env = os.environ if env is None else env
    sites = python_site_dirs() if site_dirs is None else [Path(d) for d in site_dirs]
    tried: list[str] = []

    explicit = env.get("KSPEC_NVCC")
    if explicit:
        p = Path(explicit).expanduser()
        if not _is_exe(p):
            raise KspecError(f"KSPEC_NVCC={explicit} is not an executable file",
                             hint="point KSPEC_NVCC at an nvcc binary, or unset it to search CUDA_HOME, PATH and pip wheels")
        return _make(p, "KSPEC_NVCC", env, sites)

    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = env.get(var)
        if home:
            p = Path(home).expanduser() / "bin" / "nvcc"
            if _is_exe(p):
                return _make(p, var, env, sites)
            tried.append(f"{var}: {p}")

    on_path = shutil.which("nvcc", path=env.get("PATH", ""))
    if on_path:
        return _make(Path(on_path), "PATH", env, sites)
    tried.append("PATH")

    for p in wheel_tool_candidates("nvcc", sites):
        if _is_exe(p):
            return _make(p, "pip", env, sites)
    tried.append("pip wheels (nvidia/cu13/bin, nvidia/cu12/bin, nvidia/cuda_nvcc/bin in "
                 f"{len(sites)} site dirs)")
    raise KspecError("no CUDA compiler (nvcc) found; looked in " + "; ".join(tried), hint=INSTALL_HINT)


def _make(nvcc: Path, source: str, env: Mapping[str, str], sites: Sequence[Path]) -> Toolchain:
    version = nvcc_version(nvcc)
    bin_dir = _real_bin_dir(nvcc)
    cuda_home = bin_dir.parent
    return Toolchain(nvcc=nvcc, version=version, cuda_home=cuda_home, bin_dir=bin_dir,
                     cuobjdump=_find_tool("cuobjdump", bin_dir, env, sites),
                     nvdisasm=_find_tool("nvdisasm", bin_dir, env, sites), source=source)


def nvcc_version(nvcc: Path) -> str:
    """The full release of an nvcc binary, e.g. "13.0.88" (from `nvcc --version`)."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KspecError(f"cannot run {nvcc}: {e}", hint=INSTALL_HINT) from None
    m = re.search(r"\bV(\d+\.\d+\.\d+)", out.stdout)
    if out.returncode != 0 or not m:
        raise KspecError(f"{nvcc} --version did not report a CUDA release (exit {out.returncode})",
                         hint=INSTALL_HINT)
    return m.group(1)


def _real_bin_dir(nvcc: Path) -> Path:
    """The directory of the real nvcc: follows symlinks, and asks nvcc itself (its `_HERE_`)
    when `nvcc` is a wrapper script (e.g. /usr/local/bin/nvcc exec-ing the toolkit's)."""
    resolved = nvcc.resolve()
    if (resolved.parent / "nvcc.profile").is_file():
        return resolved.parent
    try:
        out = subprocess.run([str(nvcc), "-dryrun", "-E", "-x", "cu", os.devnull],
                             capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.M)
        if m and Path(m.group(1).strip()).is_dir():
            return Path(m.group(1).strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return resolved.parent


def _find_tool(tool: str, bin_dir: Path, env: Mapping[str, str], sites: Sequence[Path]) -> Path | None:
    candidates = [bin_dir / tool]
    on_path = shutil.which(tool, path=env.get("PATH", ""))
    if on_path:
        candidates.append(Path(on_path))
    candidates += wheel_tool_candidates(tool, sites)
    return next((c for c in candidates if _is_exe(c)), None)


def _is_exe(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def _dedupe(paths: Iterable[Path]) -> list[Path]:
    seen, out = set(), []
    for p in paths:
        key = os.path.normpath(str(p))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def find_toolchain_or_reason() -> str | None:
    """None when an nvcc toolchain is found, else why not (for `kspec doctor` and backend availability)."""
    try:
        find_toolchain()
    except KspecError as e:
        return e.message
    return None
