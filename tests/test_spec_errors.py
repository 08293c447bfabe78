"""Every class of user mistake in a spec: a real bad spec, and the exact line, column, message and
hint of the error it produces; the rendered format; several errors reported together."""
from __future__ import annotations

import importlib
import re

import pytest

from kspec.spec_lang import KspecError, check, load_spec, parse
from kspec.spec_lang.errors import Diagnostic, Span
from kspec.spec_lang.parser import MAX_NESTING, _parser

GEMM_HEAD = "kernel k {\n  in A : f16[M, K]\n  in B : f16[K, N]\n  out D : f16[M, N]\n"
ONE_D = "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n"
IDENTITY = ONE_D + "  D[m] = A[m]\n}\n"
_NO_HINT = object()
check_module = importlib.import_module("kspec.spec_lang.check")   # the package's `check` is the function


def error_of(src: str, file: str = "bad.kspec") -> KspecError:
    with pytest.raises(KspecError) as info:
        load_spec(src, is_text=True, file=file)
    return info.value


def assert_error(src: str, line: int | None, col: int | None, message: str, hint=_NO_HINT, *,
                 end: tuple[int, int] | None = None, n_errors: int | None = 1) -> KspecError:
    """The first diagnostic has exactly this position, message and hint (None: no hint)."""
    e = error_of(src)
    d = e.diagnostics[0]
    assert d.message == message
    if line is None:
        assert d.span is None
    else:
        assert (d.span.file, d.span.line, d.span.col) == ("bad.kspec", line, col), d.span
    if end is not None:
        assert (d.span.end_line, d.span.end_col) == end
    if hint is not _NO_HINT:
        assert d.hint == hint
    if n_errors is not None:
        assert len(e.diagnostics) == n_errors, [x.message for x in e.diagnostics]
    # the exception agrees with its first diagnostic, and str() is the rendering
    assert (e.message, e.span, e.hint) == (d.message, d.span, d.hint)
    assert str(e) == e.render()
    return e


# ---------------------------------------------------------------- syntax

LARK_TERMINALS = {t.name for t in _parser().terminals} | {"$END"}


def assert_words_only(message: str) -> None:
    """No Lark terminal name (RSQB, NAME, __ANON_0, $END) outside the quoted user text."""
    unquoted = re.sub(r"'[^']*'", "''", message)
    leaked = {w for w in re.findall(r"[$A-Z_][A-Z_0-9]+", unquoted) if w in LARK_TERMINALS}
    assert not leaked and "__ANON" not in unquoted and "Token(" not in unquoted, message


def test_syntax_error_expected_in_words():
    e = assert_error("kernel k {\n  in A : f16[M K]\n}\n", 2, 16, "unexpected 'K'; expected '+', ',', '/' or ']'", None,
                     end=(2, 17))
    assert_words_only(e.message)


def test_syntax_error_expected_keyword_groups():
    e = assert_error("kernel k {\n  in A : float[M]\n}\n", 2, 10,
                     "unexpected 'float'; expected a dtype (f16, bf16, f32, ...)", None)
    assert_words_only(e.message)
    e = assert_error("kernel k {\n  in A : f16[M] 5\n}\n", 2, 17,
                     "unexpected '5'; expected '=', 'packed', '}', a declaration (in, out, param), a layout (row, col) or a name",
                     None)
    assert_words_only(e.message)
    e = assert_error("target sm80\n", 1, 8, "unexpected 'sm80'; expected an arch (sm90a, sm100a)", None)
    assert_words_only(e.message)


@pytest.mark.parametrize("src", [
    "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m] A[m]\n}\n",
    "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = \n}\n",
    "kernel k (\n",
    "kernel { }",
    "schedule k { tile = 128 x 128 }",
    "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m] +",
], ids=["two_operands", "no_value", "paren", "no_name", "bad_shape", "eof_operator"])
def test_syntax_errors_never_name_lark_terminals(src):
    assert_words_only(error_of(src).message)


def test_unexpected_character():
    assert_error(GEMM_HEAD + "  D[m, n] = sum(k) A[m, k] @ B[k, n]\n}\n", 5, 28, "unexpected character '@'",
                 "a matrix product is written in index notation: `sum(k) A[m, k] * B[k, n]`", end=(5, 29))


def test_unexpected_character_semicolon():
    assert_error("kernel k {\n  in A : f16[M, K];\n}\n", 2, 19, "unexpected character ';'",
                 "statements need no terminator; remove the ';'")


def test_unexpected_non_ascii_character():
    assert_error("kernel k {\n  in Å : f16[M]\n}\n", 2, 6, "unexpected character 'Å'",
                 "kspec source is ASCII: names are letters, digits and '_'")


def test_unexpected_end_of_file():
    assert_error(GEMM_HEAD + "  D[m, n] = sum(k) A[m, k] * B[k, n]\n", 5, 37,
                 "unexpected end of file; expected '}', a declaration (in, out, param), a name or an operator (+ - * / % < <= == and or ...)",
                 "is a closing '}' missing?", end=(5, 37))


def test_unexpected_end_of_file_mid_expression():
    assert_error(GEMM_HEAD + "  D[m, n] = sum(k) A[m, k] *", 5, 29,
                 "unexpected end of file; expected '(', '-', a dtype (f16, bf16, f32, ...), a name, a number or "
                 "a reduction (sum, max, min, mean, logsumexp, softmax)", "is a closing '}' missing?")


def test_unexpected_end_of_file_in_empty_and_blank_text_positions():
    assert_error("kernel", 1, 7, "unexpected end of file; expected a name", None)
    # trailing blank lines and comments: the position after the last real character
    assert_error("kernel k {\n  in A : f16[M]\n\n\n", 2, 16,
                 "unexpected end of file; expected '=', 'packed', '}', a declaration (in, out, param), a layout (row, col) or a name",
                 "is a closing '}' missing?")


@pytest.mark.parametrize("src,line,col,word", [
    ("kernel k {\n  in in : f16[M]\n  out D : f16[M]\n  D[m] = A[m]\n}\n", 2, 6, "in"),
    ("kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[row] = A[row]\n}\n", 4, 5, "row"),
    ("kernel f32 {\n}\n", 1, 8, "f32"),
    ("kernel k {\n  in A : f16[M]\n  out D : f16[sum]\n  D[m] = A[m]\n}\n", 3, 15, "sum"),
    (IDENTITY + "schedule for { }\n", 6, 10, "for"),
])
def test_reserved_word_as_name(src, line, col, word):
    assert_error(src, line, col, f"'{word}' is a reserved word and cannot be used as a name",
                 f"choose another name, e.g. `{word}_`", end=(line, col + len(word)))


def test_reserved_word_where_the_parser_sees_a_keyword():
    # declared as an input (lexes as a name there), then used where `sum(` is expected
    assert_error("kernel k {\n  in sum : f16[M]\n  out D : f16[M]\n  D[m] = sum[m]\n}\n", 4, 13,
                 "unexpected '['; expected '('",
                 "'sum' is a reserved word and cannot be used as a name; choose another name")
    assert_error(GEMM_HEAD + "  in[m, n] = A[m, n]\n}\n", 5, 5, "unexpected '['; expected a name",
                 "'in' is a reserved word and cannot be used as a name; choose another name")
    assert_error("kernel k {\n  param sum : f32\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m] * sum\n}\n",
                 6, 1, "unexpected '}'; expected '('",
                 "'sum' is a reserved word and cannot be used as a name; choose another name")


def test_nested_too_deeply():
    n = MAX_NESTING + 1
    src = ONE_D + "  D[m] = " + "(" * n + "A[m]" + ")" * n + "\n}\n"
    assert_error(src, 4, 3, f"expression is nested too deeply (more than {MAX_NESTING} levels)",
                 "split it into several statements with intermediate names")
    src = ONE_D + "  D[m] = " + " + ".join(["A[m]"] * 5000) + "\n}\n"
    assert_error(src, 4, 3, f"expression is nested too deeply (more than {MAX_NESTING} levels)")


def test_huge_integer_literals():
    assert_error("kernel k {\n  in A : f16[" + "9" * 5000 + "]\n}\n", 2, 14,
                 "integer literal 999999999999...999999 (5000 characters) is too large", None)
    assert_error(IDENTITY + "schedule k { stages = 123456789012345678901234567890123456789012345 }", 6, 23,
                 "integer literal 123456789012...012345 (45 characters) is too large", None)
    assert_error(ONE_D + "  D[m] = A[m] * 1e39\n}\n", 4, 17, "number 1e39 does not fit in f32", None)
    assert_error("kernel k {\n  in A : f16[0]\n  out D : f16[M]\n  D[m] = A[m]\n}\n", 2, 14,
                 "dimension 0 is out of range (1 to 2147483647)", None, n_errors=None)


# ---------------------------------------------------------------- names and declarations

def test_name_declared_twice():
    src = "kernel k {\n  in A : f16[M, K]\n  in A : f16[K, N]\n  out D : f16[M, K]\n  D[m, k] = A[m, k]\n}\n"
    assert_error(src, 3, 6, "'A' is declared twice", "the first declaration is at line 2", end=(3, 7))


def test_kernel_defined_twice():
    assert_error(IDENTITY + IDENTITY, 6, 8, "kernel 'k' is defined twice", "the first definition is at line 1")


def test_unknown_tensor_with_suggestion():
    assert_error(GEMM_HEAD + "  D[m, n] = sum(k) A[m, k] * Bb[k, n]\n}\n", 5, 30, "unknown name 'Bb'",
                 "did you mean `B`?", end=(5, 38))


def test_unknown_tensor_without_close_name():
    assert_error(ONE_D + "  D[m] = zzz[m]\n}\n", 4, 10, "unknown name 'zzz'", None)


def test_use_before_definition():
    assert_error(ONE_D + "  D[m] = t[m] + A[m]\n  t[m] = A[m]\n}\n", 4, 10, "'t' is used before it is defined (line 5)",
                 "move its definition above this statement")


def test_output_read_before_written():
    assert_error(ONE_D + "  t[m] = D[m]\n  D[m] = A[m]\n}\n", 4, 10, "output 'D' is read before it is written",
                 "compute the value into an intermediate first")


def test_assigning_to_an_input():
    assert_error(ONE_D + "  A[m] = D[m]\n  D[m] = A[m]\n}\n", 4, 3, "cannot assign to input 'A'",
                 "only outputs and new intermediate names can be assigned")


def test_assigning_to_a_param():
    assert_error("kernel k {\n  param s : f32\n  in A : f16[M]\n  out D : f16[M]\n  s[m] = A[m]\n  D[m] = A[m]\n}\n",
                 5, 3, "cannot assign to param 's'", "only outputs and new intermediate names can be assigned")


def test_output_written_twice():
    assert_error(ONE_D + "  D[m] = A[m]\n  D[m] = A[m] * 2.0\n}\n", 5, 3, "output 'D' is written more than once",
                 "it is first written at line 4; each name is assigned exactly once (give the new value a new name)")


def test_intermediate_written_twice():
    assert_error(ONE_D + "  t[m] = A[m]\n  t[m] = A[m]\n  D[m] = t[m]\n}\n", 5, 3,
                 "intermediate 't' is written more than once", n_errors=1)


def test_output_never_written():
    assert_error(ONE_D + "  out E : f16[M]\n  D[m] = A[m]\n}\n", 4, 7, "output 'E' is never written",
                 "add a statement `E[...] = ...`", end=(4, 8))


def test_kernel_without_statements():
    assert_error("kernel k {\n  in A : f16[M]\n}\n", 1, 8, "kernel 'k' has no statements", None)


def test_file_without_kernels():
    assert_error("", None, None, "bad.kspec defines no kernels",
                 "a spec file holds one or more `kernel NAME { ... }` blocks")
    assert_error("# only a comment\ntarget sm90a\n", None, None, "bad.kspec defines no kernels")


def test_param_with_shape():
    assert_error("kernel k {\n  param s : f32[M]\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m]\n}\n", 2, 3,
                 "param 's' has a shape; params are scalars", "declare a tensor with `in s : f32[...]`")


def test_param_with_bad_default():
    assert_error("kernel k {\n  param n : i32 = 1.5\n" + IDENTITY[11:], 2, 19,
                 "param 'n' is i32 but its default 1.5 is not an integer", None)


@pytest.mark.parametrize("decl,text", [("i32", "2147483648"), ("i32", "-2147483649"), ("i8", "128"),
                                       ("f16", "65520.0"), ("f8e4m3", "-500.0"), ("f32", "1e39")])
def test_param_default_out_of_range(decl, text):
    src = f"kernel k {{\n  param p : {decl} = {text}\n" + IDENTITY[11:]
    assert_error(src, 2, 16 + len(decl), f"default {text} does not fit in {decl}", None)


def test_param_default_at_the_limits():
    src = ("kernel k {\n  param a : i32 = -2147483648\n  param b : i8 = 127\n  param c : f16 = 65504.0\n"
           "  param d : f8e5m2 = -57344.0\n" + IDENTITY[11:])
    k = load_spec(src, is_text=True).kernels[0]
    assert [t.default for t in k.params] == [-2147483648, 127, 65504.0, -57344.0]


def test_input_without_shape_and_output_with_default():
    assert_error("kernel k {\n  in A : f16\n  out D : f16[M]\n  D[m] = 1.0\n}\n", 2, 3, "input 'A' needs a shape",
                 "for example `in A : f16[M, N]`; scalars are `param`s")
    assert_error("kernel k {\n  in A : f16[M] = 2\n  out D : f16[M]\n  D[m] = A[m]\n}\n", 2, 19,
                 "only params take a default value", None)
    # the declaration still counts: no "unknown name 'A'" follows
    assert_error("kernel k {\n  in A : f16[0]\n  out D : f16[M]\n  D[m] = A[m]\n}\n", 2, 14,
                 "dimension 0 is out of range (1 to 2147483647)", None, n_errors=1)
    assert_error("kernel k {\n  param s : f32[M]\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = s * A[m]\n}\n", 2, 3,
                 "param 's' has a shape; params are scalars", n_errors=1)


def test_param_used_with_indices():
    assert_error("kernel k {\n  param s : f32 = 2.0\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = s[m] * A[m]\n}\n",
                 5, 10, "'s' is a scalar param; use it without indices", "write `s`")


def test_tensor_used_without_indices():
    assert_error("kernel k {\n  in A : f16[M, N]\n  out D : f16[M, N]\n  D[m, n] = A * 2.0\n}\n", 4, 13,
                 "tensor 'A' is used without indices", "write `A[m, n]`", end=(4, 14))


# ---------------------------------------------------------------- indices and shapes

def test_wrong_rank_on_the_right():
    assert_error(GEMM_HEAD + "  D[m, n] = sum(k) A[m, k, n] * B[k, n]\n}\n", 5, 20,
                 "'A' has rank 2 but is used with 3 indices", "declared as A: f16[M, K]")


def test_wrong_rank_on_the_left():
    assert_error(GEMM_HEAD + "  D[m] = sum(k) A[m, k]\n}\n", 5, 3, "'D' has rank 2 but is written with 1 index",
                 "declared as D: f16[M, N]")


def test_index_not_bound_and_not_reduced():
    assert_error(GEMM_HEAD + "  D[m, n] = A[m, k] * B[k, n]\n}\n", 5, 18,
                 "index 'k' is not bound on the left side and is not reduced", "write `sum(k) A[m, k] * B[k, n]`",
                 end=(5, 19))


def test_index_not_bound_inside_a_reduction():
    src = "kernel k {\n  in A : f16[M, K, J]\n  out D : f32[M]\n  D[m] = sum(k) A[m, k, j]\n}\n"
    assert_error(src, 4, 25, "index 'j' is not bound on the left side and is not reduced",
                 "add 'j' to the reduction or to the left side")


def test_reduced_index_also_on_the_left():
    src = "kernel k {\n  in A : f16[M, K]\n  out D : f16[M, K]\n  D[m, k] = sum(k) A[m, k]\n}\n"
    assert_error(src, 4, 17, "index 'k' is reduced but also appears on the left side",
                 "the reduction has one value per [m]: write it to an intermediate first, `acc[m] = sum(k) "
                 "A[m, k]`, then read `acc[m]` in D[m, k] (or remove 'k' from the left side)")


def test_one_line_log_softmax_hint_names_the_intermediate_and_following_it_works():
    import numpy as np
    from kspec.backends.reference import reference
    src = "kernel ls {\n  in x : f32[M, N]\n  out y : f32[M, N]\n  y[m, n] = x[m, n] - logsumexp(n) x[m, n]\n}\n"
    assert_error(src, 4, 33, "index 'n' is reduced but also appears on the left side",
                 "the reduction has one value per [m]: write it to an intermediate first, `lse[m] = logsumexp(n) "
                 "x[m, n]`, then read `lse[m]` in y[m, n] (or remove 'n' from the left side)")
    fixed = src.replace("  y[m, n] = x[m, n] - logsumexp(n) x[m, n]",
                        "  lse[m] = logsumexp(n) x[m, n]\n  y[m, n] = x[m, n] - lse[m]")
    x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 - (np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1, keepdims=True)) + x64.max(1, keepdims=True))
    np.testing.assert_allclose(reference(fixed)(x=x)["y"], want, rtol=1e-5, atol=1e-5)


def test_reduction_over_an_index_the_operand_lacks():
    assert_error(GEMM_HEAD + "  D[m, n] = sum(k, j) A[m, k] * B[k, n]\n}\n", 5, 20,
                 "'sum(j)' reduces over 'j', which its operand does not use", "indices of the operand: m, k, n",
                 end=(5, 21))


def test_reduction_lists_an_index_twice():
    assert_error(GEMM_HEAD + "  D[m, n] = sum(k, k) A[m, k] * B[k, n]\n}\n", 5, 20, "'sum' lists index 'k' twice", None)


def test_left_index_without_extent():
    assert_error("kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  t[m, z] = A[m]\n  D[m] = A[m]\n}\n", 4, 8,
                 "index 'z' of 't' has no extent: it does not occur on the right side",
                 "declare 't' as an output with a shape, or use 'z' on the right")


def test_diagonal_index():
    assert_error("kernel k {\n  in A : f16[M, M]\n  out D : f16[M]\n  D[m] = A[m, m]\n}\n", 4, 15,
                 "index 'm' is used twice in A[...]", "diagonals are not supported; use distinct indices")


def test_symbolic_dim_conflict():
    src = "kernel k {\n  in A : f16[M, K]\n  in B : f16[J, N]\n  out D : f16[M, N]\n  D[m, n] = sum(k) A[m, k] * B[k, n]\n}\n"
    assert_error(src, 5, 32, "index 'k' ranges over J in B[k, n] but over K in A[m, k]",
                 "use one dimension name for both (e.g. K)")


def test_conflicting_literal_sizes():
    src = "kernel k {\n  in A : f16[M, 64]\n  in B : f16[32, N]\n  out D : f16[M, N]\n  D[m, n] = sum(k) A[m, k] * B[k, n]\n}\n"
    assert_error(src, 5, 32, "index 'k' has size 32 in B[k, n] but 64 in A[m, k]", "conflicting literal sizes")


def test_symbol_fixed_to_a_literal_then_conflicting():
    src = ("kernel k {\n  in A : f16[M, K]\n  in B : f16[64, N]\n  in C : f16[M, 32]\n  out D : f16[M, N]\n"
           "  out E : f16[M]\n  D[m, n] = sum(k) A[m, k] * B[k, n]\n  E[m] = sum(k) A[m, k] * C[m, k]\n}\n")
    assert_error(src, 8, 32, "dimension K is 32 here but 64 elsewhere", "K was fixed to 64 at line 7")


def test_symbols_fixed_to_the_same_literal_agree():
    src = ("kernel k {\n  in A : f16[M, K]\n  in B : f16[J, N]\n  in C : f16[64, 64]\n  out D : f16[M, N]\n"
           "  out E : f16[K, J]\n  E[a, b] = A[a, a2] * 0 + C[a, b] + B[b, b2] * 0\n  D[m, n] = sum(k) A[m, k] * B[k, n]\n}\n")
    with pytest.raises(KspecError):       # a2/b2 are unbound: the spec is still wrong, but not about K vs J
        load_spec(src, is_text=True)
    src = ("kernel k {\n  in A : f16[M, K]\n  in B : f16[J, N]\n  in C : f16[64, 64]\n  out D : f32[M, N]\n"
           "  out E : f16[K, J]\n  E[a, b] = C[a, b]\n  D[m, n] = sum(k) A[m, k] * B[k, n]\n}\n")
    k = load_spec(src, is_text=True).kernels[0]
    assert dict(k.bindings) == {"K": 64, "J": 64}


# ---------------------------------------------------------------- dtypes

def test_f16_bf16_mixing_needs_a_cast():
    src = "kernel k {\n  in A : f16[M]\n  in B : bf16[M]\n  out D : f32[M]\n  D[m] = A[m] + B[m]\n}\n"
    assert_error(src, 5, 10, "cannot combine f16 and bf16 without a cast",
                 "f16 and bf16 do not mix implicitly; convert one side, e.g. `f32(...)`", end=(5, 21))
    load_spec(src.replace("A[m] + B[m]", "f32(A[m]) + f32(B[m])"), is_text=True)     # the fix works


def test_int_float_mixing():
    src = "kernel k {\n  in A : i32[M]\n  in B : f16[M]\n  out D : f32[M]\n  D[m] = A[m] * B[m]\n}\n"
    assert_error(src, 5, 10, "cannot combine i32 and f16 without a cast", "convert one side explicitly, e.g. `f32(...)`")


def test_float_literal_with_int_value():
    assert_error("kernel k {\n  in A : i32[M]\n  out D : i32[M]\n  D[m] = A[m] * 0.5\n}\n", 4, 17,
                 "a floating-point literal is combined with an i32 value", "convert explicitly: `f32(...)`")


def test_storing_float_into_int_without_cast():
    assert_error("kernel k {\n  in A : f16[M]\n  out D : i32[M]\n  D[m] = A[m]\n}\n", 4, 10,
                 "cannot store an f16 value into i32 'D' without a cast",
                 "write `i32(...)` around the value to convert explicitly", end=(4, 14))


def test_output_annotation_disagrees():
    assert_error(ONE_D + "  D[m] : f32 = A[m]\n}\n", 4, 3, "output 'D' is declared f16 but annotated f32",
                 "drop the annotation; the output's declared dtype is what is stored")


def test_float_function_on_int():
    assert_error("kernel k {\n  in A : i32[M]\n  out D : i32[M]\n  D[m] = gelu(A[m])\n}\n", 4, 10,
                 "'gelu' needs a floating-point argument, got i32", "convert first: `gelu(f32(...))`")


# ---------------------------------------------------------------- functions and reductions

def test_unknown_function_with_suggestion():
    assert_error(ONE_D + "  D[m] = gleu(A[m])\n}\n", 4, 10, "unknown function 'gleu'", "did you mean `gelu`?",
                 end=(4, 14))


def test_unknown_function_lists_functions():
    e = assert_error(ONE_D + "  D[m] = frobnicate(A[m])\n}\n", 4, 10, "unknown function 'frobnicate'")
    assert e.hint.startswith("functions: abs, clamp, exp, gelu")


def test_cast_spelled_as_function():
    assert_error(ONE_D + "  D[m] = cast(A[m])\n}\n", 4, 10, "unknown function 'cast'",
                 "a cast is written with the dtype's name: `f32(x)`")


def test_wrong_arity():
    assert_error(ONE_D + "  D[m] = clamp(A[m], 0.0)\n}\n", 4, 10, "'clamp' takes 3 arguments, got 2",
                 "write `clamp(x, lo, hi)`", end=(4, 26))
    assert_error(ONE_D + "  D[m] = relu(A[m], 0.0)\n}\n", 4, 10, "'relu' takes 1 argument, got 2", None)
    assert_error(ONE_D + "  D[m] = maximum(A[m])\n}\n", 4, 10, "'maximum' takes 2 arguments, got 1", None)


def test_cast_with_two_arguments():
    assert_error(ONE_D + "  D[m] = f16(A[m], A[m])\n}\n", 4, 10, "a cast takes exactly one argument: f16(x)", None)


def test_keyword_argument_to_a_function():
    assert_error(ONE_D + "  D[m] = gelu(x=m)\n}\n", 4, 15, "function 'gelu' takes no keyword arguments", None)


MAX_HINT = "`max(i) x` reduces over index i; for the elementwise max of two values write `maximum(a, b)`"
MISSING_OPERAND = "'{}(...)' is a reduction and must be followed by the expression it reduces"


def test_max_of_two_values_hints_maximum():
    src = "kernel k {\n  in A : f16[M]\n  in B : f16[M]\n  out D : f16[M]\n  D[m] = max(A[m], B[m])\n}\n"
    assert_error(src, 5, 10, MISSING_OPERAND.format("max"), MAX_HINT, end=(5, 25))


def test_max_of_two_scalars_in_a_product_hints_maximum():
    src = "kernel k {\n  param a : f32\n  param b : f32\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m] * max(a, b)\n}\n"
    assert_error(src, 6, 17, MISSING_OPERAND.format("max"), MAX_HINT)


def test_max_of_expressions_followed_by_operand():
    src = "kernel k {\n  in A : f16[M]\n  in B : f16[M]\n  out D : f16[M]\n  D[m] = max(A[m], B[m]) A[m]\n}\n"
    assert_error(src, 5, 14, "'max(...)' takes index names, not expressions", MAX_HINT)
    src = src.replace("max(", "min(")
    assert_error(src, 5, 14, "'min(...)' takes index names, not expressions",
                 MAX_HINT.replace("max", "min"))


def test_reduction_without_operand():
    assert_error(ONE_D + "  D[m] = sum(k)\n}\n", 4, 10, MISSING_OPERAND.format("sum"),
                 "a reduction is written `sum(k) A[m, k] * B[k, n]`: index names in parentheses, then the operand")
    # also when the file ends right there
    assert_error(ONE_D + "  D[m] = mean(k)", 4, 10, MISSING_OPERAND.format("mean"))


def test_reduction_operand_starting_with_minus():
    assert_error("kernel k {\n  in A : f16[M, K]\n  out D : f16[M]\n  D[m] = sum(k) -A[m, k]\n}\n", 4, 17,
                 "unexpected '-'; expected '(', a dtype (f16, bf16, f32, ...), a name, a number or a reduction "
                 "(sum, max, min, mean, logsumexp, softmax)",
                 "the operand of sum(...) cannot start with '-'; write `sum(...) (-x)`")


def test_reduction_takes_no_options():
    assert_error("kernel k {\n  in A : f16[M, K]\n  out D : f32[M]\n  D[m] = sum(k, causal=m) A[m, k]\n}\n", 4, 17,
                 "'sum' takes no options", None)


SOFTMAX = "kernel k {\n  in S : f32[M, N]\n  out P : f32[M, N]\n  P[i, j] = {}\n}\n"


def test_softmax_unknown_option():
    assert_error(SOFTMAX.replace("{}", "softmax(j, mask=i) S[i, j]"), 4, 24, "unknown softmax option 'mask'",
                 "softmax takes `causal=i`, naming the query index", end=(4, 30))


def test_softmax_causal_index_not_in_operand():
    assert_error(SOFTMAX.replace("{}", "softmax(j, causal=q) S[i, j]"), 4, 24,
                 "causal index 'q' is not an index of the softmax operand", None)


def test_softmax_causal_index_equals_axis():
    assert_error(SOFTMAX.replace("{}", "softmax(j, causal=j) S[i, j]"), 4, 24,
                 "the causal query index must differ from the softmax index", None)


def test_softmax_over_two_indices():
    assert_error(SOFTMAX.replace("{}", "softmax(i, j) S[i, j]"), 4, 13,
                 "softmax normalises over exactly one index, got 2", "write `softmax(j) s[i, j]`")


def test_softmax_keyword_before_index():
    assert_error(SOFTMAX.replace("{}", "softmax(causal=i, j) S[i, j]"), 4, 31,
                 "keyword arguments must come after the index names", None)


def test_softmax_over_unused_index():
    src = "kernel k {\n  in S : f32[M, N]\n  out P : f32[M, N]\n  P[i, j] = softmax(q) S[i, j]\n}\n"
    assert_error(src, 4, 21, "softmax over 'q', which its operand does not use", None)


# ---------------------------------------------------------------- schedules and targets

def test_schedule_names_unknown_kernel():
    src = "kernel gemm {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m]\n}\nschedule gemn { tile = 128x128x64 }\n"
    assert_error(src, 6, 10, "schedule names unknown kernel 'gemn'", "did you mean `gemm`?", end=(6, 14))
    assert_error(src.replace("gemn", "other"), 6, 10, "schedule names unknown kernel 'other'",
                 "kernels in this file: gemm")


@pytest.mark.parametrize("setting,message", [
    # the front end checks the form of a setting; which sizes a backend takes is the backend's to
    # say when the kernel is planned (tests/test_registry.py: test_schedule_settings_no_backend_honours)
    ("cluster = 0x1x1", "impossible cluster 0x1x1: cluster sizes are positive integers"),
    ("tile = 128x0x64", "impossible tile 128x0x64: tile sizes are positive integers"),
    ("stages = 0", "impossible stages 0: the stage count is a positive integer"),
    ("tile = 128", "'tile' takes three sizes, like 128x128x64"),
    ("cluster = 2", "'cluster' takes three sizes, like 2x1x1"),
    ("stages = 2x2x2", "'stages' takes one integer, like `stages = 4`"),
])
def test_malformed_schedule_settings(setting, message):
    assert_error(IDENTITY + f"schedule k {{ {setting} }}\n", 6, 14, message, None,
                 end=(6, 14 + len(setting)))


def test_unknown_schedule_setting():
    assert_error(IDENTITY + "schedule k { tiles = 128x128x64 }\n", 6, 14, "unknown schedule setting 'tiles'",
                 "did you mean `tile`?")
    assert_error(IDENTITY + "schedule k { warps = 4 }\n", 6, 14, "unknown schedule setting 'warps'",
                 "settings: tile, cluster, stages, backend")


def test_backend_setting_takes_a_name_and_sizes_take_numbers():
    assert_error(IDENTITY + "schedule k { backend = 4 }\n", 6, 14,
                 "'backend' takes a backend name, like `backend = cutlass`", None)
    assert_error(IDENTITY + "schedule k { tile = cutlass }\n", 6, 14, "'tile' takes three sizes, not a name", None)


def test_setting_given_twice_and_schedule_given_twice():
    assert_error(IDENTITY + "schedule k { stages = 2  stages = 3 }\n", 6, 26, "setting 'stages' is given twice", None)
    assert_error(IDENTITY + "schedule k for sm90a { stages = 2 }\nschedule k for sm90a { stages = 3 }\n", 7, 10,
                 "kernel 'k' already has a schedule for sm90a", None)


def test_duplicate_target_line():
    assert_error("target sm90a\ntarget sm100a\n" + IDENTITY, 2, 1, "only one `target` line is allowed per file",
                 "list every arch in one line: `target sm90a, sm100a`", end=(2, 14))


def test_arch_listed_twice():
    assert_error("target sm90a, sm90a\n" + IDENTITY, 1, 1, "arch 'sm90a' is listed twice", None)


# ---------------------------------------------------------------- several errors, the cap, rendering

def test_independent_errors_are_all_reported():
    src = """kernel k {
  in A : f16[M, K]
  in B : bf16[K, N]
  out D : f16[M, N]
  out E : f16[M]
  out F : f16[M]
  D[m, n] = sum(k) A[m, k] * B[k, n]
  E[m] = gleu(A[m])
  E2[m] = sum(k) A[m, k] * Bq[k, m]
}
kernel k2 {
  in X : f16[M]
  out Y : i32[M]
  Y[m] = X[m]
}
schedule k3 { tile = 128x128x64 }
schedule k { stages = 0 }
"""
    e = error_of(src)
    got = [(d.span.line if d.span else None, d.message) for d in e.diagnostics]
    assert got == [
        (16, "schedule names unknown kernel 'k3'"),
        (17, "impossible stages 0: the stage count is a positive integer"),
        (7, "cannot combine f16 and bf16 without a cast"),
        (8, "unknown function 'gleu'"),
        (9, "unknown name 'Bq'"),
        (6, "output 'F' is never written"),
        (14, "cannot store an f16 value into i32 'Y' without a cast"),
    ]
    text = e.render()
    assert text.count("error:") == 7 and text.count("bad.kspec:") == 7
    # the checked statement that failed does not also produce "never written" for its target
    assert "'E' is never written" not in text and "'D' is never written" not in text


def test_error_cap(monkeypatch):
    src = "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n" + "".join(
        f"  t{i}[m] = nope{i}[m]\n" for i in range(30)) + "  D[m] = A[m]\n}\n"
    e = error_of(src)
    assert len(e.diagnostics) == check_module.MAX_ERRORS + 1
    assert e.diagnostics[-1].message == f"too many errors; stopping after {check_module.MAX_ERRORS}"
    assert e.diagnostics[-1].span is None
    assert [d.message for d in e.diagnostics[:3]] == ["unknown name 'nope0'", "unknown name 'nope1'",
                                                       "unknown name 'nope2'"]
    monkeypatch.setattr(check_module, "MAX_ERRORS", 3)
    e = error_of(src)
    assert [d.message for d in e.diagnostics] == ["unknown name 'nope0'", "unknown name 'nope1'",
                                                  "unknown name 'nope2'", "too many errors; stopping after 3"]


def test_rendered_format_exactly():
    e = error_of(GEMM_HEAD + "  D[m, n] = A[m, k] * B[k, n]\n}\n", file="specs/bad.kspec")
    assert e.render() == (
        "specs/bad.kspec:5:18: error: index 'k' is not bound on the left side and is not reduced\n"
        "      D[m, n] = A[m, k] * B[k, n]\n"
        "                     ^\n"
        "  hint: write `sum(k) A[m, k] * B[k, n]`")


def test_rendered_caret_spans_the_token():
    e = error_of(GEMM_HEAD + "  D[m, n] = sum(k) A[m, k] * Bb[k, n]\n}\n")
    lines = e.render().split("\n")
    assert lines[0] == "bad.kspec:5:30: error: unknown name 'Bb'"
    assert lines[1] == "      D[m, n] = sum(k) A[m, k] * Bb[k, n]"
    assert lines[2] == "    " + " " * 29 + "^" * 8
    assert lines[1][4 + 29:4 + 37] == "Bb[k, n]"
    assert lines[3] == "  hint: did you mean `B`?"


def test_rendered_without_hint_and_without_span():
    e = error_of(ONE_D + "  D[m] = relu(A[m], 0.0)\n}\n")
    assert e.render() == ("bad.kspec:4:10: error: 'relu' takes 1 argument, got 2\n"
                          "      D[m] = relu(A[m], 0.0)\n"
                          "             ^^^^^^^^^^^^^^^")
    assert error_of("").render() == ("error: bad.kspec defines no kernels\n"
                                      "  hint: a spec file holds one or more `kernel NAME { ... }` blocks")


def test_rendered_at_end_of_file():
    e = error_of("kernel k {\n  in A : f16[M]")
    assert e.render().split("\n")[1:3] == ["      in A : f16[M]", "    " + " " * 15 + "^"]


def test_rendered_line_with_tabs_and_odd_line_breaks():
    # a tab counts as one column; '\f' and '\u2028' inside a comment do not start a new line
    src = "kernel k {\n  # a\u2028b\fc\n\tin A : f16[M]\n\tout D : f16[M]\n\tD[m] = A[m] @\n}\n"
    e = error_of(src)
    assert (e.span.line, e.span.col) == (5, 14)
    assert e.render().split("\n")[1:3] == ["     D[m] = A[m] @", "                 ^"]


def test_crlf_line_endings():
    src = "kernel k {\r\n  in A : f16[M]\r\n  out D : f16[M]\r\n  D[m] = A[m] * B[m]\r\n}\r\n"
    e = error_of(src)
    assert (e.span.line, e.span.col) == (4, 17)
    assert e.render().split("\n")[1] == "      D[m] = A[m] * B[m]"


def test_caret_never_runs_past_the_line():
    d = Diagnostic("m", Span("f", 1, 3, 1, 99), None, "ab cd\nx")
    assert d.render().split("\n")[2] == "      ^^^^"
    d = Diagnostic("m", Span("f", 1, 3, 2, 1), None, "ab cd\nx")        # multi-line: one caret
    assert d.render().split("\n")[2] == "      ^"
    d = Diagnostic("m", Span("f", 9, 1, 9, 2), None, "ab")              # line out of range: no excerpt
    assert d.render() == "f:9:1: error: m"


def test_kernel_lookup_error_suggests():
    prog = load_spec(IDENTITY, is_text=True)
    with pytest.raises(KspecError, match="no kernel named 'kk'") as info:
        prog.kernel("kk")
    assert info.value.hint == "did you mean `k`?"


def test_parse_then_check_equals_load_spec_errors():
    src = GEMM_HEAD + "  D[m, n] = A[m, k] * B[k, n]\n}\n"
    with pytest.raises(KspecError) as a:
        check(parse(src, "bad.kspec"))
    assert a.value.render() == error_of(src).render()


# ---------------------------------------------------------------- index arithmetic, conditions, where

ATT_HEAD = ("kernel k {\n  param scale : f32 = 0.125\n  param g : f32 = 2.0\n  in Q : f16[B, H, S, 64]\n"
            "  in K : f16[B, KH, T, 64]\n  in x : f32[N]\n  out O : f32[B, H, S, T]\n  out y : f32[N]\n")


def test_float_param_in_a_subscript():
    assert_error(ATT_HEAD + "  O[b, h, i, j] = scale * sum(e) Q[b, h, i, e] * K[b, h / g, j, e]\n"
                 "  y[n] = x[n]\n}\n", 9, 55,
                 "subscript h / g (axis 1 of 'K') is f32; subscripts must be integers",
                 "'g' is f32; declare it as an integer, e.g. `param g : i32`")


def test_float_tensor_in_a_subscript():
    assert_error(ONE_D.replace("in A : f16[M]", "in A : f16[M]\n  in w : f32[M]") +
                 "  D[m] = A[w[m]]\n}\n", 5, 12,
                 "subscript tensor 'w' is f32; a subscript must hold integers",
                 "declare 'w' as i32 (or i8), e.g. `in w : i32[...]`")


def test_computed_float_subscript():
    assert_error(ONE_D + "  D[m] = A[m * 0.5]\n}\n", 4, 12,
                 "subscript m * 0.5 (axis 0 of 'A') is f32; subscripts must be integers",
                 "subscripts are computed with integers only (`/` is floor division)")


def test_condition_as_a_subscript():
    assert_error(ONE_D + "  D[m] = A[m < 3]\n}\n", 4, 12,
                 "subscript m < 3 of 'A' is a condition, not an integer",
                 "a subscript is an integer index expression such as `h / G` or `j % P`")


def test_where_needs_a_condition():
    assert_error(ONE_D + "  D[m] = where(A[m], A[m], 0.0)\n}\n", 4, 16,
                 "the first argument of 'where' needs a condition, got an f16 value",
                 "compare it, e.g. `A[m] > 0`")


def test_condition_in_arithmetic_and_stored():
    assert_error(ONE_D + "  D[m] = A[m] + (m < 3)\n}\n", 4, 18, "'+' needs a number, got a condition",
                 "choose values with where: `where(m < 3, 1.0, 0.0)`")
    assert_error(ONE_D + "  c[m] = A[m] > 0.0\n  D[m] = A[m]\n}\n", 4, 10, "a condition cannot be stored in 'c'",
                 "use the condition where it chooses values: `where(A[m] > 0.0, a, b)`")
    assert_error(ONE_D + "  D[m] = f16(m < 3)\n}\n", 4, 10, "a condition cannot be converted to f16",
                 "write `where(m < 3, 1.0, 0.0)`")


def test_and_or_not_need_conditions():
    assert_error(ONE_D + "  D[m] = where(m and m < 2, A[m], 0.0)\n}\n", 4, 16,
                 "'and' needs a condition, got an i32 value", "compare it, e.g. `m > 0`")
    assert_error(ONE_D + "  D[m] = where(not A[m], A[m], 0.0)\n}\n", 4, 20,
                 "'not' needs a condition, got an f16 value", "compare it, e.g. `A[m] > 0`")


def test_where_branches_disagree_in_shape():
    assert_error("kernel k {\n  in a : f32[M]\n  in b : f32[N]\n  out D : f32[M, N]\n"
                 "  D[m, n] = where(m < n, a[m], b[n])\n}\n", 5, 13,
                 "the branches of 'where' disagree in shape: [m] and [n]",
                 "one branch's indices must include the other's (a scalar such as -inf fits any)")


def test_where_takes_three_arguments_and_if_hints_where():
    assert_error(ONE_D + "  D[m] = where(m < 2, A[m])\n}\n", 4, 10, "'where' takes 3 arguments, got 2",
                 "write `where(cond, a, b)`: a where cond holds, else b")
    e = error_of(ONE_D + "  D[m] = select(m < 2, A[m], 0.0)\n}\n")
    assert e.hint == "choose between values with `where(cond, a, b)`"


def test_modulo_needs_integers():
    assert_error(ONE_D + "  D[m] = A[m] % 2.0\n}\n", 4, 10, "'%' needs integer operands",
                 "`%` is the integer modulo of index arithmetic (`j % P`)")


def test_index_whose_extent_cannot_be_inferred():
    assert_error(ONE_D + "  D[m] = A[m] + sum(k) f32(k)\n}\n", 4, 28,
                 "the extent of index 'k' cannot be inferred: it is used only as a value or inside computed "
                 "subscripts", "use 'k' as a plain subscript of some tensor (e.g. `x[k]`), whose dimension "
                 "gives its range")
    # an index used only inside a computed subscript has no extent either (`A[k / 2]` would give it
    # one: the extent of A's axis times 2, as a paged read `Kc[bt[b, j / P], j % P, ..]` needs)
    assert_error(ONE_D + "  D[m] = A[m] + sum(k) A[k + 1]\n}\n", 4, 26,
                 "the extent of index 'k' cannot be inferred: it is used only as a value or inside computed "
                 "subscripts", _NO_HINT)


def test_unknown_name_in_an_expression():
    assert_error(ONE_D + "  D[m] = A[m] * f16(q)\n}\n", 4, 21, "unknown name 'q'",
                 "a name in an expression is a param, a size symbol of a declared shape, or an index of the "
                 "left side or of an enclosing reduction")


def test_causal_with_different_query_and_key_extents_shows_both_alignments():
    e = assert_error(ATT_HEAD.replace("KH, T", "H, T") +
                     "  s[b, h, i, j] : f32 = scale * sum(e) Q[b, h, i, e] * K[b, h, j, e]\n"
                     "  O[b, h, i, j] = softmax(j, causal=i) s[b, h, i, j]\n  y[n] = x[n]\n}\n", 10, 30,
                     "softmax(j, causal=i) aligns the mask top-left (key j is kept when j <= i), but query i "
                     "ranges over S and key j over T")
    assert e.hint == ("write the mask explicitly and use softmax(j): top-left `where(j <= i, s[b, h, i, j], -inf)`, "
                      "or bottom-right as FlashAttention and torch SDPA align it "
                      "`where(j <= i + (T - S), s[b, h, i, j], -inf)`")
    # literal extents: the offset is a number
    e = error_of("kernel k {\n  in s : f32[4, 9]\n  out p : f32[4, 9]\n  p[i, j] = softmax(j, causal=i) s[i, j]\n}\n")
    assert "`where(j <= i + (5), s[i, j], -inf)`" in e.hint


def test_causal_with_one_extent_is_fine():
    load_spec("kernel k {\n  in s : f32[S, S]\n  out p : f32[S, S]\n  p[i, j] = softmax(j, causal=i) s[i, j]\n}\n",
              is_text=True)


def test_index_arithmetic_errors_are_reported_together():
    e = error_of(ONE_D + "  D[m] = A[m < 3]\n  E[m] = where(A[m], 1.0, 0.0)\n  F[m] = A[m] % 2.0\n}\n")
    assert [d.span.line for d in e.diagnostics[:3]] == [4, 5, 6]
