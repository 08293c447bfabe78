"""kspec: declarative kernel specs compiled to fused CUTLASS kernels for Hopper and Blackwell.

    kspec.reference(spec, kernel=None)   numpy callables (the semantics; no GPU needed)
    kspec.load(artifact_dir)             compiled kernels as Python callables (cuda-python launch)
"""
__version__ = "0.1.0"

from kspec.spec_lang.errors import KspecError  # noqa: E402
from kspec.runtime import load  # noqa: E402
from kspec.backends.reference import reference  # noqa: E402

__all__ = ["KspecError", "__version__", "load", "reference"]
