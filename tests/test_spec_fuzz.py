"""Fuzz the spec-language front end: mutated specs either check or raise a `KspecError` whose spans
point inside the text.  Nothing else may escape (no RecursionError, no lark exception, no ValueError).

Seeded and deterministic; run this file directly (`python tests/test_spec_fuzz.py`) to see timings.
"""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from kspec.spec_lang import KspecError, check, parse, print_program
from kspec.spec_lang.check import format_typed
from kspec.spec_lang.parser import MAX_NESTING, _parser

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
SEED = 20240611
N_MUTANTS = 2400
TIME_BUDGET_S = 30.0

# Extra seeds that reach corners the shipped specs do not: targets, schedules, casts, calls, ints.
EXTRA_SEEDS = [
    """target sm90a, sm100a
kernel mix {
  param a : f32 = -2.5e-3
  param n : i32 = 3
  in  X : i8[M, 64] col
  in  Y : f32[M]
  out Z : f32[M, 64]
  out W : i32[M]
  t[m, c] : f32 = f32(X[m, c]) * -a + clamp(Y[m], 0.0, 6.0) / (1.0 - (a - 2.0))
  Z[m, c] = maximum(t[m, c], minimum(gelu_tanh(t[m, c]), -(-t[m, c])))
  W[m] = sum(c) i32(X[m, c]) * n
}
schedule mix for sm100a { tile = 256x128x64  cluster = 2x1x1  stages = 4 }
schedule mix { stages = 2 }
""",
    """kernel smx {
  in  S : bf16[B, S, S]
  out P : bf16[B, S, S]
  out r : f32[B, S]
  p[b, i, j] = softmax(j, causal=i) S[b, i, j]
  P[b, i, j] = bf16(p[b, i, j])
  r[b, i] = mean(j) p[b, i, j] + max(j) p[b, i, j] * min(j) (-p[b, i, j])
}
""",
]

# Tokens: names, numbers, shapes, comments, punctuation, whitespace runs; anything else is one char.
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|[0-9]+x[0-9]+x[0-9]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?"
                    r"|#[^\n]*|\s+|.", re.S)
_WORDS = ["kernel", "schedule", "target", "for", "in", "out", "param", "row", "col", "f16", "bf16", "f32",
          "tf32", "f8e4m3", "f8e5m2", "i8", "i32", "sm90a", "sm100a", "sum", "max", "min", "mean",
          "softmax", "causal", "tile", "cluster", "stages", "relu", "gelu", "maximum", "clamp", "exp", "x",
          "A", "B", "D", "M", "N", "K", "m", "n", "k", "acc", "_", "__x9"]
_PUNCT = list("{}[]()=,:+-*/#;.@$\\\"'`!?<>|&^~%")
_ODD = ["0", "00", "-0", "1e999", "1e-999", "9" * 40, "9" * 5000, "1" * 400 + ".5", "0x1f", "1.5.3",
        "128x128x64", "0x0x0", "99999999999x1x1", "1x2", "é", "λ", "∑", "😀", "\u200b", "\u2028",
        "\x00", "\x0c", "\r", "\r\n", "\t", "\ufeff", "İ", "ﬁ", "\\n", "'", '"']


def _seeds() -> list[str]:
    return [p.read_text() for p in sorted(SPECS_DIR.glob("*.kspec"))] + EXTRA_SEEDS


def _random_ident(rng: random.Random) -> str:
    first = rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
    return first + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(rng.randint(0, 12)))


def _random_token(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return rng.choice(_WORDS)
    if r < 0.55:
        return rng.choice(_PUNCT)
    if r < 0.75:
        return _random_ident(rng)
    return rng.choice(_ODD)


def _mutate_tokens(text: str, rng: random.Random) -> str:
    toks = _TOKEN.findall(text)
    names = sorted({t for t in toks if re.fullmatch(r"[A-Za-z_]\w*", t)})
    for _ in range(rng.choice([1, 1, 1, 2, 3, 4])):
        if not toks:
            toks = [_random_token(rng)]
        i = rng.randrange(len(toks))
        op = rng.randrange(8)
        if op >= 6:                                   # one name or number replaced by another of the text
            same_kind = [j for j, t in enumerate(toks) if re.fullmatch(r"\w+", t)]
            if same_kind and names:
                j = rng.choice(same_kind)
                toks[j] = rng.choice(names + ["0", "1", "2.0", "64", "-1", "f32", "i32", "bf16"])
            continue
        if op == 0:                                   # delete
            del toks[i]
        elif op == 1:                                 # duplicate
            toks.insert(i, toks[i])
        elif op == 2 and len(toks) > 1:               # swap with a neighbour or a random token
            j = min(len(toks) - 1, i + 1) if rng.random() < 0.5 else rng.randrange(len(toks))
            toks[i], toks[j] = toks[j], toks[i]
        elif op == 3:                                 # replace
            toks[i] = _random_token(rng)
        elif op == 4:                                 # insert
            toks.insert(i, rng.choice([" ", ""]) + _random_token(rng) + rng.choice([" ", ""]))
        else:                                         # rename every occurrence of one name
            if names:
                old, new = rng.choice(names), rng.choice([_random_ident(rng), rng.choice(_WORDS)])
                toks = [new if t == old else t for t in toks]
    return "".join(toks)


def _truncate(text: str, rng: random.Random) -> str:
    return text[:rng.randrange(len(text) + 1)]


_DEEP_FORMS = [
    lambda n, leaf: "(" * n + leaf + ")" * n,
    lambda n, leaf: "- " * n + leaf,
    lambda n, leaf: "-(" * n + leaf + ")" * n,
    lambda n, leaf: "f32(" * n + leaf + ")" * n,
    lambda n, leaf: "gelu(" * n + leaf + ")" * n,
    lambda n, leaf: "sum(k) " * n + "A[m, k]",
    lambda n, leaf: " + ".join([leaf] * n),
    lambda n, leaf: " * ".join([leaf] * n),
    lambda n, leaf: " - ".join([leaf] * n),
    lambda n, leaf: "maximum(" * n + leaf + ", 1.0)" * n,
    lambda n, leaf: "(" * n + leaf,                  # unbalanced
    lambda n, leaf: leaf + ")" * n,
]


def _deep_spec(form, n: int) -> str:
    body = form(n, "A[m, n]")
    return f"kernel deep {{\n  in A : f16[M, N]\n  out D : f16[M, N]\n  D[m, n] = {body}\n}}\n"


def _deep(rng: random.Random) -> str:
    """Deep nesting around the limit (the 5,000-level cases are in `fixed_cases`, once each:
    Lark parses ~50k tokens a second, so they are too slow to repeat)."""
    return _deep_spec(rng.choice(_DEEP_FORMS), rng.choice([20, MAX_NESTING - 1, MAX_NESTING, MAX_NESTING + 1, 2 * MAX_NESTING]))


def _long_line(rng: random.Random) -> str:
    n = rng.choice([100, 5000, 100000])
    tail = rng.choice(["", " @", " }", " ;", " \u00e9", " # " + "c" * n])
    wide = rng.choice(["X" * n, "X0"])
    return (f"kernel wide {{  in {wide} : f16[M]  in Y : f16[{'M, ' * (n // 1000)}M]  out D : f16[M]"
            f"  D[m] = {wide}[m]{tail} }}")


def fixed_cases() -> list[str]:
    """Hand-picked extremes: 5,000-level nesting of every form, huge literals, odd bytes."""
    # 5,000 levels for the forms that nest one token at a time, 2,000 for the wordier ones
    cases = [_deep_spec(form, 5000 if i in (0, 1, 5, 10, 11) else 2000) for i, form in enumerate(_DEEP_FORMS)]
    base = "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m] * %s\n}\n"
    cases += [base % x for x in ("9" * 5000, "9" * 5000 + ".5", "1e99999", "." + "0" * 5000 + "1",
                                 "-" + "9" * 41, "(" + "9" * 41 + ")")]
    cases += ["kernel k { in A : f16[" + "9" * 5000 + "] out D : f16[M] D[m] = A[m] }",
              "kernel k { in A : f16[M] out D : f16[M] D[m] = A[m] }\nschedule k { stages = " + "9" * 5000 + " }",
              "kernel k { in A : f16[M] out D : f16[M] D[m] = A[m] }\nschedule k { tile = 1x" + "9" * 5000 + "x1 }",
              "kernel k { param s : f32 = -" + "9" * 5000 + "\n in A : f16[M] out D : f16[M] D[m] = A[m] }",
              "kernel k { # \u2028 \x0c \x1c \u0085\n in A : f16[M] out D : f16[M] D[m] = B[m] }",
              "\ufeffkernel k { in A : f16[M] out D : f16[M] D[m] = A[m] }",
              "kernel k { in A : f16[M] out D : f16[M] D[m] = A[m] }\x00",
              "kernel k {\r\n in A : f16[M]\r\n out D : f16[M]\r\n D[m] = A[m] +\r\n}\r\n",
              "", " ", "\n\n\n", "#", "}", "{" * 5000, "kernel k {" + " in A : f16[M]" * 3000 + "}"]
    return cases


def mutants(n: int = N_MUTANTS, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    seeds = _seeds()
    out: list[str] = []
    while len(out) < n:
        base = rng.choice(seeds)
        r = rng.random()
        if r < 0.72:
            out.append(_mutate_tokens(base, rng))
        elif r < 0.85:
            out.append(_truncate(base, rng))
        elif r < 0.92:
            out.append(_deep(rng))
        elif r < 0.96:
            out.append(_long_line(rng))
        else:                                        # a random character spliced in anywhere
            i = rng.randrange(len(base) + 1)
            out.append(base[:i] + rng.choice(_ODD) + base[i:])
    return fixed_cases() + out[:max(0, n - len(fixed_cases()))]


def assert_span_inside(text: str, err: KspecError) -> None:
    """Every diagnostic's span lies within the text: lines count '\\n' only (as the parser does),
    and a column may point one past the end of its line (end of line / end of file)."""
    lines = text.split("\n")
    for d in err.diagnostics:
        s = d.span
        if s is None:
            continue
        assert 1 <= s.line <= len(lines), (s, len(lines))
        assert 1 <= s.col <= len(lines[s.line - 1]) + 1, (s, len(lines[s.line - 1]))
        assert s.line <= s.end_line <= len(lines), s
        assert 1 <= s.end_col <= len(lines[s.end_line - 1]) + 1, s
        assert (s.end_line, s.end_col) >= (s.line, s.col), s
    rendered = err.render()
    assert "error:" in rendered and "Traceback" not in rendered


_LARK_TERMINALS = {t.name for t in _parser().terminals} | {"$END"}


def assert_words_only(message: str) -> None:
    """Syntax errors name what was expected in words, never as Lark terminals (RSQB, __ANON_0)."""
    unquoted = re.sub(r"'[^']*'", "''", message)
    leaked = {w for w in re.findall(r"[$A-Z_][A-Z_0-9]+", unquoted) if w in _LARK_TERMINALS}
    assert not leaked and "__ANON" not in unquoted and "Token(" not in unquoted, message


def run_one(text: str) -> str:
    """'ok', 'parse' or 'check'; raises anything that is not a KspecError."""
    try:
        program = parse(text, "fuzz.kspec")
    except KspecError as e:
        assert_span_inside(text, e)
        assert_words_only(e.message)
        return "parse"
    # whatever parses must survive the printer round trip
    assert parse(print_program(program), "printed.kspec") == program
    try:
        checked = check(program)
    except KspecError as e:
        assert_span_inside(text, e)
        return "check"
    format_typed(checked)
    return "ok"


def test_seeds_are_valid():
    for text in _seeds():
        assert run_one(text) == "ok"


def test_fuzz_mutants_never_crash():
    texts = mutants()
    assert len(texts) >= 2000
    outcomes = {"ok": 0, "parse": 0, "check": 0}
    # CPU time, not wall time: other jobs (nvcc) share this machine's two cores
    start = time.process_time()
    for i, text in enumerate(texts):
        try:
            outcomes[run_one(text)] += 1
        except Exception as e:  # noqa: BLE001 - report the input that crashed
            pytest.fail(f"mutant {i} raised {type(e).__name__}: {e!s:.300}\n--- input ---\n{text[:2000]}")
    elapsed = time.process_time() - start
    # every class of outcome occurs, so the mutator is neither too gentle nor too destructive
    assert all(v > 20 for v in outcomes.values()), outcomes
    assert elapsed < TIME_BUDGET_S, f"fuzzing took {elapsed:.1f}s of CPU time"


def test_fuzz_is_deterministic():
    assert mutants(50) == mutants(50)


if __name__ == "__main__":
    t0 = time.perf_counter()
    texts = mutants()
    t1, c1 = time.perf_counter(), time.process_time()
    counts: dict[str, int] = {}
    crashes = 0
    for i, text in enumerate(texts):
        try:
            r = run_one(text)
        except Exception as e:  # noqa: BLE001
            crashes += 1
            r = "CRASH " + type(e).__name__
            if crashes <= 10:
                print(f"--- mutant {i}: {type(e).__name__}: {e!s:.200}\n{text[:600]!r}")
        counts[r] = counts.get(r, 0) + 1
    print(f"{len(texts)} mutants generated in {t1 - t0:.2f}s, run in {time.perf_counter() - t1:.2f}s "
          f"({time.process_time() - c1:.2f}s CPU): {counts}")
