"""The CuTe DSL backend (see backend.py).

kspec depends on the DSL's library wheels (nvidia-cutlass-dsl-libs-cu13, -libs-base) and not on the
`nvidia-cutlass-dsl` meta wheel, which would also install the cu12 libraries; the meta wheel's only
other content is a .pth that puts the DSL's Python packages (`cutlass`, ...) on sys.path.  Importing
this package does the same, so `import cutlass` works in every process that builds with the DSL
(including the spawned build workers and the generated entry modules, which import this package)."""
import os
import sys


def _dsl_packages_on_path() -> None:
    try:
        import nvidia_cutlass_dsl
    except ImportError:              # the DSL is not installed: compat.available() says so
        return
    for base in getattr(nvidia_cutlass_dsl, "__path__", ()):
        p = os.path.join(base, "dsl_packages")
        if os.path.isdir(os.path.join(p, "cutlass")) and p not in sys.path:
            sys.path.insert(0, p)


_dsl_packages_on_path()
