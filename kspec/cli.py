"""The `kspec` command line: check, graph, compile, inspect, run, cache."""
from __future__ import annotations

import argparse
import errno
import sys
import traceback

import kspec
from kspec.core import DEFAULT_OUT_DIR, REPORT_HINT, KspecError, KspecInternalError, parse_sizes, select_archs  # noqa: F401

ISSUE_HINT = REPORT_HINT


def load_spec(path):
    from kspec.spec_lang import load_spec as _load
    return _load(path)


def _summary(k) -> str:
    from kspec.spec_lang.check import count_ops
    ops: dict[str, int] = {}
    for s in k.stmts:
        for key, n in count_ops(s.value).items():
            ops[key] = ops.get(key, 0) + n
    ins = ", ".join(t.describe() for t in k.inputs + k.params)
    outs = ", ".join(t.describe() for t in k.outputs)
    opstr = ", ".join(f"{n} {key}" for key, n in sorted(ops.items())) or "copy"
    return f"kernel {k.name}: in ({ins}) -> out ({outs}); ops: {opstr}"


def cmd_check(args) -> int:
    from kspec.spec_lang.check import format_typed
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
    p.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
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


def _archs(text: str | None, program=None) -> tuple[str, ...]:
    return select_archs(text, program.targets if program is not None else ())


def _kernels(prog, name: str | None):
    return [prog.kernel(name)] if name else list(prog.kernels)


def _plan(args, fuse_ops: bool = True):
    """Load, check and plan the spec of a graph/lower command (backend chosen per kernel and arch)."""
    from kspec.compile import plan_spec
    prog = load_spec(args.file)
    archs = _archs(args.arch, prog)
    if args.kernel:
        prog.kernel(args.kernel)
    return prog, archs, plan_spec(prog, archs, args.kernel, args.backend, args.strict, fuse_ops,
                                  sizes=parse_sizes(getattr(args, "sizes", None)))


def _plan_warnings(args, sched, c, given) -> None:
    """Print the loud-plan warnings (compiler.report.plan_warnings) to stderr; --strict refuses a
    severe one (exit 1)."""
    from kspec.compiler.report import plan_warnings
    for severe, text in plan_warnings(sched, c, given):
        if severe and args.strict:
            raise KspecError(f"{args.file}: {text}",
                             hint="--strict refuses this plan: restructure the spec, or drop --strict")
        print(f"kspec: warning: {text}", file=sys.stderr)


def cmd_graph(args) -> int:
    from kspec.compiler import cost
    from kspec.compiler.report import format_cost, format_graph, format_plan, to_dot, to_json, to_svg
    prog, archs, scheds = _plan(args, fuse_ops=not args.unfused)
    sizes = parse_sizes(args.sizes)
    if args.format == "text":
        text = []
        for s in scheds:
            text.append(f"graph of kernel {s.kernel.name}:")
            text.append(format_graph(s.graph))
            text.append(format_plan(s))
            text += _call_notes(s, sizes)
            c = cost(s, sizes)
            text.append(format_cost(c))
            text.append("")
            _plan_warnings(args, s, c, sizes)
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
        _emit(to_svg(to_dot(scheds[0])), args.output)
    return 0


def _call_notes(sched, sizes) -> list[str]:
    """Per kernel and arch, what a call at the --sizes launches where the artifact decides per call
    (a backend's `call_notes`, e.g. FlashAttention-4's split-KV count); nothing without --sizes."""
    if not sizes:
        return []
    from kspec.backends import registry
    out = []
    for p in sched.plans:
        for arch, choice in (p.choices or {}).items():
            notes = getattr(registry.get(choice.backend), "call_notes", None)
            for line in (notes(p.ir, arch, sizes) if notes else []):
                out.append(f"  [{p.id}] {arch}: {line}")
    return out


def _emit(text: str | bytes, path: str | None) -> None:
    if path:
        try:
            with open(path, "wb" if isinstance(text, bytes) else "w") as f:
                f.write(text)
        except OSError as e:
            raise KspecError(f"cannot write {path}: {e.strerror or e}", hint="give -o a writable file path") from None
        print(f"wrote {path}")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def random_inputs(kernel, sizes: dict[str, int], seed: int = 0) -> dict:
    """Random arrays for every input of a kernel (see `kspec.run.random_inputs`)."""
    from kspec.run import random_inputs as make
    return make(kernel, sizes, seed)


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
    from kspec.run import run_on_gpu
    return run_on_gpu(args, sizes)


def cmd_lower(args) -> int:
    import json

    from kspec.compiler import format_ir, ir_to_json
    from kspec.compiler.indices import guarded_sentinels, index_ranges, with_sentinels
    prog, archs, scheds = _plan(args)
    if args.format == "json":
        docs = [{"ir": ir_to_json(p.ir), "backends": {a: {"backend": ch.backend, "kind": ch.kind, "fallback": ch.fallback,
                                                          "config": dict(ch.config)} for a, ch in p.choices.items()}}
                for s in scheds for p in s.plans]
        _emit(json.dumps(docs, indent=2), args.output)
        return 0
    sizes = parse_sizes(args.sizes)
    out = []
    for s in scheds:
        for p in s.plans:
            out.append(format_ir(p.ir))
            ranges = with_sentinels(index_ranges(p.ir), guarded_sentinels(s.graph))
            if ranges:
                out.append("  index checks before launch: " + "; ".join(r.describe() for r in ranges))
            for arch, ch in p.choices.items():
                out.append(f"  {arch}: {ch.describe()}")
                for name, why in ch.rejected:
                    out.append(f"      ({name} declined: {why})")
            if sizes:
                from kspec.compiler import cost
                c = cost(s, sizes)
                pc = next(x for x in c.plans if x.plan == p.id)
                out.append(f"  cost at {', '.join(f'{k}={v}' for k, v in sizes.items())}: "
                           f"{pc.flops:.4g} FLOP, {pc.bytes:.4g} DRAM bytes")
            out.append("")
    _emit("\n".join(out), args.output)
    return 0


def _planning_options(p) -> None:
    p.add_argument("--kernel", help="only this kernel of the spec")
    p.add_argument("--arch", help="archs to plan for, comma-separated (default: the spec's target, else sm90a,sm100a)")
    p.add_argument("--backend", metavar="NAME",
                   help="build the kernels this backend implements with it (cute, cutlass, rowwise, generic; "
                        "auto = the default): the first backend that can, in the registry's preference order")
    p.add_argument("--strict", action="store_true",
                   help="fail instead of falling back to a slow loop kernel (names the kernel, arch and reason)")


def _register_lower(sub) -> None:
    p = sub.add_parser("lower", help="print each planned kernel's kernel IR and the backend chosen per arch",
                       description="Plan a spec and print the kernel IR of every kernel (buffers, ops, GEMM or "
                                   "attention structure, epilogue DAG, stores) with the backend, kernel kind and "
                                   "configuration chosen for each arch, and the reasons preferred backends declined.")
    p.add_argument("file", metavar="FILE")
    _planning_options(p)
    p.add_argument("--sizes", help="symbol sizes for a per-kernel cost line, e.g. M=4096,N=4096,K=4096")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("-o", "--output", metavar="PATH", help="write to PATH instead of stdout")
    p.set_defaults(func=cmd_lower)


def _register_graph(sub) -> None:
    p = sub.add_parser("graph", help="print the dataflow graph, fused plan and cost model",
                       description="Build, canonicalise, fuse and schedule a spec; print the graph, the fused "
                                   "kernel plan and the modelled FLOPs/DRAM bytes against the unfused graph, or "
                                   "write the graph as dot, svg or json.")
    p.add_argument("file", metavar="FILE")
    _planning_options(p)
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
    p.add_argument("-o", "--output", default=None, help=f"artifact directory when FILE is a spec (default: {DEFAULT_OUT_DIR})")
    p.set_defaults(func=cmd_run)


def _compile_warnings(args, emitted) -> None:
    """The loud-plan warnings of `kspec graph` at the cost model's default sizes (1024 per symbol;
    the warning says so), before anything is written; --strict refuses a severe one."""
    from kspec.compiler import cost
    for sched in emitted.schedules:
        _plan_warnings(args, sched, cost(sched, {}), None)


def cmd_compile(args) -> int:
    from pathlib import Path

    from kspec.compile import Progress, compile_spec, emit_spec, prepare_output, write_emitted
    prog = load_spec(args.file)
    archs = _archs(args.arch, prog)
    if args.output is not None or not (args.emit_only and args.print):
        prepare_output(args.output or DEFAULT_OUT_DIR, create=False)    # before anything is planned or built
    sm_counts = parse_sm_counts(args.sm_count, archs)
    if args.emit_only:
        emitted = emit_spec(args.file, archs, args.kernel, backend=args.backend, strict=args.strict,
                            tuned=_tuned(args), sm_counts=sm_counts, sizes=parse_sizes(args.sizes))
        _compile_warnings(args, emitted)
        if args.output is None and args.print:
            for plist in emitted.plans.values():
                for ep in plist:
                    print(f"// ===== {ep.label} =====")
                    print(ep.emitted.source)
            return 0
        for p in write_emitted(emitted, args.output or DEFAULT_OUT_DIR, Path(args.file).stem):
            print(f"wrote {p}")
        return 0
    import time
    t0 = time.monotonic()
    from kspec.backends.build import CompileCache
    cache = CompileCache()
    tuned = _tuned(args)
    emitted = emit_spec(args.file, archs, args.kernel, cache.root, backend=args.backend, strict=args.strict,
                        tuned=tuned, sm_counts=sm_counts, sizes=parse_sizes(args.sizes))
    _compile_warnings(args, emitted)
    for sched in emitted.schedules:
        for p in sched.plans:
            for arch, ch in p.choices.items():
                if ch.fallback:
                    print(f"kspec: note: kernel {p.id} on {arch} runs as {ch.fallback}", file=sys.stderr)
    out = compile_spec(args.file, archs, args.output or DEFAULT_OUT_DIR, args.kernel, args.jobs, cache=cache,
                       progress=Progress(enabled=not args.quiet), emitted=emitted, sm_counts=sm_counts)
    print(f"wrote {out}  ({time.monotonic() - t0:.1f}s)")
    return 0


def parse_sm_counts(values: list[str], archs: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """`--sm-count sm90a=132,114 --sm-count sm100a=148` -> {"sm90a": (132, 114), "sm100a": (148,)}."""
    from kspec.core import normalize_arch
    out: dict[str, tuple[int, ...]] = {}
    for text in values:
        arch, eq, counts = text.partition("=")
        if not eq:
            raise KspecError(f"bad --sm-count '{text}'", hint="write ARCH=N[,N...], e.g. --sm-count sm90a=132,114")
        arch = normalize_arch(arch)
        if arch not in archs:
            raise KspecError(f"--sm-count {text}: {arch} is not compiled for (archs: {', '.join(archs)})")
        try:
            ns = tuple(int(n) for n in counts.split(",") if n.strip())
        except ValueError:
            raise KspecError(f"--sm-count {text}: SM counts must be integers") from None
        if not ns or any(not 1 <= n <= 1024 for n in ns):
            raise KspecError(f"--sm-count {text}: give one or more SM counts from 1 to 1024")
        out[arch] = tuple(dict.fromkeys((*out.get(arch, ()), *ns)))
    return out


def _tuned(args):
    """The tuning database's chooser for `kspec compile` (None when there is no database)."""
    from kspec.tune import TuningDB, driver_identity
    db = TuningDB(getattr(args, "tuning_db", None))
    if not db.path.is_file():
        if getattr(args, "tuning_db", None):
            raise KspecError(f"tuning database {db.path} does not exist", hint="create it with `kspec tune`")
        return None
    return db.chooser(parse_sizes(getattr(args, "sizes", None)) or None, driver_identity())


def cmd_inspect(args) -> int:
    from kspec.inspect_artifact import inspect_artifact, launch_choice
    if args.sizes:
        print(launch_choice(args.artifact, parse_sizes(args.sizes), args.sm_count, arch=args.arch))
        return 0
    print(inspect_artifact(args.artifact, sass=args.sass, arch=args.arch))
    return 0


def cmd_cache(args) -> int:
    from kspec.backends.build import CompileCache
    cache = CompileCache(writable=False)
    if args.action == "info":
        info = cache.info()
        print(f"root: {info['root']}")
        print(f"entries: {info['entries']} ({info['bytes'] / 2**20:.1f} MiB)")
        for kind, (n, size) in info["by_kind"].items():
            print(f"  {kind}: {n} ({size / 2**20:.1f} MiB)")
        print(f"failed_logs: {info['failed_logs']}")
    else:
        n = cache.clear()
        print(f"cleared {cache.root}" + (f" ({n} entries)" if isinstance(n, int) else ""))
    return 0


def _register_compile(sub) -> None:
    p = sub.add_parser("compile", help="compile a spec into an artifact of CUTLASS kernels",
                       description="Plan, emit and compile every kernel of a spec for each arch (nvcc, cached "
                                   "and in parallel) into OUT/<spec stem>/ with a manifest.json.")
    p.add_argument("file", metavar="FILE")
    _planning_options(p)
    p.add_argument("-o", "--output", metavar="OUT", help=f"output directory (default: {DEFAULT_OUT_DIR})")
    p.add_argument("-j", "--jobs", type=int, default=None,
                   help="parallel nvcc processes (default: cores, bounded by free memory)")
    p.add_argument("--emit-only", action="store_true",
                   help="write the generated sources instead of compiling (CuTe DSL Python, CUDA C++)")
    p.add_argument("--print", action="store_true", help="with --emit-only and no -o: print the C++ to stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.add_argument("--tuning-db", metavar="PATH",
                   help="apply this tuning database's winners (default $KSPEC_TUNING_DB, else "
                        "$KSPEC_CACHE_DIR/tuning.json when it exists)")
    p.add_argument("--sizes", metavar="SIZES", help="the size bucket to take tuned configurations for, e.g. M=64; "
                   "it also names the GQA group of an attention whose group is known only per call (G=4, "
                   "or H=32,KH=8)")
    p.add_argument("--sm-count", action="append", default=[], metavar="ARCH=N[,N...]",
                   help="SM counts of the GPU SKUs to build SKU-specific kernels (FlashAttention-4 attention) "
                        "for, e.g. sm90a=132,114 (H100 SXM/H200, H100 PCIe); repeatable; default sm90a=132, "
                        "sm100a=148. The runtime launches the build for the device's SM count, else the "
                        "nearest below, else the smallest")
    p.set_defaults(func=cmd_compile)

    i = sub.add_parser("inspect", help="show registers, shared memory and SASS of a compiled artifact",
                       description="Per kernel and arch: registers, shared memory, launch configuration and a "
                                   "SASS summary (tensor-core MMA, TMA and other instruction counts).")
    i.add_argument("artifact", metavar="ARTIFACT")
    i.add_argument("--sass", action="store_true", help="dump the full SASS")
    i.add_argument("--arch", help="only this arch")
    i.add_argument("--sizes", help="instead: which kernels a call at these sizes launches, e.g. B=1,H=32,S=1,T=131072 "
                                   "(FlashAttention-4's size variants and split-KV)")
    i.add_argument("--sm-count", type=int, default=None,
                   help="with --sizes: the device's SM count (default: the SKU each binary was built for first)")
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser("cache", help="show or clear the compile cache",
                       description="The compile cache lives in $KSPEC_CACHE_DIR (default ~/.cache/kspec).")
    c.add_argument("action", choices=("info", "clear"))
    c.set_defaults(func=cmd_cache)


def _register_doctor(sub) -> None:
    from kspec.doctor import register
    register(sub)


def _register_selftest(sub) -> None:
    from kspec.selftest import register
    register(sub)


def cmd_build(args) -> int:
    from kspec.library import LibraryBuildError, ProgressReporter, build_library, load_library, plan_tasks
    lib = load_library(args.manifest, out=args.output)
    if args.arch:
        import dataclasses
        archs = _archs(args.arch)
        lib = dataclasses.replace(lib, specs=tuple(dataclasses.replace(s, archs=archs) for s in lib.specs))
    executor = "ray" if args.ray is not None else ("serial" if args.jobs == 1 else "local")
    from kspec.backends.build import CompileCache
    n = len(plan_tasks(lib, str(CompileCache().root), args.tuning_db))
    reporter = ProgressReporter(n, enabled=not args.quiet)
    try:
        summary = build_library(lib, jobs=args.jobs, executor=executor, ray_address=args.ray or None,
                                tuning_db=args.tuning_db, report=reporter, retries=args.retries)
    except LibraryBuildError as e:
        reporter.close()
        print(e.summary.table())
        raise
    reporter.close()
    print(summary.table())
    print(f"wrote {len(summary.artifacts)} artifacts and {lib.out}/library.json")
    return 0


def _register_build(sub) -> None:
    p = sub.add_parser("build", help="compile a library of specs x archs x size buckets in parallel",
                       description="Build every spec of a library manifest (TOML/JSON: [library], [buckets], "
                                   "[[specs]]; see kspec/library.py) or of a directory of .kspec files: one task "
                                   "per spec kernel, arch and size bucket on a local process pool (or Ray), "
                                   "cached by content, then one artifact per spec (and bucket) under OUT.")
    p.add_argument("manifest", metavar="MANIFEST|DIR")
    p.add_argument("-o", "--output", metavar="OUT", help="output directory (default: the manifest's [library] out)")
    p.add_argument("--arch", help="archs for every spec, comma-separated (default: the manifest's, else each "
                                  "spec's target, else sm90a,sm100a)")
    p.add_argument("-j", "--jobs", type=int, default=None,
                   help="worker processes (default: cores, bounded by free memory); with --ray, local cluster CPUs")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the tasks on a Ray cluster (no ADDRESS: a local one; put --ray after MANIFEST); "
                        "the compile cache must be shared by every worker")
    p.add_argument("--tuning-db", metavar="PATH", help="tuning database to apply (default: the manifest's)")
    p.add_argument("--retries", type=int, default=2, help="re-runs of a task whose worker died (default 2)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_build)


def cmd_tune(args) -> int:
    import json as _json
    from pathlib import Path

    from kspec.tune import TuningDB, describe, tune_spec
    db = None if args.dry_run else TuningDB(args.tuning_db)
    jobs = []
    if Path(args.file).suffix == ".kspec":
        sizes = parse_sizes(args.sizes) if args.sizes else None
        jobs.append((args.file, _archs(args.arch, load_spec(args.file)), [sizes] if sizes else None))
    else:
        from kspec.library import load_library
        for s in load_library(args.file).specs:
            archs = _archs(args.arch) if args.arch else s.archs
            jobs.append((s.path, archs, [b.as_dict for b in s.buckets] or None))
    measure = True if args.measure else (False if args.model_only else None)
    results = []
    if args.ray is not None:
        from kspec.raybuild import tune_ray
        from kspec.backends.build import CompileCache
        root = str(CompileCache().root)
        for rs in tune_ray([(f, a, b, None if db is None else str(db.path), root, args.backend) for f, a, b in jobs],
                           args.ray or None):
            results += rs
    else:
        from kspec.backends.build import CompileCache
        root = CompileCache().root
        for f, a, b in jobs:
            results += tune_spec(f, a, b, db, measure_gpu=measure, backend=args.backend, cache_root=root)
    if args.format == "json":
        print(_json.dumps([{"spec": r.spec, "plan": r.plan, "arch": r.arch, "bucket": r.bucket, "backend": r.backend,
                            "winner": dict(r.winner), "ranking": [{"config": dict(x.config), "seconds": x.seconds,
                                                                   "source": x.source} for x in r.ranking],
                            "rejected": [{"config": dict(c), "reason": w} for c, w in r.rejected]}
                           for r in results], indent=1))
    else:
        for r in results:
            print(f"{r.spec}:{r.plan} on {r.arch} [{r.bucket}] ({r.backend}): {describe(r.winner)}")
            for i, x in enumerate(r.ranking[:args.top]):
                mark = "*" if x.config == r.winner else " "
                print(f"  {mark} {i + 1}. {describe(x.config):<40} {x.seconds * 1e6:10.1f} us  ({x.source})")
            for c, why in r.rejected:
                print(f"    rejected {describe(c)}: {why}")
        if db is not None:
            print(f"wrote {len(results)} winners to {db.path}")
    return 0


def _register_tune(sub) -> None:
    p = sub.add_parser("tune", help="rank each kernel's candidate configurations and record the winners",
                       description="For every planned kernel, arch and size bucket: rank the backend's candidate "
                                   "configurations with the cost model (and time them with CUDA events when a GPU "
                                   "is present), and store the winner in the tuning database, which `kspec "
                                   "compile` and `kspec build` then use.")
    p.add_argument("file", metavar="FILE|MANIFEST")
    p.add_argument("--arch", help="archs, comma-separated (default: the spec's target, else all)")
    p.add_argument("--sizes", help="the size bucket for a single spec, e.g. M=64,N=4096,K=4096")
    p.add_argument("--backend", metavar="NAME", help="plan with this backend wherever it applies")
    p.add_argument("--tuning-db", metavar="PATH",
                   help="the database file (default $KSPEC_TUNING_DB, else $KSPEC_CACHE_DIR/tuning.json)")
    p.add_argument("--dry-run", action="store_true", help="print the ranking without writing the database")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--measure", action="store_true", help="require a GPU and time the candidates")
    g.add_argument("--model-only", action="store_true", help="rank by the cost model even on a GPU machine")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="tune on a Ray cluster (GPU workers measure when the cluster has GPUs)")
    p.add_argument("--top", type=int, default=5, help="candidates to print per kernel (default 5)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_tune)


def _register_doctor(sub) -> None:
    from kspec.doctor import register
    register(sub)


def _register_selftest(sub) -> None:
    from kspec.selftest import register
    register(sub)


def cmd_grad(args) -> int:
    from kspec.spec_lang.grad import grad_program
    prog = load_spec(args.file)
    wrt = [w.strip() for w in args.wrt.split(",") if w.strip()] if args.wrt else None
    text = grad_program(prog, args.kernel, wrt)       # fails before anything is written
    _emit(text, args.output)
    return 0


def _register_grad(sub) -> None:
    g = sub.add_parser("grad", help="derive the backward of a kernel: NAME_fwd and NAME_bwd as spec text",
                       description="Reverse-mode differentiation of a spec kernel.  Writes an ordinary spec with "
                       "NAME_fwd (the forward plus the values the backward reads: row statistics, a softmax's "
                       "log-sum-exp) and NAME_bwd (inputs: the forward's inputs and params, NAME_fwd's outputs and "
                       "d<OUT> per output; outputs: d<IN> per floating-point input).")
    g.add_argument("file", metavar="FILE")
    g.add_argument("--kernel", help="the kernel to differentiate (default: every kernel of FILE)")
    g.add_argument("--wrt", metavar="X,W,...", help="the inputs to differentiate with respect to "
                   "(default: every floating-point input)")
    g.add_argument("-o", "--output", metavar="OUT.kspec", help="write the spec here (default: stdout)")
    g.set_defaults(func=cmd_grad)


_EXTRA_COMMANDS: list = [_register_grad, _register_graph, _register_lower, _register_compile, _register_run,
                         _register_doctor, _register_selftest, _register_build, _register_tune]


class _Parser(argparse.ArgumentParser):
    """Usage mistakes exit 1 like every other user error (2 is reserved for internal errors)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv                     # accepted anywhere on the command line
    args = parser.parse_args([a for a in argv if a != "--debug"])
    args.debug = debug
    try:
        return args.func(args)
    except KspecError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in _ENVIRONMENT_ERRNOS:
            return _internal(e, args.debug)
        # a file system that refuses (read-only, full, permissions, a file where a folder must
        # be): the environment, not kspec; exit 1 naming the path and the problem
        where = f"{e.filename}: " if e.filename else ""
        print(KspecError(f"{where}{e.strerror or e}", hint="check the path's permissions and free space, or "
                                                            "choose another (-o, KSPEC_CACHE_DIR)").render(),
              file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - the last line of defence: never a bare traceback
        return _internal(e, args.debug)


# errnos that only the environment causes (kspec's own paths never need them to be otherwise)
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                       errno.EISDIR, errno.ENAMETOOLONG, errno.EIO, errno.EMFILE, errno.ENFILE, errno.ELOOP,
                       errno.EXDEV}


def _internal(e: BaseException, debug: bool) -> int:
    # KspecInternalError and any other exception: a bug in kspec, never the user's mistake
    kind = "internal error" if isinstance(e, KspecInternalError) else f"internal error: {type(e).__name__}"
    print(f"kspec: {kind}: {e}", file=sys.stderr)
    print(f"  {ISSUE_HINT}", file=sys.stderr)
    if debug:
        traceback.print_exception(e)
    else:
        print("  (run again with --debug for the traceback)", file=sys.stderr)
    return 2
