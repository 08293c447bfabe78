"""`kspec doctor` on this GPU-less machine, and with stand-in drivers and registries."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types


from kspec import doctor


def _kspec(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kspec", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_doctor_cli_runs_anywhere(tmp_path):
    r = _kspec("doctor", env={"KSPEC_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for title in ("kspec:", "packages:", "driver:", "toolchain:", "cache:", "backends:", "summary:"):
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
