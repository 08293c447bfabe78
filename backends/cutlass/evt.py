"""GEMM epilogues as CUTLASS Epilogue Visitor Trees (EVT).

Owns the translation of a `GemmDesc` epilogue (D, auxiliary stores, reductions over an expression
tree of Accum/Load/Const/Op) into the DAG IR of `cutlass_cppgen`'s EVT frontend, and the two C++
fragments kspec needs from it:
- the type declarations of the fusion callbacks (through `FusionCallbacks(emit_CD=False)`, the
  emitter the interface itself uses on sm90/sm100), and
- the callbacks' `Arguments` as a C++ brace initializer built from the ABI's `ptrs`/`scalars`
  arrays (the interface itself fills ctypes structs at run time, which kspec cannot use).

The DAG is built through the frontend's node API directly (no Python source text to parse):
structurally equal sub-expressions become one node, so a value that is stored and also used
further (aux stores, reductions) is computed once.  Must run inside `compat.offline(cc)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kspec.backends.desc import Accum, Const, EpiExpr, GemmDesc, Load, Op, ReductionStore, Store
from kspec.core import KspecError, KspecInternalError
from kspec.core import check_ident as _core_check_ident

from . import compat

# Example extents used only to let the EVT IR infer broadcasts and stride kinds; they are distinct
# and > 1 so each dynamic stride value maps back to exactly one symbolic expression.
_EX_M, _EX_N, _EX_L_BATCHED = 384, 640, 3
_STRIDE_EXPR = {_EX_N: "N", _EX_M: "M", _EX_M * _EX_N: "M * N"}

_BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")
_UNARY_ACT = ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")
SUPPORTED_OPS = _BINARY + _UNARY_ACT + ("neg", "exp", "abs", "clamp", "cast:<dtype>")
# Element types an intermediate value can be cast to (round-trip through that type).
_CAST_DTYPES = ("f16", "bf16", "f32", "tf32", "f8e4m3", "f8e5m2")
_LOAD_DTYPES = ("f16", "bf16", "f32", "f8e4m3", "f8e5m2")
_STORE_DTYPES = ("f16", "bf16", "f32", "f8e4m3", "f8e5m2")


def check_ident(name: str, what: str) -> str:
    """Descriptor names are sanitized upstream; anything else is a kspec bug."""
    return _core_check_ident(name, what)


@dataclass
class EvtEpilogue:
    """A traced epilogue: the frontend (holding the DAG IR) and how kspec names map onto nodes."""
    frontend: Any
    tensor_loads: tuple[Load, ...]         # row/col/full loads, in ABI order
    scalar_loads: tuple[Load, ...]         # runtime scalars, in ABI order
    node_of: dict[str, str] = field(default_factory=dict)   # kspec name -> EVT node name
    batched: bool = False

    @property
    def dag(self) -> Any:
        return self.frontend.dag_ir


class _Builder:
    """Walks the epilogue expressions and adds nodes to an EVT frontend."""

    def __init__(self, frontend: Any, desc: GemmDesc, lib: Any):
        self.fe = frontend
        self.desc = desc
        self.arch = desc.arch
        self.lib = lib
        self.L = _EX_L_BATCHED if desc.batched else 1
        self.memo: dict[EpiExpr, str] = {}
        self.loads: dict[str, Load] = {}          # kspec name -> Load (first occurrence)
        self.order: list[str] = []                # kspec load names in order of first use
        self.node_of: dict[str, str] = {}
        self.n_loads = 0

    # ---- helpers ------------------------------------------------------------------------
    def _tensor(self, dtype: str, shape: tuple[int, ...], layout: str = "row") -> Any:
        from cutlass_cppgen.backend.evt.ir.tensor import Tensor
        return Tensor(element=compat.library_dtype(dtype), shape=shape,
                      layout_tag=compat.library_layout(layout))

    def _edge(self, src: str, dst: str, weight: int) -> None:
        self.fe.add_edge(src, dst, weight=weight)

    def _compute(self, fn: Any, args: list[str]) -> str:
        name = self.fe.add_compute_node(fn)
        for i, a in enumerate(args):
            self._edge(a, name, i)
        return name

    def _imm(self, value: float) -> str:
        if math.isnan(value):
            raise KspecError(f"a NaN constant in the epilogue of '{self.desc.name}' cannot be fused")
        return self.fe.add_imm(float(value))

    # ---- expressions --------------------------------------------------------------------
    def value(self, e: EpiExpr) -> str:
        if e in self.memo:
            return self.memo[e]
        node = self._value(e)
        self.memo[e] = node
        return node

    def _value(self, e: EpiExpr) -> str:
        if isinstance(e, Accum):
            if e.index:
                raise KspecInternalError(f"EVT epilogue of '{self.desc.name}' reads a second accumulator")
            return "accum"
        if isinstance(e, Const):
            return self._imm(e.value)
        if isinstance(e, Load):
            return self._load(e)
        if isinstance(e, Op):
            return self._op(e)
        raise KspecError(f"unknown epilogue expression {type(e).__name__} in '{self.desc.name}'")

    def _load(self, ld: Load) -> str:
        check_ident(ld.name, "epilogue input")
        prev = self.loads.get(ld.name)
        if prev is not None:
            if prev != ld:
                raise KspecError(f"epilogue input '{ld.name}' is used as both {prev.kind} {prev.dtype} "
                                 f"and {ld.kind} {ld.dtype}")
            return self.node_of[ld.name]
        node = f"ld_{self.n_loads}"
        self.n_loads += 1
        if ld.kind == "scalar":
            # Runtime scalars arrive as doubles and are applied in f32.
            self.fe.add_load_node(node, 0.0)
        else:
            if ld.dtype not in _LOAD_DTYPES:
                raise KspecError(f"epilogue input '{ld.name}' has dtype {ld.dtype}; fused GEMM epilogues "
                                 f"on {self.arch} read {', '.join(_LOAD_DTYPES)}")
            # per-batch vectors are broadcasts with a batch stride (Sm90RowBroadcast/ColBroadcast
            # with StrideMNL <_0, _1, int> / <_1, _0, int>)
            shape = {"row": (1, 1, _EX_N), "col": (1, _EX_M, 1), "row_batched": (self.L, 1, _EX_N),
                     "col_batched": (self.L, _EX_M, 1), "full": (self.L, _EX_M, _EX_N)}.get(ld.kind)
            if shape is None:
                raise KspecError(f"epilogue input '{ld.name}' has unknown kind '{ld.kind}'")
            self.fe.add_load_node(node, self._tensor(ld.dtype, shape))
        self.loads[ld.name] = ld
        self.order.append(ld.name)
        self.node_of[ld.name] = node
        return node

    def _op(self, op: Op) -> str:
        from cutlass_cppgen.backend.library import ActivationOp, FunctionalOp

        fn, args = op.fn, op.args

        def arity(n: int) -> None:
            if len(args) != n:
                raise KspecError(f"epilogue op '{fn}' takes {n} argument(s), got {len(args)}")

        binary = {"add": FunctionalOp.Plus, "sub": FunctionalOp.Minus, "mul": FunctionalOp.Multiplies,
                  "div": FunctionalOp.Divides, "maximum": FunctionalOp.Maximum,
                  "minimum": FunctionalOp.Minimum}
        # gelu is CUTLASS's erf form; GELU_taylor is the tanh approximation.
        unary = {"relu": ActivationOp.ReLU, "gelu": ActivationOp.Gelu,
                 "gelu_tanh": ActivationOp.GeluTaylor, "silu": ActivationOp.SiLU,
                 "sigmoid": ActivationOp.Sigmoid, "tanh": ActivationOp.Tanh}
        if fn in binary:
            arity(2)
            return self._compute(binary[fn], [self.value(a) for a in args])
        if fn in unary:
            arity(1)
            return self._compute(unary[fn], [self.value(args[0])])
        if fn == "exp":
            arity(1)
            return self._compute(FunctionalOp.Exp, [self.value(args[0])])
        if fn == "neg":
            arity(1)
            return self._compute(FunctionalOp.Multiplies, [self.value(args[0]), self._imm(-1.0)])
        if fn == "abs":
            # |x| = max(x, -x): exact in IEEE arithmetic, and EVT has no abs node.
            arity(1)
            x = self.value(args[0])
            negx = self._compute(FunctionalOp.Multiplies, [x, self._imm(-1.0)])
            return self._compute(FunctionalOp.Maximum, [x, negx])
        if fn == "clamp":
            arity(3)
            x, lo, hi = (self.value(a) for a in args)
            return self._compute(FunctionalOp.Minimum, [self._compute(FunctionalOp.Maximum, [x, lo]), hi])
        if fn.startswith("cast:"):
            arity(1)
            dtype = fn.split(":", 1)[1]
            if dtype not in _CAST_DTYPES:
                raise KspecError(f"epilogue op '{fn}' has no EVT equivalent on {self.arch} "
                                 f"(casts to: {', '.join(_CAST_DTYPES)})")
            x = self.value(args[0])
            node = self._compute(ActivationOp.Identity, [x])
            # The identity node's output element is the rounding point of the cast.
            self.fe.dag_ir.get_node_meta(node).element_output = compat.library_dtype(dtype)
            return node
        raise KspecError(f"epilogue op '{fn}' has no EVT equivalent on {self.arch}",
                         hint=f"fusable ops: {', '.join(SUPPORTED_OPS)}")

    # ---- outputs ------------------------------------------------------------------------
    def store(self, node_name: str, st: Store) -> None:
        check_ident(st.name, "epilogue output")
        if st.dtype not in _STORE_DTYPES:
            raise KspecError(f"GEMM output '{st.name}' has dtype {st.dtype}; fused epilogues on "
                             f"{self.arch} write {', '.join(_STORE_DTYPES)}")
        if st.layout not in ("row", "col"):
            raise KspecError(f"GEMM output '{st.name}' has unknown layout '{st.layout}'")
        src = self.value(st.value)
        self.fe.add_store_node(node_name)
        self._edge(src, node_name, 0)
        self.fe.set_store_tensor(node_name, self._tensor(st.dtype, (self.L, _EX_M, _EX_N), st.layout))
        self.fe.mark_output(node_name)
        self.node_of[st.name] = node_name
        # Later uses of the same value read the store (EVT stores pass their input through), so
        # the graph stays a tree where it can.
        if node_name != "D":
            self.memo[st.value] = node_name

    def reduction(self, node_name: str, red: ReductionStore) -> None:
        from cutlass_cppgen.backend.library import FunctionalOp
        check_ident(red.name, "reduction output")
        if red.dtype != "f32":
            raise KspecError(f"reduction '{red.name}' has dtype {red.dtype}; fused GEMM reductions on "
                             f"{self.arch} accumulate with f32 atomics and must be f32")
        fns = {"max": (FunctionalOp.Maximum, FunctionalOp.AtomicMaximum),
               "sum": (FunctionalOp.Plus, FunctionalOp.AtomicAdd)}
        if red.op not in fns:
            raise KspecError(f"reduction '{red.op}' has no EVT equivalent on {self.arch} (max, sum)")
        shapes = {"n": (self.L, _EX_M, 1), "m": (self.L, 1, _EX_N)}
        if red.axis not in shapes:
            raise KspecError(f"reduction '{red.name}' has unknown axis '{red.axis}'")
        src = self.value(red.value)
        comp = self._compute(fns[red.op], [src])
        self.fe.add_store_node(node_name)
        self._edge(comp, node_name, 0)
        self.fe.set_store_tensor(node_name, self._tensor("f32", shapes[red.axis]))
        self.fe.mark_output(node_name)
        self.node_of[red.name] = node_name


def _frontend_class() -> type:
    from cutlass_cppgen.backend.evt.frontend.frontend_base import EVTFrontendBase

    class KspecEVTFrontend(EVTFrontendBase):
        """EVT frontend fed by a kspec descriptor instead of Python source."""

        def __init__(self, cc: int, desc: GemmDesc):
            super().__init__(cc)
            self.desc = desc
            self.builder: _Builder | None = None

        def parse(self, *_args: Any, **_kwargs: Any) -> None:
            import cutlass_library
            desc = self.desc
            b = _Builder(self, desc, cutlass_library)
            self.add_load_node("accum", b._tensor("f32", (b.L, _EX_M, _EX_N)))
            # Aux stores first (so D and reductions read stored values through the store node and
            # the graph stays a tree), then D, then reductions: a deterministic node order.
            for i, st in enumerate(desc.aux_stores):
                b.store(f"aux_{i}", st)
            b.store("D", desc.output)
            for i, red in enumerate(desc.reductions):
                b.reduction(f"red_{i}", red)
            self.return_names = ["D"] + [f"aux_{i}" for i in range(len(desc.aux_stores))] + \
                [f"red_{i}" for i in range(len(desc.reductions))]
            self.builder = b

    return KspecEVTFrontend


def trace_epilogue(desc: GemmDesc, cc: int) -> EvtEpilogue:
    """Build and run the EVT passes for the epilogue of `desc` (inside `compat.offline(cc)`)."""
    names = [desc.output.name] + [s.name for s in desc.aux_stores] + [r.name for r in desc.reductions]
    if len(set(names)) != len(names):
        raise KspecError(f"GEMM '{desc.name}' writes the same output name twice: {names}")
    fe = _frontend_class()(cc, desc)
    try:
        fe.trace()
    except KspecError:
        raise
    except (RuntimeError, NotImplementedError, AssertionError, SyntaxError, ValueError) as e:
        raise KspecError(f"the epilogue of '{desc.name}' cannot be expressed as a CUTLASS epilogue "
                         f"visitor tree on {desc.arch}: {e}") from e
    b = fe.builder
    assert b is not None
    for name in names:
        if name in b.loads:
            raise KspecError(f"'{name}' is both an input and an output of GEMM '{desc.name}'")
    loads = [b.loads[n] for n in b.order]
    return EvtEpilogue(frontend=fe,
                       tensor_loads=tuple(ld for ld in loads if ld.kind != "scalar"),
                       scalar_loads=tuple(ld for ld in loads if ld.kind == "scalar"),
                       node_of=dict(b.node_of), batched=desc.batched)


# --------------------------------------------------------------------------------------------
# C++ emission
# --------------------------------------------------------------------------------------------

def emit_callbacks(epi: EvtEpilogue, cc: int) -> tuple[str, str]:
    """(type declarations, name of the callbacks type) of the fusion callbacks, C and D excluded."""
    from cutlass_cppgen.backend.evt.backend.emitter_base import FusionCallbacks
    decl, name = FusionCallbacks(epi.dag, cc, emit_CD=False).emit()
    return decl, name


def stride_d_type(epi: EvtEpilogue) -> str:
    return epi.dag.get_node_meta("D").underlying_impl.stride_mnl


def stride_d_value(epi: EvtEpilogue) -> str:
    return _stride_value(epi.dag.get_node_meta("D").underlying_impl)


def element_tag(lib_dtype: Any) -> str:
    from cutlass_library import DataTypeTag
    return DataTypeTag[lib_dtype]


def _stride_value(impl: Any) -> str:
    parts = []
    for v in impl.get_stride_mnl():
        if isinstance(v, tuple):
            raise KspecError("nested (hierarchical) epilogue strides are not supported")
        if v in (0, 1):
            parts.append(f"cute::Int<{v}>{{}}")
        else:
            expr = _STRIDE_EXPR.get(v)
            if expr is None:
                raise KspecInternalError(f"unexpected epilogue stride {v} for node {impl.name}")
            parts.append(f"static_cast<{impl.stride_dtype}>({expr})")
    return f"cute::make_stride({', '.join(parts)})"


def _float_literal(v: float) -> str:
    if math.isinf(v):
        return ("-" if v < 0 else "") + "cutlass::platform::numeric_limits<float>::infinity()"
    return f"static_cast<float>({float(v)!r})"


@dataclass(frozen=True)
class ArgNames:
    """How the ABI's inputs are spelled inside the generated host function."""
    ptr_index: dict[str, int]       # kspec tensor name -> index in `ptrs`
    scalar_index: dict[str, int]    # kspec scalar name -> index in `scalars`


def arguments_initializer(epi: EvtEpilogue, names: ArgNames) -> str:
    """The callbacks' `Arguments` as a C++ brace initializer (children first, then the node's own
    arguments, mirroring `PassGetArgumentType`)."""
    dag = epi.dag
    kspec_of = {node: name for name, node in epi.node_of.items()}
    root = dag.get_all_inputs("D")[0]
    return _tree_args(dag, root, kspec_of, names)


def _tree_args(dag: Any, node: str, kspec_of: dict[str, str], names: ArgNames) -> str:
    from cutlass_cppgen.backend.evt.ir import TopoVisitorNode
    meta = dag.get_node_meta(node)
    if isinstance(meta, TopoVisitorNode):
        sub = meta.subgraph
        parts = []
        for n in sub.nodes_topological_order()[:-1]:
            m = sub.get_node_meta(n)
            parts.append(_tree_args(dag, n, kspec_of, names) if m.disabled else
                         _leaf_args(m, kspec_of, names))
        return "{" + ", ".join(parts) + "}"
    inputs = dag.get_all_inputs(node)
    own = _leaf_args(meta, kspec_of, names)
    if not inputs:
        return own
    return "{" + ", ".join([_tree_args(dag, c, kspec_of, names) for c in inputs] + [own]) + "}"


def _leaf_args(meta: Any, kspec_of: dict[str, str], names: ArgNames) -> str:
    from cutlass_cppgen.backend.evt.ir import load_nodes as ln, store_nodes as sn
    from cutlass_cppgen.backend.evt.ir.compute_nodes import ComputeImpl
    from cutlass_library import DataTypeTag
    impl = meta.underlying_impl

    def ptr(const: bool) -> str:
        name = kspec_of[meta.name]
        elem = DataTypeTag[impl.element]
        return f"static_cast<{elem}{' const' if const else ''}*>(ptrs[{names.ptr_index[name]}])"

    if isinstance(impl, (ln.AccumulatorImpl, ln.LoadSrcImpl, ComputeImpl)):
        return "{}"
    if isinstance(impl, ln.ScalarBroadcastImpl):
        elem = DataTypeTag[impl.element]
        if impl.tensor.is_constant:
            value = _float_literal(impl.tensor.value)
        else:
            value = f"static_cast<float>(scalars[{names.scalar_index[kspec_of[meta.name]]}])"
        return f"{{{{{elem}({value})}}, {{}}, {{}}}}"
    if isinstance(impl, (ln.AuxLoadImpl, ln.RowBroadcastImpl, ln.ColumnBroadcastImpl)):
        elem = DataTypeTag[impl.element]
        return f"{{{ptr(True)}, {elem}(0), {_stride_value(impl)}}}"
    if isinstance(impl, (sn.RowReductionImpl, sn.ColumnReductionImpl)):
        name = kspec_of[meta.name]
        is_max = "maximum" in str(impl.gmem_reduce_fn).lower()
        identity = "-cutlass::platform::numeric_limits<float>::infinity()" if is_max else "0.0f"
        return f"{{ptrs[{names.ptr_index[name]}], {identity}, {_stride_value(impl)}}}"
    if isinstance(impl, sn.AuxStoreImpl):
        return f"{{{ptr(False)}, {_stride_value(impl)}}}"
    raise KspecInternalError(f"no argument printer for EVT node {meta.name} ({type(impl).__name__})")
