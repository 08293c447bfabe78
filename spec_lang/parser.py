"""Parse kspec text into the AST with a Lark LALR parser; syntax errors become `KspecError`s."""
from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import lark
from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from . import ast
from .errors import KspecError, Span

# Terminal names in words, for syntax errors.
_TERMINAL_WORDS = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "SHAPE3": "a shape like 128x128x64",
    "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'", "LPAR": "'('", "RPAR": "')'",
    "COMMA": "','", "COLON": "':'", "EQUAL": "'='", "PLUS": "'+'", "MINUS": "'-'", "STAR": "'*'",
    "SLASH": "'/'", "$END": "end of file",
}
_KEYWORD_GROUPS = [
    ({"F16", "BF16", "F32", "TF32", "F8E4M3", "F8E5M2", "I8", "I32"}, "a dtype (f16, bf16, f32, ...)"),
    ({"SUM", "MAX", "MIN", "MEAN", "SOFTMAX"}, "a reduction (sum, max, min, mean, softmax)"),
    ({"IN", "OUT", "PARAM"}, "a declaration (in, out, param)"),
    ({"ROW", "COL"}, "a layout (row, col)"),
    ({"SM90A", "SM100A"}, "an arch (sm90a, sm100a)"),
]


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("kspec.spec_lang").joinpath("kspec.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False)


def _expected_words(expected: set[str]) -> list[str]:
    words: list[str] = []
    rest = set(expected)
    for group, word in _KEYWORD_GROUPS:
        if rest & group:
            words.append(word)
            rest -= group
    for t in sorted(rest):
        if t in _TERMINAL_WORDS:
            words.append(_TERMINAL_WORDS[t])
        elif t.isupper() and not t.startswith("__"):
            words.append(f"'{t.lower()}'")
        # anonymous terminals (__ANON_n) carry no useful name
    if "a number" in words and "an integer" in words:
        words.remove("an integer")
    return sorted(set(words))


def _token_desc(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    return f"'{tok.value}'"


class _Build(Transformer):
    """Lark tree -> AST.  Spans come from the tree's propagated positions."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _span(self, meta_or_tok) -> Span | None:
        m = meta_or_tok
        if isinstance(m, Token):
            return Span(self.file, m.line, m.column, m.end_line, m.end_column)
        if getattr(m, "empty", True):
            return None
        return Span(self.file, m.line, m.column, m.end_line, m.end_column)

    # -- leaves --
    @v_args(inline=True)
    def role(self, tok): return str(tok)
    @v_args(inline=True)
    def layout(self, tok): return str(tok)
    @v_args(inline=True)
    def dtype(self, tok): return str(tok)
    @v_args(inline=True)
    def arch(self, tok): return str(tok)
    @v_args(inline=True)
    def reducer(self, tok): return tok

    @v_args(inline=True)
    def number(self, tok):
        text = str(tok)
        value = int(text) if tok.type == "INT" else float(text)
        return ast.Num(value, text, self._span(tok))

    @v_args(meta=True)
    def atom(self, meta, children):   # `atom -> number`
        return children[0]

    @v_args(meta=True)
    def signed_number(self, meta, children):
        if len(children) == 2:
            n = children[1]
            return ast.Num(-n.value, "-" + n.text, self._span(meta))
        return children[0]

    @v_args(inline=True)
    def default(self, num): return num

    @v_args(inline=True)
    def dim_sym(self, tok): return ast.Dim(str(tok), self._span(tok))

    @v_args(inline=True)
    def dim_lit(self, tok): return ast.Dim(int(str(tok)), self._span(tok))

    def shape(self, children): return tuple(children)

    def index_list(self, children): return [(str(t), self._span(t)) for t in children]

    @v_args(inline=True)
    def annotation(self, dt): return ("annotation", dt)

    # -- expressions --
    @v_args(meta=True)
    def access(self, meta, children):
        name = children[0]
        idx = children[1] if len(children) > 1 else []
        return ast.Access(str(name), tuple(i for i, _ in idx), self._span(meta), tuple(s for _, s in idx))

    @v_args(meta=True)
    def name_ref(self, meta, children):
        return ast.Name(str(children[0]), self._span(meta))

    @v_args(meta=True)
    def binop(self, meta, children):
        lhs, op, rhs = children
        return ast.Binary(str(op), lhs, rhs, self._span(meta))

    @v_args(meta=True)
    def neg(self, meta, children):
        return ast.Unary("-", children[1], self._span(meta))

    @v_args(meta=True)
    def paren(self, meta, children):
        return children[0]

    def arg_list(self, children): return list(children)

    @v_args(meta=True)
    def kwarg(self, meta, children):
        return ast.KwArg(str(children[0]), str(children[1]), self._span(meta))

    @v_args(meta=True)
    def call(self, meta, children):
        fn = children[0]
        args = children[1] if len(children) > 1 else []
        for a in args:
            if isinstance(a, ast.KwArg):
                raise KspecError(f"function '{fn}' takes no keyword arguments", a.span)
        return ast.Call(str(fn), tuple(args), self._span(meta), self._span(fn))

    @v_args(meta=True)
    def cast(self, meta, children):
        dt, args = children
        if len(args) != 1 or isinstance(args[0], ast.KwArg):
            raise KspecError(f"a cast takes exactly one argument: {dt}(x)", self._span(meta))
        return ast.Cast(dt, args[0], self._span(meta))

    @v_args(meta=True)
    def prefix_app(self, meta, children):
        op_tok, args, operand = children
        op = str(op_tok)
        indices, spans, options = [], [], []
        for a in args:
            if isinstance(a, ast.KwArg):
                options.append(a)
            elif isinstance(a, ast.Name):
                if options:
                    raise KspecError("keyword arguments must come after the index names", a.span)
                indices.append(a.name)
                spans.append(a.span)
            else:
                hint = None
                if op in ("max", "min"):
                    hint = f"`{op}(i) x` reduces over index i; for the elementwise {op} of two values write `{op}imum(a, b)`"
                raise KspecError(f"'{op}(...)' takes index names, not expressions", getattr(a, "span", None),
                                 hint=hint)
        return ast.Reduce(op, tuple(indices), operand, tuple(options), self._span(meta), tuple(spans))

    # -- declarations, statements, top level --
    @v_args(meta=True)
    def decl(self, meta, children):
        role, name, dt, *rest = children
        shape = layout = default = None
        for r in rest:
            if isinstance(r, tuple):
                shape = r
            elif isinstance(r, str):
                layout = r
            elif isinstance(r, ast.Num):
                default = r
        return ast.Decl(role, str(name), dt, shape, layout, default, self._span(meta), self._span(name))

    @v_args(meta=True)
    def stmt(self, meta, children):
        target, *rest = children
        idx, dt = [], None
        value = rest[-1]
        for r in rest[:-1]:
            if isinstance(r, list):
                idx = r
            elif isinstance(r, tuple) and r[0] == "annotation":
                dt = r[1]
        return ast.Stmt(str(target), tuple(i for i, _ in idx), dt, value, self._span(meta),
                        tuple(s for _, s in idx))

    @v_args(meta=True)
    def kernel(self, meta, children):
        name, *items = children
        decls = tuple(i for i in items if isinstance(i, ast.Decl))
        stmts = tuple(i for i in items if isinstance(i, ast.Stmt))
        return ast.Kernel(str(name), decls, stmts, self._span(meta), self._span(name))

    @v_args(inline=True)
    def shape3(self, tok):
        return (tuple(int(x) for x in str(tok).split("x")), str(tok))

    @v_args(inline=True)
    def int_value(self, tok):
        return (int(str(tok)), str(tok))

    @v_args(meta=True)
    def setting(self, meta, children):
        key, (value, text) = children
        return ast.Setting(str(key), value, text, self._span(meta))

    @v_args(meta=True)
    def schedule(self, meta, children):
        name = children[0]
        arch = None
        settings = []
        for c in children[1:]:
            if isinstance(c, str):
                arch = c
            else:
                settings.append(c)
        return ast.Schedule(str(name), arch, tuple(settings), self._span(meta), self._span(name))

    @v_args(meta=True)
    def target_decl(self, meta, children):
        return ast.Target(tuple(children), self._span(meta))

    def start(self, children):
        return children


def _syntax_error(e: UnexpectedInput, source: str, file: str) -> KspecError:
    line, col = e.line, e.column
    if isinstance(e, UnexpectedCharacters):
        ch = source[e.pos_in_stream] if 0 <= e.pos_in_stream < len(source) else "?"
        span = Span(file, line, col, line, col + 1)
        hint = None
        if ch == ";":
            hint = "statements need no terminator; remove the ';'"
        elif not ch.isascii():
            hint = "kspec source is ASCII: names are letters, digits and '_'"
        return KspecError(f"unexpected character {ch!r}", span, hint, source)
    if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
        lines = source.splitlines() or [""]
        line = len(lines)
        col = len(lines[-1]) + 1
        expected = _expected_words(set(getattr(e, "expected", ()) or getattr(e, "accepts", ()) or ()))
        msg = "unexpected end of file"
        if expected:
            msg += "; expected " + _join_or(expected)
        hint = "is a closing '}' missing?" if source.count("{") > source.count("}") else None
        return KspecError(msg, Span(file, line, col, line, col + 1), hint, source)
    assert isinstance(e, UnexpectedToken)
    tok = e.token
    expected = _expected_words(set(e.accepts or e.expected or ()))
    msg = f"unexpected {_token_desc(tok)}"
    if expected:
        msg += "; expected " + _join_or(expected)
    span = Span(file, tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + 1)
    hint = _syntax_hint(tok, e)
    return KspecError(msg, span, hint, source)


def _syntax_hint(tok: Token, e: UnexpectedToken) -> str | None:
    prev = getattr(e, "token_history", None)
    if tok.type in ("IN", "OUT", "PARAM", "ROW", "COL", "SUM", "MAX", "MIN", "MEAN", "SOFTMAX",
                    "F16", "BF16", "F32", "TF32", "F8E4M3", "F8E5M2", "I8", "I32", "KERNEL", "SCHEDULE",
                    "TARGET", "FOR", "SM90A", "SM100A") and "NAME" in (e.accepts or set()):
        return f"'{tok.value}' is a reserved word; choose another name"
    if prev and prev[-1].type == "RPAR" and tok.type in ("NAME",):
        return "a reduction is written `sum(k) A[m, k] * B[k, n]` (sum, max, min, mean, softmax)"
    return None


def _join_or(words: list[str]) -> str:
    if len(words) <= 1:
        return "".join(words)
    if len(words) > 6:
        return "one of " + ", ".join(words[:6]) + ", ..."
    return ", ".join(words[:-1]) + " or " + words[-1]


def parse(source: str, file: str = "<string>") -> ast.Program:
    """Parse kspec source text into an `ast.Program` (no semantic checks)."""
    try:
        tree = _parser().parse(source)
    except UnexpectedInput as e:
        raise _syntax_error(e, source, file) from None
    try:
        items = _Build(file).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, KspecError):
            raise e.orig_exc.with_source(source) from None
        raise
    except RecursionError:
        raise KspecError("expression nested too deeply", Span(file, 1, 1, 1, 2), source=source) from None
    kernels = tuple(i for i in items if isinstance(i, ast.Kernel))
    schedules = tuple(i for i in items if isinstance(i, ast.Schedule))
    targets = tuple(i for i in items if isinstance(i, ast.Target))
    return ast.Program(kernels, schedules, targets, file=file, source=source)


def parse_file(path: str | Path) -> ast.Program:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KspecError(f"no such file: {p}") from None
    except UnicodeDecodeError as e:
        raise KspecError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise KspecError(f"cannot read {p}: {e.strerror}") from None
    return parse(text, str(path))
