"""Run a generated row kernel on the CPU (tests/rowwise_emu.h): its text, compiled with g++ against
an emulation of the CUDA features it uses, launched through its own `kspec_prepare`."""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from kspec.numerics import storage_dtype
from kspec.compile import emit_spec

HERE = Path(__file__).parent
_BUILT: dict[str, ctypes.CDLL] = {}


def _build_dir() -> Path:
    """Built emulators are kept under the test compile cache (keyed by source), so reruns skip g++."""
    from conftest import test_cache_root
    d = test_cache_root() / "rowemu"
    try:
        d.mkdir(parents=True, exist_ok=True)
        return d
    except OSError:
        return Path(tempfile.mkdtemp(prefix="kspec-rowemu-"))


_DIR = _build_dir()


def cuda_include() -> str | None:
    from kspec.backends.toolchain import find_toolchain
    try:
        tc = find_toolchain()
    except Exception:
        return None
    for base in (tc.cuda_home, tc.bin_dir.parent if tc.bin_dir else None):
        if base is not None and (Path(base) / "include" / "cuda_bf16.h").is_file():
            return str(Path(base) / "include")
    return None


def available() -> str | None:
    """Why the emulator cannot run here (None if it can)."""
    if shutil.which("g++") is None:
        return "no g++"
    if cuda_include() is None:
        return "no CUDA headers (cuda_bf16.h)"
    return None


class EmuKernel:
    def __init__(self, spec: str, arch: str = "sm90a", budget: int | None = None, is_text: bool = False,
                 plan: int | None = None, sms: int | None = None):
        """plan: which planned kernel of the spec's one kernel to run (default: the only one);
        sms: the SM count the host glue is told (default 132)."""
        path = spec
        if is_text:
            path = Path(tempfile.mkdtemp(prefix="kspec-rowemu-spec-")) / "spec.kspec"
            path.write_text(spec)
        em = emit_spec(path, (arch,))
        plist = list(em.plans.values())[plan] if plan is not None else next(iter(em.plans.values()))
        if plan is None and len(em.plans) != 1:
            raise ValueError(f"the spec plans {len(em.plans)} kernels: pick one with plan=")
        ep = plist[0]
        self.lowered, self.emitted = ep.lowered, ep.emitted
        self.desc = self.lowered.desc
        self.kernel = em.program.kernels[0]
        defines = ([f"-DKSPEC_SMEM_BUDGET={budget}"] if budget else []) + ([f"-DKSPEC_EMU_SMS={sms}"] if sms else [])
        emu = (HERE / "rowwise_emu.h").read_text() + (HERE / "rowwise_emu_run.h").read_text()
        key = hashlib.sha256((self.emitted.source + " ".join(defines) + emu).encode()).hexdigest()[:24]
        if key not in _BUILT:
            so = _DIR / f"{key}.so"
            if not so.is_file():
                cpp = _DIR / f"{key}.{os.getpid()}.cpp"
                tmp = _DIR / f"{key}.{os.getpid()}.so"
                cpp.write_text('#include "rowwise_emu.h"\n' + self.emitted.source + '\n#include "rowwise_emu_run.h"\n')
                subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-DKSPEC_HOST",
                                "-DKSPEC_EMULATE", *defines, f"-I{HERE}", f"-I{cuda_include()}", str(cpp), "-o",
                                str(tmp)], check=True, capture_output=True, text=True)
                os.replace(tmp, so)
                cpp.unlink()
            _BUILT[key] = ctypes.CDLL(str(so))
        self.lib = _BUILT[key]

    def __call__(self, arrays: dict, params: dict | None = None, outputs: dict | None = None):
        """Run on numpy arrays (any strides); returns ({output: array}, launch facts)."""
        k = self.kernel
        sizes: dict = dict(k.bindings)
        for t in k.inputs:
            for d, n in zip(t.shape, arrays[t.name].shape):
                if isinstance(d, str):
                    sizes[d] = n
        outs = dict(outputs or {})
        for t in k.outputs:
            if t.name not in outs:
                shape = tuple(d if isinstance(d, int) else sizes[d] for d in t.shape)
                outs[t.name] = np.full(shape, np.nan, dtype=storage_dtype(t.dtype))
        names = self.lowered.names
        every = {**arrays, **outs}
        stride_of = {role: (arg, axis) for role, arg, axis in self.desc.strides}
        dims = []
        for role, v in self.lowered.dims:
            if role in stride_of:
                arg, axis = stride_of[role]
                a = every[names[arg]]
                dims.append(a.strides[axis] // a.itemsize)
            else:
                vals = v if isinstance(v, tuple) else (v,)
                dims.append(math.prod(x if isinstance(x, int) else sizes[x] for x in vals))
        ptrs = [every[names[a]].ctypes.data for a in self.desc.args]
        p = dict(params or {})
        scalars = []
        for s in self.desc.scalars:
            ref = self.lowered.scalars[s]
            scalars.append(float(p.get(ref, k.tensor(ref).default)) if isinstance(ref, str) else float(ref))
        c_dims = (ctypes.c_int64 * max(1, len(dims)))(*dims)
        c_ptrs = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        c_sc = (ctypes.c_double * max(1, len(scalars)))(*scalars)
        launch = (ctypes.c_int64 * 8)()
        err = ctypes.create_string_buffer(512)
        rc = self.lib.kspec_emu_run(c_dims, c_ptrs, c_sc, launch, err, ctypes.c_uint64(512))
        if rc:
            raise RuntimeError(err.value.decode())
        facts = dict(zip(("grid", "block_x", "block_y", "cluster", "smem", "vec", "cache"), launch[:7]))
        return outs, facts
