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
    p = _Parser(prog="kspec", description="Compile declarative kernel specs (.kspec) "
                                "to fused CUTLASS kernels for Hopper (sm_90a) and Blackwell (sm_100a).")
    p.add_argument("--version", action="version", version=f"kspec {kspec.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("check", help="parse and check spec files", description="Parse and check spec files; "
                       "print a one-line summary per kernel, or every error with its location.")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--ast", action="store_true", help="print the typed AST")
    c.set_defaults(func=cmd_check)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


def parse_sizes(text: str | None) -> dict[str, int]:
    """`M=256,N=512` -> {"M": 256, "N": 512}."""
    out: dict[str, int] = {}
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, value = part.partition("=")
        if not eq or not name.strip().isidentifier():
            raise KspecError(f"bad size '{part}'", hint="write sizes as NAME=VALUE pairs: M=256,N=512,K=128")
        try:
            v = int(value)
        except ValueError:
            raise KspecError(f"size {name.strip()}={value!r} is not an integer") from None
        if v < 1 or v > 1 << 31:
            raise KspecError(f"size {name.strip()}={v} is out of range (1 to 2^31)")
        out[name.strip()] = v
    return out


def _archs(text: str | None, program=None) -> tuple[str, ...]:
    from kspec.backends.desc import ARCHS
    if text:
        archs = tuple(a.strip().replace("sm_", "sm") for a in text.split(",") if a.strip())
    elif program is not None and program.targets:
        archs = program.targets
    else:
        archs = ARCHS
    for a in archs:
        if a not in ARCHS:
            raise KspecError(f"unknown arch '{a}'", hint=f"archs: {', '.join(ARCHS)}")
    return archs


def _kernels(prog, name: str | None):
    return [prog.kernel(name)] if name else list(prog.kernels)


def _attention_check(archs):
    from kspec.backends.lower import attention_veto
    return attention_veto(archs)


def cmd_graph(args) -> int:
    from kspec.compiler import cost, plan_kernel
    from kspec.compiler.report import format_cost, format_graph, format_plan, to_dot, to_json, to_svg
    prog = load_spec(args.file)
    archs = _archs(args.arch, prog)
    sizes = parse_sizes(args.sizes)
    scheds = [plan_kernel(k, archs, _attention_check(archs), fuse_ops=not args.unfused)
              for k in _kernels(prog, args.kernel)]
    if args.format == "text":
        text = []
        for s in scheds:
            text.append(f"graph of kernel {s.kernel.name}:")
            text.append(format_graph(s.graph))
            text.append(format_plan(s))
            text.append(format_cost(cost(s, sizes)))
            text.append("")
        _emit("\n".join(text), args.output)
        return 0
    if len(scheds) != 1 and args.format != "json":
        raise KspecError(f"{args.file} has {len(scheds)} kernels; pick one with --kernel for --format {args.format}")
    if args.format == "dot":
        _emit(to_dot(scheds[0]), args.output)
    elif args.format == "json":
        docs = [to_json(s, cost(s, sizes)).strip() for s in scheds]
        # one kernel: its document; several: a JSON list of them
        _emit(docs[0] + "\n" if len(docs) == 1 else "[\n" + ",\n".join(docs) + "\n]\n", args.output)
    elif args.format == "svg":
        if not args.output:
            raise KspecError("--format svg needs -o PATH")
        data = to_svg(to_dot(scheds[0]))
        with open(args.output, "wb") as f:
            f.write(data)
        print(f"wrote {args.output}")
    return 0


def _emit(text: str, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def random_inputs(kernel, sizes: dict[str, int], seed: int = 0) -> dict:
    """Random arrays for every input of a kernel, at the given symbol sizes (default 64)."""
    import numpy as np

    from kspec.backends.reference.numerics import is_int, to_storage
    rng = np.random.default_rng(seed)
    out = {}
    fixed = dict(kernel.bindings)
    for t in kernel.inputs:
        shape = []
        for d in t.shape:
            if isinstance(d, int):
                shape.append(d)
            elif d in fixed:
                shape.append(fixed[d])
            else:
                shape.append(sizes.get(d, 64))
        if is_int(t.dtype):
            out[t.name] = rng.integers(-4, 5, size=shape).astype(np.int8 if t.dtype == "i8" else np.int32)
        else:
            out[t.name] = to_storage(rng.standard_normal(shape).astype(np.float32), t.dtype)
    return out


def cmd_run(args) -> int:
    import numpy as np
    sizes = parse_sizes(args.random_inputs)
    if args.reference:
        from kspec.backends.reference import reference
        prog = load_spec(args.file)
        for k in _kernels(prog, args.kernel):
            unknown = set(sizes) - set(k.symbols)
            if unknown:
                raise KspecError(f"kernel {k.name} has no size symbol {', '.join(sorted(unknown))}",
                                 hint=f"its symbols: {', '.join(k.symbols) or 'none'}")
            fn = reference(prog, k.name)
            outs = fn(**random_inputs(k, sizes, args.seed))
            print(f"kernel {k.name} (reference, seed {args.seed}):")
            for name, v in outs.items():
                f = np.asarray(v, dtype=np.float64)
                print(f"  {name}: {v.dtype}{list(v.shape)}  sum={f.sum():.6g}  abs-sum={np.abs(f).sum():.6g}  "
                      f"max={f.max():.6g}  min={f.min():.6g}")
        return 0
    from kspec.runtime.run import run_on_gpu
    return run_on_gpu(args, sizes)


def _register_graph(sub) -> None:
    p = sub.add_parser("graph", help="print the dataflow graph, fused plan and cost model",
                       description="Build, canonicalise, fuse and schedule a spec; print the graph, the fused "
                                   "kernel plan and the modelled FLOPs/DRAM bytes against the unfused graph, or "
                                   "write the graph as dot, svg or json.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--kernel", help="only this kernel of the spec")
    p.add_argument("--arch", help="archs to schedule for (default: the spec's target, else sm90a,sm100a)")
    p.add_argument("--sizes", help="symbol sizes for the cost model, e.g. M=4096,N=4096,K=4096 (default 1024 each)")
    p.add_argument("--unfused", action="store_true", help="one kernel per op (the baseline)")
    p.add_argument("--format", choices=("text", "dot", "svg", "json"), default="text")
    p.add_argument("-o", "--output", metavar="PATH", help="write to PATH instead of stdout")
    p.set_defaults(func=cmd_graph)


def _register_run(sub) -> None:
    p = sub.add_parser("run", help="run a spec's kernels on random inputs (GPU, or --reference on the CPU)",
                       description="Run every kernel of a spec (or a compiled artifact) on random inputs. On a GPU "
                                   "the results are compared against the numpy reference; with --reference the "
                                   "reference runs on the CPU and output checksums are printed.")
    p.add_argument("file", metavar="FILE|ARTIFACT")
    p.add_argument("--kernel", help="only this kernel")
    p.add_argument("--reference", action="store_true", help="run the numpy reference backend on the CPU")
    p.add_argument("--random-inputs", metavar="SIZES", default="",
                   help="symbol sizes for the random inputs, e.g. M=256,N=512,K=128 (default 64 each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", help="archs to compile for when FILE is a spec")
    p.add_argument("-o", "--output", default=None, help="artifact directory when FILE is a spec (default: build)")
    p.set_defaults(func=cmd_run)


def cmd_compile(args) -> int:
    from pathlib import Path

    from kspec.compile import Progress, compile_spec, emit_spec, write_emitted
    prog = load_spec(args.file)
    archs = _archs(args.arch, prog)
    if args.emit_only:
        emitted = emit_spec(args.file, archs, args.kernel, backend=args.backend)
        if args.output is None and args.print:
            for plist in emitted.plans.values():
                for ep in plist:
                    print(f"// ===== {ep.label} =====")
                    print(ep.emitted.source)
            return 0
        for p in write_emitted(emitted, args.output or "build", Path(args.file).stem):
            print(f"wrote {p}")
        return 0
    import time
    t0 = time.monotonic()
    out = compile_spec(args.file, archs, args.output or "build", args.kernel, args.jobs,
                       progress=Progress(enabled=not args.quiet), backend=args.backend)
    print(f"wrote {out}  ({time.monotonic() - t0:.1f}s)")
    return 0


def cmd_inspect(args) -> int:
    from kspec.inspect_artifact import inspect_artifact
    print(inspect_artifact(args.artifact, sass=args.sass, arch=args.arch))
    return 0


def cmd_cache(args) -> int:
    from kspec.backends.build import CompileCache
    cache = CompileCache()
    if args.action == "info":
        info = cache.info()
        for k, v in info.items():
            print(f"{k}: {v}")
    else:
        n = cache.clear()
        print(f"cleared {cache.root}" + (f" ({n} entries)" if isinstance(n, int) else ""))
    return 0


def _register_compile(sub) -> None:
    p = sub.add_parser("compile", help="compile a spec into an artifact of CUTLASS kernels",
                       description="Plan, emit and compile every kernel of a spec for each arch (nvcc, cached "
                                   "and in parallel) into OUT/<spec stem>/ with a manifest.json.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--arch", help="comma-separated archs: sm90a, sm100a (default: the spec's target, else both)")
    p.add_argument("-o", "--output", metavar="OUT", help="output directory (default: build)")
    p.add_argument("--kernel", help="only this kernel of the spec")
    p.add_argument("-j", "--jobs", type=int, default=None,
                   help="parallel nvcc processes (default: cores, bounded by free memory)")
    p.add_argument("--emit-only", action="store_true", help="write the generated C++ instead of compiling")
    p.add_argument("--print", action="store_true", help="with --emit-only and no -o: print the C++ to stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.add_argument("--backend", choices=("auto", "cute", "cutlass"), default="auto",
                   help="GEMM backend: auto (default: the CuTe DSL where it can implement a kernel, else "
                        "CUTLASS C++), cute (error where it cannot), cutlass (always CUTLASS C++ + nvcc)")
    p.set_defaults(func=cmd_compile)

    i = sub.add_parser("inspect", help="show registers, shared memory and SASS of a compiled artifact",
                       description="Per kernel and arch: registers, shared memory, launch configuration and a "
                                   "SASS summary (tensor-core MMA, TMA and other instruction counts).")
    i.add_argument("artifact", metavar="ARTIFACT")
    i.add_argument("--sass", action="store_true", help="dump the full SASS")
    i.add_argument("--arch", help="only this arch")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser("cache", help="show or clear the compile cache",
                       description="The compile cache lives in $KSPEC_CACHE_DIR (default ~/.cache/kspec).")
    c.add_argument("action", choices=("info", "clear"))
    c.set_defaults(func=cmd_cache)


_EXTRA_COMMANDS: list = [_register_graph, _register_compile, _register_run]


class _Parser(argparse.ArgumentParser):
    """Usage mistakes exit 1 like every other user error (2 is reserved for internal errors)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


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
