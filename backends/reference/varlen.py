"""Argument errors of the numpy reference (KspecReferenceError), and its packed (varlen) arguments: `packed(cu)` tensors arrive as [total, ...]
arrays whose sequence b is rows cu[b] .. cu[b + 1] - 1 (spec_lang/check.py, "variable-length
batches").  `unpack` gives the logical [B, S, ...] array the graph computes on (S the longest
sequence; absent positions hold 0 and take part in nothing: the checker masks the softmax over a
packed axis), `pack` stores an output's present rows only."""
from __future__ import annotations

import numpy as np

from kspec.core import KspecError, split_offset_dim


class KspecReferenceError(KspecError):
    """Wrong arguments to a reference callable."""


def check_offsets(name: str, cu: np.ndarray, rows: int, packed: str) -> np.ndarray:
    """The offsets `cu` of the packed tensor `packed` ([rows, ...]) as int64; wrong ones raise."""
    cu = np.asarray(cu).astype(np.int64)
    if cu.ndim != 1 or cu.size < 1:
        raise KspecReferenceError(f"argument '{name}': expected a vector of B + 1 offsets, got shape {cu.shape}")
    if (cu < 0).any() or (cu > rows).any():
        k = int(np.argmax((cu < 0) | (cu > rows)))
        raise KspecReferenceError(f"argument '{name}': {name}[{k}] = {int(cu[k])} is outside the {rows} rows of "
                                  f"'{packed}' (expected 0 <= {name} <= {rows})")
    if (np.diff(cu) < 0).any():
        k = int(np.argmax(np.diff(cu) < 0)) + 1
        raise KspecReferenceError(f"argument '{name}': {name}[{k}] = {int(cu[k])} is less than {name}[{k - 1}] = "
                                  f"{int(cu[k - 1])}: offsets must not decrease")
    if int(cu[0]) != 0:
        raise KspecReferenceError(f"argument '{name}': the first offset {name}[0] = {int(cu[0])} must be 0",
                                  hint="sequence b is rows cu[b] .. cu[b + 1] - 1; the first sequence starts at the "
                                       "first row")
    if int(cu[-1]) != rows:
        raise KspecReferenceError(f"argument '{name}': the last offset {name}[{cu.size - 1}] = {int(cu[-1])} must be "
                                  f"the row count of '{packed}', {rows}",
                                  hint="sequence b is rows cu[b] .. cu[b + 1] - 1; the last sequence ends at the last row")
    return cu


def unpack(a: np.ndarray, cu: np.ndarray, longest: int) -> np.ndarray:
    lengths = np.diff(cu)
    out = np.zeros((len(lengths), longest) + a.shape[1:], dtype=a.dtype)
    for b, (start, n) in enumerate(zip(cu[:-1], lengths)):
        out[b, :n] = a[start:start + n]
    return out


def pack(x: np.ndarray, cu: np.ndarray) -> np.ndarray:
    lengths = np.diff(cu)
    out = np.zeros((int(cu[-1]),) + x.shape[2:], dtype=x.dtype)
    for b, (start, n) in enumerate(zip(cu[:-1], lengths)):
        out[start:start + n] = x[b, :n]
    return out


def bind_offsets(dim, n: int, sizes: dict, where: dict, name: str) -> bool:
    """A dimension `B + 1` of argument `name` with extent n binds B = n - 1 (True when dim is one)."""
    off = split_offset_dim(dim)
    if off is None:
        return False
    sym, k = off
    if n < k:
        raise KspecReferenceError(f"argument '{name}': expected at least {k} offsets ({sym} + {k}), got {n}")
    if sym in sizes and sizes[sym] != n - k:
        raise KspecReferenceError(f"argument '{name}': {n} offsets mean {sym} = {n - k}, but {sym} = {sizes[sym]} "
                                  f"from {where[sym]}")
    sizes[sym], sizes[dim] = n - k, n
    where[sym] = where[dim] = f"argument '{name}'"
    return True


__all__ = ["KspecReferenceError", "bind_offsets", "check_offsets", "pack", "unpack"]
