"""Spec names never reach generated code: every buffer a kernel touches gets a generated
identifier (`t0`, `t1`, ...), and `Names.back()` maps them to spec names for the manifest."""
from __future__ import annotations


class Names:
    def __init__(self):
        self.to_c: dict[str, str] = {}

    def __call__(self, buffer: str) -> str:
        if buffer not in self.to_c:
            self.to_c[buffer] = f"t{len(self.to_c)}"
        return self.to_c[buffer]

    def back(self) -> dict[str, str]:
        return {c: b for b, c in self.to_c.items()}


def number_placeholders(text: str, names: Names, scalars) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """Generated kernel text refers to buffer `tN` / scalar as `{tN}`; number the tensor arguments
    and the scalars (each in generated order) and put their positions in place of the placeholders.
    Returns (text, tensor arguments in ABI order, scalars in ABI order)."""
    def order(c: str) -> int:
        return int(c[1:])
    args = tuple(sorted({c for c in names.to_c.values() if c not in scalars}, key=order))
    scal = tuple(sorted(scalars, key=order))
    for group in (args, scal):
        for i, c in enumerate(group):
            text = text.replace(f"{{{c}}}", str(i))
    return text, args, scal
