"""Source spans and the user-facing exception types (defined in `kspec.core`, re-exported here)."""
from kspec.core import Diagnostic, KspecError, KspecInternalError, Span

__all__ = ["Diagnostic", "KspecError", "KspecInternalError", "Span"]
