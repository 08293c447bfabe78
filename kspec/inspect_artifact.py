"""`kspec inspect`: what a compiled artifact holds, per kernel plan and arch: launch facts from the
manifest, registers, shared memory and a SASS summary (tensor-core MMA, TMA and other counts); with
`--sizes`, which of its kernels a call at those sizes launches (launch_choice)."""
from __future__ import annotations

from pathlib import Path

from kspec.artifact import read_manifest
from kspec.core import STEP_ROLES, STEP_SEQUENCES
from kspec.backends.inspect import dump_sass, format_summary, sass_summary
from kspec.backends.toolchain import find_toolchain
from kspec.spec_lang.errors import KspecError


def inspect_artifact(path: str | Path, sass: bool = False, arch: str | None = None) -> str:
    d = Path(path)
    m = read_manifest(d)
    if arch is not None and arch.replace("sm_", "sm") not in m.archs:
        raise KspecError(f"{d} has no binaries for {arch}", hint=f"it has: {', '.join(m.archs)}")
    toolchain = find_toolchain()
    toolchain.require_inspect_tools()
    lines = [f"artifact {d}: spec {m.spec.file}, archs {', '.join(m.archs)}, "
             f"kspec {m.kspec_version}, " + ", ".join(f"{k} {v}" for k, v in m.toolchain.items())]
    for k in m.kernels:
        sig = ", ".join(f"{t.name}: {t.describe()}" for t in k.inputs)
        outs = ", ".join(f"{t.name}: {t.describe()}" for t in k.outputs)
        lines.append(f"kernel {k.name}({sig}) -> ({outs}): {len(k.plans)} plan{'s' if len(k.plans) != 1 else ''}")
        if k.index_ranges is None:
            lines.append("  index checks: not recorded (an artifact from an older kspec; rebuild to check index "
                         "tensors before launch)")
        elif k.index_ranges:
            lines.append("  index checks before launch: " + "; ".join(r.describe() for r in k.index_ranges))
        for p in k.plans:
            lines.append(f"  plan {p.id} [{p.kind}] args {', '.join(p.args)}"
                         + (f"; scalars {', '.join(map(str, p.scalars))}" if p.scalars else ""))
            for a, b in p.binaries.items():
                if arch is not None and a != arch.replace("sm_", "sm"):
                    continue
                cfg = " ".join(f"{key}={v}" for key, v in b.config.items() if key != "cutlass")
                lines.append(f"    {a}: {cfg}")
                # a size-bucketed binary (FlashAttention-4): every variant with the SKUs (SM counts) it
                # was built for and the sizes it serves there (kspec.runtime.module.sku_for picks the SKU)
                for label, binary in ([("", b)] if not b.variants else
                                      [(f"variant {i}{_skus(v)} {_serves(v)}: ", v) for i, v in enumerate(b.variants)]):
                    if label:
                        own = " ".join(f"{key}={v}" for key, v in binary.config.items()
                                       if b.config.get(key) != v and key not in ("param_offsets", "sm_count"))
                        lines.append(f"    {label}{own}".rstrip())
                    s = sass_summary(d / binary.cubin, toolchain)
                    for line in format_summary(s).splitlines()[1:]:
                        lines.append("    " + line)
                    if sass:
                        lines.append(dump_sass(d / binary.cubin, toolchain))
    return "\n".join(lines)


def _serves(v) -> str:
    """Which calls a variant serves: its size boxes, or its part of a split-KV pair."""
    role = v.config.get("role")
    if role == "split":
        return (f"split-KV (num_splits {v.config.get('num_splits', 'auto')}: taken when the call splits, "
                "S >= 1)")
    if role == "combine":
        return "split-KV combine (after the split kernel)"
    if role in STEP_ROLES:
        return f"attention backward, {_STEP_KERNELS[role]} kernel (every call: {_steps(v)})"
    return f"for {_select(v.select)}"


# the kernels of the step sequences (kspec.core.STEP_SEQUENCES) by role, as `kspec inspect` names them
_STEP_KERNELS = {"bwd_preprocess": "preprocess", "bwd_main": "main", "bwd_postprocess": "postprocess",
                 "bwd_postprocess_dk": "dK postprocess", "bwd_postprocess_dv": "dV postprocess"}


def _steps(v) -> str:
    """The kernels of the attention backward whose step v is, in order: "preprocess, main and
    postprocess", or with GQA's dK/dV accumulators (ws_kv_tile in its config) the five."""
    seq = STEP_SEQUENCES[1] if v.config.get("ws_kv_tile") else STEP_SEQUENCES[0]
    names = [_STEP_KERNELS[r] for r in seq]
    return ", ".join(names[:-1]) + " and " + names[-1]


def _select(boxes) -> str:
    def rng(lo, hi):
        return f"{lo}..{hi}" if hi is not None else f">= {lo}"
    return " or ".join(", ".join(f"{r} {rng(lo, hi)}" for r, (lo, hi) in box.items()) for box in boxes)


def _skus(v) -> str:
    n = v.config.get("sm_count")
    return f" on {n.replace(',', '/')} SMs" if n else ""


def launch_choice(path: str | Path, sizes: dict[str, int], sm_count: int | None = None,
                  arch: str | None = None) -> str:
    """Per kernel, plan and arch: the variants a call at these sizes launches on a device of
    `sm_count` SMs (default: the first SKU each binary was built for), as the runtime picks them
    (Module.launches: the split-KV pair when its glue asks for a workspace, else the size variant),
    and the workspace; a call the artifact cannot serve says why.  Loads the host glue (no GPU)."""
    import kspec
    from kspec.core import extent_value
    from kspec.runtime.errors import KspecRuntimeError
    mod = kspec.load(path)
    at = ", ".join(f"{k}={v}" for k, v in sizes.items())
    lines = [f"artifact {path} at {at}:"]
    for k in mod.manifest.kernels:
        for p in k.plans:
            for a, b in p.binaries.items():
                if arch is not None and a != arch.replace("sm_", "sm"):
                    continue
                skus = [int(x) for x in b.config.get("sm_count", "").split(",") if x.strip().isdigit()]
                sms = sm_count or (skus[0] if skus else 0)
                try:
                    dims = [extent_value(v, sizes) for _r, v in p.dims]
                except KeyError as e:
                    lines.append(f"  {k.name} plan {p.id} {a}: give {e.args[0]} in --sizes")
                    continue
                # (a binary built for no particular SKU, like the attention backward's, records none)
                where = f"  {k.name} plan {p.id} {a}" + (f" on {sms} SMs: " if sms else ": ")
                try:
                    vs, ws = mod.launches(p, a, dims, 0, sms)
                except KspecRuntimeError as e:
                    lines.append(where + f"refused: {e.message}" + (f" ({e.hint})" if e.hint else ""))
                    continue
                if len(vs) > 2:
                    lines.append(where + f"variants {', '.join(map(str, vs))} in order (the attention backward's "
                                 f"{_steps(b.variants[vs[0]])} kernels; {ws} bytes of workspace)")
                elif len(vs) == 2:
                    lines.append(where + f"variants {vs[0]} then {vs[1]} (split-KV kernel, then the combine; "
                                 f"{ws} bytes of workspace)")
                elif vs[0] >= 0:
                    lines.append(where + f"variant {vs[0]} ({_serves(b.variants[vs[0]])})")
                else:
                    lines.append(where + "its one kernel")
    return "\n".join(lines)
