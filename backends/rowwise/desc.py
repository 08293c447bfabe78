"""The row kernel's description (`RowwiseDesc`: what the generator hands the source emitter and the
host glue) and the constants both share: the vector width, the shared-memory budget per CTA and the
largest cluster."""
from __future__ import annotations

from dataclasses import dataclass

from kspec.core import DTYPE_TABLE, FLOAT_DTYPES

V = 8                              # elements per vector step (128-bit for 16-bit types)
SMEM_BUDGET = 96 * 1024            # cached-row bytes per CTA before a cluster splits the row
MAX_CLUSTER = 8
COLSUM_TX, COLSUM_TY = 32, 8         # colsum kernel: 32 columns per CTA, the partial rows split 8 ways
_ITEMSIZE = {name: d.itemsize for name, d in DTYPE_TABLE.items()}
_FLOAT = FLOAT_DTYPES
_IDENTITY = {"sum": "0.0f", "mean": "0.0f", "max": "(-INFINITY)", "min": "INFINITY"}
_COMBINE = {"sum": "{a} + {b}", "mean": "{a} + {b}", "max": "fmaxf({a}, {b})", "min": "fminf({a}, {b})"}


@dataclass(frozen=True)
class RowwiseDesc:
    """A generated row kernel: `body` is the kernel body over sanitized names; the rest is what the
    host glue needs to choose the launch."""
    name: str
    arch: str
    body: str
    args: tuple[str, ...]             # buffer identifiers in pointer order
    scalars: tuple[str, ...]
    dims: tuple[str, ...]             # d0..d<k-1> outer extents, d<k> row length, then strides/extents
    n_outer: int
    vec_checks: tuple[tuple[int, int, tuple[int, ...]], ...]   # (arg, itemsize, stride dims) of row-indexed buffers
    cache_bytes: int                  # shared-memory bytes per row element: cached inputs + column accumulators
    n_passes: int
    n_slots: int                      # most reductions folded at once
    strides: tuple[tuple[str, str, int], ...] = ()   # stride dim role -> (argument, axis)
    # element size of each argument: what the element-by-element path needs (the glue takes the
    # 128-bit vector path only where every row pointer and stride allows it)
    arg_bytes: tuple[int, ...] = ()
    # column partials: the row slots (grid-stride over the rows; the launch has slots / TY * cs CTAs)
    # and, for a "colsum" kernel, the finishing of them (colsum.py)
    slots: int = 0
    kind: str = "row"                 # row | colsum

