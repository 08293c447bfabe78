"""`kspec check` and the CLI's general behaviour, through `main()` and through `python -m kspec`."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kspec
from kspec.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent
SPECS = REPO / "specs"
SPEC_FILES = sorted(SPECS.glob("*.kspec"))
BAD = "kernel k {\n  in A : f16[M, K]\n  in B : f16[K, N]\n  out D : f16[M, N]\n  D[m, n] = A[m, k] * B[k, n]\n}\n"


def run_cli(*args: str, cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "kspec", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env, input=stdin)


def assert_no_traceback(*texts: str) -> None:
    for t in texts:
        assert "Traceback" not in t and "internal error" not in t, t


def subcommands() -> list[str]:
    parser = build_parser()
    for action in parser._actions:                          # argparse keeps subparsers here
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


# ---------------------------------------------------------------- through main()

def test_check_one_spec_summary(capsys):
    path = SPECS / "gemm.kspec"
    assert main(["check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out == (f"{path}: kernel gemm: in (A: f16[M, K], B: f16[K, N] col) -> out (D: f16[M, N]); "
                   "ops: 1 contraction\n")


def test_check_every_shipped_spec_one_line_per_kernel(capsys):
    assert main(["check", *map(str, SPEC_FILES)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == len(SPEC_FILES)
    for path, line in zip(SPEC_FILES, lines):
        assert line.startswith(f"{path}: kernel {path.stem}: in (")
        assert " -> out (" in line and "; ops: " in line
    attention = next(l for l in lines if ": kernel attention:" in l)
    assert attention.endswith("ops: 2 contraction, 1 elementwise, 1 softmax")
    assert "scale: f32 = 0.08838834764831845" in attention
    rowmax = next(l for l in lines if "gemm_rowmax" in l)
    assert "out (D: f16[M, N], rowmax: f32[M])" in rowmax and "1 reduction" in rowmax


def test_check_two_kernels_in_one_file(tmp_path, capsys):
    f = tmp_path / "two.kspec"
    f.write_text("kernel a {\n  in X : f16[M]\n  out Y : f16[M]\n  Y[m] = relu(X[m])\n}\n"
                 "kernel b {\n  in X : f32[M]\n  out Y : f32[M]\n  Y[m] = X[m]\n}\n")
    assert main(["check", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{f}: kernel a: in (X: f16[M]) -> out (Y: f16[M]); ops: 1 elementwise",
                   f"{f}: kernel b: in (X: f32[M]) -> out (Y: f32[M]); ops: copy"]


def test_check_error_exit_1_on_stderr(tmp_path, capsys):
    f = tmp_path / "bad.kspec"
    f.write_text(BAD)
    assert main(["check", str(f)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"{f}:5:18: error: index 'k' is not bound on the left side and is not reduced\n"
                   "      D[m, n] = A[m, k] * B[k, n]\n"
                   "                     ^\n"
                   "  hint: write `sum(k) A[m, k] * B[k, n]`\n")


def test_check_good_and_bad_files_together(tmp_path, capsys):
    bad = tmp_path / "bad.kspec"
    bad.write_text(BAD)
    good = SPECS / "gemm.kspec"
    assert main(["check", str(bad), str(good)]) == 1
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}: kernel gemm:")        # the good file is still checked
    assert err.startswith(f"{bad}:5:18: error:")


def test_check_missing_and_unreadable_files(tmp_path, capsys):
    missing = tmp_path / "nope.kspec"
    assert main(["check", str(missing)]) == 1
    assert capsys.readouterr().err == f"error: no such file: {missing}\n"
    binary = tmp_path / "bin.kspec"
    binary.write_bytes(b"\xff\xfe\x00kernel")
    assert main(["check", str(binary)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {binary} is not UTF-8 text")
    assert main(["check", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"error: cannot read {tmp_path}")


def test_check_file_with_byte_order_mark(tmp_path, capsys):
    f = tmp_path / "bom.kspec"
    f.write_bytes(b"\xef\xbb\xbf" + (SPECS / "gemm.kspec").read_bytes())
    assert main(["check", str(f)]) == 0
    assert capsys.readouterr().out.startswith(f"{f}: kernel gemm:")


def test_check_ast(capsys):
    path = SPECS / "gemm_bias_relu.kspec"
    assert main(["check", "--ast", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"program {path}"
    assert lines[1] == "kernel gemm_bias_relu"
    assert lines[2] == "  symbols: M, K, N"
    assert "  in    bias: f16[N]" in lines
    assert "  temp  acc: f32[M, N]" in lines
    assert "  acc[m, n] : f32   (m: M, k: K, n: N)" in lines
    assert "    sum(k) : f32 [m, n]" in lines
    assert "      * : f16 [m, k, n]" in lines
    assert "  D[m, n] : f16   (m: M, n: N)" in lines
    assert "    relu : f32 [m, n]" in lines          # computed in f32, stored as f16


def test_check_ast_with_errors_prints_errors_only(tmp_path, capsys):
    f = tmp_path / "bad.kspec"
    f.write_text(BAD)
    assert main(["check", "--ast", str(f)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "error: index 'k'" in err


def test_version_and_help_through_main(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kspec {kspec.__version__}"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kspec") and "check" in out


def test_every_subcommand_has_help(capsys):
    names = subcommands()
    assert "check" in names
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    listed = re.findall(r"^    ([a-z][a-z0-9_-]*)(?:\s|$)", top, re.M)       # the COMMAND list
    assert listed == names
    for name in names:
        assert name in top, f"`kspec --help` does not list {name}"
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0, name
        out, err = capsys.readouterr()
        assert out.startswith(f"usage: kspec {name}"), out
        assert err == ""


def test_usage_mistakes_exit_nonzero_without_traceback(capsys):
    for argv in ([], ["check"], ["frobnicate"], ["check", "--no-such-flag", "x.kspec"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code not in (0, None), argv
        out, err = capsys.readouterr()
        assert "usage: kspec" in err
        assert_no_traceback(out, err)


@pytest.mark.parametrize("text", [
    "",                                                      # no kernels
    "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = " + "(" * 5000 + "A[m]" + ")" * 5000 + "\n}\n",
    "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = " + " + ".join(["A[m]"] * 3000) + "\n}\n",
    "kernel k { in A : f16[" + "9" * 5000 + "] }",
    "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = A[m] \u2203 \U0001F600\n}\n",
    "kernel k {\x00}",
    "\ufeffkernel",
    "kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = max(A[m], 1.0)\n}\n",
], ids=["empty", "parens5000", "sum3000", "huge_dim", "unicode", "nul", "bom", "max_ab"])
def test_user_mistakes_never_traceback(tmp_path, capsys, text):
    f = tmp_path / "bad.kspec"
    f.write_text(text, encoding="utf-8")
    assert main(["check", str(f)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"{f}:") or err.startswith("error:")
    assert_no_traceback(err)


# ---------------------------------------------------------------- through `python -m kspec`

def test_module_check_ok_and_error(tmp_path):
    r = run_cli("check", str(SPECS / "gemm.kspec"), str(SPECS / "attention.kspec"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert [l.split(": kernel ")[1].split(":")[0] for l in r.stdout.splitlines()] == ["gemm", "attention"]

    bad = tmp_path / "bad.kspec"
    bad.write_text(BAD)
    r = run_cli("check", "bad.kspec", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.splitlines()[0] == "bad.kspec:5:18: error: index 'k' is not bound on the left side and is not reduced"
    assert r.stderr.splitlines()[-1] == "  hint: write `sum(k) A[m, k] * B[k, n]`"
    assert_no_traceback(r.stderr)


def test_module_ast_version_help(tmp_path):
    r = run_cli("check", "--ast", str(SPECS / "gemm.kspec"), cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.splitlines()[1] == "kernel gemm"
    r = run_cli("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"kspec {kspec.__version__}"
    r = run_cli("--help", cwd=tmp_path)
    assert r.returncode == 0
    for name in subcommands():
        assert name in r.stdout
        sub = run_cli(name, "--help", cwd=tmp_path)
        assert sub.returncode == 0, (name, sub.stderr)
        assert sub.stdout.startswith(f"usage: kspec {name}")
        assert_no_traceback(sub.stdout, sub.stderr)


def test_module_user_mistakes_without_traceback(tmp_path):
    deep = tmp_path / "deep.kspec"
    deep.write_text("kernel k {\n  in A : f16[M]\n  out D : f16[M]\n  D[m] = " + "-(" * 5000 + "A[m]" + ")" * 5000 + "\n}\n")
    r = run_cli("check", str(deep), "missing.kspec", cwd=tmp_path)
    assert r.returncode == 1
    assert f"{deep}:4:3: error: expression is nested too deeply" in r.stderr
    assert "error: no such file: missing.kspec" in r.stderr
    assert_no_traceback(r.stderr)
    r = run_cli(cwd=tmp_path)
    assert r.returncode != 0 and "usage: kspec" in r.stderr
    assert_no_traceback(r.stderr)
