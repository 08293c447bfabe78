"""Calls that would reduce over nothing are refused before any launch.

An output that is not empty while an input is empty can only get its values from a reduction over
that input's empty axis (a GEMM with K = 0, a row sum over N = 0, attention over T = 0 keys or a
head dimension of 0).  The language defines those (a sum over nothing is 0, a max -inf, a
logsumexp -inf; `kspec.reference` computes them), but kspec's kernels do not: a GEMM kernel never
clears its accumulator without a K tile (sm_100a keeps it in tensor memory) and a TMA descriptor
with a zero extent is invalid.  So such a call raises `KspecRuntimeError` naming the size that is
0, for every backend alike.  A call whose outputs are all empty launches nothing and is fine.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from kspec.runtime.errors import KspecRuntimeError

# (name, spec extents (symbols or ints), actual extents)
Tensor = tuple[str, Sequence[object], Sequence[int]]


def check_no_empty_reduction(kernel: str, inputs: Iterable[Tensor], outputs: Iterable[Tensor]) -> None:
    """Raise when some output is non-empty while some input is empty (see the module docstring)."""
    outputs = list(outputs)
    full = [o for o in outputs if math.prod(o[2]) > 0]
    if not full:
        return
    for name, spec, shape in inputs:
        if math.prod(shape) > 0:
            continue
        out, ospec, oshape = full[0]
        zero = [str(e) for e, n in zip(spec, shape) if n == 0]
        # the sizes of the empty input that the output does not range over: what it reduces over
        reduced = [z for z in zero if z not in {str(e) for e in ospec}] or zero
        sizes = ", ".join(f"{z} = 0" for z in dict.fromkeys(reduced))
        raise KspecRuntimeError(
            f"kernel '{kernel}': {sizes} (input '{name}' has shape {list(shape)}) while output '{out}' "
            f"{list(oshape)} is not empty: its values would be reductions over nothing, which kspec's "
            "kernels do not compute (an empty sum or max); the call is refused before any launch",
            hint="skip the call: a sum over nothing is 0 (a GEMM's D is then its epilogue applied to a zero "
                 "accumulator), which the caller can compute without a kernel")
