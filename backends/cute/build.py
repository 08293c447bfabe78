"""Building one GEMM with the CuTe DSL: trace + compile (`cute.compile`), export (`export_to_c`), and
link kspec's host glue (`kspec_prepare`) with kspec's capture shim into a `.so` that depends on
libc only.  Results are cached by content under `<cache root>/cute/`.

    build(desc, arch, cache_root, config=None, dims=None) -> CuteBuild

Per build: `kernel.cubin` (the device code the runtime loads), `kernel.so` (host glue, ABI.md),
`kernel.ptx`, `entry.py` (the traced module), `glue.c`, `meta.json`.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kspec.backends.desc import GemmDesc
from kspec.core import KspecError, KspecInternalError

from .. import cache as cache_entry
from . import compat, epilogue, gemm

BUILD_FORMAT = 1
_HERE = Path(__file__).parent
SHIM_C = _HERE / "csrc" / "kspec_cute_shim.c"
_PREFIX = "kspec_k"
PARAMS_CAP = 4096          # kspec.runtime.glue's parameter buffer


@dataclass(frozen=True)
class CuteBuild:
    key: str
    dir: str                             # cache entry directory
    cubin: str
    host: str
    symbol: str                          # the kernel's entry point in the cubin
    param_offsets: tuple[int, ...]       # byte offset of each kernel parameter in the blob
    param_sizes: tuple[int, ...]
    config: tuple[tuple[str, str], ...]
    args: tuple[str, ...]                # descriptor names of the tensor arguments, ABI order
    scalars: tuple[str, ...]             # descriptor names of the scalar arguments, ABI order
    dims: tuple[str, ...]
    alignment: tuple[tuple[str, int], ...]
    seconds: float = 0.0
    cached: bool = False


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _source_identity() -> str:
    h = hashlib.sha256(f"cute-build-{BUILD_FORMAT}".encode())
    for p in sorted(_HERE.rglob("*")):
        if p.suffix in (".py", ".c") and p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def build_key(desc: GemmDesc, arch: str, cfg: gemm.CuteConfig) -> tuple[str, str, epilogue.EpilogueCode]:
    code = epilogue.generate(desc)
    src = gemm.entry_source(desc, arch, cfg, code)
    # The C compiler is not part of the key: the host glue is plain C11 whose behaviour does not
    # depend on its version (and a key never holds machine paths).
    # The entry source names the tensors but not their dtypes and layouts, which reach the trace as
    # fake tensors: the tensor ABI is part of the key.
    material = {"src": src, "arch": arch, "dsl": compat.dsl_version(), "flavour": compat.cuda_flavour(),
                "backend": _source_identity(), "names": gemm.abi_names(desc, code),
                "tensors": [asdict(t) for t in gemm.tensor_abi(desc, code)]}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest(), src, code


def _cc() -> str:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "gcc"


# ---------------------------------------------------------------------------------------------
# parsing what the DSL wrote
# ---------------------------------------------------------------------------------------------

_PTX_TYPES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "b32": 4, "u32": 4, "s32": 4,
              "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}
_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.S)
_PARAM_RE = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+[\w$]+(?:\[(\d+)\])?")


def ptx_params(ptx: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(entry name, parameter offsets, parameter sizes) of the single kernel in a PTX module,
    laid out as the CUDA ABI does (each parameter at its alignment)."""
    entries = _ENTRY_RE.findall(ptx)
    if len(entries) != 1:
        raise KspecInternalError(f"expected one kernel entry in the CuTe DSL's PTX, found {len(entries)}")
    name, body = entries[0]
    offs, sizes, cur = [], [], 0
    for align, ty, count in _PARAM_RE.findall(body):
        if ty not in _PTX_TYPES:
            raise KspecInternalError(f"unknown PTX parameter type .{ty} in {name}")
        size = _PTX_TYPES[ty] * (int(count) if count else 1)
        al = int(align) if align else _PTX_TYPES[ty]
        cur = (cur + al - 1) // al * al
        offs.append(cur)
        sizes.append(size)
        cur += size
    return name, tuple(offs), tuple(sizes)


def param_layout(cubin: Path, ptx: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(entry, offsets, sizes) of the kernel's parameters as the cubin declares them
    (EIATTR_KPARAM_INFO, what the driver copies by), relative to the first: ptxas aligns parameters
    in the constant bank, not in the parameter list (a 64-byte-aligned TMA descriptor after 96 bytes
    of parameters lands at 112, not 128), so the PTX alone is not the layout.  The PTX's count and
    sizes must agree."""
    from kspec.runtime.cubin import read_cubin
    entry, _offs, sizes = ptx_params(ptx)
    try:
        k = read_cubin(cubin).kernel(entry)
    except Exception as e:                          # noqa: BLE001  (reported with the cause)
        raise KspecInternalError(f"cannot read the parameter layout of {entry} from {cubin}: {e}") from e
    # relative to the first parameter: the blob holds the parameters, not the bank's leading padding
    # (a cubin may start its parameter area at a non-zero offset to align a TMA descriptor)
    base = k.params[0].offset if k.params else 0
    offs = tuple(p.offset - base for p in k.params)
    csizes = tuple(p.size for p in k.params)
    if csizes != sizes:
        raise KspecInternalError(f"{entry}: the cubin declares parameter sizes {csizes}, the PTX {sizes}")
    return entry, offs, csizes


_STRUCT_RE = re.compile(r"typedef struct \{\s*void \*data;\s*(?:int32_t dynamic_shapes\[(\d+)\];\s*)?"
                        r"(?:int64_t dynamic_strides\[(\d+)\];\s*)?\}\s*(\w+);")
_WRAPPER_RE = re.compile(r"int32_t cute_dsl_\w+_wrapper\(([^)]*)\)")
_CIFACE_RE = re.compile(r"(_mlir_\w+__mlir_ciface_\w+)\(args,\s*(\d+)\)")


def check_header(header: str, tensors, scalar_params: list[str] | int, trailing: list[str] | None = None) -> str:
    """Check the exported header against what the glue assumes; returns the C-interface symbol.
    scalar_params: the wrapper's scalar parameters after the tensors (e.g. "float s0"); trailing:
    the parameters before the stream (default: the GEMM's "int32_t max_clusters")."""
    trailing = ["int32_t max_clusters"] if trailing is None else trailing
    if isinstance(scalar_params, int):
        scalar_params = [f"float s{k}" for k in range(scalar_params)]
    structs = {name: (int(s or 0), int(t or 0)) for s, t, name in _STRUCT_RE.findall(header)}
    for t in tensors:
        want = (len(t.dynamic_shapes), len(t.dynamic_strides))
        got = structs.get(f"{_PREFIX}_Tensor_{t.name}_t")
        if got != want:
            raise KspecInternalError(f"CuTe DSL header: tensor {t.name} is {got}, kspec expected {want} "
                                     "(dynamic shapes, dynamic strides)")
    w = _WRAPPER_RE.search(header)
    if not w:
        raise KspecInternalError("CuTe DSL header: no wrapper function found")
    params = [p.strip() for p in w.group(1).split(",")]
    expect = ([f"{_PREFIX}_Kernel_Module_t *module"] + [f"{_PREFIX}_Tensor_{t.name}_t *{t.name}" for t in tensors]
              + list(scalar_params) + list(trailing) + ["cudaStream_t stream"])
    if params != expect:
        raise KspecInternalError(f"CuTe DSL wrapper signature changed: {params} (kspec expects {expect})")
    c = _CIFACE_RE.search(header)
    if not c or int(c.group(2)) != len(expect):
        raise KspecInternalError("CuTe DSL header: C-interface call not found or with an unexpected arity")
    return c.group(1)


# ---------------------------------------------------------------------------------------------
# host glue
# ---------------------------------------------------------------------------------------------

_DIM_INDEX = {"M": 0, "N": 1, "K": 2, "L": 3}


def glue_source(tensors: list[gemm.TensorABI], num_scalars: int, ciface: str, entry: str,
                offsets: tuple[int, ...], sizes: tuple[int, ...], cluster_size: int, smem_optin: int,
                multiples: tuple[tuple[str, int], ...] = ()) -> str:
    """kspec_workspace_size / kspec_prepare (backends/ABI.md) for one exported CuTe DSL GEMM;
    multiples: gemm.size_multiples (size roles the kernel needs to be a multiple of a number)."""
    from kspec.core import DTYPE_TABLE, dtype_bytes
    checks = [
        "    const int64_t M = dims[0], N = dims[1], K = dims[2], L = dims[3];",
        "    if (M < 0 || N < 0 || K < 0 || L < 0) KS_FAIL(\"negative size (M=%lld N=%lld K=%lld L=%lld)\", (long long)M, (long long)N, (long long)K, (long long)L);",
        "    if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || L > INT32_MAX)",
        "        KS_FAIL(\"sizes must fit in 32 bits (M=%lld N=%lld K=%lld L=%lld)\", (long long)M, (long long)N, (long long)K, (long long)L);",
        "    if (M == 0 || N == 0 || L == 0) KS_EMPTY();   /* empty output: nothing to launch */",
    ]
    if any("R" in t.shape for t in tensors):      # a gathered A's own row count
        checks.insert(1, "    const int64_t R = dims[4];")
    for role, m in multiples:
        # gemm.size_multiples (the manifest says so too): a gathered A's rows are read in whole
        # 128-byte K tiles by cp.async; the block-scaled kernel reads whole K tiles (no K tail)
        why = ("a GEMM whose A rows are gathered" if any("R" in t.shape for t in tensors) else
               f"the block-scaled {tensors[0].dtype} GEMM, which reads whole K tiles")
        checks.append(f"    if ({role} % {m} != 0) KS_FAIL(\"{role} = %lld: {why} needs {role} to be a "
                      f"multiple of {m}\", (long long){role});")
    for t in tensors:
        if not t.tma and t.alignment > dtype_bytes(t.dtype):
            # (e.g. MX scales, read 4 bytes a row at a time): every row starts as aligned as the base
            q = t.alignment // dtype_bytes(t.dtype)
            for st in t.dynamic_strides:
                expr = "*".join(st)
                checks.append(f"    if (({expr}) % {q} != 0) KS_FAIL(\"{expr} = %lld: the CuTe DSL kernel reads "
                              f"{t.alignment}-byte rows of {t.dtype} here (a multiple of {q})\", (long long)({expr}));")
        if t.tma:
            lead = t.leading()
            el = 128 // DTYPE_TABLE[t.dtype].bits          # (32 values of a 4-bit dtype, two a byte)
            checks.append(f"    if ({lead} % {el} != 0) KS_FAIL(\"{lead} = %lld: the CuTe DSL kernel needs it to be a "
                          f"multiple of {el} ({t.dtype}, 16-byte TMA rows)\", (long long){lead});")
    values = [f"    float s{k} = (float)scalars[{k}];" for k in range(num_scalars)]
    values += [f"    int32_t max_clusters = sm_count / {cluster_size};", "    if (max_clusters < 1) max_clusters = 1;"]
    return capture_glue(tensors, checks, values, [f"&s{k}" for k in range(num_scalars)] + ["&max_clusters"],
                        ciface, entry, offsets, sizes, smem_optin)


@dataclass(frozen=True)
class GlueTensor:
    """One tensor of capture_glue's launcher call (the FA4 kernels': attention.py, splitkv.py,
    attention_bwd.py): its C struct fields from the ABI's dims and pointers."""
    name: str
    ptr_index: int
    dynamic_shapes: tuple[str, ...]
    dynamic_strides: tuple[tuple[str, ...], ...]
    data: str | None = None     # the address, when not the ABI pointer (e.g. inside the workspace)


def capture_glue(tensors, checks: list[str], values: list[str], value_args: list[str], ciface: str, entry: str,
                 offsets: tuple[int, ...], sizes: tuple[int, ...], smem_optin: int, what: str = "CuTe DSL",
                 workspace: list[str] | None = None, helpers: str = "") -> str:
    """The host glue of one exported CuTe DSL kernel (backends/ABI.md): kspec_prepare runs the DSL's
    launcher under kspec's capture shim.  tensors: objects with name, ptr_index, dynamic_shapes (C
    expressions) and dynamic_strides (tuples of C factors), and optionally `data` (a C expression of
    the address, e.g. inside the workspace; default ptrs[ptr_index]); checks: C lines validating
    `dims` (KS_FAIL on a bad input, KS_EMPTY for nothing to launch); values: C lines declaring the
    launcher's non-tensor arguments, passed by address in the order of value_args.  workspace: the
    body of kspec_workspace_size (default: none needed); helpers: C definitions both functions use."""
    from kspec.core import ABI_VERSION
    lines = [
        f"/* Generated by kspec ({what}): host glue; see backends/ABI.md. */",
        "#include <stdint.h>", "#include <stdio.h>", "#include <string.h>", "",
        f"void _mlir_{_PREFIX}_cuda_init(void **);",
        f"void _mlir_{_PREFIX}_cuda_load_to_device(void **);",
        f"void {ciface}(void **args, int32_t num_args);",
        "void kspec_capture_begin(int, int, int, const char *, const uint32_t *, const uint32_t *, int, void *, uint64_t);",
        "int kspec_capture_end(uint64_t *, uint32_t *, uint32_t *, uint32_t *, uint32_t *, char *, uint64_t);",
        "",
        f'static const char ks_entry[] = "{entry}";',
        f"static const uint32_t ks_off[{len(offsets)}] = {{{', '.join(map(str, offsets))}}};",
        f"static const uint32_t ks_size[{len(sizes)}] = {{{', '.join(map(str, sizes))}}};",
        "",
    ]
    for t in tensors:
        fields = ["void *data;"]
        if t.dynamic_shapes:
            fields.append(f"int32_t dynamic_shapes[{len(t.dynamic_shapes)}];")
        if t.dynamic_strides:
            fields.append(f"int64_t dynamic_strides[{len(t.dynamic_strides)}];")
        lines.append(f"typedef struct {{ {' '.join(fields)} }} ks_tensor_{t.name};")
    lines += [
        "",
        "#define KS_FAIL(...) do { if (err && err_cap) snprintf(err, (size_t)err_cap, __VA_ARGS__); return 1; } while (0)",
        "#define KS_EMPTY() do { *params_size = 0; grid[0] = grid[1] = grid[2] = 0; block[0] = block[1] = block[2] = 0; \\",
        "    cluster[0] = cluster[1] = cluster[2] = 1; *smem_bytes = 0; return 0; } while (0)",
        "",
        "__attribute__((visibility(\"default\")))",
        f"int kspec_abi_version(void) {{ return {ABI_VERSION}; }}",
        "",
        *([helpers, ""] if helpers else []),
        "__attribute__((visibility(\"default\")))",
        "int kspec_workspace_size(const int64_t *dims, int32_t device, int32_t sm_count,",
        "                         uint64_t *bytes, char *err, uint64_t err_cap) {",
        *(workspace if workspace is not None else [
            "    (void)dims; (void)device; (void)sm_count; (void)err; (void)err_cap;",
            "    *bytes = 0;",
            "    return 0;"]),
        "}",
        "",
        "__attribute__((visibility(\"default\")))",
        "int kspec_prepare(const int64_t *dims, void *const *ptrs, const double *scalars, void *workspace,",
        "                  int32_t device, int32_t sm_count, void *params, uint64_t params_cap,",
        "                  uint64_t *params_size, uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],",
        "                  uint32_t *smem_bytes, char *err, uint64_t err_cap) {",
        "    (void)workspace; (void)scalars;",
        *checks,
    ]
    for t in tensors:
        # shapes and stride factors are C identifiers (dims roles) or integer literals
        shapes = ", ".join(f"(int32_t){s}" for s in t.dynamic_shapes)
        strides = ", ".join("(int64_t)" + "*".join(s) for s in t.dynamic_strides)
        init = [getattr(t, "data", None) or f"ptrs[{t.ptr_index}]"]
        if t.dynamic_shapes:
            init.append(f"{{{shapes}}}")
        if t.dynamic_strides:
            init.append(f"{{{strides}}}")
        lines.append(f"    ks_tensor_{t.name} t_{t.name} = {{{', '.join(init)}}};")
    lines += [
        *values,
        "    void *stream = NULL;",
        "    int32_t ret = 0, cerr = 0, dev = device;",
        "    void *library = NULL, *library_ptr = &library;",
        f"    kspec_capture_begin(device, sm_count, {smem_optin}, ks_entry, ks_off, ks_size, {len(offsets)}, params, params_cap);",
        "    struct { void **library_ptr; int32_t *ret; } init_args = {(void **)&library_ptr, &cerr};",
        f"    _mlir_{_PREFIX}_cuda_init((void **)&init_args);",
        "    struct { void **library; int32_t *device_id; int32_t *ret; } load_args = {(void **)&library_ptr, &dev, &cerr};",
        "    if (cerr == 0)",
        f"        _mlir_{_PREFIX}_cuda_load_to_device((void **)&load_args);",
    ]
    args = [f"&t_{t.name}" for t in tensors] + list(value_args) + ["&stream", "&ret"]
    lines += [
        f"    void *args[{len(args)}] = {{{', '.join(args)}}};",
        "    if (cerr == 0)",
        f"        {ciface}(args, {len(args)});",
        "    int rc = kspec_capture_end(params_size, grid, block, cluster, smem_bytes, err, err_cap);",
        "    if (rc != 0) return rc;",
        f"    if (cerr != 0 || ret != 0) KS_FAIL(\"the {what} launcher failed (library %d, launch %d)\", (int)cerr, (int)ret);",
        "    return 0;",
        "}",
        "",
    ]
    return "\n".join(lines)


_VERSION_SCRIPT = "{ global: kspec_prepare; kspec_workspace_size; kspec_abi_version; local: *; };\n"


def link_host(obj: Path, glue_c: Path, out: Path, log: Path) -> None:
    """gcc: the exported object + glue + kspec's shim -> a .so needing only libc (no CUDA library)."""
    vs = out.parent / "exports.map"
    vs.write_text(_VERSION_SCRIPT)
    cmd = [_cc(), "-shared", "-fPIC", "-O2", "-std=c11", "-fvisibility=hidden", "-o", str(out), str(glue_c),
           str(SHIM_C), str(obj), "-Wl,--no-undefined", f"-Wl,--version-script={vs}", "-Wl,-z,noexecstack"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    if r.returncode != 0:
        raise KspecInternalError(f"linking the CuTe DSL host glue failed (see {log}):\n{r.stderr[-2000:]}")


# ---------------------------------------------------------------------------------------------
# the build
# ---------------------------------------------------------------------------------------------

def _fake_tensors(tensors: list[gemm.TensorABI]):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from .dslops import dsl_type
    from kspec.core import dtype_bytes
    syms = {d: cute.sym_int32() for d in ("M", "N", "K", "L", "R")}
    out = []
    for t in tensors:
        div = t.alignment // dtype_bytes(t.dtype)      # rows start as aligned as the base
        # derived extents (a block-scale tensor's `(K / 128)`) are runtime values of their own
        shape = tuple(syms[s] if s in syms else syms.setdefault(s, cute.sym_int32()) for s in t.shape)
        stride = tuple(1 if s == 1 else cute.sym_int64(divisibility=div) for s in t.stride)
        out.append(make_fake_tensor(dsl_type(t.dtype), shape, stride=stride, assumed_align=t.alignment))
    return out


def _import_entry(path: Path, key: str):
    name = f"kspec_cute_entry_{key[:24]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod            # the DSL reads the source of jit functions through their module
    spec.loader.exec_module(mod)
    return mod


def compile_export(work: Path, entry, args: list, arch: str, what: str, options: str = ""
                   ) -> tuple[str, tuple[int, ...], tuple[int, ...], str, float]:
    """Compile `entry(*args, stream)` for `arch` with `cute.compile` (no TVM-FFI), export it into
    work/kernel.{o,h} and keep its one cubin as work/kernel.cubin: (entry symbol, parameter offsets,
    parameter sizes, PTX, compile seconds).  Every CuTe DSL kernel kspec builds goes through here:
    the GEMMs and FlashAttention-4's forward, split-KV combine and backward kernels (attention.py,
    splitkv.py, attention_bwd.py); the caller then writes its glue and links (link_host).  `what`
    names the kernel in errors; options: more `cute.compile` options (e.g. ptxas's)."""
    import cutlass.cute as cute
    dump = work / "dump"
    t0 = time.monotonic()
    try:
        fn = cute.compile(entry, *args, compat.fake_stream(), options=compat.compile_options(arch, dump) + options)
    except Exception as e:
        raise KspecInternalError(f"the CuTe DSL failed to compile {what} for {arch}: {type(e).__name__}: "
                                 f"{str(e)[:2000]}") from e
    fn.export_to_c(file_path=str(work), file_name="kernel", function_prefix=_PREFIX)
    seconds = time.monotonic() - t0
    cubins, ptxs = sorted(dump.glob("*.cubin")), sorted(dump.glob("*.ptx"))
    if len(cubins) != 1 or len(ptxs) != 1:
        raise KspecInternalError(f"expected one cubin and one PTX from the CuTe DSL, got {len(cubins)}/{len(ptxs)}")
    shutil.copyfile(cubins[0], work / "kernel.cubin")
    ptx = ptxs[0].read_text()
    shutil.rmtree(dump)
    sym, offs, sizes = param_layout(work / "kernel.cubin", ptx)
    if offs and offs[-1] + sizes[-1] > PARAMS_CAP:
        raise KspecInternalError(f"{what}: its kernel parameters take {offs[-1] + sizes[-1]} bytes (> {PARAMS_CAP})")
    return sym, offs, sizes, ptx, seconds


def _compile_into(work: Path, desc: GemmDesc, arch: str, cfg: gemm.CuteConfig, key: str, src: str,
                  code: epilogue.EpilogueCode) -> dict:
    import cutlass
    tensors = gemm.tensor_abi(desc, code)
    entry_py = work / "entry.py"
    entry_py.write_text(src)
    with compat.target_arch(arch):
        mod = _import_entry(entry_py, key)
        args = [*_fake_tensors(tensors), *(cutlass.Float32(1.0) for _ in code.scalars), cutlass.Int32(1)]
        entry, offs, sizes, ptx, seconds = compile_export(work, mod.kspec_entry, args, arch,
                                                          f"GEMM {desc.name} ({cfg.describe()})")
    (work / "kernel.ptx").write_text(ptx)
    ciface = check_header((work / "kernel.h").read_text(), tensors,
                          [f"float s{k}" for k in range(len(code.scalars))])
    cluster = cfg.cluster[0] * cfg.cluster[1]
    (work / "glue.c").write_text(glue_source(tensors, len(code.scalars), ciface, entry, offs, sizes, cluster,
                                                  compat.SMEM_OPTIN[arch], gemm.size_multiples(desc)))
    link_host(work / "kernel.o", work / "glue.c", work / "kernel.so", work / "link.log")
    return {"symbol": entry, "param_offsets": list(offs), "param_sizes": list(sizes), "compile_seconds": seconds}


def _entry_dir(cache_root: Path | None, key: str) -> Path:
    root = Path(cache_root if cache_root is not None else tempfile.mkdtemp(prefix="kspec-cute-")) / "cute"
    return root / key[:2] / key


def _result(desc: GemmDesc, cfg: gemm.CuteConfig, key: str, code: epilogue.EpilogueCode, entry_dir: Path,
            meta: dict, seconds: float, cached: bool) -> CuteBuild:
    tensors = gemm.tensor_abi(desc, code)
    names = gemm.abi_names(desc, code)
    alignment = tuple((names[t.ptr_index], t.alignment) for t in tensors)
    return CuteBuild(key=key, dir=str(entry_dir), cubin=str(entry_dir / "kernel.cubin"),
                     host=str(entry_dir / "kernel.so"), symbol=meta["symbol"],
                     param_offsets=tuple(meta["param_offsets"]), param_sizes=tuple(meta["param_sizes"]),
                     config=tuple(cfg.as_dict().items()), args=gemm.abi_names(desc, code),
                     scalars=tuple(l.name for l in code.scalars),
                     dims=("M", "N", "K", "L", *(("R",) if desc.a_rows else ())),
                     alignment=alignment, seconds=seconds, cached=cached)


def lookup(desc: GemmDesc, arch: str, cache_root: Path | None, config: gemm.CuteConfig) -> CuteBuild | None:
    """The cached build of `desc` on `arch`, or None; never imports the DSL."""
    if cache_root is None:
        return None
    key, _src, code = build_key(desc, arch, config)
    d = _entry_dir(cache_root, key)
    meta = _read_entry(d)
    return None if meta is None else _result(desc, config, key, code, d, meta, 0.0, True)


def build(desc: GemmDesc, arch: str, cache_root: Path | None, config: gemm.CuteConfig | None = None,
          dims: dict | None = None) -> CuteBuild:
    """Build (or find in the cache) the CuTe DSL kernel for `desc` on `arch`."""
    why = gemm.can_implement(desc, arch)
    if why is not None:
        raise KspecError(f"GEMM '{desc.name}' on {arch}: the CuTe DSL backend cannot build it: {why}")
    cfg = config or gemm.default_config(desc, arch, dims)
    key, src, code = build_key(desc, arch, cfg)
    entry_dir = _entry_dir(cache_root, key)
    root = entry_dir.parent.parent
    t0 = time.monotonic()
    meta = _read_entry(entry_dir)
    cached = meta is not None
    if meta is None:
        cache_entry.reclaim_once(root)
        with cache_entry.workdir(root, f".{key[:12]}.") as work:
            info = _compile_into(work, desc, arch, cfg, key, src, code)
            shutil.rmtree(work / "__pycache__", ignore_errors=True)
            cache_entry.seal(work, {"format": BUILD_FORMAT, "key": key, "arch": arch, "desc": desc.name, **info})
            meta = cache_entry.install(work, entry_dir, BUILD_FORMAT)
    return _result(desc, cfg, key, code, entry_dir, meta, time.monotonic() - t0, cached)


def _elem(dtype: str) -> int:
    from kspec.core import dtype_bytes
    return dtype_bytes(dtype)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _read_entry(d: Path) -> dict | None:
    """A whole cache entry's metadata, or None (missing; damaged or stale: removed, rebuilt)."""
    meta = cache_entry.read(d, BUILD_FORMAT)
    if meta is not None and not {"kernel.cubin", "kernel.so"} <= set(meta["files"]):
        cache_entry.warn_damaged(d, "it lacks kernel.cubin or kernel.so")
        cache_entry.discard(d)
        return None
    return meta


def build_result_dict(b: CuteBuild) -> dict:
    return asdict(b)
