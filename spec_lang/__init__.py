"""The kspec spec language: Lark grammar, AST, semantic checks and error reporting."""
from .errors import Diagnostic, KspecError, KspecInternalError, Span

__all__ = ["Diagnostic", "KspecError", "KspecInternalError", "Span"]
