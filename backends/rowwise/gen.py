"""The row-kernel generator: a rowwise plan's kernel IR -> the kernel body (`RowwiseDesc`).

`lower_rowwise` stages the group's ops into passes (a reduction waits for the values it reads, a
softmax takes a max and a sum pass), decides which inputs are cached on chip, and writes the C++
body of one pass loop per pass plus the folds between them (`_emit_reduce`).
"""
from __future__ import annotations

import math

import networkx as nx

from kspec.backends.api import LoweredPlan
from kspec.backends.generic import _CTYPE, _FN, KspecLoweringError, _round
from kspec.backends.irview import ScheduleView, plan_view
from kspec.backends.names import Names as _Names
from kspec.backends.names import number_placeholders
from kspec.compiler.graph import op, operands
from kspec.compiler.kir import KernelIR

from .desc import _COMBINE, _FLOAT, _IDENTITY, _ITEMSIZE, RowwiseDesc


class _RowGen:
    def __init__(self, sched: ScheduleView, plan, arch: str):
        self.s, self.plan, self.arch, self.g = sched, plan, arch, sched.graph
        self.info = plan.info
        self.group = plan.group.nodes
        self.names = _Names()
        self.scalars: dict[str, object] = {}
        self.dims: list[tuple[str, object]] = []
        self.dim_key: dict = {}
        for i, label in enumerate(self.info.outer):
            self.dim(("ext", label), self.info.extent(label))
        self.n_dim = self.dim(("ext", self.info.axis), self.info.extent(self.info.axis))
        self.nodes = [n for n in nx.topological_sort(self.g.subgraph(self.group))]
        self.stage: dict = {}
        self.cached: dict[str, int] = {}          # buffer -> cache slot
        self.first_read: dict[str, int] = {}      # buffer -> first pass that reads it at element level
        self.reads_in: dict[str, set] = {}        # buffer -> passes reading it

    # ---- sizes and buffers ----
    def dim(self, key, value) -> int:
        """The index in p.dim of a launch size: ("ext", label) an extent of the row space,
        ("stride", buffer, axis) a buffer's element stride, ("extent", buffer, axis) a gathered
        dimension's size, ("size", symbol) a size symbol read as a value."""
        if key not in self.dim_key:
            self.dim_key[key] = len(self.dims)
            prefix = {"ext": "d", "stride": "s", "extent": "e", "size": "z"}[key[0]]
            self.dims.append((f"{prefix}{len(self.dims)}", value))
        return self.dim_key[key]

    def fail(self, msg: str, n=None):
        span = op(self.g, n if n is not None else self.plan.group.anchor).span
        raise KspecLoweringError(f"kernel {self.s.kernel.name} (plan {self.plan.id}) on {self.arch}: {msg}", span)

    def arg(self, buffer: str) -> str:
        return self.names(buffer)

    def leaf(self, u, known: dict) -> str | None:
        """A constant, a scalar param (a launch scalar) or a value already in `known` (node -> C
        variable) as a C expression; None for anything else."""
        uo = op(self.g, u)
        if uo.kind == "const":
            return _const(uo)
        if u in known:
            return known[u]
        if uo.kind == "param":
            c = self.names(uo.name)
            self.scalars[c] = uo.name
            return f"(float)p.scalar[{{{c}}}]"
        return None

    def strides(self, buffer: str) -> list[object]:
        """Element strides of a dense buffer, per axis (symbolic products of extents)."""
        b = self.s.buffers[buffer]
        order = list(range(len(b.shape)))
        if b.layout == "col" and len(order) >= 2:
            order[-1], order[-2] = order[-2], order[-1]
        out: list[object] = [1] * len(b.shape)
        inner: list[object] = []
        for axis in reversed(order):
            ints = math.prod(x for x in inner if isinstance(x, int))
            syms = [x for x in inner if not isinstance(x, int)]
            if not syms:
                out[axis] = ints
            elif ints == 1 and len(syms) == 1:
                out[axis] = syms[0]
            else:
                out[axis] = tuple(syms) + ((ints,) if ints != 1 else ())
            inner.append(b.shape[axis])
        return out

    def stride_dim(self, buffer: str, axis: int) -> int:
        return self.dim(("stride", buffer, axis), self.strides(buffer)[axis])

    def row_base(self, buffer: str, labels: tuple[str, ...]) -> tuple[str, list[int]]:
        """C expression of the element offset of this row in `buffer` read under `labels` (the row
        axis, if present, is innermost with stride 1), and the stride dims used."""
        terms, used = [], []
        for axis, label in enumerate(labels):
            if label == self.info.axis:
                continue
            if label not in self.info.outer:
                self.fail(f"buffer axis '{label}' is neither a row axis nor the row position")
            d = self.stride_dim(buffer, axis)
            used.append(d)
            terms.append(f"i_{self.info.outer.index(label)} * p.dim[{d}]")
        return (" + ".join(terms) or "0LL"), used


def lower_rowwise(ir: KernelIR, arch: str) -> LoweredPlan:
    try:
        return _lower_rowwise(ir, arch)
    except RecursionError:
        # values feeding a loop are inlined into one C expression: a chain of thousands of ops is
        # more than the generator (or nvcc) takes
        raise KspecLoweringError(f"kernel {ir.id} on {arch}: the row kernel cannot inline an expression this deep (split the chain "
                                 "with a stored intermediate)", ir.span) from None


def _lower_rowwise(ir: KernelIR, arch: str) -> LoweredPlan:
    sched, plan = ScheduleView(ir), plan_view(ir)
    gen = _RowGen(sched, plan, arch)
    g, info, group = gen.g, gen.info, gen.group
    r = info.axis
    elem = {n: r in op(g, n).axes for n in gen.nodes}

    # ---- stages: how many reduction barriers a value waits for ----
    stage: dict = {}
    red_pass: dict = {}                # reduction -> pass accumulating it
    sm_passes: dict = {}               # softmax -> (max pass, sum pass)

    def st(u):
        return stage.get(u, 0) if u in group else 0

    for n in gen.nodes:
        o = op(g, n)
        ins = operands(g, n)
        if o.kind == "reduction" and o.fn == "logsumexp":
            # a max pass and a sum-of-exponentials pass, as a softmax: mx + log(sum exp(x - mx))
            p0 = st(ins[0][0])
            sm_passes[n] = (p0, p0 + 1)
            stage[n] = p0 + 2
        elif o.kind in ("reduction", "contraction"):
            p0 = max(st(u) for u, _ in ins)
            red_pass[n] = p0
            stage[n] = p0 + 1
        elif o.kind == "softmax":
            p0 = st(ins[0][0])
            sm_passes[n] = (p0, p0 + 1)
            stage[n] = p0 + 2
        elif o.kind in ("gather", "const"):
            stage[n] = 0
        else:
            stage[n] = max([st(u) for u, _ in ins] or [0])
    leaving = [n for n in gen.nodes if gen.s.stores(n)]
    # column partials (compiler/rowwise.py, COLUMN_SLOTS): accumulated per column in the last pass
    partials = [n for n in gen.nodes if op(g, n).kind == "partial"]
    elem_stores = [n for n in leaving if elem[n] and n not in partials]
    row_stores = [n for n in leaving if not elem[n]]
    n_red_passes = max([p + 1 for p in red_pass.values()] + [b + 1 for _, b in sm_passes.values()] + [0])
    final_pass = n_red_passes if elem_stores or partials else None
    n_passes = n_red_passes + (1 if final_pass is not None else 0)
    for n in elem_stores:
        if stage[n] > n_red_passes:
            gen.fail("internal: a stored value needs a later pass than the last one", n)

    # roots evaluated at element level in each pass
    roots: dict[int, list] = {p: [] for p in range(n_passes)}
    for n, p in red_pass.items():
        roots[p].extend(operands(g, n))
    for n, (pm, ps) in sm_passes.items():
        roots[pm].append(operands(g, n)[0])
        roots[ps].append(operands(g, n)[0])
    if final_pass is not None:
        roots[final_pass].extend((n, op(g, n).axes) for n in elem_stores)
        for n in partials:
            roots[final_pass].extend(operands(g, n))

    def closure(rs) -> tuple[list, list]:
        """In-group element nodes and element loads (buffer, labels) the roots need."""
        need: set = set()
        loads: list = []
        stack = list(rs)
        while stack:
            u, labels = stack.pop()
            if u in group:
                if not elem[u] or u in need:
                    continue
                need.add(u)
                stack.extend(operands(g, u))
                continue
            uo = op(g, u)
            if uo.kind in ("param", "const") or r not in labels:
                continue
            key = (gen.s.value_buffer[u], tuple(labels))
            if key not in loads:
                loads.append(key)
        return [n for n in gen.nodes if n in need], loads

    plan_pass = {p: closure(roots[p]) for p in range(n_passes)}
    for p in range(n_passes):
        for buf, _ in plan_pass[p][1]:
            gen.reads_in.setdefault(buf, set()).add(p)
    for buf, passes in gen.reads_in.items():
        gen.first_read[buf] = min(passes)
        if len(passes) > 1:
            gen.cached[buf] = len(gen.cached)

    body: list[str] = []
    emit = body.append
    slot_count = max([sum(1 for x in red_pass.values() if x == p) +
                      sum((pm == p) + (ps == p) for pm, ps in sm_passes.values()) for p in range(n_passes)] + [1])

    # ---- row indices and row bases ----
    k = len(info.outer)
    head = ["const int tx = threadIdx.x, TX = blockDim.x, ty = threadIdx.y, TY = blockDim.y;",
            "const int cs = p.cs;",
            "const int rank = cs > 1 ? (int)(blockIdx.x % (unsigned)cs) : 0;"]
    if partials:
        head += _partials_head(gen, partials)
        emit("const long long row = it_ * slots_ + slot_;")
    else:
        body.extend(head)
        emit("const long long row = (long long)(blockIdx.x / (unsigned)cs) * TY + ty;")
    emit("const bool live = row < p.rows;")
    emit("const long long N = p.n;")
    emit("const int W = p.vec ? KSPEC_V : 1;")
    emit("const long long nunits = p.vec ? N / KSPEC_V : N;     // no 64-bit division by a variable")
    emit("const long long u0 = live ? kspec_minll(nunits, (long long)rank * p.upr) : 0;")
    emit("const long long u1 = live ? kspec_minll(nunits, u0 + p.upr) : 0;")
    emit("const long long e0 = u0 * W;")
    emit("const bool tail = live && p.vec && rank == cs - 1;")
    emit("long long rr_ = live ? row : 0;")
    for j in reversed(range(k)):
        # the outermost index is what is left (row < rows): no division for plain [rows, n] tensors
        emit(f"const long long i_{j} = rr_ % p.dim[{j}]; rr_ /= p.dim[{j}];" if j else "const long long i_0 = rr_;")
    emit("(void)e0; (void)tail; (void)N;")

    row_base: dict = {}

    def base(buf, labels) -> str:
        key = (buf, labels)
        if key not in row_base:
            expr, _ = gen.row_base(buf, labels)
            v = f"rb{len(row_base)}"
            row_base[key] = v
            emit(f"const long long {v} = {expr};")
        return row_base[key]

    # cached inputs: one region per buffer, TY rows of p.cap elements each
    cache_ptr: dict[str, str] = {}
    if gen.cached:
        emit("unsigned char* cbase_ = kspec_smem;")
        for buf in sorted(gen.cached, key=gen.cached.get):
            ct = _CTYPE[gen.s.buffers[buf].dtype]
            c = f"c{gen.cached[buf]}"
            cache_ptr[buf] = c
            emit(f"{ct}* {c} = reinterpret_cast<{ct}*>(cbase_) + (long long)ty * p.cap;")
            emit(f"cbase_ += (size_t)TY * p.cap * sizeof({ct});")

    # ---- values ----
    row_var: dict = {}        # row-level node -> C variable

    def scalar_of(u, labels) -> str:
        """A row-level value (or a param/const) as a C expression."""
        x = gen.leaf(u, row_var)
        if x is not None:
            return x
        buf = gen.s.value_buffer[u]
        b = gen.s.buffers[buf]
        if b.dtype not in _FLOAT:
            gen.fail(f"an integer tensor ({b.dtype}) is read as a value in a row kernel", plan.group.anchor)
        rb = base(buf, tuple(labels))
        v = f"rl{len(row_var)}"
        emit(f"const float {v} = live ? kspec_f(((const {_CTYPE[b.dtype]}*)p.ptr[{{{gen.arg(buf)}}}])[{rb}]) : 0.0f;")
        row_var[u] = v
        return v

    def row_node(n) -> None:
        o = op(g, n)
        v = f"r{len(row_var)}"
        if o.kind == "gather":
            expr = gather_expr(n)
        elif o.kind in ("reduction", "contraction"):
            return
        else:
            args = [scalar_of(u, l) for u, l in operands(g, n)]
            expr = _apply(gen, n, args)
        emit(f"const float {v} = {_round(o.dtype, expr)};")
        row_var[n] = v

    def gather_expr(n) -> str:
        o = op(g, n)
        ins = operands(g, n)
        src, src_labels = ins[0]
        buf = gen.s.value_buffer[src]
        b = gen.s.buffers[buf]
        strides = gen.strides(buf)
        terms, conds = [], []
        for axis, x in enumerate(o.subscripts):
            sd = f"p.dim[{gen.stride_dim(buf, axis)}]" if strides[axis] != 1 else "1LL"
            if x.startswith("#"):
                terms.append(f"{int(x[1:])}LL * {sd}")
            elif x.startswith("@"):
                iu, il = ins[int(x[1:])]
                ib = gen.s.value_buffer[iu]
                it = gen.s.buffers[ib]
                if it.dtype not in ("i8", "i32"):
                    gen.fail("a gather index must be an integer tensor", n)
                iv = f"ix{len(row_var)}_{axis}"
                emit(f"const long long {iv} = live ? (long long)((const {_CTYPE[it.dtype]}*)"
                     f"p.ptr[{{{gen.arg(ib)}}}])[{base(ib, tuple(il))}] : 0LL;")
                ext = gen.dim(("extent", buf, axis), b.shape[axis])
                conds.append(f"{iv} >= 0 && {iv} < p.dim[{ext}]")
                terms.append(f"{iv} * {sd}")
            else:
                terms.append(f"i_{info.outer.index(x)} * {sd}")
        off = " + ".join(terms) or "0LL"
        load = f"kspec_f(((const {_CTYPE[b.dtype]}*)p.ptr[{{{gen.arg(buf)}}}])[{off}])"
        cond = " && ".join(["live"] + conds)
        return f"(({cond}) ? {load} : NAN)"

    def emit_row_stage(sv: int) -> None:
        for n in gen.nodes:
            if not elem[n] and stage[n] == sv and n not in row_var and op(g, n).kind not in ("const",):
                row_node(n)

    # ---- passes ----
    sm_vars: dict = {}            # softmax -> (max var, sum var)
    for n, (pm, ps) in sm_passes.items():
        i = len(sm_vars)
        sm_vars[n] = (f"smx{i}", f"ssm{i}")
    emit_row_stage(0)
    for p in range(n_passes):
        need, loads = plan_pass[p]
        accs = []                 # (var, fn, node, element operand expression fn)
        for n, pr in red_pass.items():
            if pr == p:
                accs.append((f"a{len(accs)}_{p}", op(g, n).fn, n, "red"))
        for n, (pm, ps) in sm_passes.items():
            if pm == p:
                accs.append((f"a{len(accs)}_{p}", "max", n, "smax"))
            if ps == p:
                accs.append((f"a{len(accs)}_{p}", "sum", n, "ssum"))
        for var, fn, _, _ in accs:
            emit(f"float {var} = {_IDENTITY[fn]};")
        # the element code of this pass, for a step of W elements at element e
        lam: list[str] = []
        lv: dict = {}
        for buf, labels in loads:
            bt = gen.s.buffers[buf]
            ct = _CTYPE[bt.dtype]
            rb = base(buf, labels)
            x = f"x{len(lv)}"
            gptr = f"((const {ct}*)p.ptr[{{{gen.arg(buf)}}}] + {rb} + e)"
            lam.append(f"  {ct} raw_{x}[WW];")
            if buf in gen.cached and gen.first_read[buf] != p:
                c = cache_ptr[buf]
                lam.append(f"  if (p.cache) kspec_ld_shared<WW>({c} + (e - e0), raw_{x}); "
                           f"else kspec_ld_global<WW>({gptr}, raw_{x});")
            else:
                lam.append(f"  kspec_ld_global<WW>({gptr}, raw_{x});")
                if buf in gen.cached:
                    lam.append(f"  if (p.cache) kspec_st<WW>({cache_ptr[buf]} + (e - e0), raw_{x});")
            lam.append(f"  float {x}[WW];")
            lam.append(f"  for (int i = 0; i < WW; ++i) {x}[i] = kspec_f(raw_{x}[i]);")
            lv[(buf, labels)] = x

        def el(u, labels) -> str:
            """An operand at element i of the step."""
            if op(g, u).kind == "const":
                return _const(op(g, u))
            if u in group:
                if elem[u]:
                    return f"{ev[u]}[i]"
                return row_var[u]
            uo = op(g, u)
            if uo.kind in ("param", "const") or r not in labels:
                return scalar_of(u, labels)
            return f"{lv[(gen.s.value_buffer[u], tuple(labels))]}[i]"

        ev: dict = {}
        for n in need:
            o = op(g, n)
            v = f"v{len(ev)}"
            if o.kind == "softmax":
                (u, l), = operands(g, n)
                mx, sm = sm_vars[n]
                expr = f"({sm} > 0.0f ? expf({el(u, l)} - {mx}) / {sm} : 0.0f)"
            elif o.kind == "gather":
                gen.fail("a gather of whole rows cannot run in a row kernel", n)
            else:
                expr = _apply(gen, n, [el(u, l) for u, l in operands(g, n)])
            lam.append(f"  float {v}[WW];")
            lam.append(f"  for (int i = 0; i < WW; ++i) {v}[i] = {_round(o.dtype, expr)};")
            ev[n] = v
        for var, fn, n, how in accs:
            x = " * ".join(el(u, l) for u, l in operands(g, n))     # a row dot product multiplies two
            if how == "ssum":
                x = f"expf({x} - {sm_vars[n][0]})"
            lam.append(f"  for (int i = 0; i < WW; ++i) {var} = {_COMBINE[fn].format(a=var, b=x)};")
        if p == final_pass:
            for n in elem_stores:
                for t in gen.s.stores(n):
                    labels = gen.s.ir.store_labels(n, t)
                    bt = gen.s.buffers[t]
                    ct = _CTYPE[bt.dtype]
                    rb = base(t, tuple(labels))
                    w = f"w{len(lam)}"
                    lam.append(f"  {ct} {w}[WW];")
                    lam.append(f"  for (int i = 0; i < WW; ++i) {w}[i] = kspec_to<{ct}>({ev[n]}[i]);")
                    lam.append(f"  kspec_st<WW>(({ct}*)p.ptr[{{{gen.arg(t)}}}] + {rb} + e, {w});")
            for j, n in enumerate(partials):
                x = " * ".join(el(u, l) for u, l in operands(g, n))
                lam.append(f"  for (int i = 0; i < WW; ++i) ca{j}_[e + i - cofs_] += {x};")
        # the same step code three times: 8-element steps, the row's tail, and the element path
        emit(f"// pass {p}")
        emit("if (p.vec) {")
        emit("  #pragma unroll 4")      # several 128-bit loads in flight per thread
        emit("  for (long long u = u0 + tx; u < u1; u += TX) {")
        emit("    constexpr int WW = KSPEC_V; const long long e = u * KSPEC_V;")
        body.extend("    " + x for x in lam)
        emit("  }")
        emit("  if (tail) for (long long e = nunits * KSPEC_V + tx; e < N; e += TX) {")
        emit("    constexpr int WW = 1;")
        body.extend("    " + x for x in lam)
        emit("  }")
        emit("} else {")
        emit("  for (long long e = u0 + tx; e < u1; e += TX) {")
        emit("    constexpr int WW = 1;")
        body.extend("    " + x for x in lam)
        emit("  }")
        emit("}")
        if accs:
            _emit_reduce(emit, [(var, fn) for var, fn, _, _ in accs], p)
        for var, fn, n, how in accs:
            if how == "red":
                o = op(g, n)
                val = var
                if fn == "mean":
                    val = f"{var} / (float)N"
                v = f"r{len(row_var)}"
                emit(f"const float {v} = {_round(o.dtype, val)};")
                row_var[n] = v
            elif how == "smax" and op(g, n).kind == "reduction":
                # logsumexp: an infinite max shifts by 0 (all -inf: the sum is 0 and the result -inf)
                emit(f"const float {sm_vars[n][0]} = (fabsf({var}) == INFINITY) ? 0.0f : {var};")
            elif how == "smax":
                emit(f"const float {sm_vars[n][0]} = ({var} == -INFINITY) ? 0.0f : {var};")
            else:
                emit(f"const float {sm_vars[n][1]} = {var};")
                if op(g, n).kind == "reduction":
                    mx, sm = sm_vars[n]
                    v = f"r{len(row_var)}"
                    lse = f"({sm} == 0.0f) ? -INFINITY : {mx} + logf({sm})"
                    emit(f"const float {v} = {_round(op(g, n).dtype, lse)};")
                    row_var[n] = v
        emit_row_stage(p + 1)
    for n in row_stores:
        for t in gen.s.stores(n):
            labels = gen.s.ir.store_labels(n, t)
            bt = gen.s.buffers[t]
            ct = _CTYPE[bt.dtype]
            if bt.dtype not in _FLOAT:
                gen.fail(f"a row kernel stores floating-point values, not {bt.dtype}", n)
            rb = base(t, tuple(labels))
            emit(f"if (live && tx == 0 && rank == 0) (({ct}*)p.ptr[{{{gen.arg(t)}}}])[{rb}] = "
                 f"kspec_to<{ct}>({row_var[n]});")
    emit("if (cs > 1) cg::this_cluster().sync();   // no CTA leaves while others read its shared memory")
    if partials:
        # slot s takes rows s, s + P, ..: the trip count is the same for every thread of the grid
        body[:] = head + ["for (long long it_ = 0; it_ < iters_; ++it_) {"] + ["  " + x for x in body] + ["}"] + \
            _partials_tail(gen, partials)

    names = gen.names
    text, args, scalars = number_placeholders("\n".join("  " + line for line in body), names, gen.scalars)
    # the host glue's alignment checks: every buffer read or written per element
    vec_checks = []
    for key in {**{(b, l): 1 for p in range(n_passes) for b, l in plan_pass[p][1]},
                **{(t, None): 1 for n in elem_stores for t in gen.s.stores(n)}}:
        buf = key[0]
        idx = args.index(names.to_c[buf])
        item = _ITEMSIZE[gen.s.buffers[buf].dtype]
        sd = tuple(d for (kind, *rest), d in gen.dim_key.items() if kind == "stride" and rest[0] == buf)
        vec_checks.append((idx, item, sd))
    vec_checks = sorted(set(vec_checks))
    cache_bytes = sum(_ITEMSIZE[gen.s.buffers[b].dtype] for b in gen.cached)
    slots = op(g, partials[0]).shape[0] if partials else 0
    if partials:
        cache_bytes += 4 * len(partials)        # an f32 accumulator per column per partial, on chip
    desc = RowwiseDesc(name=f"k_{plan.id.rsplit('_', 1)[-1]}", arch=arch, body=text, args=args, scalars=scalars,
                       dims=tuple(d for d, _ in gen.dims), n_outer=k, vec_checks=tuple(vec_checks),
                       cache_bytes=cache_bytes, n_passes=n_passes, n_slots=slot_count,
                       strides=tuple((gen.dims[i][0], names.to_c[key[1]], key[2])
                                     for key, i in gen.dim_key.items() if key[0] == "stride"),
                       arg_bytes=tuple(_ITEMSIZE[gen.s.buffers[names.back()[a]].dtype] for a in args),
                       slots=slots)
    return LoweredPlan(ir, arch, "rowwise", desc, names.back(), tuple(gen.dims), dict(gen.scalars))


def _partial_args(gen: _RowGen, partials: list) -> list[str]:
    """The pointer placeholder of each partial's [P, n] buffer (its one store)."""
    return [gen.arg(gen.s.stores(n)[0]) for n in partials]


def _partials_head(gen: _RowGen, partials: list) -> list[str]:
    """Before the row loop: this thread's row slot (slots_ of them: the host glue launches at most
    P, fewer when fewer are resident at once), the CTA's columns [ce0_, ce1_), and one accumulator
    row per partial, zeroed: TY rows of p.cap f32 per partial in shared memory after the cached
    inputs (p.cache), else the slot's row of the partials buffer itself."""
    cached = sum(_ITEMSIZE[gen.s.buffers[b].dtype] for b in gen.cached)
    out = ["const long long slot_ = (long long)(blockIdx.x / (unsigned)cs) * TY + ty;",
           "const long long slots_ = (long long)(gridDim.x / (unsigned)cs) * TY;",
           "const long long iters_ = (p.rows + slots_ - 1) / slots_;",
           "const long long Nc_ = p.n, Wc_ = p.vec ? KSPEC_V : 1, nu_ = p.vec ? Nc_ / KSPEC_V : Nc_;",
           "const long long ce0_ = kspec_minll(nu_, (long long)rank * p.upr) * Wc_;",
           "const long long ce1_ = rank == cs - 1 ? Nc_ : kspec_minll(nu_, (long long)rank * p.upr + p.upr) * Wc_;",
           "const long long cofs_ = p.cache ? ce0_ : -slot_ * Nc_;     // accumulator index of column e: e - cofs_",
           f"float* const cacc_ = reinterpret_cast<float*>(kspec_smem + (size_t)TY * p.cap * {cached});"]
    for j, t in enumerate(_partial_args(gen, partials)):
        out.append(f"float* const ca{j}_ = p.cache ? cacc_ + ((long long){j} * TY + ty) * p.cap "
                   f": (float*)p.ptr[{{{t}}}];")
    out.append("for (long long e = ce0_ + tx; e < ce1_; e += TX) {")
    out.extend(f"  ca{j}_[e - cofs_] = 0.0f;" for j in range(len(partials)))
    out.append("}")
    out.append("__syncthreads();")
    return out


def _partials_tail(gen: _RowGen, partials: list) -> list[str]:
    """After the row loop: shared-memory accumulators are copied to the slot's row of each partials
    buffer (a slot that got no row writes zeros), and the rows of the P no slot ran are zeroed (slot
    s zeroes s + slots_, s + 2 slots_, ..): the colsum kernel sums all P."""
    args = _partial_args(gen, partials)
    slots = op(gen.g, partials[0]).shape[0]
    out = ["__syncthreads();", "if (p.cache) for (long long e = ce0_ + tx; e < ce1_; e += TX) {"]
    out.extend(f"  ((float*)p.ptr[{{{t}}}])[slot_ * Nc_ + e] = ca{j}_[e - cofs_];" for j, t in enumerate(args))
    out.append("}")
    out.append(f"for (long long z = slot_ + slots_; z < {slots}LL; z += slots_)")
    out.append("  for (long long e = ce0_ + tx; e < ce1_; e += TX) {")
    out.extend(f"    ((float*)p.ptr[{{{t}}}])[z * Nc_ + e] = 0.0f;" for t in args)
    out.append("  }")
    return out


def _const(o) -> str:
    v = o.value
    if isinstance(v, float) and not math.isfinite(v):
        return "(-INFINITY)" if v < 0 else ("INFINITY" if v > 0 else "NAN")
    return f"{float(v)!r}f"


def _apply(gen: _RowGen, n, args: list[str]) -> str:
    o = op(gen.g, n)
    if o.kind == "size":            # a size symbol's runtime value (`dmu[m] / N`): a launch size
        return f"(float)p.dim[{gen.dim(('size', o.fn), o.fn)}]"
    if o.kind in ("broadcast", "cast") or o.fn == "copy":
        return args[0]
    if o.fn == "div":
        return f"({args[0]} / {args[1]})"
    if o.fn in ("relu", "maximum", "minimum", "clamp", "abs"):
        return {"relu": "fmaxf({0}, 0.0f)", "maximum": "fmaxf({0}, {1})", "minimum": "fminf({0}, {1})",
                "clamp": "fminf(fmaxf({0}, {1}), {2})", "abs": "fabsf({0})"}[o.fn].format(*args)
    if o.fn not in _FN:
        gen.fail(f"the row kernel has no implementation of '{o.fn}'", n)
    return _FN[o.fn].format(*args)


def _emit_reduce(emit, accs: list[tuple[str, str]], p: int) -> None:
    """Fold each accumulator over the row: warp butterfly, then the row's warps through shared
    memory, then (clusters) the cluster's CTAs through distributed shared memory."""
    emit("for (int off = 16; off > 0; off >>= 1) {")
    for i, (var, fn) in enumerate(accs):
        emit("  " + f"{var} = " + _COMBINE[fn].format(a=var, b=f"__shfl_xor_sync(0xffffffffu, {var}, off)") + ";")
    emit("}")
    emit("{")
    emit("  const int nw = TX >> 5, w0 = ty * nw, wid = w0 + (tx >> 5);")
    emit("  if ((tx & 31) == 0) {" + " ".join(f"kspec_red[wid][{i}] = {v};" for i, (v, _) in enumerate(accs)) + "}")
    emit("  __syncthreads();")
    for i, (var, fn) in enumerate(accs):
        emit(f"  {var} = kspec_red[w0][{i}];")
    emit("  for (int w = 1; w < nw; ++w) {")
    for i, (var, fn) in enumerate(accs):
        emit("    " + f"{var} = " + _COMBINE[fn].format(a=var, b=f"kspec_red[w0 + w][{i}]") + ";")
    emit("  }")
    emit("  __syncthreads();")
    emit("}")
    emit("if (cs > 1) {")
    emit("  cg::cluster_group cluster = cg::this_cluster();")
    emit("  if (tx == 0) {" + " ".join(f"kspec_part[{p}][{i}] = {v};" for i, (v, _) in enumerate(accs)) + "}")
    emit("  cluster.sync();")
    for var, fn in accs:
        emit(f"  {var} = {_IDENTITY[fn]};")
    emit("  for (int q = 0; q < cs; ++q) {")
    emit(f"    const float* rp = cluster.map_shared_rank(&kspec_part[{p}][0], q);")
    for i, (var, fn) in enumerate(accs):
        emit("    " + f"{var} = " + _COMBINE[fn].format(a=var, b=f"rp[{i}]") + ";")
    emit("  }")
    emit("}")
