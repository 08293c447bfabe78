"""The attention backward in the CuTe DSL backend: this module owns it.  The backward of a plain or
causal attention (compiler.kir.AttentionBwdStructure, what `kspec grad` derives) is built as
FlashAttention-4 4.0.0b36's own backward: three kernels, run in order by one kspec call, sharing a
per-call workspace, exactly as `flash_attn.cute.interface._flash_attn_bwd` drives them:

    1. FlashAttentionBackwardPreprocess   D = rowsum(dO * O) (`dpsum`), LSE * log2(e) (`lse_log2`),
                                          the f32 dQ accumulator (`dq_accum`) zeroed
    2. FlashAttentionBackwardSm90 / Sm100 dK and dV, and dQ accumulated in f32 into dq_accum
    3. FlashAttentionBackwardPostprocess  dq_accum * softmax_scale converted to dQ

    covered(ir, arch) / unsupported(...)  which backwards FA4 takes (and why not)
    lower(ir, arch) -> BwdDesc            what the kernel is (no DSL import)
    entry_source(desc) -> str             the traced module: one @cute.jit entry per kernel
    build(desc, cache_root) / lookup(...) the three kernels on desc.arch (cached; an attention.AttnBuild
                                          whose variants have the roles STEPS, never chosen by size)

**FA4's choices, not copies of them.**  kspec runs `_flash_attn_bwd` itself (torch FakeTensors, no
device, under compat.fa4_target) with `cute.compile` intercepted (capture): the three kernel objects
it constructs are the ones kspec compiles, through its own entry (kspec's strided views of
[B, H, S, E] tensors, no TVM-FFI; build.compile_export), so the tiles, stages, swaps, 2-CTA and
accumulator orders are FA4's for the arch, head dim and mask.  The workspace layout is read from the
tensors FA4 allocates in that same call: dq_accum f32 [B, H, S_r * E_r], dpsum and lse_log2 f32
[B, H, S_r], with S_r the query length rounded up to FA4's tile_m and E_r the head dim rounded up
as FA4 rounds it; each 256-byte aligned, in that order (workspace_bytes; the C in every kernel's
glue).  The choice does not depend on the sizes (FA4's compile key varies with them only for TVM-FFI
stride specialisations kspec does not use); capture checks this at two sizes.

**The runtime** (kspec.runtime.module.Module.launches) launches a binary whose variants carry the
roles STEPS as one call: the three in order, one workspace of the size the first one's glue asks,
not cleared (the preprocess zeroes dq_accum; FA4 allocates all three uninitialised too).

**Not covered** (planned unfused, with the reason `kspec graph` prints): score modifications (ALiBi,
soft-capping: FA4 needs a score_mod_bwd), varlen, head dims other than 64 and 128, causal attention
with query and key lengths that may differ (FA4 aligns its mask bottom-right, the spec's `j <= i`
top-left), dtypes other than f16/bf16, and GQA.  GQA is what remains to be done, in three steps:
(1) compiler/fusion.py match_attention_backward: accept K and V read at head `h / G` (the gather the
forward's GQA matching recognises) and dK, dV stored as `sum(h) where(h / G == kh, dK_part, 0)` over
the per-query-head dK_part/dV_part contractions, and give AttentionBwdStructure the group and the
K/V head extent (HK); (2) here: capture with K/V of HK = H / G heads (FA4 then constructs the main
kernel with qhead_per_kvhead = G writing f32 dk_accum and dv_accum [B, HK, T_r * E_r], and two more
FlashAttentionBackwardPostprocess objects, dK scaled by softmax_scale and dV by 1; T_r is T rounded
up to tile_n, one tile more where a 2-CTA cluster needs an even count), i.e. five kernels; (3) the runtime: those five roles in
kspec.core.ATTENTION_BWD_STEPS' place and the dK/dV accumulators zeroed before the main kernel
(FA4 allocates them with torch.zeros; the preprocess zeroes only dq_accum).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kspec.backends.desc import Const, Load
from kspec.core import ARCHS, ATTENTION_BWD_STEPS, KspecError, KspecInternalError, attention_bwd_workspace

HEAD_DIMS = (64, 128)
DTYPES = ("f16", "bf16")
AUX_DTYPES = ("f32", "f16", "bf16", "i32", "i8")   # tensors a score modification may read (as the forward's)
ROLES = ("B", "H", "S", "T")                       # ABI dims, in order
STEPS = ATTENTION_BWD_STEPS                        # the variants' roles, in launch order
ALIGN = 256                                        # workspace sub-buffer alignment (attention_bwd_workspace's)
BUILD_FORMAT = 1
CAPTURE_POINTS = ((2, 512, 4), (1, 200, 2))        # (B, S, H) at which FA4's choice is captured


def covered(ir, arch: str) -> str | None:
    """Why FlashAttention-4's backward as kspec would drive it cannot compute this backward (None: it can)."""
    a = ir.attention_bwd
    if a is None:
        return "not an attention backward kspec recognises"
    if arch not in ARCHS:
        return f"FlashAttention-4's backward is built for {', '.join(ARCHS)}, not {arch}"
    if a.dtype not in DTYPES:
        return f"FlashAttention-4's backward takes f16/bf16 Q, K, V, O, dO (got {a.dtype})"
    if a.head_dim not in HEAD_DIMS:
        return f"head dim {a.head_dim}: kspec drives FlashAttention-4's backward at head dims 64 and 128 only"
    if tuple(a.out_dtypes) != (a.dtype,) * 3:
        return f"dQ, dK and dV must be stored as {a.dtype} (got {', '.join(a.out_dtypes)})"
    dims = dict(a.dims)
    if a.causal and dims["S"] != dims["T"]:
        return ("a causal backward with query and key lengths that may differ (FlashAttention-4 aligns its causal "
                "mask bottom-right, the spec's `j <= i` top-left)")
    if len(a.batch) != 2:
        return "FlashAttention-4's backward takes [b, h, seq, head] tensors (one batch and one head axis)"
    return _mods_unsupported(ir, a)


def _mods_unsupported(ir, a) -> str | None:
    """Why FA4's backward cannot take this backward's score modification as generated score_mod and
    score_mod_bwd functions (None: it can, or there is none)."""
    from kspec.compiler.kir import Size, epi_nodes

    from . import attnmods
    if a.score_mod is None:
        return None
    for e in (a.score_mod, a.score_mod_grad):
        why = attnmods.unsupported(e)
        if why:
            return why
        sizes = {x.name for x in epi_nodes(e) if isinstance(x, Size)}
        dims = {v for _r, v in a.dims if isinstance(v, str)}
        if sizes - dims:
            return f"the score modification reads the size {sorted(sizes - dims)[0]}, not one of the attention's"
    for name in a.aux:
        b = ir.buffer(name)
        if b.dtype not in AUX_DTYPES:
            return f"aux tensor {name} of dtype {b.dtype}"
        if b.packed is not None or b.layout != "row" or any(not isinstance(x, int) and _role(a, x) is None
                                                             for x in b.shape):
            return (f"aux tensor {name} must be row-major with extents that are literals or the attention's own "
                    "B, H, S, T")
    return None


def _role(a, extent) -> str | None:
    """The ABI dim role (B, H, S, T) whose extent `extent` is, or None."""
    return next((r for r in ROLES if dict(a.dims)[r] == extent), None)


def unsupported(ir, arch: str) -> str | None:
    """The backend's answer for an attention_bwd kernel: what FlashAttention-4 cannot do first (installing
    it would not help there), then whether it is installed."""
    from . import compat
    return covered(ir, arch) or compat.fa4_available()


# ---------------------------------------------------------------------------------------------
# IR -> descriptor
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BwdDesc:
    name: str
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    q: str                     # C names of the ABI's tensors, in ABI order (args)
    k: str
    v: str
    o: str
    do: str
    lse: str
    dq: str
    dk: str
    dv: str
    scale: Load | Const
    dims: tuple[str, ...]
    scalars: tuple[str, ...]
    sm_count: int
    # a score modification: FA4's score_mod and score_mod_bwd (attnmods.analyse_bwd), the aux tensors
    # they read (attention.AuxArg, after dV in the ABI) and their aux_scalars (("scalar", ABI scalar)
    # | ("dim", role))
    mods: object = None
    aux: tuple = ()
    mod_scalars: tuple[tuple[str, str], ...] = ()

    @property
    def args(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v, self.o, self.do, self.lse, self.dq, self.dk, self.dv,
                *(x.name for x in self.aux))

    def alignment(self) -> tuple[tuple[str, int], ...]:
        from kspec.core import dtype_bytes
        aux = {x.name: dtype_bytes(x.dtype) for x in self.aux}
        return tuple((n, aux[n] if n in aux else 4 if n == self.lse else 16) for n in self.args)


def lower(ir, arch: str, sm_count: int | None = None):
    """The kernel IR as a BwdDesc plus the ABI facts (names, dims, scalars) for a LoweredPlan."""
    from kspec.backends.names import Names

    from . import compat
    why = covered(ir, arch)
    if why:
        raise KspecInternalError(f"attention backward lowering called for an unsupported kernel {ir.id}: {why}")
    a = ir.attention_bwd
    names = Names()
    ext = dict(a.dims)
    scalars: dict[str, object] = {}
    if a.scale is not None:
        scale: Load | Const = Load(names(a.scale), "scalar", "f32")
    else:
        scale = Const(1.0)
    bufs = [names(b) for b in (a.q_buffer, a.k_buffer, a.v_buffer, a.o_buffer, a.do_buffer, a.lse_buffer,
                               a.dq_buffer, a.dk_buffer, a.dv_buffer)]
    if isinstance(scale, Load):
        scalars[scale.name] = a.scale
    mods = _lower_mods(ir, a, names, scalars)
    desc = BwdDesc(f"k_{ir.id.rsplit('_', 1)[-1]}", arch, a.dtype, int(a.head_dim), bool(a.causal), *bufs,
                   scale=scale, dims=ROLES, scalars=tuple(scalars),
                   sm_count=int(sm_count or compat.OFFLINE_SM_COUNT[arch]), **mods)
    return desc, names.back(), tuple((r, ext[r]) for r in ROLES), scalars


def _lower_mods(ir, a, names, scalars: dict) -> dict:
    """BwdDesc's mods, aux and mod_scalars for a backward with a score modification ({} without);
    the params the mods read join `scalars` (C name -> param)."""
    from .attention import AuxArg
    from . import attnmods
    if a.score_mod is None:
        return {}
    ext = dict(a.dims)
    mods = attnmods.analyse_bwd(a, {"S": ext["S"], "T": ext["T"]})
    aux = tuple(AuxArg(names(n), ir.buffer(n).dtype, tuple(str(x) if isinstance(x, int) else _role(a, x)
                                                            for x in ir.buffer(n).shape)) for n in mods.aux)
    mod_scalars = []
    for kind, ref in mods.scalars:
        if kind == "param":
            scalars[names(ref)] = ref
            mod_scalars.append(("scalar", names(ref)))
        else:
            mod_scalars.append(("dim", _role(a, ref)))
    return {"mods": mods, "aux": aux, "mod_scalars": tuple(mod_scalars)}


def config_items(desc: BwdDesc, kernels: str | None = None) -> tuple[tuple[str, str], ...]:
    from . import compat
    main = "FlashAttentionBackwardSm90" if desc.arch == "sm90a" else "FlashAttentionBackwardSm100"
    return (("kernel", f"FlashAttention-4 {compat.FA4_VERSION} backward: " +
             (kernels or f"FlashAttentionBackwardPreprocess, {main}, FlashAttentionBackwardPostprocess")),
            ("head_dim", str(desc.head_dim)), ("mask", "causal" if desc.causal else "none"),
            *((("score_mod", "generated, with its generated derivative (score_mod_bwd)"),) if desc.mods else ()),
            ("workspace", "dq_accum f32, dpsum f32, lse_log2 f32 (per call)"),
            ("source", "FlashAttention-4 heuristics"))


# ---------------------------------------------------------------------------------------------
# the three kernels' tensors and entry
# ---------------------------------------------------------------------------------------------

def _seq(role: str, e: str) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """FA4's (b, s, h) view of a [B, H, role, E] tensor: extents and stride factors (d innermost)."""
    return ("B", role, "H"), (("H", role, e), (e,), (role, e))


def tensors(desc: BwdDesc, step: str) -> list[tuple]:
    """(entry name, dtype, dynamic shape (C expressions), stride factors, data C expression) of one
    kernel's tensors, in the entry's order.  FA4's Q/K/V/O/dO/dQ/dK/dV views end with the static head
    dim; the workspace buffers and the LSE are row-major [B, H, n] (a static unit last stride)."""
    e = str(desc.head_dim)
    idx = {n: f"ptrs[{i}]" for i, n in enumerate(("q", "k", "v", "o", "do", "lse", "dq", "dk", "dv"))}
    dt = desc.dtype

    def seq(name, which, role="S"):
        return (name, dt, *_seq(role, e), idx[which])

    def rows(n):
        return ("B", "H", n), (("H", n), (n,))
    lse = ("mLSE", "f32", *rows("S"), idx["lse"])
    dpsum = ("mdPsum", "f32", *rows("ks_sr"), "ks_dpsum")
    lse2 = ("mLSElog2", "f32", *rows("ks_sr"), "ks_lse_log2")
    acc = ("mdQaccum", "f32", *rows("ks_qd"), "ks_dq_accum")
    if step == "bwd_preprocess":
        return [seq("mO", "o"), seq("mdO", "do"), dpsum, lse, lse2, acc]
    if step == "bwd_main":
        aux = [(f"mA{k}", x.dtype, tuple(x.shape), tuple(tuple(x.shape[j + 1:]) for j in range(len(x.shape) - 1)),
                f"ptrs[{9 + k}]") for k, x in enumerate(desc.aux)]
        return [seq("mQ", "q"), seq("mK", "k", "T"), seq("mV", "v", "T"), seq("mdO", "do"), lse2, dpsum, acc,
                seq("mdK", "dk", "T"), seq("mdV", "dv", "T"), *aux]
    if step == "bwd_postprocess":
        return [acc, seq("mdQ", "dq")]
    raise KspecInternalError(f"no attention backward step {step!r}")


_VALUES = {"bwd_preprocess": (), "bwd_main": ("softmax_scale",), "bwd_postprocess": ("softmax_scale",)}


def _values(desc: BwdDesc, step: str) -> list[tuple[str, str]]:
    """A kernel's non-tensor parameters: (name, DSL type); the main kernel's mod scalars c<k> last."""
    out = [(v, "Float32") for v in _VALUES[step]]
    if step == "bwd_main":
        out += [(f"c{k}", "Float32" if kind == "scalar" else "Int32") for k, (kind, _r) in enumerate(desc.mod_scalars)]
    return out


def entry_source(desc: BwdDesc) -> str:
    """The traced module: kspec_<step> for each of STEPS, calling the FA4 object kspec set in PRE,
    MAIN, POST with FA4's own argument order (the optional ones None, as _flash_attn_bwd passes them
    for a dense, non-varlen, non-deterministic backward)."""
    def params(step):
        return ", ".join([f"{t[0]}: cute.Tensor" for t in tensors(desc, step)] +
                         [f"{v}: cutlass.{t}" for v, t in _values(desc, step)] + ["stream: cuda.CUstream"])
    aux_t = "[" + ", ".join(f"mA{k}" for k in range(len(desc.aux))) + "]" if desc.aux else "None"
    aux_s = "(" + "".join(f"c{k}, " for k in range(len(desc.mod_scalars))) + ")" if desc.mod_scalars else "None"
    mods = [desc.mods.score_mod, desc.mods.score_mod_bwd] if desc.mods else []
    return "\n".join([
        f'"""Generated by kspec (CuTe DSL backend, FlashAttention-4): attention backward {desc.name} for '
        f'{desc.arch}."""',
        "import cuda.bindings.driver as cuda",
        "import cutlass",
        "import cutlass.cute as cute",
        "from flash_attn.cute.utils import AuxData",
        *(["", "from kspec.backends.cute import dslops as F"] if mods else []),
        "",
        "PRE = MAIN = POST = None   # FA4's kernel objects (set by kspec)",
        "",
        *mods,
        "",
        "@cute.jit",
        f"def kspec_bwd_preprocess({params('bwd_preprocess')}):",
        "    # (O, dO, dpsum, LSE, lse_log2, dq_accum, cu_seqlens_q, seqused_q, dLSE, row_max, scale_p,",
        "    #  softmax_scale (read with scale_p only), cu_total_m_blocks, o_lo)",
        "    PRE(mO, mdO, mdPsum, mLSE, mLSElog2, mdQaccum, None, None, None, None, None, cutlass.Float32(1.0),",
        "        None, None, stream=stream)",
        "",
        "",
        "@cute.jit",
        f"def kspec_bwd_main({params('bwd_main')}):",
        "    MAIN(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdK, mdV, softmax_scale, None, None, None, None,",
        f"         None, None, None, None, None, AuxData({aux_t}, {aux_s}), None, None, stream=stream)",
        "",
        "",
        "@cute.jit",
        f"def kspec_bwd_postprocess({params('bwd_postprocess')}):",
        "    POST(mdQaccum, mdQ, softmax_scale, None, None, None, None, stream=stream)",
        "",
    ])


def _fake_args(desc: BwdDesc, step: str) -> list:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from kspec.core import dtype_bytes

    from .dslops import dsl_type
    syms: dict[str, object] = {}
    out = []
    for name, dt, shape, strides, _data in tensors(desc, step):
        el = dtype_bytes(dt)
        div = 16 // el                      # FA4's assumed 16-byte alignment of every tensor but the LSE
        aux = name.startswith("mA")         # a score modification's tensor: element-aligned, no head dim
        if name == "mLSE" or aux:
            div = 1
        shp = [int(r) if r.isdigit() else syms.setdefault(r, cute.sym_int32()) for r in shape]
        if dt != "f32" and not aux:
            shp.append(desc.head_dim)
        stride = tuple(cute.sym_int64(divisibility=div) for _ in strides) + (1,)
        out.append(make_fake_tensor(dsl_type(dt), tuple(shp), stride=stride, assumed_align=div * el))
    return out + [getattr(cutlass, t)(1.0 if t == "Float32" else 1) for _v, t in _values(desc, step)]


# ---------------------------------------------------------------------------------------------
# the workspace and the host glue
# ---------------------------------------------------------------------------------------------

def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def workspace_bytes(B: int, H: int, S: int, tile_m: int, head_dim_rounded: int) -> int:
    """The workspace of one call (kspec.core.attention_bwd_workspace: what the glue's C computes)."""
    return attention_bwd_workspace(B, H, S, tile_m, head_dim_rounded)["total"][0]


def _layout_c(tile_m: int, dr: int) -> list[str]:
    """C lines computing the sub-buffer sizes of workspace_layout from B, H, S."""
    return [
        f"    const int64_t ks_sr = (S + {tile_m} - 1) / {tile_m} * {tile_m};",
        f"    const int64_t ks_qd = ks_sr * {dr};",
        f"    const uint64_t ks_off1 = ((uint64_t)B * H * ks_qd * 4 + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
        f"    const uint64_t ks_rows = ((uint64_t)B * H * ks_sr * 4 + {ALIGN - 1}) / {ALIGN} * {ALIGN};",
    ]


def _decl() -> list[str]:
    return [f"    const int64_t {r} = dims[{k}]; (void){r};" for k, r in enumerate(ROLES)]


def workspace_lines(tile_m: int, dr: int) -> list[str]:
    """The body of kspec_workspace_size (the same in the three kernels' glue)."""
    return _decl() + [
        "    (void)device; (void)sm_count; (void)err; (void)err_cap;",
        "    *bytes = 0;",
        "    if (B <= 0 || H <= 0 || S <= 0 || T <= 0) return 0;",
        *_layout_c(tile_m, dr),
        "    *bytes = ks_off1 + 2 * ks_rows;",
        "    return 0;",
    ]


def checks(desc: BwdDesc, tile_m: int, dr: int) -> list[str]:
    """C lines of kspec_prepare: the sizes validated, the workspace's sub-buffers placed."""
    out = _decl() + [
        "    if (B < 0 || H < 0 || S < 0 || T < 0)",
        "        KS_FAIL(\"bad attention sizes (B=%lld H=%lld S=%lld T=%lld)\", (long long)B, (long long)H, "
        "(long long)S, (long long)T);",
        "    if (B > INT32_MAX || H > INT32_MAX || S > INT32_MAX || T > INT32_MAX)",
        "        KS_FAIL(\"attention sizes must fit in 32 bits\");",
        "    if (B == 0 || H == 0) KS_EMPTY();",
        "    if (S == 0 || T == 0)",
        "        KS_FAIL(\"S = %lld queries, T = %lld keys: FlashAttention-4's backward needs at least one of each\", "
        "(long long)S, (long long)T);",
    ]
    if desc.causal:
        out += ["    if (S != T) KS_FAIL(\"causal attention backward with S = %lld queries and T = %lld keys: they must "
                "be equal\", (long long)S, (long long)T);"]
    return out + [
        *_layout_c(tile_m, dr),
        "    if (ks_qd > INT32_MAX) KS_FAIL(\"S = %lld queries: the dQ accumulator rows exceed 32-bit extents\", "
        "(long long)S);",
        "    if (workspace == NULL) KS_FAIL(\"FlashAttention-4's backward called without its workspace\");",
        "    void *ks_dq_accum = workspace;",
        "    void *ks_dpsum = (void *)((char *)workspace + ks_off1);",
        "    void *ks_lse_log2 = (void *)((char *)workspace + ks_off1 + ks_rows);",
    ]


def _glue_tensors(desc: BwdDesc, step: str) -> list:
    from .build import GlueTensor
    return [GlueTensor(name, -1, tuple(shape), tuple(f for f in strides if f), data)
            for name, _dt, shape, strides, data in tensors(desc, step)]


def _glue(desc: BwdDesc, step: str, ciface: str, entry: str, offs, sizes, tile_m: int, dr: int) -> str:
    from . import compat
    from .build import capture_glue
    values, args = [], []
    if _VALUES[step]:
        if isinstance(desc.scale, Load):
            values.append(f"    float softmax_scale = (float)scalars[{desc.scalars.index(desc.scale.name)}];")
        else:
            values.append(f"    float softmax_scale = (float){float(desc.scale.value)!r};")
        args.append("&softmax_scale")
    if step == "bwd_main":
        for k, (kind, ref) in enumerate(desc.mod_scalars):
            values.append(f"    float c{k} = (float)scalars[{desc.scalars.index(ref)}];" if kind == "scalar" else
                          f"    int32_t c{k} = (int32_t)({ref});")
            args.append(f"&c{k}")
    return capture_glue(_glue_tensors(desc, step), checks(desc, tile_m, dr), values, args, ciface, entry, offs,
                        sizes, compat.SMEM_OPTIN[desc.arch], what=f"FlashAttention-4 backward ({step})",
                        workspace=workspace_lines(tile_m, dr))


# ---------------------------------------------------------------------------------------------
# FA4's choice
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Captured:
    objects: tuple                  # the preprocess, main and postprocess kernel objects
    signature: str
    tile_m: int                     # the workspace's row rounding
    head_dim_rounded: int


def _describe(obj) -> str:
    return type(obj).__name__ + repr(sorted((k, repr(v)) for k, v in vars(obj).items()
                                            if v is None or isinstance(v, (bool, int, float, str, tuple))))


def capture(desc: BwdDesc, mod=None) -> Captured:
    """FA4's three backward kernel objects for desc, from `_flash_attn_bwd` run on torch FakeTensors
    with `cute.compile` recorded (nothing is compiled or launched there); FA4's compile caches are
    swapped for empty ones meanwhile, so every kernel is constructed.  Runs under compat.fa4_target.
    mod: the imported entry module, whose generated kspec_score_mod / kspec_score_mod_bwd FA4 is
    given (with aux tensors standing for desc.aux) when desc has a score modification."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cutlass.cute as cute

    from . import compat
    interface = compat.fa4_interface()
    fns = (interface._bwd_preprocess, interface._flash_attn_bwd, interface._bwd_postprocess_convert)
    tdt = {"f16": torch.float16, "bf16": torch.bfloat16}[desc.dtype]
    seen, calls = [], []

    def record(*args, **kwargs):
        calls.append(args)
        return lambda *x, **y: None
    for B, S, H in CAPTURE_POINTS:
        calls.clear()
        real, caches = cute.compile, [f.compile_cache for f in fns]
        warn = torch._C._set_warn_deprecated_on_mutable_data_ptr     # FA4 reads data_ptr() (unused)
        cute.compile = record
        torch._C._set_warn_deprecated_on_mutable_data_ptr = lambda t: None
        for f in fns:
            f.compile_cache = {}
        try:
            with FakeTensorMode():
                q = torch.empty(B, S, H, desc.head_dim, dtype=tdt, device="cuda")
                lse = torch.empty(B, H, S, dtype=torch.float32, device="cuda")
                interface._flash_attn_bwd(q, q, q, q, q, lse, softmax_scale=0.125, causal=desc.causal,
                                          **_mod_kwargs(desc, mod))
        finally:
            cute.compile = real
            torch._C._set_warn_deprecated_on_mutable_data_ptr = warn
            for f, c in zip(fns, caches):
                f.compile_cache = c
        names = [type(a[0]).__name__ for a in calls]
        want = ["FlashAttentionBackwardPreprocess",
                "FlashAttentionBackwardSm90" if desc.arch == "sm90a" else "FlashAttentionBackwardSm100",
                "FlashAttentionBackwardPostprocess"]
        if names != want:
            raise KspecInternalError(f"FlashAttention-4's backward built {names} for {desc.name} on {desc.arch}, "
                                     f"kspec expects {want}")
        pre, main, post = (a[0] for a in calls)
        # the workspace as FA4 allocated it: lse_log2 [B, H, S_r], dq_accum [B, H, S_r * E_r]
        lse2, acc = calls[1][5], calls[1][7]
        sr, qd = int(lse2.shape[2]), int(acc.shape[2])
        tile_m = int(pre.tile_m)
        if sr != _up(S, tile_m) or qd % sr or main.tile_m != tile_m or post.tile_m != tile_m:
            raise KspecInternalError(f"FlashAttention-4's backward workspace for S={S} is not rounded to its tile "
                                     f"({sr} rows, tile_m {tile_m})")
        seen.append(Captured((pre, main, post), " ".join(_describe(o) for o in (pre, main, post)), tile_m, qd // sr))
    if len({c.signature for c in seen}) != 1 or len({c.head_dim_rounded for c in seen}) != 1:
        raise KspecInternalError(f"FlashAttention-4's backward for {desc.name} on {desc.arch} depends on the sizes; "
                                 "kspec builds one")
    return seen[0]


def _mod_kwargs(desc: BwdDesc, mod) -> dict:
    """`_flash_attn_bwd`'s score_mod, score_mod_bwd and aux_tensors for desc (FakeTensors of the aux
    tensors' rank, as the forward's capture passes them: FA4 keys its kernels by their dtype and
    static strides, none of which kspec's entry uses)."""
    import torch
    if desc.mods is None:
        return {}
    if mod is None:
        raise KspecInternalError(f"attention backward {desc.name}: its score modification needs the entry module")
    aux = [torch.empty(*(2 for _ in x.shape), dtype=torch.float32, device="cuda") for x in desc.aux]
    return {"score_mod": mod.kspec_score_mod, "score_mod_bwd": mod.kspec_score_mod_bwd, "aux_tensors": aux or None}


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------

def build_key(desc: BwdDesc) -> str:
    from . import compat
    from .build import _source_identity
    material = {"desc": repr(desc), "src": entry_source(desc), "fa4": compat.FA4_VERSION,
                "quack": compat.QUACK_VERSION, "dsl": compat.dsl_version(), "flavour": compat.cuda_flavour(),
                "backend": _source_identity(), "format": BUILD_FORMAT}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _dir(root: Path, desc: BwdDesc) -> tuple[str, Path]:
    key = build_key(desc)
    return key, root / "cute-attention-bwd" / key[:2] / key


def lookup(desc: BwdDesc, cache_root: Path | None):
    """The cached build (an attention.AttnBuild), or None; never imports the DSL or FA4."""
    from . import attention
    if cache_root is None:
        return None
    key, d = _dir(Path(cache_root), desc)
    meta = attention._read(d, BUILD_FORMAT)
    return None if meta is None else attention._result(desc, [(key, d, meta)], 0.0, True, config_items(desc))


def build(desc: BwdDesc, cache_root: Path | None):
    """The three kernels of desc on desc.arch (cached by content): an attention.AttnBuild whose
    variants are the STEPS in order."""
    from . import attention, compat
    why = compat.fa4_available()
    if why:
        raise KspecError(f"attention backward kernel {desc.name} on {desc.arch}: {why}")
    root = Path(cache_root if cache_root is not None else tempfile.mkdtemp(prefix="kspec-attn-bwd-"))
    t0 = time.monotonic()
    key, d = _dir(root, desc)
    meta = attention._read(d, BUILD_FORMAT)
    cached = meta is not None
    if meta is None:
        meta = _build(desc, key, d)
    return attention._result(desc, [(key, d, meta)], time.monotonic() - t0, cached, config_items(desc))


def _build(desc: BwdDesc, key: str, d: Path) -> dict:
    from .. import cache as cache_entry
    from . import attention, compat
    from .build import _sha, check_header, compile_export, link_host
    root = d.parent.parent
    cache_entry.reclaim_once(root)
    with cache_entry.workdir(root, f".{key[:12]}.") as work:
        (work / "entry.py").write_text(entry_source(desc))
        variants = []
        with compat.fa4_target(desc.arch, desc.sm_count):
            mod = attention._import_entry(work / "entry.py")
            cap = capture(desc, mod)
            mod.PRE, mod.MAIN, mod.POST = cap.objects
            try:
                for k, (step, fa) in enumerate(zip(STEPS, cap.objects)):
                    vd = work / f"v{k}"
                    vd.mkdir()
                    ptxas = getattr(fa, "ptxas_options", "")
                    with attention._sm_count_reads() as reads:
                        entry, offs, sizes, _ptx, seconds = compile_export(
                            vd, getattr(mod, f"kspec_{step}"), _fake_args(desc, step), desc.arch,
                            f"FlashAttention-4 attention backward {desc.name} ({step})",
                            f" --ptxas-options '{ptxas}'" if ptxas else "")
                    if reads:
                        # FA4's backward schedulers are not persistent: nothing SKU-specific is baked in
                        raise KspecInternalError(f"FlashAttention-4's backward ({step}) asked the SM count while "
                                                 "tracing; kspec builds it once for every SKU")
                    gts = _glue_tensors(desc, step)
                    ciface = check_header((vd / "kernel.h").read_text(), gts,
                                          [f"{'float' if t == 'Float32' else 'int32_t'} {v}"
                                           for v, t in _values(desc, step)], trailing=[])
                    (vd / "glue.c").write_text(_glue(desc, step, ciface, entry, offs, sizes, cap.tile_m,
                                                     cap.head_dim_rounded))
                    link_host(vd / "kernel.o", vd / "glue.c", vd / "kernel.so", vd / "link.log")
                    (vd / "kernel.o").unlink(missing_ok=True)
                    cfg = [["variant", str(k)], ["role", step], ["fa4_class", type(fa).__name__],
                           ["tile", f"{fa.tile_m}x{getattr(fa, 'tile_n', getattr(fa, 'tile_hdim', getattr(fa, 'head_dim_padded', '?')))}"],
                           ["ws_tile_m", str(cap.tile_m)], ["ws_head_dim", str(cap.head_dim_rounded)],
                           *([["2cta", str(bool(fa.use_2cta_instrs)).lower()]]
                             if hasattr(fa, "use_2cta_instrs") else []),
                           ["fa4_signature", hashlib.sha256(cap.signature.encode()).hexdigest()[:16]]]
                    variants.append({"dir": f"v{k}", "symbol": entry, "param_offsets": list(offs),
                                     "compile_seconds": seconds, "sm_independent": True, "select": [],
                                     "config": cfg, "sha256": {f: _sha(vd / f) for f in ("kernel.cubin",
                                                                                         "kernel.so")}})
            finally:
                mod.PRE = mod.MAIN = mod.POST = None
        meta = {"format": BUILD_FORMAT, "key": key, "arch": desc.arch, "variants": variants}
        shutil.rmtree(work / "__pycache__", ignore_errors=True)
        cache_entry.seal(work, meta)
        return cache_entry.install(work, d, BUILD_FORMAT)
