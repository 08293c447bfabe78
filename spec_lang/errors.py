"""Source spans and the one user-facing exception type, `KspecError`, with its rendering."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """A half-open region of a source file; lines and columns are 1-based."""
    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass
class Diagnostic:
    message: str
    span: Span | None = None
    hint: str | None = None
    source: str | None = field(default=None, repr=False)

    def render(self) -> str:
        where = f"{self.span}: " if self.span else ""
        out = [f"{where}error: {self.message}"]
        if self.span and self.source is not None:
            # split on '\n' only: spans count lines the way Lark does, and str.splitlines() would
            # also break at '\f', '\x1c', '\u2028', ... (legal inside comments)
            lines = self.source.split("\n")
            if 1 <= self.span.line <= len(lines):
                text = lines[self.span.line - 1].rstrip("\r").expandtabs(1)
                out.append("    " + text)
                width = 1
                if self.span.end_line == self.span.line and self.span.end_col > self.span.col:
                    width = self.span.end_col - self.span.col
                width = max(1, min(width, len(text) - self.span.col + 2))
                out.append("    " + " " * (self.span.col - 1) + "^" * width)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


class KspecError(Exception):
    """A mistake in the user's spec, arguments or environment.  Carries one or more diagnostics,
    each with an optional source span and hint; `str()` renders them the way the CLI prints them."""

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None,
                 source: str | None = None, diagnostics: list[Diagnostic] | None = None):
        if diagnostics is None:
            diagnostics = [Diagnostic(message, span, hint, source)]
        self.diagnostics = diagnostics
        first = diagnostics[0]
        self.message, self.span, self.hint = first.message, first.span, first.hint
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)

    def with_source(self, source: str) -> "KspecError":
        for d in self.diagnostics:
            if d.source is None:
                d.source = source
        self.args = (self.render(),)
        return self


class KspecInternalError(Exception):
    """A bug in kspec itself (the CLI exits 2 with an issue-report hint)."""
