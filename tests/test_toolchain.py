"""Toolchain discovery: search order on fake layouts (fast), the real system nvcc, and a real
compile with pip's CUDA toolkit wheels (nvcc-marked; skipped when no such wheel install exists)."""
from __future__ import annotations

import glob
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kspec.backends.toolchain import Toolchain, find_toolchain, python_site_dirs
from kspec.spec_lang.errors import KspecError

VERSION_TEXT = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release {mm}, V{v}\n"


def fake_nvcc(bin_dir: Path, version: str = "13.0.88", profile: bool = True, here: Path | None = None) -> Path:
    """An executable that answers `--version` like nvcc (and `-dryrun` with a `_HERE_` line)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    mm = ".".join(version.split(".")[:2])
    text = VERSION_TEXT.format(mm=mm, v=version)
    script = bin_dir / "nvcc"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --version) printf '%s' '{text}' ;;\n"
        f"  -dryrun) echo '#$ _HERE_={here or bin_dir}' >&2 ;;\n"
        "esac\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    if profile:
        (bin_dir / "nvcc.profile").write_text("TOP = $(_HERE_)/..\n")
    return script


def fake_tool(bin_dir: Path, name: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    p = bin_dir / name
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755)
    return p


def test_pip_wheel_layout_found_with_empty_path(tmp_path):
    site = tmp_path / "site-packages"
    nvcc = fake_nvcc(site / "nvidia" / "cu13" / "bin")
    cuobjdump = fake_tool(site / "nvidia" / "cu13" / "bin", "cuobjdump")
    nvdisasm = fake_tool(site / "nvidia" / "cu13" / "bin", "nvdisasm")
    tc = find_toolchain(env={"PATH": ""}, site_dirs=[site])
    assert tc.source == "pip"
    assert tc.nvcc == nvcc
    assert tc.version == "13.0.88" and tc.version_tuple == (13, 0, 88)
    assert tc.bin_dir == nvcc.parent.resolve()
    assert tc.cuda_home == (site / "nvidia" / "cu13").resolve()
    assert tc.cuobjdump == cuobjdump and tc.nvdisasm == nvdisasm


def test_cu13_preferred_over_cu12_and_cuda12_layouts(tmp_path):
    site_a, site_b = tmp_path / "a", tmp_path / "b"
    fake_nvcc(site_a / "nvidia" / "cuda_nvcc" / "bin", "12.4.131")
    fake_nvcc(site_b / "nvidia" / "cu13" / "bin", "13.0.88")
    assert find_toolchain(env={"PATH": ""}, site_dirs=[site_a, site_b]).version == "13.0.88"
    only12 = find_toolchain(env={"PATH": ""}, site_dirs=[site_a])
    assert only12.version == "12.4.131" and only12.source == "pip"
    # CUDA 12 wheels put cuobjdump/nvdisasm in their own packages
    fake_tool(site_a / "nvidia" / "cuda_cuobjdump" / "bin", "cuobjdump")
    fake_tool(site_a / "nvidia" / "cuda_nvdisasm" / "bin", "nvdisasm")
    tc = find_toolchain(env={"PATH": ""}, site_dirs=[site_a])
    assert tc.cuobjdump is not None and tc.cuobjdump.parent.parent.name == "cuda_cuobjdump"
    assert tc.nvdisasm is not None and tc.nvdisasm.parent.parent.name == "cuda_nvdisasm"


def test_search_order_kspec_nvcc_cuda_home_path_pip(tmp_path):
    explicit = fake_nvcc(tmp_path / "explicit" / "bin", "13.0.1")
    home = tmp_path / "home"
    fake_nvcc(home / "bin", "13.0.2")
    on_path = fake_nvcc(tmp_path / "onpath", "13.0.3")
    site = tmp_path / "site"
    fake_nvcc(site / "nvidia" / "cu13" / "bin", "13.0.4")
    env = {"KSPEC_NVCC": str(explicit), "CUDA_HOME": str(home), "PATH": str(on_path.parent)}
    assert find_toolchain(env=env, site_dirs=[site]).source == "KSPEC_NVCC"
    del env["KSPEC_NVCC"]
    tc = find_toolchain(env=env, site_dirs=[site])
    assert (tc.source, tc.version, tc.cuda_home) == ("CUDA_HOME", "13.0.2", home.resolve())
    env["CUDA_PATH"] = env.pop("CUDA_HOME")
    assert find_toolchain(env=env, site_dirs=[site]).source == "CUDA_PATH"
    env["CUDA_PATH"] = str(tmp_path / "nowhere")       # a stale CUDA_PATH falls through to PATH
    assert find_toolchain(env=env, site_dirs=[site]).version == "13.0.3"
    env["PATH"] = ""
    assert find_toolchain(env=env, site_dirs=[site]).version == "13.0.4"


def test_bad_kspec_nvcc_is_an_error(tmp_path):
    with pytest.raises(KspecError, match="KSPEC_NVCC"):
        find_toolchain(env={"KSPEC_NVCC": str(tmp_path / "missing"), "PATH": ""}, site_dirs=[])


def test_no_nvcc_anywhere_gives_install_hint(tmp_path):
    with pytest.raises(KspecError) as ei:
        find_toolchain(env={"PATH": str(tmp_path)}, site_dirs=[tmp_path])
    assert "no CUDA compiler" in ei.value.message
    assert 'pip install "kspec[toolchain]"' in ei.value.hint


def test_wrapper_script_resolved_to_real_bin_dir(tmp_path):
    real = tmp_path / "cuda-13.0" / "bin"
    fake_nvcc(real)
    wrapper = fake_nvcc(tmp_path / "usr-local-bin", profile=False, here=real)
    fake_tool(tmp_path / "tools", "cuobjdump")
    fake_tool(tmp_path / "tools", "nvdisasm")
    tc = find_toolchain(env={"PATH": f"{wrapper.parent}{os.pathsep}{tmp_path / 'tools'}"}, site_dirs=[])
    assert tc.nvcc == wrapper and tc.bin_dir == real and tc.cuda_home == real.parent
    # cuobjdump must see nvdisasm on PATH, and nvcc its own bin first
    path = tc.env({"PATH": "/usr/bin"})["PATH"].split(os.pathsep)
    assert path[0] == str(real) and str(tmp_path / "tools") in path and path[-1] == "/usr/bin"


def test_host_link_flags_only_for_wheel_layout(tmp_path):
    wheel = tmp_path / "nvidia" / "cu13"
    (wheel / "lib").mkdir(parents=True)
    (wheel / "lib" / "libcudart_static.a").write_bytes(b"!<arch>\n")
    tc = Toolchain(nvcc=wheel / "bin" / "nvcc", version="13.0.88", cuda_home=wheel, bin_dir=wheel / "bin")
    assert tc.host_link_flags() == (f"-L{wheel / 'lib'}",)
    (wheel / "targets" / "x86_64-linux" / "lib").mkdir(parents=True)   # a system-style toolkit
    assert tc.host_link_flags() == ()


def test_check_arch_and_inspect_tools(tmp_path):
    old = Toolchain(nvcc=tmp_path / "nvcc", version="12.4.131", cuda_home=tmp_path, bin_dir=tmp_path)
    old.check_arch("sm90a")
    with pytest.raises(KspecError, match="cannot build for sm100a"):
        old.check_arch("sm100a")
    with pytest.raises(KspecError, match="unknown arch"):
        old.check_arch("sm80")
    with pytest.raises(KspecError, match="cuobjdump and nvdisasm not found"):
        old.require_inspect_tools()


def test_python_site_dirs_include_this_interpreters_nvidia_namespace():
    dirs = {os.path.normpath(d) for d in python_site_dirs()}
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    if spec is None:
        pytest.skip("no pip nvidia-* package installed in this interpreter")
    for loc in spec.submodule_search_locations:
        assert os.path.normpath(os.path.dirname(loc)) in dirs


def test_system_toolchain_if_present():
    try:
        tc = find_toolchain()
    except KspecError as e:
        pytest.skip(f"no nvcc on this machine: {e.message}")
    assert tc.nvcc.is_file() and (tc.bin_dir / "nvcc").is_file()
    assert len(tc.version_tuple) == 3 and tc.version_tuple >= (12, 0, 0)


# ---- the real pip wheel toolchain ----

def _wheel_site() -> Path | None:
    """site-packages of a venv with `cuda-toolkit[nvcc,...]` wheels: $KSPEC_TEST_TOOLKIT_SITE, or
    the throwaway venv /tmp/kspec-tk-venv (`python -m venv /tmp/kspec-tk-venv &&
    /tmp/kspec-tk-venv/bin/pip install "cuda-toolkit[nvcc,cudart,cccl,crt,nvvm]==13.0.*"`)."""
    explicit = os.environ.get("KSPEC_TEST_TOOLKIT_SITE")
    cands = [explicit] if explicit else glob.glob("/tmp/kspec-tk-venv/lib/python3*/site-packages")
    for c in cands:
        if c and (Path(c) / "nvidia" / "cu13" / "bin" / "nvcc").is_file():
            return Path(c)
    return None


TINY = r"""
extern "C" __global__ void kspec_kernel(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __expf(x[i]);
}
"""


@pytest.mark.nvcc
def test_pip_wheel_nvcc_discovered_and_compiles_sm90a(tmp_path, monkeypatch):
    site = _wheel_site()
    if site is None:
        pytest.skip("no pip CUDA toolkit wheels (set KSPEC_TEST_TOOLKIT_SITE or create /tmp/kspec-tk-venv)")
    # PATH without any system CUDA: only the OS's own tools (the host compiler).
    bare_path = os.pathsep.join(p for p in ("/usr/bin", "/bin") if os.path.isdir(p))
    # Discovery through the interpreter's import machinery, as in a venv with the wheels.
    probe = subprocess.run(
        [sys.executable, "-c", "from kspec.backends.toolchain import find_toolchain as f; t = f(); "
                               "print(t.source, t.nvcc, t.version)"],
        env={"PATH": bare_path, "PYTHONPATH": str(site),
             "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    source, nvcc, version = probe.stdout.split()
    assert source == "pip" and Path(nvcc) == site / "nvidia" / "cu13" / "bin" / "nvcc"
    assert version.startswith("13.0.")

    tc = find_toolchain(env={"PATH": bare_path}, site_dirs=[site])
    assert tc.source == "pip" and tc.host_link_flags() == (f"-L{tc.cuda_home / 'lib'}",)
    (tmp_path / "k.cu").write_text(TINY)
    env = tc.env({"PATH": bare_path, "HOME": str(tmp_path)})
    out = subprocess.run([str(tc.nvcc), "-cubin", "-arch=sm_90a", "-o", "k.cubin", "k.cu"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "k.cubin").read_bytes()[:4] == b"\x7fELF"
    if tc.cuobjdump and tc.nvdisasm:
        from kspec.backends.inspect import sass_summary
        k = sass_summary(tmp_path / "k.cubin", tc).kernel("kspec_kernel")
        assert k.arch == "sm_90a" and k.count("MUFU.EX2") == 1

    # Through the build driver, device and host kinds (the host .so links the wheel's static cudart).
    from kspec.backends.build import BuildJob, CompileCache, build_all
    monkeypatch.setenv("PATH", bare_path)
    src = TINY.replace("extern", "#ifdef KSPEC_DEVICE\nextern") + "#endif\n"
    results = build_all([BuildJob("kernel tiny on sm90a", src, "sm90a", "cubin"),
                         BuildJob("kernel tiny on sm100a", src, "sm100a", "host")],
                        tc, CompileCache(tmp_path / "cache"), max_parallel=1)
    assert [r.path.name for r in results] == ["kernel.cubin", "kernel.so"]
    assert all(r.path.read_bytes()[:4] == b"\x7fELF" for r in results)
