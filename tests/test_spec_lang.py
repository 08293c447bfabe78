"""The spec language on valid input: every shipped spec parses and checks, the typed AST says what
the spec means, and the AST round-trips through the pretty-printer (print -> parse -> equal)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from kspec.spec_lang import CheckedProgram, KspecError, ast, check, load_spec, parse, parse_file, print_program
from kspec.spec_lang.check import TAccess, TBinary, TCall, TConst, TReduce, TScalar, TSoftmax, count_ops, format_typed
from kspec.spec_lang.parser import MAX_NESTING
from kspec.spec_lang.printer import print_expr

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
SPEC_FILES = sorted(SPECS_DIR.glob("*.kspec"))


def one_stmt(expr: str, decls: str = "") -> ast.Expr:
    """The right side of `D[i] = expr` (parsed, unchecked)."""
    return parse(f"kernel k {{\n{decls}\n  D[i] = {expr}\n}}\n").kernels[0].stmts[0].value


def assert_round_trips(program: ast.Program) -> None:
    text = print_program(program)
    again = parse(text, "printed.kspec")
    assert again == program, text
    assert print_program(again) == text           # printing is a fixed point


# ---------------------------------------------------------------- shipped specs

def test_there_are_shipped_specs():
    names = {p.stem for p in SPEC_FILES}
    assert {"gemm", "attention", "attention_causal", "gemm_rowmax", "fp8_gemm_scaled"} <= names


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_shipped_spec_checks(path: Path):
    prog = load_spec(path)
    assert isinstance(prog, CheckedProgram)
    assert prog.file == str(path)
    assert [k.name for k in prog.kernels] == [path.stem]     # one kernel per file, named like the file
    k = prog.kernels[0]
    assert k.outputs, "a kernel has outputs"
    for s in k.stmts:
        assert set(s.indices) <= {ix for ix, _ in s.extents}
    text = format_typed(prog)
    assert text.startswith(f"program {path}") and f"kernel {k.name}" in text


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_shipped_spec_round_trips(path: Path):
    program = parse_file(path)
    assert_round_trips(program)
    # the printed text checks to the same typed program
    assert check(parse(print_program(program), str(path))) == check(program)


def test_load_spec_from_text_and_path_agree():
    path = SPECS_DIR / "gemm.kspec"
    from_path = load_spec(path)
    from_text = load_spec(path.read_text(), is_text=True, file=str(path))
    assert from_text == from_path


def test_gemm_typed():
    k = load_spec(SPECS_DIR / "gemm.kspec").kernel("gemm")
    assert [(t.name, t.role, t.dtype, t.shape, t.layout) for t in k.tensors] == [
        ("A", "in", "f16", ("M", "K"), "row"),
        ("B", "in", "f16", ("K", "N"), "col"),
        ("D", "out", "f16", ("M", "N"), "row"),
        ("acc", "temp", "f32", ("M", "N"), "row"),
    ]
    assert k.symbols == ("M", "K", "N")
    acc, d = k.stmts
    assert (acc.target, acc.indices, acc.dtype) == ("acc", ("m", "n"), "f32")
    assert dict(acc.extents) == {"m": "M", "n": "N", "k": "K"}
    assert isinstance(acc.value, TReduce) and acc.value.op == "sum" and acc.value.indices == ("k",)
    assert acc.value.dtype == "f32" and acc.value.free == ("m", "n")
    prod = acc.value.operand
    assert isinstance(prod, TBinary) and prod.op == "*" and prod.dtype == "f16"
    assert prod.free == ("m", "k", "n")
    assert isinstance(prod.lhs, TAccess) and prod.lhs.tensor == "A" and prod.lhs.indices == ("m", "k")
    assert d.dtype == "f16" and isinstance(d.value, TAccess) and d.value.tensor == "acc"
    assert count_ops(acc.value) == {"contraction": 1}


def test_attention_causal_typed():
    k = load_spec(SPECS_DIR / "attention_causal.kspec").kernels[0]
    assert k.params[0].name == "scale" and k.params[0].default == 0.125 and k.params[0].shape == ()
    s, p, o = k.stmts
    assert isinstance(s.value, TBinary) and isinstance(s.value.lhs, TScalar)
    assert isinstance(p.value, TSoftmax)
    assert (p.value.axis, p.value.causal, p.value.dtype) == ("j", "i", "f32")
    assert o.dtype == "bf16" and dict(o.extents)["e"] == 64 and dict(o.extents)["j"] == "S"
    assert k.tensor("s").shape == ("B", "H", "S", "S")


def test_gemm_rowmax_and_schedule():
    k = load_spec(SPECS_DIR / "gemm_rowmax.kspec").kernels[0]
    rowmax = k.stmts[-1]
    assert isinstance(rowmax.value, TReduce) and rowmax.value.op == "max" and rowmax.value.dtype == "f32"
    assert [t.name for t in k.outputs] == ["D", "rowmax"]
    g = load_spec(SPECS_DIR / "gemm_bias_gelu_residual.kspec").kernels[0]
    hint = g.schedule_for("sm90a")
    assert hint.tile == (128, 128, 64) and hint.cluster == (2, 1, 1) and hint.stages is None
    assert g.schedule_for("sm100a").tile is None       # that schedule is for sm90a only


def test_fp8_gemm_dtypes():
    k = load_spec(SPECS_DIR / "fp8_gemm_scaled.kspec").kernels[0]
    acc, d = k.stmts
    assert acc.dtype == "f32" and acc.value.operand.dtype == "f32"    # f8 arithmetic happens in f32
    assert d.dtype == "bf16" and k.outputs[0].dtype == "bf16"


# ---------------------------------------------------------------- language features

def test_schedules_targets_and_literal_dims():
    src = """
target sm90a, sm100a
kernel k {
  param a : f32 = -0.5
  param n : i32 = -3
  in  X : f16[64, N] col
  out Y : f32[64, N]
  Y[i, j] = a * X[i, j] + f32(n)
}
schedule k { tile = 128x128x64  stages = 3 }
schedule k for sm100a { tile = 256x128x64  cluster = 2x1x1 }
"""
    prog = load_spec(src, is_text=True)
    assert prog.targets == ("sm90a", "sm100a")
    k = prog.kernels[0]
    assert [t.default for t in k.params] == [-0.5, -3]
    assert k.tensor("X").shape == (64, "N") and k.tensor("X").layout == "col"
    assert k.schedule_for("sm90a").tile == (128, 128, 64)
    # an arch-specific schedule overrides the generic one field by field
    h = k.schedule_for("sm100a")
    assert (h.tile, h.cluster, h.stages) == ((256, 128, 64), (2, 1, 1), 3)
    assert_round_trips(parse(src))


def test_symbol_fixed_by_a_literal():
    src = """kernel k {
  in A : f16[M, K]
  in B : f16[64, N]
  out D : f32[M, N]
  D[m, n] = sum(k) A[m, k] * B[k, n]
}"""
    k = load_spec(src, is_text=True).kernels[0]
    assert k.bindings == (("K", 64),)
    assert "(K = 64)" in format_typed(load_spec(src, is_text=True))


def test_literal_dtypes_are_weak():
    src = """kernel k {
  in A : bf16[M]
  in I : i32[M]
  out D : bf16[M]
  out E : i32[M]
  D[m] = A[m] * 2.0 + 1
  E[m] = I[m] * 3 - 1
}"""
    k = load_spec(src, is_text=True).kernels[0]
    d, e = k.stmts
    assert d.value.dtype == "bf16" and e.value.dtype == "i32"
    consts = [x for x in (d.value.lhs.rhs, d.value.rhs) if isinstance(x, TConst)]
    assert [c.value for c in consts] == [2.0, 1] and all(c.weak for c in consts)


def test_functions_and_casts():
    src = """kernel k {
  in A : f16[M]
  out D : f16[M]
  D[m] = clamp(maximum(gelu_tanh(A[m]), minimum(silu(A[m]), A[m])), 0.0, 6.0) + f16(sigmoid(f32(A[m])))
}"""
    d = load_spec(src, is_text=True).kernels[0].stmts[0]
    assert isinstance(d.value.lhs, TCall) and d.value.lhs.fn == "clamp" and len(d.value.lhs.args) == 3
    assert d.value.rhs.dtype == "f16"
    assert count_ops(d.value) == {"elementwise": 9}   # + clamp maximum gelu_tanh minimum silu f16 sigmoid f32


def test_comments_blank_lines_and_crlf():
    src = "# leading comment\r\n\r\nkernel k { # trailing\r\n  in A : f16[M]\r\n  out D : f16[M]\r\n  D[m] = A[m]\r\n}\r\n"
    prog = load_spec(src, is_text=True)
    assert prog.kernels[0].name == "k"
    assert parse(src).kernels[0].stmts[0].span.line == 6


def test_spans_point_at_source():
    src = "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m] * 2.0\n}\n"
    p = parse(src, "s.kspec")
    k = p.kernels[0]
    assert (k.name_span.line, k.name_span.col) == (1, 8)
    a = k.decls[0]
    assert (a.name_span.line, a.name_span.col, a.name_span.end_col) == (2, 6, 7)
    s = k.stmts[0]
    assert (s.span.line, s.span.col) == (4, 3)
    mul = s.value
    assert isinstance(mul, ast.Binary) and (mul.span.col, mul.span.end_col) == (10, 20)
    assert (mul.rhs.span.col, mul.rhs.span.end_col) == (17, 20)
    assert [(sp.line, sp.col) for sp in mul.lhs.index_spans] == [(4, 12)]
    assert str(mul.span) == "s.kspec:4:10"


def test_spans_do_not_take_part_in_equality():
    a = parse("kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m]\n}\n")
    b = parse("kernel   k { in A:f16[M]   out D:f16[M]  D[m]=A[m] }")
    assert a == b


def test_reserved_word_prefixes_are_names():
    src = """kernel k {
  in input : f16[M]
  in summed : f16[M]
  in f16x : f16[M]
  out output : f16[M]
  output[row_] = input[row_] + summed[row_] + f16x[row_]
}"""
    k = load_spec(src, is_text=True).kernels[0]
    assert [t.name for t in k.inputs] == ["input", "summed", "f16x"]


# ---------------------------------------------------------------- printer precedence

TRICKY = [
    ("a - (b - c)", ast.Binary("-", ast.Name("a"), ast.Binary("-", ast.Name("b"), ast.Name("c")))),
    ("a - b - c", ast.Binary("-", ast.Binary("-", ast.Name("a"), ast.Name("b")), ast.Name("c"))),
    ("a / (b * c)", ast.Binary("/", ast.Name("a"), ast.Binary("*", ast.Name("b"), ast.Name("c")))),
    ("(a + b) * c", ast.Binary("*", ast.Binary("+", ast.Name("a"), ast.Name("b")), ast.Name("c"))),
    ("-(a + b)", ast.Unary("-", ast.Binary("+", ast.Name("a"), ast.Name("b")))),
    ("-a * b", ast.Binary("*", ast.Unary("-", ast.Name("a")), ast.Name("b"))),
    ("-(-a)", ast.Unary("-", ast.Unary("-", ast.Name("a")))),
    ("((((a))))", ast.Name("a")),
    ("a * -1", ast.Binary("*", ast.Name("a"), ast.Unary("-", ast.Num(1, "1")))),
    ("a - -2.5e-3", ast.Binary("-", ast.Name("a"), ast.Unary("-", ast.Num(2.5e-3, "2.5e-3")))),
]


@pytest.mark.parametrize("text,expected", TRICKY, ids=[t for t, _ in TRICKY])
def test_parse_precedence(text, expected):
    assert one_stmt(text) == expected


def _acc(t, *ix):
    return ast.Access(t, tuple(ix))


def test_reduction_extends_over_the_rest_of_the_product():
    # x * sum(k) a*b  ==  x * (sum(k) (a * b))
    e = one_stmt("x * sum(k) a[k] * b[k]")
    assert e == ast.Binary("*", ast.Name("x"),
                           ast.Reduce("sum", ("k",), ast.Binary("*", _acc("a", "k"), _acc("b", "k"))))
    # ... but not over a following sum term
    e = one_stmt("sum(k) a[k] * b[k] + c[i]")
    assert isinstance(e, ast.Binary) and e.op == "+" and isinstance(e.lhs, ast.Reduce)
    # a parenthesised reduction stops at the parenthesis
    e = one_stmt("(sum(k) a[k]) * b[i]")
    assert isinstance(e, ast.Binary) and e.op == "*" and isinstance(e.lhs, ast.Reduce)
    # nested reductions
    e = one_stmt("sum(j) softmax(j) s[i, j] * v[j]")
    assert isinstance(e, ast.Reduce) and isinstance(e.operand, ast.Reduce) and e.operand.op == "softmax"
    assert isinstance(e.operand.operand, ast.Binary)
    # unary minus in front of a reduction negates all of it
    e = one_stmt("-sum(k) a[k] * b")
    assert isinstance(e, ast.Unary) and isinstance(e.operand, ast.Reduce)
    assert isinstance(e.operand.operand, ast.Binary)


def test_softmax_options_parse():
    e = one_stmt("softmax(j, causal=i) s[i, j]")
    assert e == ast.Reduce("softmax", ("j",), _acc("s", "i", "j"), (ast.KwArg("causal", "i"),))


PRINTER_CASES = [
    "a - (b - c)", "a - b - c", "a / (b / c)", "a / b * c", "(a + b) * c", "-(a + b)", "-a * b", "-(a * b)",
    "x * sum(k) a[m, k] * b[k, n]", "(sum(k) a[m, k]) * b[m, n]", "sum(k) a[m, k] * b[k, n] + c[m, n]",
    "sum(k) (a[m, k] + b[m, k])", "sum(k) (-a[m, k])", "-sum(k) a[m, k]", "- -a", "-1", "a * -1",
    "(-1) * a", "-1.5e-3 * a", "a - -1", "softmax(j, causal=i) s[i, j]", "sum(j) softmax(j) s[i, j] * v[j, e]",
    "sum(j) (softmax(j) s[i, j]) * v[j, e]", "a * max(j) b[i, j] * c[i, j]", "a * (max(j) b[i, j]) * c[i]",
    "f32(a + b) * c", "gelu(a * sum(k) b[k])", "sum(k) sum(j) a[k, j]", "a / sum(k) b[k]",
    "(a / sum(k) b[k]) / c", "(a - sum(k) b[k]) * c", "-(sum(k) a[k]) * b", "a * (-sum(k) b[k]) * c",
    "clamp(-a, -1, 1.0)", "sum(k) (-1) * a[k]", "a * sum(k) (b[k] * c[k]) * d", "mean(i, j) a[i, j]",
    "1 - -a", "a*-b*-c", "((((a + b))))", "0.5 * .5 * 5. * 1e3 * 2E-2",
    # index arithmetic, conditions and where (issue 16)
    "K[b, h / G, j, e]", "x[i + 1]", "Kc[bt[b, j / P], j % P, h, e]", "x[(i + 1) % N]", "x[i - (T - S)]",
    "where(j <= i + (T - S), s[i, j], -inf)", "where(j <= i and j > i - W, s[i, j], -inf)",
    "where(not (a < b) or c == d, x, y)", "not a < b", "(not a) == b", "-(not a)", "(a < b) == (c < d)",
    "a % b * c", "a % (b * c)", "slope[h] * (j - i)", "cap * tanh(s[i, j] / cap)", "-inf", "a * inf",
    "sum(k) (a[k] < b)", "sum(k) a[k] < b", "where(a or b and c, 1.0, 0.0)", "where((a or b) and c, 1, 0)",
]


@pytest.mark.parametrize("text", PRINTER_CASES)
def test_printer_round_trip(text):
    e = one_stmt(text)
    printed = print_expr(e)
    assert one_stmt(printed) == e, printed


def test_printer_output_is_minimal_where_it_matters():
    assert print_expr(one_stmt("a - (b - c)")) == "a - (b - c)"
    assert print_expr(one_stmt("((a)) * (b)")) == "a * b"
    assert print_expr(one_stmt("x * (sum(k) a[k] * b[k])")) == "x * (sum(k) a[k] * b[k])"
    assert print_expr(one_stmt("sum(k) (-a[k])")) == "sum(k) (-a[k])"
    assert print_expr(one_stmt("softmax(j, causal=i) s[i, j]")) == "softmax(j, causal=i) s[i, j]"


def test_negative_default_round_trips():
    src = "kernel k {\n  param a : f32 = -1.25e-2\n  param b : i32 = -7\n  in A : f32[M]\n  out D : f32[M]\n  D[m] = a * A[m]\n}\n"
    p = parse(src)
    assert p.kernels[0].decls[0].default == ast.Num(-1.25e-2, "-1.25e-2")
    assert p.kernels[0].decls[1].default == ast.Num(-7, "-7")
    assert_round_trips(p)


def test_programmatic_negative_literal_prints_in_parentheses():
    e = ast.Binary("*", ast.Name("a"), ast.Num(-1, "-1"))
    assert print_expr(e) == "a * (-1)"


def _random_expr(rng: random.Random, depth: int) -> ast.Expr:
    names, idx = ["a", "b", "x"], ["i", "j", "k"]
    if depth <= 0 or rng.random() < 0.2:
        r = rng.random()
        if r < 0.3:
            return ast.Name(rng.choice(names))
        if r < 0.6:
            return ast.Access(rng.choice(["A", "B"]), tuple(rng.sample(idx, rng.randint(1, 2))))
        text = rng.choice(["0", "1", "2.5", "1e-3", "64"])
        return ast.Num(int(text) if text.isdigit() else float(text), text)
    kind = rng.randrange(8)
    sub = lambda: _random_expr(rng, depth - 1)  # noqa: E731
    if kind == 0:
        return ast.Unary(rng.choice(["-", "-", "not"]), sub())
    if kind in (1, 2):
        return ast.Binary(rng.choice(["+", "-", "*", "/", "%", "<", "<=", ">", ">=", "==", "!=", "and", "or"]),
                          sub(), sub())
    if kind == 6:
        return ast.Call("where", (sub(), sub(), sub()))
    if kind == 7:       # a gather with a computed subscript
        return ast.Gather("A", (ast.IndexVar(rng.choice(idx)), ast.Binary(rng.choice(["/", "%", "+"]), sub(), sub())))
    if kind == 3:
        fn = rng.choice(["gelu", "maximum", "clamp"])
        return ast.Call(fn, tuple(sub() for _ in range({"gelu": 1, "maximum": 2, "clamp": 3}[fn])))
    if kind == 4:
        return ast.Cast(rng.choice(["f32", "bf16"]), sub())
    if rng.random() < 0.2:
        return ast.Reduce("softmax", ("j",), sub(), (ast.KwArg("causal", "i"),))
    return ast.Reduce(rng.choice(["sum", "max", "min", "mean"]), tuple(rng.sample(idx, rng.randint(1, 2))), sub())


def test_printer_round_trips_random_expressions():
    rng = random.Random(7)
    for _ in range(400):
        e = _random_expr(rng, rng.randint(1, 6))
        printed = print_expr(e)
        assert one_stmt(printed) == e, printed


def test_printed_program_checks_the_same():
    src = """target sm100a
kernel k {
  in  A : f16[M, K]
  in  B : f16[K, N] col
  out D : f16[M, N]
  acc[m, n] : f32 = sum(k) A[m, k] * B[k, n]
  D[m, n] = acc[m, n] * -(1.0 - acc[m, n])
}
schedule k for sm100a { tile = 256x128x64 }
"""
    p = parse(src)
    assert_round_trips(p)
    assert check(parse(print_program(p))) == check(p)


def test_deep_but_legal_nesting_is_fine():
    # MAX_NESTING levels are allowed (the limit itself is tested in test_spec_errors.py)
    n = MAX_NESTING - 1
    e = one_stmt("(" * (n - 2) + "-a" + ")" * (n - 2) + " + 1")     # +, parens, -, a: MAX_NESTING levels
    assert print_expr(e) == "-a + 1"
    for body in ("gelu(" * n + "A[m]" + ")" * n, "- " * n + "A[m]", " + ".join(["A[m]"] * MAX_NESTING),
                 "sum(j) " * n + "A[m]"):
        src = "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = " + body + "\n}\n"
        program = parse(src)
        assert_round_trips(program)
        if not body.startswith("sum"):                 # sum(j) over an unused j is a check error
            k = check(program).kernels[0]
            assert format_typed(check(program)).count("\n") > MAX_NESTING
            count_ops(k.stmts[0].value)


def test_load_spec_missing_file_is_a_kspec_error(tmp_path):
    with pytest.raises(KspecError, match="no such file"):
        load_spec(tmp_path / "nope.kspec")
    bad = tmp_path / "latin1.kspec"
    bad.write_bytes(b"# caf\xe9\nkernel k {}\n")
    with pytest.raises(KspecError, match="not UTF-8"):
        load_spec(bad)
    with pytest.raises(KspecError, match="cannot read"):
        load_spec(tmp_path)
