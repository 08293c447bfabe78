"""`kspec doctor` on this GPU-less machine, and with stand-in drivers and registries."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest


from kspec import doctor


def _kspec(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kspec", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_doctor_cli_runs_anywhere(tmp_path):
    r = _kspec("doctor", env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for title in ("kspec:", "packages:", "cute dsl:", "driver:", "toolchain:", "cache:", "backends:", "summary:"):
        assert f"\n{title}" in "\n" + out, title
    assert str(tmp_path / "c") in out and "none yet" in out
    assert "Traceback" not in r.stderr
    from kspec.runtime import cuda_available
    if not cuda_available()[0]:
        assert "unavailable:" in out.split("driver:")[1].split("toolchain:")[0]
        assert "run here      yes" not in out and "run here" in out


def test_doctor_json_without_toolchain(tmp_path):
    r = _kspec("doctor", "--json", env={"KSPEC_NVCC": str(tmp_path / "no-nvcc"),
                                         "KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["can_compile"] is (data["sections"]["backends"]["cute"] == "usable")   # the CuTe DSL needs no nvcc
    assert data["sections"]["toolchain"]["nvcc"].startswith("not found: KSPEC_NVCC=")
    assert data["sections"]["backends"]["generic"].startswith("unavailable: KSPEC_NVCC=")
    assert list(data["sections"]["backends"]) == ["cute", "cutlass", "rowwise", "generic"]   # the registry's order
    assert any("not compiled" in n for n in data["notes"])


class _FakeDriver:
    def available(self):
        return True, ""

    def call(self, fn, *args, what=""):
        assert fn == "cuDriverGetVersion"
        return 13000

    def device_count(self):
        return 3

    def facts(self, i):
        if i == 2:
            raise RuntimeError("cuDeviceGetAttribute failed: CUDA_ERROR_UNKNOWN")
        return [(9, 0, 132, "NVIDIA H100 80GB HBM3"), (8, 0, 108, "NVIDIA A100")][i]


def test_doctor_lists_gpus_and_their_arch(monkeypatch):
    from kspec.runtime import driver
    monkeypatch.setattr(driver, "Driver", _FakeDriver)
    report = doctor.collect()
    text = report.render()
    assert report.can_run is True
    assert "version" in text and "13.0 (CUDA driver API 13000)" in text
    assert "cuda:0  " in text or "cuda:0" in text
    assert "NVIDIA H100 80GB HBM3, compute capability 9.0, 132 SMs -> kspec arch sm90a" in text
    assert "NVIDIA A100, compute capability 8.0, 108 SMs -> not a kspec target" in text
    assert "cuda:2" in text and "cannot query: cuDeviceGetAttribute failed" in text


def test_doctor_asks_the_backend_registry_when_there_is_one(monkeypatch):
    class B:
        def __init__(self, name, reason):
            self.name, self._reason = name, reason

        def available(self):
            if self._reason == "boom":
                raise RuntimeError("probe crashed")
            return self._reason
    fake = types.ModuleType("kspec.backends.registry")
    fake.backends = lambda: [B("cutlass", None), B("cute_dsl", "needs nvidia-cutlass-dsl"), B("odd", "boom")]
    import kspec.backends
    monkeypatch.setitem(sys.modules, "kspec.backends.registry", fake)
    monkeypatch.setattr(kspec.backends, "registry", fake, raising=False)
    sec, usable = doctor._backends(toolchain=None)
    assert usable and dict(sec.rows) == {"cutlass": "usable", "cute_dsl": "unavailable: needs nvidia-cutlass-dsl",
                                         "odd": "unavailable: probe crashed"}


def test_a_broken_probe_does_not_stop_the_report(monkeypatch, capsys):
    def broken():
        raise OSError("disk on fire")
    monkeypatch.setattr(doctor, "_cache", broken)
    report = doctor.collect()
    assert ("status", "probe failed: disk on fire") in next(s for s in report.sections if s.title == "cache").rows
    assert doctor.main() == 0
    out = capsys.readouterr().out
    assert "probe failed: disk on fire" in out and "backends:" in out


# ---------------------------------------------------------------- the CuTe DSL's flavour

_CUDA12_DRIVER = """
import ctypes, os, sys
_real = ctypes.CDLL
class _Cuda12:                                   # a libcuda whose driver supports CUDA 12.9
    def cuDriverGetVersion(self, ref):
        ref._obj.value = 12090
        return 0
ctypes.CDLL = lambda name, *a, **k: _Cuda12() if name == "libcuda.so.1" else _real(name, *a, **k)
import nvidia_cutlass_dsl
sys.path.insert(0, os.path.join(list(nvidia_cutlass_dsl.__path__)[0], "dsl_packages"))
if sys.argv[1] == "kspec":
    import kspec.backends.cute
import cutlass.cute
from cutlass.base_dsl.version_info import CUDA_VERSION
print(os.path.basename(sys.modules["cutlass._mlir._mlir_libs._cutlass_ir"].__file__).split(".")[1], CUDA_VERSION.major)
"""


def test_kspec_builds_with_cu13_whatever_the_driver_prefers():
    """Left to itself the DSL picks its flavour by the CUDA driver: with a CUDA 12 driver it refuses
    the cu13 libraries (or takes cu12 where those are installed too).  kspec binds cu13 first."""
    pytest.importorskip("nvidia_cutlass_dsl", reason="the CuTe DSL is not installed")
    plain = subprocess.run([sys.executable, "-c", _CUDA12_DRIVER, "plain"], capture_output=True, text=True,
                           timeout=300)
    assert ((plain.returncode != 0 and "are compatible with the CUDA driver" in plain.stderr)
            or plain.stdout.split() == ["cu12", "12"]), \
        plain.stdout + plain.stderr[-1000:]
    ours = subprocess.run([sys.executable, "-c", _CUDA12_DRIVER, "kspec"], capture_output=True, text=True,
                          timeout=300)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout.split() == ["cu13", "13"]


def test_flavour_files_reads_the_dsl_layout(tmp_path):
    from kspec.backends.cute import flavour_files
    libs = tmp_path / "cutlass" / "_mlir" / "_mlir_libs"
    libs.mkdir(parents=True)
    for n in ("_cutlass_ir.cu12.cpython-311-x86_64-linux-gnu.so", "_cutlass_ir.cu13.cpython-311-x86_64-linux-gnu.so",
              "_cutlass_ir_version_cu13.py", "__init__.py"):
        (libs / n).write_text("")
    assert flavour_files(str(tmp_path)) == {"cu12": str(libs / "_cutlass_ir.cu12.cpython-311-x86_64-linux-gnu.so"),
                                            "cu13": str(libs / "_cutlass_ir.cu13.cpython-311-x86_64-linux-gnu.so")}
    assert flavour_files(str(tmp_path / "nowhere")) == {}


def _dsl_notes(monkeypatch, dists, torch_requires=None):
    monkeypatch.setattr(doctor, "_installed", lambda prefix: dict(dists))
    monkeypatch.setattr(doctor, "_probe_gpu_torch_wanted", lambda: False)
    if torch_requires is not None:
        import importlib.metadata as md
        real = md.requires
        monkeypatch.setattr(md, "requires", lambda d: torch_requires if d == "torch" else real(d))
    notes: list[str] = []
    section = doctor._cute_dsl(notes)
    return dict(section.rows), notes


def test_doctor_names_mixed_flavours_with_the_command_that_removes_them(monkeypatch):
    rows, notes = _dsl_notes(monkeypatch, {"nvidia-cutlass-dsl": "4.8.1", "nvidia-cutlass-dsl-libs-base": "4.8.1",
                                           "nvidia-cutlass-dsl-libs-cu12": "4.8.1",
                                           "nvidia-cutlass-dsl-libs-cu13": "4.8.1"})
    assert rows["flavours"] == "cu12, cu13" and rows["builds with"].startswith("cu13")
    (note,) = [n for n in notes if "cu12" in n]
    assert note.endswith("to remove them: pip uninstall -y nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-cu12")


def test_doctor_names_a_wrong_or_missing_dsl_with_the_install_command(monkeypatch):
    _, notes = _dsl_notes(monkeypatch, {"nvidia-cutlass-dsl-libs-base": "4.7.0", "nvidia-cutlass-dsl-libs-cu12": "4.7.0"})
    fix = 'pip install "nvidia-cutlass-dsl-libs-cu13==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1"'
    assert f"CuTe DSL 4.7.0 is installed; kspec needs 4.8.1: {fix}" in notes
    assert f"the CuTe DSL's cu13 libraries are missing: {fix}" in notes
    _, notes = _dsl_notes(monkeypatch, {})
    assert notes == [f"the CuTe DSL is not installed (GEMMs and attention fall back to CUTLASS C++): {fix}"]


def test_doctor_says_a_cpu_torch_is_enough_to_build(monkeypatch):
    if doctor._dist_version("torch") is None:
        pytest.skip("torch is not installed")
    dists = {"nvidia-cutlass-dsl-libs-base": "4.8.1", "nvidia-cutlass-dsl-libs-cu13": "4.8.1"}
    _, notes = _dsl_notes(monkeypatch, dists, torch_requires=["nvidia-cublas-cu12==12.8", "filelock"])
    assert any("is a CUDA build" in n and "--index-url https://download.pytorch.org/whl/cpu" in n for n in notes)
    _, notes = _dsl_notes(monkeypatch, dists, torch_requires=["filelock"])
    assert not any("CUDA build" in n for n in notes)
