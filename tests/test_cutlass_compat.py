"""The offline shim for cutlass_cppgen (backends/cutlass/compat.py): each workaround, and that
nothing stays patched after the block."""
from __future__ import annotations

import importlib
import os

import pytest

from kspec.backends.cutlass import compat
from kspec.spec_lang.errors import KspecError, KspecInternalError

_PATCHED = ("_nvcc_version", "_NVCC_VERSION", "device_id", "initialize_cuda_context",
            "check_cuda_versions", "device_cc", "_option_registry")


def _snapshot() -> dict:
    cg = compat._import_cutlass_cppgen()      # not from the cwd: see compat
    snap = {("cutlass_cppgen", n): getattr(cg, n, None) for n in _PATCHED}
    for mod in compat._DEVICE_CC_CALLERS:
        snap[(mod, "device_cc")] = importlib.import_module(mod).device_cc
    return snap


def test_installed_version_is_tested():
    v = compat.check_cutlass_version()
    assert v.startswith("4.2.")
    assert compat.cutlass_version() == v


@pytest.mark.parametrize("version", ["4.3.0", "4.1.0.0", "3.9.2"])
def test_untested_version_raises_clear_error(version):
    with pytest.raises(KspecError, match=rf"nvidia-cutlass {version} is not a version kspec was tested"):
        compat.check_cutlass_version(version)


def test_include_dirs_hold_cutlass_and_util_headers():
    inc, util = compat.cutlass_include_dirs()
    assert os.path.isfile(os.path.join(inc, "cutlass", "cutlass.h"))
    assert os.path.isfile(os.path.join(inc, "cute", "tensor.hpp"))
    assert os.path.isfile(os.path.join(util, "cutlass", "util", "packed_stride.hpp"))


def test_unsupported_cc_and_old_toolkit_raise():
    with pytest.raises(KspecError, match="compute capability 80"):
        with compat.offline(80):
            pass
    with pytest.raises(KspecError, match="too old for sm_100a"):
        compat.check_cc(100, "12.4")
    compat.check_cc(90, "12.4")


@pytest.mark.parametrize("cc", [90, 100])
def test_device_cc_reports_target_inside_and_is_restored(cc):
    before = _snapshot()
    with compat.offline(cc, toolkit="13.0") as cg:
        assert cg.device_cc() == cc
        for mod in compat._DEVICE_CC_CALLERS:
            assert importlib.import_module(mod).device_cc() == cc
        assert cg._nvcc_version == "13.0" and cg._NVCC_VERSION == "13.0"
    assert _snapshot() == before


def test_device_queries_are_refused_inside():
    with compat.offline(90) as cg:
        for fn in (cg.device_id, cg.initialize_cuda_context, cg.check_cuda_versions):
            with pytest.raises(KspecInternalError, match="offline"):
                fn()


def test_option_registry_holds_only_target_cc_and_is_cached():
    import cutlass_library
    from cutlass_cppgen.library_defaults import OptionRegistry
    with compat.offline(90) as cg:
        reg = cg.get_option_registry()
        assert isinstance(reg, OptionRegistry)
        assert list(reg.registry) == [90]
        opts = reg.options_for_cc(90)
        tensorop = opts.operations_by_opclass[cutlass_library.OpcodeClass.TensorOp]
        f16 = cutlass_library.DataType.f16
        assert any(k[0] == (f16, f16, cutlass_library.DataType.f32) for k in tensorop)
        with pytest.raises(KspecInternalError):
            reg.options_for_cc(80)
    with compat.offline(90) as cg:
        assert cg.get_option_registry() is reg       # built once per process


def test_op_gemm_plans_without_a_gpu_or_cuda_cuda():
    """op.Gemm with cuda-python 13 and no driver: the classic failure points are never reached."""
    import cutlass_library as lib
    with compat.offline(90) as cg:
        plan = cg.op.Gemm(element=lib.DataType.f16, layout=lib.LayoutType.RowMajor,
                          element_accumulator=lib.DataType.f32, cc=90, kernel_cc=90)
        assert plan.op_class == lib.OpcodeClass.TensorOp
        assert plan.tile_descriptions()


def test_everything_restored_after_an_exception():
    before = _snapshot()
    with pytest.raises(ValueError):
        with compat.offline(90):
            raise ValueError("boom")
    assert _snapshot() == before


def test_dtype_and_layout_views():
    import cutlass_library as lib
    assert compat.library_dtype("tf32") == lib.DataType.f32        # tf32 kernels take f32 storage
    assert compat.library_dtype("f8e4m3") == lib.DataType.e4m3
    assert compat.library_layout("col") == lib.LayoutType.ColumnMajor
    with pytest.raises(KspecError):
        compat.library_dtype("f64")


def test_generator_is_importable_when_argv_has_dash_m(monkeypatch):
    """cutlass_library skips importing its generator when '-m' is in sys.argv (pytest -m ...)."""
    import sys
    import cutlass_library
    monkeypatch.setattr(sys, "argv", [sys.argv[0], "-m", "nvcc"])
    monkeypatch.delattr(cutlass_library, "generator", raising=False)
    monkeypatch.delitem(sys.modules, "cutlass_library.generator", raising=False)
    with compat.offline(90):
        assert hasattr(cutlass_library, "generator")
        assert hasattr(cutlass_library.generator, "GenerateSM90")


def test_first_import_does_not_create_cache_db_in_cwd(tmp_path):
    import subprocess
    import sys
    code = ("from kspec.backends.cutlass import compat\n"
            "with compat.offline(90) as cg:\n"
            "    assert cg.device_cc() == 90\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "compiled_cache.db").exists()
