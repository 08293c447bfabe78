"""Every code block of the README runs, in order, as a user would run it.

- Shell blocks (```bash, and plain blocks that start with a `$ ` prompt): each `kspec ...` command
  runs through the CLI in a scratch directory that holds the tutorial's spec and the checkout's
  `specs/` (the tutorial's artifacts land there, so later blocks use them). A `$ ` transcript's
  printed lines must be exactly what the command prints. `pip install` names extras that
  pyproject.toml defines; `pytest` is the command `.ci/run` runs.
- Python blocks run in a subprocess in that directory; with no GPU they run against the recording
  fake driver (`kspec.runtime.fakedriver`), so a launch goes as far as the host library's checks.
- A plain block holding a `kernel` is a spec: `kspec check` accepts it. `# library.toml` loads as
  a library manifest.
- A block that cannot run here says why in an HTML comment on the line above the fence:
  `<!-- readme-test: gpu REASON -->` (Python is compiled and each `kspec` command's arguments are
  parsed, nothing runs), `<!-- readme-test: slow REASON -->` (the same), or
  `<!-- readme-test: fragment REASON -->` (grammar, output or a partial statement: not run).
- A block that needs an optional package says which, and why, in the same place:
  `<!-- readme-test: needs MODULE[,MODULE...] REASON -->` (e.g. `needs torch`). Where every module
  imports, it runs like any other block; where one is missing (the README's `pip install -e ".[test]"`
  installs neither torch nor FlashAttention-4), it is checked as a `gpu` block is (compiled or
  parsed, not run), and the test warns which blocks it did not run and why.
  A block that is none of the above and has no comment fails the test: say what it is.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

README = (ROOT / "README.md").read_text()
_FENCE = re.compile(r"(?:^[ ]*<!-- readme-test: (?P<kind>\w+) (?P<why>.+?) -->\n)?"
                    r"^(?P<indent>[ ]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
_RUNNER = """
import sys
from kspec.runtime import driver
src = open(sys.argv[1]).read()
code = compile(src, "README.md block at line " + sys.argv[2], "exec")
if driver.Driver().available()[0]:
    exec(code, {"__name__": "__main__"})
else:
    from kspec.runtime.fakedriver import FakeDriver
    with FakeDriver():
        exec(code, {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    body: str
    kind: str | None        # gpu, slow, fragment, needs (the comment above the fence), or None
    why: str | None

    @property
    def needs(self) -> tuple[str, ...]:
        """The modules a `needs` block imports (the first word of its comment, comma-separated)."""
        return tuple(self.why.split(" ", 1)[0].split(",")) if self.kind == "needs" else ()

    def missing(self) -> tuple[str, ...]:
        """Those of its modules that are not installed here."""
        return tuple(m for m in self.needs if importlib.util.find_spec(m) is None)


def blocks() -> list[Block]:
    return [Block(README.count("\n", 0, m.start("lang")) + 1, m["lang"], textwrap.dedent(m["body"]), m["kind"],
                  m["why"]) for m in _FENCE.finditer(README)]


def _commands(body: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) per command of a shell block; lines after a `$ ` prompt are
    what it prints, and a block without prompts is commands only."""
    lines = body.rstrip("\n").splitlines()
    prompted = any(ln.startswith("$ ") for ln in lines)
    out: list[tuple[str, list[str]]] = []
    for ln in lines:
        if prompted and not ln.startswith("$ "):
            out[-1][1].append(ln)
        elif ln.strip():
            out.append((ln[2:] if prompted else ln, []))
    return [(c, o) if prompted else (c, None) for c, o in out]


def _kspec_argv(part: str) -> list[str] | None:
    words = shlex.split(part, comments=True)
    return words[1:] if words and words[0] == "kspec" else None


def _check_shell_word(part: str, run: bool) -> None:
    """What a shell step other than `kspec` must be for the README to be true: an extra that exists,
    the CI's test command, a script of the checkout (run with `--help` when the block is not run)."""
    words = shlex.split(part, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):      # VAR=value before the command
        words = words[1:]
    if words and (words[0] in ("python", "python3") and len(words) > 1 or words[0].startswith("bench/")):
        script = words[1] if words[0].startswith("python") else words[0]
        assert (ROOT / script).is_file(), f"`{part}`: {script} is not in the checkout"
        assert not run, f"`{part}`: a script run from the README needs a readme-test comment (gpu or slow)"
        if script.endswith(".py"):
            r = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, f"`{script} --help` fails:\n{r.stderr[-2000:]}"
        return
    if words[:2] == ["pip", "install"]:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for w in words[2:]:
            m = re.fullmatch(r"\.\[([\w,]+)\]", w)
            if m:
                missing = set(m[1].split(",")) - set(extras)
                assert not missing, f"`{part}` names extras pyproject.toml does not define: {missing}"
        return
    if words == ["pytest"]:
        assert re.search(r"^\s*if \[ -z \"\$tier\" \]; then python3 -m pytest;", (ROOT / ".ci/run").read_text(), re.M), \
            ".ci/run must run exactly the README's test command"
        return
    raise AssertionError(f"the README's shell step `{part}` is not one this test knows how to run")


def _run_kspec(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kspec", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    (d / "specs").symlink_to(ROOT / "specs")
    return d


def test_every_block_is_runnable_or_says_why():
    bs = blocks()
    assert len(bs) >= 15
    for b in bs:
        if b.kind == "needs":
            assert all(re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", m) for m in b.needs), \
                f"line {b.line}: `needs` names modules, comma-separated: {b.why!r}"
            reason = b.why.split(" ", 1)[1] if " " in b.why else ""
            assert len(reason) >= 10, f"line {b.line}: say what the block needs {', '.join(b.needs)} for"
        elif b.kind is not None:
            assert b.kind in ("gpu", "slow", "fragment"), f"line {b.line}: unknown readme-test kind {b.kind!r}"
            assert len(b.why) >= 10, f"line {b.line}: say why the block is not run"
        elif b.lang == "":
            first = b.body.lstrip().splitlines()[0]
            assert (first.startswith("$ ") or re.search(r"^kernel \w+ \{", b.body, re.M)), \
                f"README line {b.line}: a plain block that is neither a transcript nor a spec needs a readme-test comment"
        else:
            assert b.lang in ("bash", "python", "toml"), f"README line {b.line}: a {b.lang!r} block"


def test_readme_blocks_run_in_order(workdir):
    """The README top to bottom: each failure names the README line of its block."""
    not_run = []
    for b in blocks():
        where = f"README.md block at line {b.line}"
        kind = b.kind
        if kind == "needs":
            # run where its modules are installed; else checked as a gpu block is (not run), and said so
            missing = b.missing()
            kind = "absent" if missing else None
            if missing:
                not_run.append(f"{where} ({b.why.split(' ', 1)[1]}): {', '.join(missing)} not installed")
        if kind == "fragment":
            continue
        if b.lang == "python":
            compile(b.body, where, "exec")
            if kind is None:
                src = workdir / f"block_{b.line}.py"
                src.write_text(b.body)
                r = subprocess.run([sys.executable, "-c", _RUNNER, str(src), str(b.line)], cwd=workdir,
                                   capture_output=True, text=True, timeout=900)
                assert r.returncode == 0, f"{where}:\n{r.stderr[-3000:]}"
            continue
        if b.lang == "toml":
            assert b.body.startswith("# library.toml"), f"{where}: a toml block that is not a library manifest"
            from kspec.library import load_library
            (workdir / "library.toml").write_text(b.body)
            assert load_library(workdir / "library.toml").specs, where
            continue
        shell = b.lang == "bash" or b.body.lstrip().startswith("$ ") or kind in ("gpu", "slow", "absent")
        if not shell:
            name = re.match(r"# (\S+\.kspec)\n", b.body)
            spec = workdir / (name[1] if name else f"block_{b.line}.kspec")
            spec.write_text(b.body)
            r = _run_kspec(["check", spec.name], workdir)
            assert r.returncode == 0, f"{where}: {r.stderr}"
            continue
        for cmd, expected in _commands(b.body):
            for part in (p.strip() for p in cmd.split("&&")):
                argv = _kspec_argv(part)
                if argv is None:
                    _check_shell_word(part, run=kind is None)
                    continue
                if kind in ("gpu", "slow", "absent"):
                    from kspec.cli import build_parser
                    try:
                        build_parser().parse_args(argv)
                    except SystemExit as e:
                        raise AssertionError(f"{where}: `{part}` is not a valid kspec command line") from e
                    continue
                r = _run_kspec(argv, workdir)
                assert r.returncode == 0, f"{where}: `{part}` exited {r.returncode}:\n{r.stderr[-3000:]}"
                if expected is not None:
                    got = [ln.rstrip() for ln in r.stdout.rstrip("\n").splitlines()]
                    assert got == [ln.rstrip() for ln in expected], \
                        f"{where}: `{part}` prints\n" + "\n".join(got) + "\nbut the README shows\n" + "\n".join(expected)
    if not_run:
        warnings.warn("README blocks not run (an optional package is missing): " + "; ".join(not_run))
