"""The kspec spec language: Lark grammar, AST, semantic checks and error reporting.

    text --parse--> ast.Program --check--> CheckedProgram (typed AST)
"""
from __future__ import annotations

from pathlib import Path

from .check import CheckedKernel, CheckedProgram, TensorInfo, check
from .errors import Diagnostic, KspecError, KspecInternalError, Span
from .parser import parse, parse_file
from .printer import print_program


def load_spec(path_or_text: str | Path, *, is_text: bool = False, file: str = "<string>") -> CheckedProgram:
    """Parse and check a spec file (or, with is_text=True, spec source text)."""
    program = parse(str(path_or_text), file) if is_text else parse_file(path_or_text)
    return check(program)


__all__ = ["CheckedKernel", "CheckedProgram", "Diagnostic", "KspecError", "KspecInternalError", "Span",
           "TensorInfo", "check", "load_spec", "parse", "parse_file", "print_program"]
