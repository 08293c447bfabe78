"""The runtime's user-facing exception."""
from __future__ import annotations

from kspec.spec_lang.errors import KspecError


class KspecRuntimeError(KspecError):
    """A call that cannot run: bad arguments, no usable CUDA device, or a failed launch."""
