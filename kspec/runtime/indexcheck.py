"""The pre-launch check of index tensors: every integer input whose values are subscripts
(`KernelEntry.index_ranges`, recorded by `kspec compile`; see kspec.core.IndexRange) must hold
values in range, else the call raises `KspecRuntimeError` naming the kernel, the tensor, the first
offending position (in C order), its value and the valid range, and nothing is launched.

Cost: the index tensors are read to the host, one device-to-host copy each, ordered on the launch
stream and waited for, so the host waits for the work queued before the call (a stream sync).  For
a cross-entropy over M rows that is 4*M bytes.  It is on by default; `kspec.load(path,
check_indices=False)` or `kernel.check_indices = False` turns it off (hot loops that know their
indices are valid).  Under CUDA graph capture it is skipped: a capture cannot synchronise, and a
replay reads whatever the index tensors hold then.  With the check off, the kernels still never read
out of bounds: an out-of-range index reads NaN (see the README, "Index checks").
"""
from __future__ import annotations

from typing import Any, Mapping

from kspec.core import IndexRange, format_extent
from kspec.runtime.errors import KspecRuntimeError


def check_index_values(kernel: str, ranges: tuple[IndexRange, ...], sizes: Mapping[str, int],
                       values: Mapping[str, Any]) -> None:
    """Raise for the first range (in recorded order) that a value of its tensor violates.
    values: tensor name -> host numpy array indexed like the tensor; sizes: size symbol -> value."""
    import numpy as np

    def first(bad) -> tuple[str, tuple[int, ...], str]:
        pos = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
        count = int(bad.sum())
        where = f"[{', '.join(map(str, pos))}]" if pos else ""
        return where, pos, f" ({count} values out of range)" if count > 1 else ""

    for r in ranges:
        a = np.asarray(values[r.tensor])
        hi = r.bound(sizes)
        bad = (a > hi) if r.inclusive else (a >= hi)
        if not r.negative:
            bad |= a < 0
        if r.ignore is not None:        # an ignore index: the kernels read nothing for it
            bad &= a != r.ignore
        hint = f"every value of '{r.tensor}' selects an element of '{r.target}'; nothing was launched"
        if bad.any():
            where, pos, more = first(bad)
            size = f"size {hi}" if isinstance(r.extent, int) else f"{format_extent(r.extent)} = {hi}"
            raise KspecRuntimeError(f"{kernel}: {r.tensor}{where} = {int(a[pos])} is out of range for {r.target} "
                                    f"axis {r.axis} ({size}): expected {r.condition(hi)}{more}", hint=hint)
        if r.monotonic and a.ndim and a.shape[-1] > 1:
            down = np.zeros(a.shape, dtype=bool)
            down[..., 1:] = a[..., 1:] < a[..., :-1]
            if down.any():
                where, pos, _ = first(down)
                prev = (*pos[:-1], pos[-1] - 1)
                raise KspecRuntimeError(
                    f"{kernel}: {r.tensor}{where} = {int(a[pos])} is less than {r.tensor}"
                    f"[{', '.join(map(str, prev))}] = {int(a[prev])}: expected non-decreasing offsets along "
                    f"its last axis", hint=hint)
        if r.ends and a.ndim and a.shape[-1] and (a[..., 0] != 0).any():
            late = a[..., 0] != 0
            pos = (*(int(i) for i in np.unravel_index(int(np.argmax(late)), late.shape)), 0)
            raise KspecRuntimeError(
                f"{kernel}: the first offset {r.tensor}[{', '.join(map(str, pos))}] = {int(a[pos])} must be 0",
                hint=f"sequence b is rows {r.tensor}[b] .. {r.tensor}[b + 1] - 1 of '{r.target}': the first sequence "
                     "starts at its first row (rows before it would never be written); nothing was launched")
        if r.ends and a.ndim and a.shape[-1] and (a[..., -1] != hi).any():
            short = a[..., -1] != hi
            pos = (*(int(i) for i in np.unravel_index(int(np.argmax(short)), short.shape)), a.shape[-1] - 1)
            size = f"size {hi}" if isinstance(r.extent, int) else f"{format_extent(r.extent)} = {hi}"
            raise KspecRuntimeError(
                f"{kernel}: the last offset {r.tensor}[{', '.join(map(str, pos))}] = {int(a[pos])} must be the row "
                f"count of {r.target} ({size})",
                hint=f"sequence b is rows {r.tensor}[b] .. {r.tensor}[b + 1] - 1 of '{r.target}': the last sequence "
                     "ends at its last row; nothing was launched")


def check_before_launch(kernel: str, ranges: tuple[IndexRange, ...], views: Mapping[str, Any],
                        sizes: Mapping[str, int], stream: int) -> None:
    """Read each index tensor among `views` (TensorViews of the call's arguments) on `stream` and
    check it (see the module docstring for the cost)."""
    from kspec.runtime.transfer import read_view
    values = {}
    for r in ranges:
        if r.tensor not in values:
            values[r.tensor] = read_view(views[r.tensor], stream, f"index tensor '{r.tensor}' of {kernel}")
    check_index_values(kernel, ranges, sizes, values)
