"""numpy reference backend: the semantics every GPU backend is tested against."""
from .executor import KspecReferenceError, ReferenceKernel, ReferenceModule, execute, reference

__all__ = ["KspecReferenceError", "ReferenceKernel", "ReferenceModule", "execute", "reference"]
