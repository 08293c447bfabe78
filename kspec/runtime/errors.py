"""The runtime's user-facing exception (defined in `kspec.core`, re-exported here)."""
from kspec.core import KspecRuntimeError

__all__ = ["KspecRuntimeError"]
