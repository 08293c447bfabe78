"""Parse kspec text into the AST with a Lark LALR parser; syntax errors become `KspecError`s."""
from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

import lark
from lark import Lark, Token, Transformer_NonRecursive, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from kspec.core import ARCHS, DTYPES

from . import ast
from .errors import KspecError, Span

# Terminal names in words, for syntax errors.
_TERMINAL_WORDS = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "SHAPE3": "a shape like 128x128x64",
    "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'", "LPAR": "'('", "RPAR": "')'",
    "COMMA": "','", "COLON": "':'", "EQUAL": "'='", "PLUS": "'+'", "MINUS": "'-'", "STAR": "'*'",
    "SLASH": "'/'", "PERCENT": "'%'", "CMP": "a comparison (<, <=, >, >=, ==, !=)", "INF": "'inf'",
    "AND": "'and'", "OR": "'or'", "NOT": "'not'", "$END": "end of file",
}
_KEYWORD_GROUPS = [
    ({d.upper() for d in DTYPES}, "a dtype (f16, bf16, f32, ...)"),
    ({"SUM", "MAX", "MIN", "MEAN", "LOGSUMEXP", "SOFTMAX"}, "a reduction (sum, max, min, mean, logsumexp, softmax)"),
    ({"IN", "OUT", "PARAM"}, "a declaration (in, out, param)"),
    ({"ROW", "COL"}, "a layout (row, col)"),
    ({a.upper() for a in ARCHS}, f"an arch ({', '.join(ARCHS)})"),
]

# Deeper expressions than this are refused up front: the checker, the printer and every later stage
# recurse over expressions (a few frames a level), and a RecursionError must never reach the user.
# Real specs nest well under 20 levels.
MAX_NESTING = 100
# Longer sources are refused before parsing (the LALR parser takes about a second per 100 kB; real
# specs are a few kB, and a chain of 10,000 statements is about 270 kB).
MAX_SOURCE_BYTES = 512 * 1024
# Longer integer literals are refused before int() (Python refuses > 4300 digits with ValueError).
MAX_INT_DIGITS = 40
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("kspec.spec_lang").joinpath("kspec.lark").read_text()
    for rule, words in (("!dtype: DTYPES", DTYPES), ("!arch: ARCHS", ARCHS)):
        grammar = grammar.replace(rule, rule.split(":")[0] + ": " + " | ".join(f'"{w}"' for w in words))
    # cache=True: lark keeps the LALR tables in a temp file keyed by the grammar's hash, so a process
    # (e.g. a warm `kspec compile`) does not rebuild them (~0.3 s CPU)
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False, cache=True)


@functools.lru_cache(maxsize=1)
def reserved_words() -> frozenset[str]:
    """Every keyword of the grammar (`in`, `sum`, `f16`, ...): none of them can be used as a name."""
    return frozenset(t.pattern.value for t in _parser().terminals
                     if t.pattern.type == "str" and _NAME_RE.fullmatch(t.pattern.value))


_BINARY_OPERATORS = {"PLUS", "MINUS", "STAR", "SLASH", "PERCENT", "CMP", "AND", "OR"}


def _expected_words(expected: set[str]) -> list[str]:
    words: list[str] = []
    rest = set(expected)
    if {"STAR", "CMP", "AND"} <= rest:
        # after an operand: every binary operator fits; name them as one
        words.append("an operator (+ - * / % < <= == and or ...)")
        rest -= _BINARY_OPERATORS
    if "INF" in rest and ("FLOAT" in rest or "INT" in rest):
        rest.discard("INF")       # `inf` is a number
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


class _Build(Transformer_NonRecursive):
    """Lark tree -> AST.  Spans come from the tree's propagated positions.  Non-recursive, so a
    deep tree cannot overflow the Python stack here (MAX_NESTING protects the later stages)."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _name(self, tok: Token) -> str:
        """A NAME token's text.  The contextual lexer lets a keyword through as a NAME wherever the
        keyword itself cannot occur (`in in : f16[M]`), so reserved words are refused here."""
        text = str(tok)
        if text in reserved_words():
            raise KspecError(f"'{text}' is a reserved word and cannot be used as a name", self._span(tok),
                             f"choose another name, e.g. `{text}_`")
        return text

    def _int(self, tok: Token) -> int:
        text = str(tok)
        if len(text.lstrip("0")) > MAX_INT_DIGITS:
            raise KspecError(f"integer literal {_abbrev(text)} is too large", self._span(tok))
        return int(text)

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
        value = self._int(tok) if tok.type == "INT" else float(text)    # "inf" is float("inf")
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
    def dim_sym(self, tok): return ast.Dim(self._name(tok), self._span(tok))

    @v_args(inline=True)
    def dim_lit(self, tok): return ast.Dim(self._int(tok), self._span(tok))

    @v_args(inline=True)
    def dim_plus(self, tok, _plus, num): return ast.Dim(self._name(tok), self._span(tok), self._int(num))

    @v_args(inline=True)
    def dim_div(self, tok, _slash, num): return ast.Dim(self._name(tok), self._span(tok), div=self._int(num))

    @v_args(inline=True)
    def packed(self, tok): return ("packed", self._name(tok), self._span(tok))

    def shape(self, children): return tuple(children)

    def index_list(self, children): return [(self._name(t), self._span(t)) for t in children]

    @v_args(inline=True)
    def annotation(self, dt): return ("annotation", dt)

    # -- expressions --
    @v_args(meta=True)
    def access(self, meta, children):
        name = children[0]
        # a bare name as a whole subscript is an index (`x[m, label[m]]`); names inside subscript
        # arithmetic (`h / G`) stay names, which the checker resolves (index, param or size symbol)
        subs = [ast.IndexVar(x.name, x.span) if isinstance(x, ast.Name) else x
                for x in (children[1] if len(children) > 1 else [])]
        if all(isinstance(x, ast.IndexVar) for x in subs):
            return ast.Access(self._name(name), tuple(x.name for x in subs), self._span(meta),
                              tuple(x.span for x in subs))
        return ast.Gather(self._name(name), tuple(subs), self._span(meta))

    def subscript_list(self, children): return list(children)

    @v_args(meta=True)
    def name_ref(self, meta, children):
        return ast.Name(self._name(children[0]), self._span(meta))

    @v_args(meta=True)
    def binop(self, meta, children):
        lhs, op, rhs = children
        return ast.Binary(str(op), lhs, rhs, self._span(meta))

    @v_args(meta=True)
    def neg(self, meta, children):
        return ast.Unary("-", children[1], self._span(meta))

    @v_args(meta=True)
    def not_(self, meta, children):
        return ast.Unary("not", children[1], self._span(meta))

    @v_args(meta=True)
    def paren(self, meta, children):
        return children[0]

    def arg_list(self, children): return list(children)

    @v_args(meta=True)
    def kwarg(self, meta, children):
        return ast.KwArg(self._name(children[0]), self._name(children[1]), self._span(meta))

    @v_args(meta=True)
    def call(self, meta, children):
        fn = self._name(children[0])
        args = children[1] if len(children) > 1 else []
        for a in args:
            if isinstance(a, ast.KwArg):
                raise KspecError(f"function '{fn}' takes no keyword arguments", a.span)
        return ast.Call(fn, tuple(args), self._span(meta), self._span(children[0]))

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
        shape = layout = default = packed = None
        for r in rest:
            if isinstance(r, tuple) and r and r[0] == "packed":
                packed = r
            elif isinstance(r, tuple):
                shape = r
            elif isinstance(r, str):
                layout = r
            elif isinstance(r, ast.Num):
                default = r
        return ast.Decl(role, self._name(name), dt, shape, layout, default, self._span(meta), self._span(name),
                        packed[1] if packed else None, packed[2] if packed else None)

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
        return ast.Stmt(self._name(target), tuple(i for i, _ in idx), dt, value, self._span(meta),
                        tuple(s for _, s in idx))

    @v_args(meta=True)
    def kernel(self, meta, children):
        name, *items = children
        decls = tuple(i for i in items if isinstance(i, ast.Decl))
        stmts = tuple(i for i in items if isinstance(i, ast.Stmt))
        return ast.Kernel(self._name(name), decls, stmts, self._span(meta), self._span(name))

    @v_args(inline=True)
    def shape3(self, tok):
        parts = str(tok).split("x")
        if any(len(x.lstrip("0")) > MAX_INT_DIGITS for x in parts):
            raise KspecError(f"shape {_abbrev(str(tok))} has a size that is too large", self._span(tok))
        return (tuple(int(x) for x in parts), str(tok))

    @v_args(inline=True)
    def int_value(self, tok):
        return (self._int(tok), str(tok))

    @v_args(inline=True)
    def name_value(self, tok):
        return (str(tok), str(tok))

    @v_args(meta=True)
    def setting(self, meta, children):
        key, (value, text) = children
        return ast.Setting(self._name(key), value, text, self._span(meta))

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
        return ast.Schedule(self._name(name), arch, tuple(settings), self._span(meta), self._span(name))

    @v_args(meta=True)
    def target_decl(self, meta, children):
        return ast.Target(tuple(children), self._span(meta))

    def start(self, children):
        return children


def _end_position(source: str) -> tuple[int, int]:
    """Line and column just after the last non-blank character (lines count '\\n' only, as Lark does)."""
    idx = len(source.rstrip())
    line = source.count("\n", 0, idx) + 1
    col = idx - (source.rfind("\n", 0, idx) + 1) + 1
    return line, col


def _syntax_error(e: UnexpectedInput, source: str, file: str) -> KspecError:
    if isinstance(e, UnexpectedCharacters):
        line, col = e.line, e.column
        ch = source[e.pos_in_stream] if 0 <= e.pos_in_stream < len(source) else "?"
        span = Span(file, line, col, line, col + 1)
        hint = None
        if ch == ";":
            hint = "statements need no terminator; remove the ';'"
        elif ch == "@":
            hint = "a matrix product is written in index notation: `sum(k) A[m, k] * B[k, n]`"
        elif not ch.isascii():
            hint = "kspec source is ASCII: names are letters, digits and '_'"
        return KspecError(f"unexpected character {ch!r}", span, hint, source)
    if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
        line, col = _end_position(source)
        # `accepts` (what the parser really takes here) is exact; `expected` is the LALR state's superset
        expected = _expected_words(set(getattr(e, "accepts", ()) or getattr(e, "expected", ()) or ()))
        missing = _missing_operand(source, len(source), None, file)
        if missing is not None:
            return missing
        msg = "unexpected end of file"
        if expected:
            msg += "; expected " + _join_or(expected)
        hint = "is a closing '}' missing?" if source.count("{") > source.count("}") else None
        # zero width: the position after the last character, which has no character to underline
        return KspecError(msg, Span(file, line, col, line, col), hint, source)
    assert isinstance(e, UnexpectedToken)
    tok = e.token
    expected = _expected_words(set(e.accepts or e.expected or ()))
    msg = f"unexpected {_token_desc(tok)}"
    if expected:
        msg += "; expected " + _join_or(expected)
    span = Span(file, tok.line, tok.column, tok.end_line or tok.line, tok.end_column or tok.column + 1)
    start = tok.start_pos if tok.start_pos is not None else len(source)
    missing = _missing_operand(source, start, tok, file)
    if missing is not None:
        return missing
    return KspecError(msg, span, _syntax_hint(tok, e, source, start), source)


def _syntax_hint(tok: Token, e: UnexpectedToken, source: str, start: int) -> str | None:
    if tok.type != "NAME" and str(tok) in reserved_words() and "NAME" in (e.accepts or e.expected or set()):
        return f"'{tok.value}' is a reserved word; choose another name"
    # `in sum : f16[M]` lexes; the reserved word only fails where it is used: `sum[m]`, `in[m] = ...`
    word = _last_word(source[max(0, start - 200):start])
    if word in reserved_words():
        # a reduction or a dtype must be followed by '(': anything else means it was meant as a name
        needs_paren = word in ast.REDUCERS + ast.NORMALIZERS + ast.DTYPES
        if tok.type in ("LSQB", "EQUAL", "COLON") or (needs_paren and tok.type != "LPAR"):
            return f"'{word}' is a reserved word and cannot be used as a name; choose another name"
    return _after_reducer_hint(source, start, tok)


def _last_word(text: str) -> str | None:
    """The name that `text` ends with (trailing blanks ignored), if it ends with one."""
    text = text.rstrip()
    m = re.search(r"[A-Za-z_0-9]+$", text[-65:])
    if m is None or len(m.group(0)) > 64 or m.group(0)[0].isdigit():
        return None
    return m.group(0)


def _reducer_before(source: str, pos: int) -> tuple[str, int, int] | None:
    """If the text before `pos` ends with `sum(...)` (or another reduction, or softmax), outside a
    comment: (the word, its start offset, the offset after its ')')."""
    lo = max(0, pos - 4000)
    before = source[lo:pos].rstrip()
    if not before.endswith(")"):
        return None
    end = lo + len(before)
    depth = 0
    for i in range(len(before) - 1, -1, -1):
        c = before[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                break
    else:
        return None
    word = _last_word(before[:i])
    if word not in ast.REDUCERS + ast.NORMALIZERS:
        return None
    start = lo + len(before[:i].rstrip()) - len(word)
    if "#" in source[source.rfind("\n", 0, start) + 1:start]:
        return None
    return word, start, end


def _missing_operand(source: str, pos: int, tok: Token | None, file: str) -> KspecError | None:
    """`max(a, b)` and `sum(k)` with nothing after it: report it at the reduction, not at whatever
    token (often the next line's '}') the parser happened to stop at."""
    found = _reducer_before(source, pos)
    if found is None or (tok is not None and tok.type == "MINUS"):
        return None
    word, start, end = found
    line = source.count("\n", 0, start) + 1
    col = start - (source.rfind("\n", 0, start) + 1) + 1
    end_line = source.count("\n", 0, end) + 1
    end_col = end - (source.rfind("\n", 0, end) + 1) + 1
    return KspecError(f"'{word}(...)' is a reduction and must be followed by the expression it reduces",
                      Span(file, line, col, end_line, end_col), _after_reducer_hint(source, pos, tok), source)


def _after_reducer_hint(source: str, pos: int, tok: Token | None) -> str | None:
    """A hint for an error right after `max(...)`, `sum(...)` and friends: the usual mistakes are
    `max(a, b)` (elementwise maximum), a missing operand, and an operand starting with '-'."""
    found = _reducer_before(source, pos)
    if found is None:
        return None
    word = found[0]
    if tok is not None and tok.type == "MINUS":
        return f"the operand of {word}(...) cannot start with '-'; write `{word}(...) (-x)`"
    if word in ("max", "min"):
        return (f"`{word}(i) x` reduces over index i; for the elementwise {word} of two values "
                f"write `{word}imum(a, b)`")
    if word == "softmax":
        return "softmax is written `softmax(j) s[i, j]`"
    return f"a reduction is written `{word}(k) A[m, k] * B[k, n]`: index names in parentheses, then the operand"


def _join_or(words: list[str]) -> str:
    if len(words) <= 1:
        return "".join(words)
    if len(words) > 6:
        return "one of " + ", ".join(words[:6]) + ", ..."
    return ", ".join(words[:-1]) + " or " + words[-1]


def _abbrev(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-6:]} ({len(text)} characters)"


def _check_nesting(tree: lark.Tree, file: str, source: str) -> None:
    """Refuse trees deeper than MAX_NESTING, iteratively (a recursive walk would itself overflow)."""
    stack: list[tuple[lark.Tree, int, lark.Tree | None]] = [(tree, 0, None)]
    while stack:
        node, depth, stmt = stack.pop()
        if node.data == "stmt":
            stmt, depth = node, 0     # levels count from the statement: its right side is level 1
        if depth > MAX_NESTING:
            meta = (stmt if stmt is not None else node).meta
            span = None if getattr(meta, "empty", True) else \
                Span(file, meta.line, meta.column, meta.end_line, meta.end_column)
            raise KspecError(f"expression is nested too deeply (more than {MAX_NESTING} levels)", span,
                             "split it into several statements with intermediate names", source)
        for c in node.children:
            if isinstance(c, lark.Tree):
                # lists are no level of their own: `gelu(x)` nests x one level deep
                flat = c.data in ("arg_list", "index_list", "subscript_list", "name_ref", "number")
                stack.append((c, depth if flat else depth + 1, stmt))


def parse(source: str, file: str = "<string>") -> ast.Program:
    """Parse kspec source text into an `ast.Program` (no semantic checks)."""
    if len(source) > MAX_SOURCE_BYTES or len(source.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
        raise _too_large(file, len(source.encode("utf-8", "surrogatepass")))
    try:
        tree = _parser().parse(source)
    except UnexpectedInput as e:
        raise _syntax_error(e, source, file) from None
    _check_nesting(tree, file, source)
    too_deep = KspecError("expression is nested too deeply", None,
                          "split it into several statements with intermediate names", source)
    try:
        items = _Build(file).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, KspecError):
            raise e.orig_exc.with_source(source) from None
        if isinstance(e.orig_exc, RecursionError):
            raise too_deep from None
        raise
    except RecursionError:
        raise too_deep from None
    kernels = tuple(i for i in items if isinstance(i, ast.Kernel))
    schedules = tuple(i for i in items if isinstance(i, ast.Schedule))
    targets = tuple(i for i in items if isinstance(i, ast.Target))
    return ast.Program(kernels, schedules, targets, file=file, source=source)


def _too_large(file: str, size: int) -> KspecError:
    return KspecError(f"{file} is {size:,} bytes; a spec file has at most {MAX_SOURCE_BYTES:,} bytes", None,
                      "split it into several spec files")


def parse_file(path: str | Path) -> ast.Program:
    p = Path(path)
    try:
        if p.is_file() and p.stat().st_size > MAX_SOURCE_BYTES + 3:      # (+ a BOM) refused unread
            raise _too_large(str(path), p.stat().st_size)
        text = p.read_text(encoding="utf-8-sig")      # editors on Windows like to start with a BOM
    except FileNotFoundError:
        raise KspecError(f"no such file: {p}") from None
    except UnicodeDecodeError as e:
        raise KspecError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise KspecError(f"cannot read {p}: {e.strerror}") from None
    return parse(text, str(path))
