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
