"""The CuTe DSL backend (see backend.py).

kspec depends on the DSL's library wheels (nvidia-cutlass-dsl-libs-cu13, -libs-base) and not on the
`nvidia-cutlass-dsl` meta wheel, which would also install the cu12 libraries; the meta wheel's only
other content is a .pth that puts the DSL's Python packages (`cutlass`, ...) on sys.path.  Importing
this package does the same, so `import cutlass` works in every process that builds with the DSL
(including the spawned build workers and the generated entry modules, which import this package).

It also chooses the DSL's CUDA flavour.  Left to itself, the DSL picks the newest flavour the CUDA
driver supports (the newest installed one when there is no driver), so a machine with a CUDA 12
driver, or with the cu12 libraries installed beside cu13 (which FlashAttention-4's dependency on the
meta wheel brings), could build with another flavour than a GPU-less build box, or refuse to build
at all.  kspec compiles ahead of time and never runs the DSL's code on the build machine's driver,
so it loads the cu13 flavour itself before the DSL chooses (`FLAVOUR`): the same binaries wherever
they are built, whatever else is installed.  `kspec doctor` reports other flavours and how to
remove them."""
import importlib.util
import os
import sys

FLAVOUR = "cu13"                                     # the one kspec builds with (nvcc 13)
_IR_MODULE = "cutlass._mlir._mlir_libs._cutlass_ir"  # what the DSL binds its chosen flavour to


def _dsl_packages_on_path() -> str | None:
    """The DSL's package directory, put on sys.path; None when the DSL is not installed."""
    try:
        import nvidia_cutlass_dsl
    except ImportError:              # the DSL is not installed: compat.available() says so
        return None
    for base in getattr(nvidia_cutlass_dsl, "__path__", ()):
        p = os.path.join(base, "dsl_packages")
        if os.path.isdir(os.path.join(p, "cutlass")):
            if p not in sys.path:
                sys.path.insert(0, p)
            return p
    return None


def flavour_files(packages: str) -> dict[str, str]:
    """{flavour: path} of the DSL's IR extension modules installed under `packages`."""
    libs = os.path.join(packages, "cutlass", "_mlir", "_mlir_libs")
    try:
        names = os.listdir(libs)
    except OSError:
        return {}
    out = {}
    for n in names:
        parts = n.split(".")
        if parts[0] == "_cutlass_ir" and len(parts) > 2 and parts[1].startswith("cu") and n.endswith(".so"):
            out[parts[1]] = os.path.join(libs, n)
    return out


def _load_flavour(packages: str | None) -> None:
    """Bind the cu13 IR module where the DSL looks for its chosen flavour, before the DSL chooses
    (the DSL keeps a module already bound).  Nothing to do once `cutlass` is imported."""
    if packages is None or _IR_MODULE in sys.modules or "cutlass" in sys.modules:
        return
    path = flavour_files(packages).get(FLAVOUR)
    if path is None:                 # no cu13 libraries: the DSL chooses; compat.available() judges it
        return
    spec = importlib.util.spec_from_file_location(_IR_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_IR_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_IR_MODULE, None)
        raise


_load_flavour(_dsl_packages_on_path())
