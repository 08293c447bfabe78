"""kspec: declarative kernel specs compiled to fused CUTLASS kernels for Hopper and Blackwell."""
__version__ = "0.1.0"

from kspec.spec_lang.errors import KspecError  # noqa: E402
from kspec.runtime import load  # noqa: E402,F401

__all__ = ["KspecError", "__version__"]
