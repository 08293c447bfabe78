"""Printable forms of the compiler's stages: the graph, the fused plan, the cost table, and graph
exports (dot, json, svg via Graphviz) with fused groups drawn as clusters."""
from __future__ import annotations

import json
import shutil
import subprocess

import networkx as nx

from kspec.spec_lang.errors import KspecError

from .canon import block_scale_nodes
from .cost import CostReport
from .graph import op
from .schedule import KernelSchedule


def _order(n) -> int:
    return int(str(n)[1:])


def format_graph(g: nx.DiGraph) -> str:
    lines = []
    for n in nx.lexicographical_topological_sort(g, key=_order):
        ins = []
        for u in sorted(g.predecessors(n), key=_order):
            for pos, labels in g.edges[u, n]["uses"]:
                ins.append(f"{u}[{', '.join(labels)}]" if labels else str(u))
        src = f" <- {', '.join(ins)}" if ins else ""
        lines.append(f"  {n:>4}  {op(g, n).label()}{src}")
    return "\n".join(lines)


def _group_desc(sched: KernelSchedule, plan) -> list[str]:
    g = sched.graph
    out = []
    info = plan.info
    if plan.kind == "gemm":
        packing = getattr(op(g, info.gather[1] if info.gather else info.a), "packed", None)
        batch = (f"grouped over [{', '.join(info.batch)}] (rows packed by {packing}), " if packing else
                 f"batched over [{', '.join(info.batch)}], " if info.batch else "")
        dual = f" and B2={op(g, info.b2).name or info.b2} (a dual GEMM: one A tile feeds two accumulators)" \
            if info.b2 is not None else ""
        out.append(f"      GEMM {batch}A={op(g, info.a).name or info.a} ({info.a_layout}), "
                   f"B={op(g, info.b).name or info.b} ({info.b_layout}){dual}, m={info.m} n={info.n} k={info.k}")
        inside = block_scale_nodes(g, info) | ({info.gather[0]} if info.gather else set())
        if info.gather:
            out.append(f"      A rows gathered through {op(g, info.gather[1]).name} (inside the GEMM's loads)")
        if info.scales:
            out.append("      block scales (inside the sum): " + "; ".join(
                f"{op(g, sc.source).name} of {sc.operand.upper()} per {sc.block_mn}x{sc.block_k}"
                f"{' [k blocks, mn blocks]' if sc.order == 'km' else ''}" for sc in info.scales))
        epi = sorted((n for n in plan.group.nodes if n not in (plan.group.anchor, info.anchor2)
                      and op(g, n).kind != "const" and n not in inside), key=_order)
        if epi:
            out.append("      epilogue: " + "; ".join(op(g, n).label() for n in epi))
    elif plan.kind == "attention":
        out.append(f"      fused attention: Q={op(g, info.q).name}, K={op(g, info.k).name}, V={op(g, info.v).name}, "
                   f"softmax over {info.key}{', causal' if info.causal else ''}; "
                   f"the [{', '.join(info.batch + (info.query, info.key))}] scores stay on chip"
                   + (f"; log-sum-exp -> {op(g, next(iter(g.successors(info.lse)))).name}" if info.lse is not None
                      else ""))
    elif plan.kind == "rowwise":
        kinds = [op(g, n).kind for n in plan.group.nodes]
        n_red = sum(k in ("reduction", "contraction") for k in kinds) + 2 * kinds.count("softmax")
        out.append(f"      row kernel: rows over [{', '.join(info.outer)}], reduced along {info.axis} "
                   f"({n_red} row reduction{'s' if n_red != 1 else ''}, {kinds.count('gather')} gather"
                   f"{'s' if kinds.count('gather') != 1 else ''}); intermediates stay on chip")
        n_part = kinds.count("partial")
        if n_part:
            slots = next(op(g, n).shape[0] for n in plan.group.nodes if op(g, n).kind == "partial")
            out.append(f"      column partials: {n_part} sum{'s' if n_part != 1 else ''} over "
                       f"[{', '.join(info.outer)}] "
                       f"accumulated per column by up to {slots} row slots (grid-stride over the rows) into "
                       f"[{slots}, {info.axis}] f32 partials")
        out.append("      ops: " + "; ".join(op(g, n).label() for n in sorted(plan.group.nodes, key=_order)
                                            if op(g, n).kind != "const"))
    elif plan.kind == "colsum":
        n_sum = sum(op(g, n).kind == "reduction" for n in plan.group.nodes)
        out.append(f"      column sums: {n_sum} result{'s' if n_sum != 1 else ''} over [{info.outer[0]}], each the sum "
                   f"of its {info.extent(info.axis)} partial rows, then the maps that follow")
        out.append("      ops: " + "; ".join(op(g, n).label() for n in sorted(plan.group.nodes, key=_order)
                                            if op(g, n).kind != "const"))
    else:
        out.append("      ops: " + "; ".join(op(g, n).label() for n in sorted(plan.group.nodes, key=_order)
                                            if op(g, n).kind != "const"))
    return out


def format_plan(sched: KernelSchedule) -> str:
    lines = [f"kernel {sched.kernel.name}: {len(sched.plans)} fused kernel{'s' if len(sched.plans) != 1 else ''}"]
    for p in sched.plans:
        lines.append(f"  [{p.id}] {p.kind}: reads {', '.join(p.reads) or '-'} -> writes {', '.join(p.writes)}")
        lines.extend(_group_desc(sched, p))
        for arch, ch in p.choices.items():
            lines.append(f"      {arch}: {ch.describe()}")
            for name, why in ch.opt_in:
                lines.append(f"        (not {name}: {why})")
    inter = sched.intermediates
    if inter:
        lines.append("  global intermediates:")
        for b in inter:
            first, last = sched.liveness[b.name]
            slot = sched.reuse[b.name]
            reuse = f", reuses {slot}" if slot != b.name else ""
            lines.append(f"    {b.describe()}  live plans {first}..{last}{reuse}")
    fallbacks = fallback_notes(sched)
    if sched.fusion.notes or fallbacks:
        lines.append("  notes:")
        lines.extend(f"    - {n}" for n in sched.fusion.notes + fallbacks)
    return "\n".join(lines)


def fallback_notes(sched: KernelSchedule) -> list[str]:
    """One line per kernel and arch that runs as a loop-kernel fallback, with the reason."""
    return [f"FALLBACK {p.id} on {arch}: {ch.fallback}" for p in sched.plans for arch, ch in p.choices.items()
            if ch.fallback]


def _si(x: float, unit: str) -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {p}{unit}"
    return f"{x:.0f} {unit}"


def format_cost(c: CostReport) -> str:
    sizes = ", ".join(f"{k}={v}" for k, v in c.sizes.items())
    lines = [f"  cost model at {sizes}:",
             f"    {'kernel':<28} {'kind':<11} {'FLOPs':>12} {'DRAM bytes':>12} {'ideal':>12} {'x ideal':>8}"]
    for p in c.plans:
        loop = "" if p.tiled else "  (loop kernel: re-reads modelled)"
        lines.append(f"    {p.plan:<28} {p.kind:<11} {_si(p.flops, 'FLOP'):>12} {_si(p.bytes, 'B'):>12} "
                     f"{_si(p.ideal_bytes, 'B'):>12} {p.ratio:>8.2f}{loop}")
    lines.append(f"    {'fused total':<28} {len(c.plans):<11} {_si(c.fused_flops, 'FLOP'):>12} {_si(c.fused_bytes, 'B'):>12} "
                 f"{_si(c.ideal_bytes, 'B'):>12} {c.ideal_ratio:>8.2f}")
    lines.append(f"    {'unfused (one kernel per op)':<28} {c.unfused_kernels:<11} {_si(c.unfused_flops, 'FLOP'):>12} "
                 f"{_si(c.unfused_bytes, 'B'):>12}")
    saved = c.unfused_bytes - c.fused_bytes
    verdict = f"{_si(saved, 'B')} saved" if saved >= 0 else f"{_si(-saved, 'B')} MORE than unfused"
    lines.append(f"    fused/unfused DRAM bytes: {c.bytes_ratio:.3f}  ({verdict})")
    if c.minimum_bytes:
        lines.append(f"    modelled/ideal DRAM bytes: {c.ideal_ratio:.3f}; against the spec minimum (inputs read "
                     f"once, outputs written once, {_si(c.minimum_bytes, 'B')}): "
                     f"{c.fused_bytes / c.minimum_bytes:.3f}")
    return "\n".join(lines)


def to_dot(sched: KernelSchedule) -> str:
    g = sched.graph
    where = {n: p for p in sched.plans for n in p.group.nodes}
    lines = [f'digraph "{_esc(sched.kernel.name)}" {{', "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for p in sched.plans:
        lines.append(f'  subgraph "cluster_{p.id}" {{')
        backends = ", ".join(f"{a}: {ch.backend}{' FALLBACK' if ch.fallback else ''}" for a, ch in p.choices.items())
        color = "red" if any(ch.fallback for ch in p.choices.values()) else "blue"
        label = _esc(f"{p.id} ({p.kind})") + (f"\\n{_esc(backends)}" if backends else "")
        lines.append(f'    label="{label}"; style=rounded; color={color};')
        for n in sorted(p.group.nodes, key=_order):
            lines.append(f'    {n} [label="{_esc(op(g, n).label())}", shape=box];')
        lines.append("  }")
    for n in sorted(g.nodes, key=_order):
        if n not in where:
            shape = "ellipse" if op(g, n).kind in ("input", "param", "output") else "box"
            lines.append(f'  {n} [label="{_esc(op(g, n).label())}", shape={shape}];')
    for u, v in g.edges:
        labels = [",".join(l) for _, l in g.edges[u, v]["uses"]]
        lines.append(f'  {u} -> {v} [label="{_esc(" ".join(labels))}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def to_json(sched: KernelSchedule, c: CostReport | None = None) -> str:
    g = sched.graph
    doc = {
        "kernel": sched.kernel.name,
        "nodes": [{"id": n, "kind": op(g, n).kind, "fn": op(g, n).fn, "dtype": op(g, n).dtype,
                   "axes": list(op(g, n).axes), "shape": list(op(g, n).shape), "name": op(g, n).name}
                  for n in sorted(g.nodes, key=_order)],
        "edges": [{"from": u, "to": v, "uses": [{"pos": p, "labels": list(l)} for p, l in g.edges[u, v]["uses"]]}
                  for u, v in g.edges],
        "plans": [{"id": p.id, "kind": p.kind, "nodes": sorted(p.group.nodes, key=_order), "reads": list(p.reads),
                   "writes": list(p.writes),
                   "backends": {a: {"backend": ch.backend, "kind": ch.kind, "fallback": ch.fallback,
                                    "config": dict(ch.config), "rejected": [list(r) for r in ch.rejected],
                                    "opt_in": [list(r) for r in ch.opt_in]}
                                for a, ch in p.choices.items()}} for p in sched.plans],
        "notes": sched.fusion.notes + fallback_notes(sched),
    }
    if c is not None:
        doc["cost"] = {"sizes": c.sizes, "fused_bytes": c.fused_bytes, "unfused_bytes": c.unfused_bytes,
                       "fused_flops": c.fused_flops, "unfused_kernels": c.unfused_kernels,
                       "bytes_ratio": c.bytes_ratio, "ideal_bytes": c.ideal_bytes, "minimum_bytes": c.minimum_bytes,
                       "plans": [{"id": p.plan, "bytes": p.bytes, "ideal_bytes": p.ideal_bytes, "tiled": p.tiled}
                                 for p in c.plans]}
    return json.dumps(doc, indent=2) + "\n"


def to_svg(dot: str) -> bytes:
    exe = shutil.which("dot")
    if exe is None:
        raise KspecError("drawing SVG needs Graphviz's `dot` program, which is not installed",
                         hint="install Graphviz (e.g. `apt-get install graphviz`), or write "
                              "`--format dot` and render it elsewhere")
    r = subprocess.run([exe, "-Tsvg"], input=dot.encode(), capture_output=True, timeout=120)
    if r.returncode != 0:
        raise KspecError(f"Graphviz failed: {r.stderr.decode(errors='replace').strip()[:500]}")
    return r.stdout


TRAFFIC_LIMIT = 4.0                 # modelled DRAM bytes / the spec minimum above which a plan is loud
INTERMEDIATE_LIMIT = 2 ** 30        # bytes of one global intermediate above which a plan is loud


def plan_warnings(sched: KernelSchedule, c: CostReport, given: dict | None = None) -> list[tuple[bool, str]]:
    """Warnings about a plan at the cost report's sizes: (severe, text).  Severe (refused by
    --strict): the modelled DRAM traffic exceeds TRAFFIC_LIMIT x the spec minimum, or a global
    intermediate exceeds INTERMEDIATE_LIMIT bytes; each names the intermediate(s) and why.  Not
    severe: size symbols the caller did not give (`given`), which the cost model set to 1024."""
    from .cost import DEFAULT_SIZE, _buffer_bytes
    name = sched.kernel.name
    out: list[tuple[bool, str]] = []
    at = ", ".join(f"{k}={v}" for k, v in c.sizes.items())
    big = sorted(((_buffer_bytes(b, c.sizes), b) for b in sched.intermediates),
                 key=lambda t: -t[0])
    for nbytes, b in big:
        if nbytes > INTERMEDIATE_LIMIT:
            out.append((True, f"kernel {name}: intermediate {b.describe()} is {_si(nbytes, 'B')} at {at} (over "
                              f"{INTERMEDIATE_LIMIT / 2 ** 30:g} GiB): it is written to and read back from DRAM because "
                              "no fused kernel keeps it on chip"))
    if c.minimum_bytes and c.fused_bytes > TRAFFIC_LIMIT * c.minimum_bytes:
        worst = max(c.plans, key=lambda p: p.bytes)
        why = (f"through the intermediate{'s' if len(big) > 1 else ''} "
               f"{', '.join(b.name for _, b in big[:3])}" if big else
               f"re-reads in {worst.plan} ({worst.kind}{'' if worst.tiled else ', a loop kernel'})")
        out.append((True, f"kernel {name}: modelled DRAM traffic {_si(c.fused_bytes, 'B')} is "
                          f"{c.fused_bytes / c.minimum_bytes:.1f}x the spec minimum {_si(c.minimum_bytes, 'B')} at {at} "
                          f"(over {TRAFFIC_LIMIT:g}x), {why}"))
    if given is not None:
        bound = dict(sched.kernel.bindings)
        missing = [s for s in sched.kernel.symbols if s not in given and s not in bound]
        if missing:
            out.append((False, f"kernel {name}: no size given for {', '.join(missing)}: the cost model uses "
                               f"{DEFAULT_SIZE} for each (give --sizes {','.join(f'{s}=...' for s in missing)})"))
    return out
