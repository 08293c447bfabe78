"""The `kspec` command line: check, graph, compile, inspect, run, cache."""
from __future__ import annotations

import argparse
import sys
import traceback

import kspec
from kspec.spec_lang import KspecError, load_spec
from kspec.spec_lang.check import count_ops, format_typed

ISSUE_HINT = "this is a bug in kspec; please report it with the command and spec that triggered it"


def _summary(k) -> str:
    ops: dict[str, int] = {}
    for s in k.stmts:
        for key, n in count_ops(s.value).items():
            ops[key] = ops.get(key, 0) + n
    ins = ", ".join(t.describe() for t in k.inputs + k.params)
    outs = ", ".join(t.describe() for t in k.outputs)
    opstr = ", ".join(f"{n} {key}" for key, n in sorted(ops.items())) or "copy"
    return f"kernel {k.name}: in ({ins}) -> out ({outs}); ops: {opstr}"


def cmd_check(args) -> int:
    status = 0
    for f in args.files:
        try:
            prog = load_spec(f)
        except KspecError as e:
            print(e.render(), file=sys.stderr)
            status = 1
            continue
        if args.ast:
            print(format_typed(prog))
        else:
            for k in prog.kernels:
                print(f"{f}: {_summary(k)}")
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kspec", description="Compile declarative kernel specs (.kspec) "
                                "to fused CUTLASS kernels for Hopper (sm_90a) and Blackwell (sm_100a).")
    p.add_argument("--version", action="version", version=f"kspec {kspec.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("check", help="parse and check spec files", description="Parse and check spec files; "
                       "print a one-line summary per kernel, or every error with its location.")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--ast", action="store_true", help="print the typed AST")
    c.set_defaults(func=cmd_check)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


_EXTRA_COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KspecError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - the last line of defence: never a bare traceback
        print(f"kspec: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"  {ISSUE_HINT}", file=sys.stderr)
        if "--debug" in (argv or sys.argv):
            traceback.print_exc()
        return 2
