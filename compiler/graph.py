"""The dataflow graph: typed AST -> networkx.DiGraph with one node per tensor op.

Every node carries an `OpNode` under the key "op".  Node values are tensors whose axes are named
by index labels (`OpNode.axes`); an edge (u, v) says v reads u's value, and its "uses" attribute
lists, per operand position of v, the labels v uses for u's axes (u.axes[i] is read as uses[..][1][i]).
Labels are local to a statement, so a value defined as acc[m, n] and read as acc[i, j] has an edge
with labels (i, j).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import networkx as nx

from kspec.core import INT_DTYPES
from kspec.spec_lang.check import (CheckedKernel, DimValue, TAccess, TBinary, TCall, TCast, TConst, TExpr,
                                   TGather, TIndex, TReduce, TScalar, TSize, TSoftmax, TUnary, subscript_text)
from kspec.spec_lang.errors import KspecInternalError, Span

KINDS = ("input", "param", "const", "index", "size", "contraction", "elementwise", "broadcast", "reduction",
         "softmax", "cast", "gather", "output")
# Integer `/` is floor division ("floordiv") and `%` its modulo ("mod", non-negative for a positive
# divisor); comparisons, and/or/not give conditions (dtype "bool"); where(c, a, b) chooses.
_BINARY_FN = {"+": "add", "-": "sub", "*": "mul", "/": "div", "%": "mod", "<": "lt", "<=": "le", ">": "gt",
              ">=": "ge", "==": "eq", "!=": "ne", "and": "and", "or": "or"}
# Nodes without operands that any kernel computes where it needs them: constants, the integer value
# of an index along its axis ("index", fn = the label) and the runtime value of a size symbol ("size",
# fn = the symbol).
GENERATED_KINDS = ("const", "index", "size")


@dataclass(frozen=True)
class OpNode:
    kind: str
    dtype: str
    axes: tuple[str, ...]                 # index labels of the value, in storage order
    shape: tuple[DimValue, ...]           # extent per axis
    fn: str = ""                          # elementwise function / reduction op
    name: str | None = None               # the spec tensor this node defines or stands for
    reduced: tuple[str, ...] = ()         # contraction / reduction: labels reduced away
    reduced_shape: tuple[DimValue, ...] = ()
    value: float | int | None = None      # const
    causal: str | None = None             # softmax: the query label of a causal mask
    layout: str = "row"                   # input/output storage layout
    packed: str | None = None             # input/output: `packed(cu)`, the offsets tensor (varlen)
    # gather: per axis of the source (operand 0), what selects the element: an axis label of this
    # node, "#<int>" a literal, or "@<pos>" the integer value of operand <pos> at this point
    subscripts: tuple[str, ...] = ()
    subscript_text: tuple[str, ...] = ()  # gather: each subscript as the spec wrote it (for messages)
    # input: axes of the declared tensor dropped by canon.squeeze_unit_reads (extent 1, only ever
    # read at 0): the node's shape is the declared one without them, the same bytes
    squeezed: tuple[int, ...] = ()
    span: Span | None = field(default=None, compare=False)

    def label(self) -> str:
        ax = f"[{', '.join(self.axes)}]" if self.axes else ""
        if self.kind in ("input", "param", "output"):
            return f"{self.kind} {self.name}{ax} : {self.dtype}"
        if self.kind == "const":
            return f"const {self.value}"
        if self.kind == "index":
            return f"index {self.fn}{ax} : {self.dtype}"
        if self.kind == "size":
            return f"size {self.fn} : {self.dtype}"
        if self.kind in ("contraction", "reduction", "partial"):
            return f"{self.kind} {self.fn}({', '.join(self.reduced)}){ax} : {self.dtype}"
        if self.kind == "gather":
            return f"gather [{', '.join(self.subscripts)}]{ax} : {self.dtype}"
        if self.kind == "softmax":
            c = f", causal={self.causal}" if self.causal else ""
            return f"softmax({self.fn}{c}){ax} : {self.dtype}"
        tag = f" ={self.name}" if self.name else ""
        return f"{self.kind} {self.fn}{ax} : {self.dtype}{tag}"


def op(g: nx.DiGraph, n) -> OpNode:
    return g.nodes[n]["op"]


def uses(g: nx.DiGraph, u, v) -> tuple[tuple[int, tuple[str, ...]], ...]:
    return g.edges[u, v]["uses"]


def operands(g: nx.DiGraph, v) -> list[tuple[object, tuple[str, ...]]]:
    """v's operands in position order: (producer node, labels v uses for its axes)."""
    found = []
    for u in g.predecessors(v):
        for pos, labels in uses(g, u, v):
            found.append((pos, u, labels))
    return [(u, labels) for _, u, labels in sorted(found, key=lambda t: t[0])]


class _Builder:
    def __init__(self, kernel: CheckedKernel):
        self.k = kernel
        self.g = nx.DiGraph(kernel=kernel.name)
        self.ids = itertools.count()
        self.defined: dict[str, object] = {}       # tensor name -> node
        self.extent: dict[str, DimValue] = {}

    def add(self, o: OpNode, inputs: list[tuple[object, tuple[str, ...]]] = ()) -> str:
        n = f"n{next(self.ids)}"
        self.g.add_node(n, op=o)
        for pos, (u, labels) in enumerate(inputs):
            if self.g.has_edge(u, n):
                self.g.edges[u, n]["uses"] += ((pos, tuple(labels)),)
            else:
                self.g.add_edge(u, n, uses=((pos, tuple(labels)),))
        return n

    def build(self) -> nx.DiGraph:
        k = self.k
        for t in k.tensors:
            if t.role == "in":
                axes = tuple(f"d{i}" for i in range(t.rank))
                self.defined[t.name] = self.add(OpNode("input", t.dtype, axes, t.shape, name=t.name,
                                                       layout=t.layout, packed=t.packed, span=t.span))
            elif t.role == "param":
                self.defined[t.name] = self.add(OpNode("param", t.dtype, (), (), name=t.name,
                                                       value=t.default, span=t.span))
        defined_indices: dict[str, tuple[str, ...]] = {}
        for s in k.stmts:
            s = unify_labels(s, defined_indices)
            defined_indices[s.target] = s.indices
            self.extent = dict(s.extents)
            root = self.store(self.expr(s.value), s)
            self.defined[s.target] = root
            info = k.tensor(s.target)
            if info.role == "out":
                self.add(OpNode("output", info.dtype, tuple(f"d{i}" for i in range(info.rank)), info.shape,
                                name=info.name, layout=info.layout, packed=info.packed, span=info.span),
                         [(root, s.indices)])
        return self.g

    def store(self, value: tuple[str, tuple[str, ...]], s) -> str:
        """A node holding the statement's value with the target's dtype, index order and name."""
        node, labels = value
        o = op(self.g, node)
        if o.kind in ("input", "param", *GENERATED_KINDS) or o.name is not None or labels != o.axes:
            # the value is another tensor (read under new labels): copy it, so each name has a node
            node = self.add(OpNode("elementwise", o.dtype, labels, self.shape(labels) if labels else (),
                                   fn="copy", span=s.span), [(node, labels)])
            o = op(self.g, node)
        if o.dtype != s.dtype:
            node = self.add(OpNode("cast", s.dtype, o.axes, o.shape, fn=f"cast:{s.dtype}", span=s.span),
                            [(node, o.axes)])
            o = op(self.g, node)
        if set(o.axes) != set(s.indices):
            # the left side has indices the value does not use: broadcast
            node = self.add(OpNode("broadcast", o.dtype, tuple(s.indices), self.shape(s.indices),
                                   fn="broadcast", span=s.span), [(node, o.axes)])
            o = op(self.g, node)
        if o.axes != tuple(s.indices):
            o = _reorder(o, tuple(s.indices))    # storage order = the left side's index order
        self.g.nodes[node]["op"] = replace(o, name=s.target)
        return node

    def shape(self, axes) -> tuple[DimValue, ...]:
        return tuple(self.extent[a] for a in axes)

    def expr(self, e: TExpr) -> tuple[str, tuple[str, ...]]:
        """Build e's nodes; return (node, the labels under which e reads that node's axes)."""
        if isinstance(e, TConst):
            return self.node(OpNode("const", e.dtype, (), (), value=e.value, span=e.span))
        if isinstance(e, TScalar):
            return self.defined[e.name], ()
        if isinstance(e, TAccess):
            return self.defined[e.tensor], tuple(e.indices)
        if isinstance(e, TGather):
            return self.gather(e)
        if isinstance(e, TIndex):
            return self.node(OpNode("index", "i32", (e.name,), self.shape((e.name,)), fn=e.name, span=e.span))
        if isinstance(e, TSize):
            return self.node(OpNode("size", "i32", (), (), fn=e.name, span=e.span))
        if isinstance(e, TUnary):
            fn = "neg" if e.op == "-" else "not"
            return self.node(OpNode("elementwise", e.dtype, e.free, self.shape(e.free), fn=fn, span=e.span),
                             [self.read(e.operand, e.free)])
        if isinstance(e, TBinary):
            fn = _BINARY_FN[e.op]
            if fn == "div" and e.dtype in INT_DTYPES:
                fn = "floordiv"
            return self.node(OpNode("elementwise", e.dtype, e.free, self.shape(e.free), fn=fn,
                                    span=e.span), [self.read(e.lhs, e.free), self.read(e.rhs, e.free)])
        if isinstance(e, TCall):
            return self.node(OpNode("elementwise", e.dtype, e.free, self.shape(e.free), fn=e.fn, span=e.span),
                             [self.read(a, e.free) for a in e.args])
        if isinstance(e, TCast):
            return self.node(OpNode("cast", e.dtype, e.free, self.shape(e.free), fn=f"cast:{e.dtype}", span=e.span),
                             [self.read(e.operand, e.free)])
        if isinstance(e, TSoftmax):
            return self.node(OpNode("softmax", e.dtype, e.free, self.shape(e.free), fn=e.axis, causal=e.causal,
                                    span=e.span), [self.expr(e.operand)])
        if isinstance(e, TReduce):
            inner = e.operand
            red_shape = tuple(self.extent[i] for i in e.indices)
            if e.op == "sum" and (found := self.factored_contraction(e)) is not None:
                return found
            if e.op == "sum" and isinstance(inner, TBinary) and inner.op == "*" and \
                    all(i in inner.lhs.free and i in inner.rhs.free for i in e.indices):
                return self.node(OpNode("contraction", e.dtype, e.free, self.shape(e.free), fn="sum",
                                        reduced=e.indices, reduced_shape=red_shape, span=e.span),
                                 [self.expr(inner.lhs), self.expr(inner.rhs)])
            return self.node(OpNode("reduction", e.dtype, e.free, self.shape(e.free), fn=e.op, reduced=e.indices,
                                    reduced_shape=red_shape, span=e.span), [self.expr(inner)])
        raise KspecInternalError(f"cannot build a graph node for {type(e).__name__}")

    def factored_contraction(self, e: TReduce) -> tuple[str, tuple[str, ...]] | None:
        """`sum(k) A[.., k] * B[.., k] * c` where the factors c do not use a reduced index (scalars,
        e.g. an attention scale, or vectors over free indices): the contraction of A and B, then
        multiplied (or divided) by each c, which is the same sum.  None when the product is not two
        factors over every reduced index times such factors."""
        red = set(e.indices)
        factors = _product_factors(e.operand, red)
        if factors is None:
            return None
        inside = [f for f, how in factors if set(f.free) & red]
        outside = [(f, how) for f, how in factors if not set(f.free) & red]
        if len(inside) != 2 or not outside or not all(red <= set(f.free) for f in inside):
            return None
        if any(how != "mul" for f, how in factors if f in inside):
            return None
        if e.dtype == "i32" and any(f.dtype not in ("i8", "i32") for f, _ in outside):
            return None     # a float factor of an integer sum: not the same sum after factoring
        used = set(inside[0].free) | set(inside[1].free)
        c_axes = tuple(x for x in e.free if x in used)
        red_shape = tuple(self.extent[i] for i in e.indices)
        value = self.node(OpNode("contraction", e.dtype, c_axes, self.shape(c_axes), fn="sum", reduced=e.indices,
                                 reduced_shape=red_shape, span=e.span),
                          [self.expr(inside[0]), self.expr(inside[1])])
        for f, how in outside:
            node, labels = value
            if labels and set(labels) != set(e.free):
                node, labels = self.node(OpNode("broadcast", e.dtype, e.free, self.shape(e.free), fn="broadcast",
                                                span=e.span), [(node, labels)])
            value = self.node(OpNode("elementwise", e.dtype, e.free, self.shape(e.free), fn=how, span=e.span),
                              [(node, labels), self.read(f, e.free)])
        return value

    def gather(self, e: TGather) -> tuple[str, tuple[str, ...]]:
        """tensor[subscripts] as a gather node: operand 0 is the tensor (axes selected by something
        other than a label are read under placeholder labels `~<axis>`), operands 1.. the integer
        tensors whose values select elements."""
        src_labels: list[str] = []
        subs: list[str] = []
        inputs = [None]
        for axis, x in enumerate(e.subscripts):
            if isinstance(x, str):
                src_labels.append(x)
                subs.append(x)
            elif isinstance(x, int):
                src_labels.append(f"~{axis}")
                subs.append(f"#{x}")
            else:
                # an integer tensor element or index arithmetic (`h / G`): its value at this point
                src_labels.append(f"~{axis}")
                subs.append(f"@{len(inputs)}")
                inputs.append(self.expr(x))
        inputs[0] = (self.defined[e.tensor], tuple(src_labels))
        return self.node(OpNode("gather", e.dtype, e.free, self.shape(e.free), fn="gather", name=None,
                                subscripts=tuple(subs),
                                subscript_text=tuple(x if isinstance(x, str) else subscript_text(x)
                                                     for x in e.subscripts), span=e.span), inputs)

    def node(self, o: OpNode, inputs=()) -> tuple[str, tuple[str, ...]]:
        n = self.add(o, list(inputs))
        return n, o.axes

    def read(self, e: TExpr, consumer_axes) -> tuple[str, tuple[str, ...]]:
        """e as an elementwise operand of a consumer over `consumer_axes`: tensors that do not cover
        every consumer axis are broadcast by an explicit node (scalars are not)."""
        node, labels = self.expr(e)
        o = op(self.g, node)
        if not labels or set(labels) == set(consumer_axes):
            return node, labels          # scalars are broadcast implicitly
        b = self.add(OpNode("broadcast", o.dtype, tuple(consumer_axes), self.shape(consumer_axes),
                            fn="broadcast", span=e.span), [(node, labels)])
        return b, tuple(consumer_axes)


def _product_factors(e: TExpr, reduced: set) -> list[tuple[TExpr, str]] | None:
    """e as a product: [(factor, "mul" | "div")], flattening `*` and a division by a factor that
    uses no reduced index; None if e is not a product of at least three factors."""
    def walk(x: TExpr) -> list[tuple[TExpr, str]]:
        if isinstance(x, TBinary) and x.op == "*":
            return walk(x.lhs) + walk(x.rhs)
        if isinstance(x, TBinary) and x.op == "/" and not set(x.rhs.free) & reduced:
            return walk(x.lhs) + [(x.rhs, "div")]
        return [(x, "mul")]
    out = walk(e)
    return out if len(out) >= 3 else None


def _accesses(e: TExpr):
    if isinstance(e, TAccess):
        yield e
    if isinstance(e, TGather):
        for x in e.subscripts:
            if isinstance(x, TExpr):
                yield from _accesses(x)
    for f in ("operand", "lhs", "rhs"):
        c = getattr(e, f, None)
        if isinstance(c, TExpr):
            yield from _accesses(c)
    for c in getattr(e, "args", ()):
        yield from _accesses(c)


def _all_labels(s) -> set[str]:
    return {i for i, _ in s.extents} | set(s.indices)


def _rename_expr(e: TExpr, m: dict[str, str]) -> TExpr:
    r = lambda xs: tuple(m.get(x, x) for x in xs)  # noqa: E731
    changes: dict = {"free": r(e.free)}
    if isinstance(e, TAccess):
        changes["indices"] = r(e.indices)
    if isinstance(e, TReduce):
        changes["indices"] = r(e.indices)
    if isinstance(e, TIndex):
        changes["name"] = m.get(e.name, e.name)
    if isinstance(e, TGather):
        changes["subscripts"] = tuple(m.get(x, x) if isinstance(x, str) else
                                      _rename_expr(x, m) if isinstance(x, TExpr) else x for x in e.subscripts)
    if isinstance(e, TSoftmax):
        changes["axis"] = m.get(e.axis, e.axis)
        changes["causal"] = m.get(e.causal, e.causal) if e.causal else None
    for f in ("operand", "lhs", "rhs"):
        c = getattr(e, f, None)
        if isinstance(c, TExpr):
            changes[f] = _rename_expr(c, m)
    if isinstance(e, TCall):
        changes["args"] = tuple(_rename_expr(a, m) for a in e.args)
    return replace(e, **changes)


def unify_labels(s, defined: dict[str, tuple[str, ...]]):
    """Rename a statement's index labels after those that defined the values it reads, so that
    `D[i, j] = relu(acc[i, j])` uses acc's own labels (m, n) and fuses like one expression.
    A label is renamed only where that cannot clash with another label of the statement."""
    used = _all_labels(s)
    m: dict[str, str] = {}
    for acc in _accesses(s.value):
        for mine, theirs in zip(acc.indices, defined.get(acc.tensor, ())):
            if mine in m or mine == theirs or theirs in m.values():
                continue
            if theirs in used and theirs not in m:
                continue
            m[mine] = theirs
    if not m:
        return s
    return replace(s, indices=tuple(m.get(i, i) for i in s.indices), value=_rename_expr(s.value, m),
                   extents=tuple((m.get(i, i), d) for i, d in s.extents))


def _reorder(o: OpNode, axes: tuple[str, ...]) -> OpNode:
    pos = {a: i for i, a in enumerate(o.axes)}
    return replace(o, axes=axes, shape=tuple(o.shape[pos[a]] for a in axes))


def build_graph(kernel: CheckedKernel) -> nx.DiGraph:
    """Build the (validated) dataflow graph of one checked kernel."""
    g = _Builder(kernel).build()
    validate(g)
    return g


def validate(g: nx.DiGraph) -> None:
    """Structural invariants: acyclic, operand labels match the producer's rank, every spec tensor has
    one producer, outputs are sinks fed once."""
    if not nx.is_directed_acyclic_graph(g):
        raise KspecInternalError("the dataflow graph has a cycle")
    names: dict[str, object] = {}
    for n, data in g.nodes(data=True):
        o: OpNode = data["op"]
        if o.kind not in KINDS:
            raise KspecInternalError(f"node {n} has unknown kind {o.kind}")
        if len(o.axes) != len(o.shape):
            raise KspecInternalError(f"node {n}: {len(o.axes)} axes but {len(o.shape)} extents")
        if o.name and o.kind != "output":
            if o.name in names:
                raise KspecInternalError(f"tensor {o.name} has two producers: {names[o.name]} and {n}")
            names[o.name] = n
        for u in g.predecessors(n):
            for _, labels in uses(g, u, n):
                if len(labels) != len(op(g, u).axes):
                    raise KspecInternalError(f"edge {u}->{n}: {len(labels)} labels for a rank-{len(op(g, u).axes)} value")
        if o.kind == "output":
            if g.out_degree(n) or g.in_degree(n) != 1:
                raise KspecInternalError(f"output node {n} must have exactly one producer and no consumers")
            (u, labels), = operands(g, n)
            if labels != op(g, u).axes or op(g, u).kind in ("input", "param", *GENERATED_KINDS):
                # outputs store their producer's value as it is: transposes and copies are op nodes
                raise KspecInternalError(f"output node {n} must store an op's value in its axis order")
        if o.kind == "gather":
            ins = operands(g, n)
            src = op(g, ins[0][0]) if ins else None
            if src is None or len(o.subscripts) != len(src.axes) or \
                    any(x.startswith("@") and not 0 < int(x[1:]) < len(ins) for x in o.subscripts):
                raise KspecInternalError(f"gather node {n}: subscripts {o.subscripts} do not match its operands")
        if o.kind in ("input", "param", *GENERATED_KINDS) and g.in_degree(n):
            raise KspecInternalError(f"{o.kind} node {n} has producers")
