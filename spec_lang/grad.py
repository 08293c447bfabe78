"""`kspec grad`: reverse-mode differentiation of a spec kernel into spec text.

    grad_program(program, kernel=None, wrt=None) -> spec text with NAME_fwd and NAME_bwd

Why here, in the front end: the result is an ordinary spec (printable, checkable, editable), made
from the checked, typed AST and printed with the spec printer; the graph, the fusion and the
backends then see it like a hand-written spec, so a backward kernel is planned, fused and compiled
by exactly the rules a forward one is.  Nothing here knows about graphs or backends (spec_lang
imports no later stage).

The transform:

1. Normalise (grad_normal.py): every reduction or softmax nested inside a statement is lifted into
   a temporary of its own (`lse[m] = log(sum(v) ..) + mx[m]` becomes `lse_r[m] = sum(v) ..` and
   `lse[m] = log(lse_r[m]) + mx[m]`), and so is the argument of a nonlinear function (its
   derivative reads it again, and every gradient through it shares one adjoint: GEMM + bias + gelu
   gets one d(pre-activation) for the bias sum and the backward GEMMs); a `softmax(j, causal=i)` is
   written with its mask explicit (`where(j <= i, s, -inf)`, what FlashAttention's causal flag is)
   and an operand of its own.
2. Activity: the floating-point tensors that depend on a differentiated input and reach an output.
3. Reverse pass, statement by statement from the last: the adjoint of a statement's target (a sum
   of the contributions of its uses, over the target's own indices) is pushed into the statement's
   value (grad_rules.backprop); a read `X[I]` inside a statement over indices F contributes
   `sum(F \\ I) term` to dX, renamed to dX's indices.  Sum and broadcast are each other's adjoint
   this way; `mean` divides by the reduced extent; `logsumexp` multiplies by exp(x - lse);
   `max`/`min` send the gradient to the first arg-extremum (row-major over the reduced indices; a
   `U_arg` statement finds it: the smallest position whose value equals the stored extremum);
   `softmax` gives dx = p (dp - sum_j dp p), and when p's one use is `O = sum(j) p * V` with O an
   output, sum_j dp p is computed as sum_e dO * O (FlashAttention's dO·O preprocess); a log-sum-exp
   written out with its max shift (`log(sum(v) exp(x - M)) + M`) sends no gradient through the
   shift M (it would cancel to rounding, through an arg-max pass); a read at computed subscripts
   (a gather, `logits[m, label[m]]`, `K[b, h / 4, j, e]`) is adjoint to a scatter-add, written as
   a sum over the statement's indices of `where(subscript == v, .., 0)` into dX[.., v, ..]
   (cross-entropy's gather becomes `where(v == label[m], ..)`: softmax minus one-hot), the indices
   no subscript mentions summed first (a GQA read: dK per query head is a batched GEMM, then each
   K/V head sums its query heads); integer values, conditions and index arithmetic get no
   gradient, and a float value converted to an integer on the way to an output is refused (not
   differentiable).  An adjoint gets a statement of its own (`dT[..] = ..`) when it holds a
   reduction, feeds a backward GEMM or a softmax's row sum, or is shared by several reads; else it
   is inlined where it is used (a row statistic's adjoint is computed per element of the row).
4. Saved versus recomputed (what the backward reads from NAME_fwd and what it computes again):
   - row statistics (a reduction that is not a GEMM-like contraction: mean, variance, max, sum of
     exp, logsumexp) are saved: NAME_fwd writes them as extra outputs;
   - a softmax's probabilities are recomputed as exp(x - lse) from a saved log-sum-exp (its
     statement's operand and NAME_fwd's extra `P_lse` output; an existing `logsumexp` of the same
     scores is reused): attention saves O and LSE and recomputes P, as FlashAttention does;
   - everything else the backward needs (contractions, the elementwise chains of an epilogue) is
     recomputed: a GEMM's pre-activation is recomputed by a GEMM whose epilogue then applies the
     activation's derivative.
5. dtypes: adjoints are f32; the adjoint of a contraction with f16/bf16 operands is stored in that
   dtype (it is the operand of the backward GEMMs), and an f32 factor of a backward contraction
   whose other factor is 16-bit is converted to it (P in dV = Pᵀ dO), as FlashAttention and the
   training frameworks round them; each dX is stored in X's dtype (casts differentiate in f32).

Scalar params get no gradient.  Packed (varlen) tensors are differentiated like dense ones: the
size symbol of a packed axis is printed back as itself (each sequence's own length), a saved
log-sum-exp over packed queries is stored packed like them (batch and sequence first), and a
backward sum over a packed axis is masked to the present positions unless a packed input read over
it is a factor (_mask_absent).  A read at a rotation of a whole axis (`(e + c) % n`, e over all n
values: RoPE's rotate-half) is a bijection: its adjoint reads the gradient at the inverse rotation
instead of a scatter-add (_invert_rotations).
"""
from __future__ import annotations


from kspec.core import FLOAT_DTYPES, split_offset_dim

# float dtypes a gradient cannot be stored in (d<X> is stored in X's dtype): such inputs are left
# out of the default --wrt set, like integer inputs, and naming one is an error
NO_GRADIENT_STORAGE = {"f8e8m0": "an E8M0 scale is an unsigned power-of-two exponent"}

from . import ast
from .check import (CheckedKernel, CheckedProgram, TAccess, TBinary, TCall, TExpr, TGather,
                    TReduce, TSoftmax, TensorInfo, texpr_children)
from .errors import KspecError, KspecInternalError
from .grad_normal import NStmt, Normaliser
from .grad_rules import (SIXTEEN_BIT, access, backprop, cast, decompile, div, f32, modular_shift, mul, num,
                         plain_indices, rename, sub, substitute, tensors_read, total, where)
from .printer import print_program


def grad_program(program: CheckedProgram, kernel: str | None = None, wrt: list[str] | None = None) -> str:
    """Spec text holding NAME_fwd and NAME_bwd for `kernel` (every kernel when None)."""
    kernels = [program.kernel(kernel)] if kernel else list(program.kernels)
    out_kernels, schedules = [], []
    for k in kernels:
        fwd, bwd, header = _Grad(k, wrt).run()
        out_kernels += [fwd, bwd]
        for arch, hint in k.schedules:
            schedules.append((k.name + "_fwd", arch, hint))
    prog = ast.Program(tuple(out_kernels), tuple(_schedule(*s) for s in schedules),
                       (ast.Target(program.targets),) if program.targets else ())
    text = print_program(prog)
    head = f"# generated by `kspec grad` from {program.file}: an ordinary spec (check, edit, compile it)\n" + header
    text = head + "\n" + text
    from .check import check
    from .parser import parse
    try:
        check(parse(text, "<kspec grad>"))
    except KspecError as e:
        raise KspecInternalError(f"kspec grad produced a spec that does not check:\n{e.render()}\n{text}") from e
    return text


def _schedule(name, arch, hint) -> ast.Schedule:
    settings = []
    for key, value in (("tile", hint.tile), ("cluster", hint.cluster), ("stages", hint.stages),
                       ("backend", hint.backend)):
        if value is None:
            continue
        text = "x".join(map(str, value)) if isinstance(value, tuple) else str(value)
        settings.append(ast.Setting(key, value, text))
    return ast.Schedule(name, arch, tuple(settings))


def is_contraction(v: TExpr) -> bool:
    """`sum(k) A[.., m, k] * B[.., k, n]`: a GEMM-like product (each side has an index the other
    lacks), as opposed to a row dot product `sum(n) x[m, n] * y[m, n]`."""
    if not (isinstance(v, TReduce) and v.op == "sum" and isinstance(v.operand, TBinary) and v.operand.op == "*"):
        return False
    a, b = set(v.operand.lhs.free), set(v.operand.rhs.free)
    return bool(a - b) and bool(b - a) and bool(a & b & set(v.indices))


def _names_in(e: TExpr) -> set[str]:
    """Every tensor an expression reads (gather subscripts included)."""
    out: set[str] = set()
    if isinstance(e, (TAccess, TGather)):
        out.add(e.tensor)
    for c in texpr_children(e):
        out |= _names_in(c)
    return out


def _ast_names(e) -> set[str]:
    out: set[str] = set()
    if isinstance(e, (ast.Access, ast.Gather)):
        out.add(e.tensor)
    if isinstance(e, ast.Gather):
        for s in e.subscripts:
            if not isinstance(s, (ast.IndexVar, ast.Num)):
                out |= _ast_names(s)
    for c in ((e.operand,) if isinstance(e, (ast.Unary, ast.Cast, ast.Reduce)) else
              (e.lhs, e.rhs) if isinstance(e, ast.Binary) else e.args if isinstance(e, ast.Call) else ()):
        out |= _ast_names(c)
    return out


def _dim(d) -> ast.Dim:
    if isinstance(d, int):
        return ast.Dim(d)
    off = split_offset_dim(d)
    if off is not None:
        return ast.Dim(off[0], plus=off[1])
    if isinstance(d, tuple):
        raise KspecError(f"kspec grad cannot declare a tensor of extent {'*'.join(map(str, d))} (a paged axis)")
    return ast.Dim(d)


def _extent_expr(d) -> ast.Expr:
    if isinstance(d, int):
        return num(d)
    if isinstance(d, tuple):
        out = None
        for x in d:
            out = _extent_expr(x) if out is None else ast.Binary("*", out, _extent_expr(x))
        return out
    off = split_offset_dim(d)
    if off is not None:
        return ast.Binary("+", ast.Name(off[0]), num(off[1]))
    return ast.Name(d)


class _Grad:
    def __init__(self, k: CheckedKernel, wrt: list[str] | None):
        self.k = k
        self.infos: dict[str, TensorInfo] = {t.name: t for t in k.tensors}
        self.used: set[str] = set(self.infos) | set(k.symbols)
        for st in k.stmts:
            self.used.update(ix for ix, _ in st.extents)
        self._explicit = tuple(wrt or ())
        self.wrt = self._wrt(wrt)
        self.bwd: list[ast.Stmt] = []
        self.fwd_extra: list[NStmt] = []
        self.adj_terms: dict[str, list] = {}
        self.adj_expr: dict[str, ast.Expr] = {}
        self.canon: dict[str, tuple[str, ...]] = {}
        self.generated: set[str] = set()
        self.dnames: dict[str, str] = {}

    # ---- names ----
    def fresh(self, base: str) -> str:
        name, n = base, 1
        while name in self.used:
            n += 1
            name = f"{base}_{n}"
        self.used.add(name)
        return name

    def dname(self, t: str) -> str:
        """The gradient of t is named d<t>; a spec that already uses that name is refused."""
        if t in self.dnames:
            return self.dnames[t]
        name = "d" + t
        if name in self.infos:
            raise KspecError(f"kspec grad names the gradient of '{t}' '{name}', which kernel {self.k.name} "
                             "already uses", self.infos[name].span, f"rename '{name}'")
        self.used.add(name)
        self.dnames[t] = name
        return name

    def _wrt(self, wrt):
        k = self.k
        floats = [t.name for t in k.inputs if t.dtype in FLOAT_DTYPES and t.dtype not in NO_GRADIENT_STORAGE]
        if wrt is None:
            if not floats:
                raise KspecError(f"kernel {k.name} has no floating-point input to differentiate", k.span,
                                 "integer inputs get no gradient")
            return floats
        for name in wrt:
            t = self.infos.get(name)
            if t is None or t.role not in ("in", "param"):
                raise KspecError(f"--wrt names '{name}', which is not an input of kernel {k.name}", k.span,
                                 f"floating-point inputs: {', '.join(floats) or 'none'}")
            if t.role == "param":
                raise KspecError(f"--wrt names param '{name}': scalar params get no gradient", t.span,
                                 f"floating-point inputs: {', '.join(floats) or 'none'}")
            if t.dtype not in FLOAT_DTYPES:
                raise KspecError(f"--wrt names '{name}', an {t.dtype} input: integer inputs get no gradient", t.span,
                                 f"floating-point inputs: {', '.join(floats) or 'none'}")
            if t.dtype in NO_GRADIENT_STORAGE:
                raise KspecError(f"--wrt names '{name}', an {t.dtype} input: {NO_GRADIENT_STORAGE[t.dtype]}, so its "
                                 "gradient cannot be stored in its dtype", t.span,
                                 f"floating-point inputs kspec grad differentiates: {', '.join(floats) or 'none'}")
        return list(dict.fromkeys(wrt))

    # ---- 1. normalise (grad_normal.py) ----
    def normalise(self) -> list[NStmt]:
        return Normaliser(self.k, self.infos, self.fresh).run()

    # ---- 2. activity ----
    def activity(self, stmts: list[NStmt]) -> set[str]:
        active = set(self.wrt)
        for st in stmts:
            reads = tensors_read(st.value)
            if reads & active:
                if st.dtype not in FLOAT_DTYPES:
                    raise KspecError(f"not differentiable: '{st.target}' is {st.dtype}, computed from values that "
                                     "depend on a differentiated input", st.span,
                                     "an integer value has no gradient; keep it in floating point or take the "
                                     "input out of --wrt")
                active.add(st.target)
        useful = {t.name for t in self.k.outputs}
        for st in reversed(stmts):
            if st.target in useful:
                useful |= tensors_read(st.value)
        return (active & useful) - self._shifts(stmts)

    def _shifts(self, stmts: list[NStmt]) -> set[str]:
        """Maxima that only shift a log-sum-exp written out by hand, `M = max(v) x`, `Z = x - M`,
        `S = sum(v) exp(Z)`, `L = log(S) + M`: L does not depend on M, so M gets no gradient (its
        derivative terms would cancel to rounding, through an arg-max pass)."""
        uses: dict[str, list[NStmt]] = {}
        for st in stmts:
            for t in tensors_read(st.value):
                uses.setdefault(t, []).append(st)

        def only(name):
            u = uses.get(name, [])
            return u[0] if len(u) == 1 and self.infos[name].role == "temp" else None

        out = set()
        for st in stmts:
            v = st.value
            if not (isinstance(v, TReduce) and v.op in ("max", "min")) or self.infos[st.target].role != "temp":
                continue
            users = uses.get(st.target, [])
            if len(users) != 2:
                continue
            z = next((u for u in users if isinstance(u.value, TBinary) and u.value.op == "-" and
                      isinstance(u.value.rhs, TAccess) and u.value.rhs.tensor == st.target), None)
            ssum = only(z.target) if z else None
            if ssum is None or not (isinstance(ssum.value, TReduce) and ssum.value.op == "sum" and
                                    set(ssum.value.indices) == set(v.indices) and isinstance(ssum.value.operand, TCall)
                                    and ssum.value.operand.fn == "exp" and
                                    isinstance(ssum.value.operand.args[0], TAccess) and
                                    ssum.value.operand.args[0].tensor == z.target):
                continue
            lse = only(ssum.target)
            other = next((u for u in users if u is not z), None)
            if lse is None or lse is not other or not (isinstance(lse.value, TBinary) and lse.value.op == "+"):
                continue
            sides = (lse.value.lhs, lse.value.rhs)
            has_log = any(isinstance(x, TCall) and x.fn == "log" and isinstance(x.args[0], TAccess) and
                          x.args[0].tensor == ssum.target for x in sides)
            has_m = any(isinstance(x, TAccess) and x.tensor == st.target for x in sides)
            if has_log and has_m:
                out.add(st.target)
        return out

    # ---- 3. reverse pass ----
    def run(self):
        k = self.k
        stmts = self.normalise()
        self.stmts = stmts
        self.defn = {s.target: s for s in stmts}
        active = self.activity(stmts)
        self.active = active
        for name in self._explicit:
            if name not in active:
                raise KspecError(f"input '{name}' does not reach any output of kernel {k.name}: its gradient "
                                 "is zero", self.infos[name].span, "leave it out of --wrt")
        outs = [t for t in k.outputs if t.name in active]
        if not outs:
            raise KspecError(f"no output of kernel {k.name} depends on {', '.join(self.wrt)}", k.name_span if
                             hasattr(k, "name_span") else k.span)
        for t in outs:
            st = self.defn[t.name]
            d = access(self.dname(t.name), st.indices)
            self.adj_terms.setdefault(t.name, []).append(d if t.dtype == "f32" else cast("f32", d))
        for st in reversed(stmts):
            terms = self.adj_terms.pop(st.target, None)
            if st.target not in active or not terms:
                continue
            adj = self.materialise(st, terms)
            self.adj_expr[st.target] = adj
            self.differentiate(st, adj)
        grads = []
        for name in self.wrt:
            terms = self.adj_terms.get(name)
            if not terms:           # not on any path to an output (or only through conditions)
                continue
            self.bwd.append(ast.Stmt(self.dname(name), self.canon[name], None, total(terms)))
            grads.append(name)
        return self.emit(grads)

    def materialise(self, st: NStmt, terms: list):
        tot = total(terms)
        if len(terms) == 1 and (isinstance(tot, ast.Access) or
                                (isinstance(tot, ast.Cast) and isinstance(tot.operand, ast.Access))):
            return tot
        if plain_indices(tot) >= set(st.indices) and self._worth_a_name(st, tot):
            name = self.dname(st.target) if st.target not in self.infos or self.infos[st.target].role != "out" \
                else self.fresh("d" + st.target + "_t")
            dtype = None
            v = st.value
            if is_contraction(v) and v.operand.lhs.dtype == v.operand.rhs.dtype and v.operand.lhs.dtype in SIXTEEN_BIT:
                dtype = v.operand.lhs.dtype
            self.infos[name] = TensorInfo(name, "temp", dtype or "f32", (), "row")
            self.generated.add(name)
            self.bwd.append(ast.Stmt(name, st.indices, dtype, tot))
            return access(name, st.indices)
        return rename(tot, {f: f for f in st.extents}, self.fresh)

    def _worth_a_name(self, st: NStmt, tot) -> bool:
        """Whether the adjoint of st's target is written as a statement of its own (else it is inlined
        where it is used): when it holds a reduction, feeds a backward GEMM or a softmax's row sum,
        or is shared by several reads; a row statistic's adjoint (`dlse_r[m] = dloss[m] / lse_r[m]`)
        is inlined into the row-wide terms that broadcast it."""
        if _has_reduce(tot):
            return True
        v = st.value
        if is_contraction(v) or isinstance(v, TSoftmax):
            return True
        if isinstance(v, TReduce):
            return False
        reads = set()

        def visit(e):
            if isinstance(e, (TAccess, TGather)) and e.tensor in self.active:
                reads.add((e.tensor, e.indices if isinstance(e, TAccess) else e))
            kids = e.args[1:] if isinstance(e, TCall) and e.fn == "where" else texpr_children(e)
            for c in kids:
                if not isinstance(e, TGather):
                    visit(c)
        visit(v)
        return len(reads) >= 2

    def differentiate(self, st: NStmt, adj) -> None:
        v, out, J = st.value, {}, st.indices
        if isinstance(v, TReduce):
            e = v.operand
            if is_contraction(v) and isinstance(e.lhs, (TAccess, TGather)) and isinstance(e.rhs, (TAccess, TGather)):
                for x, partner in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
                    if x.tensor in self.active:
                        a, p = self._gemm_pair(adj, partner)
                        key = ("acc", x.tensor, x.indices) if isinstance(x, TAccess) else ("gather", x.tensor, x)
                        out.setdefault(key, []).append(mul(a, p))
            elif v.op == "sum":
                backprop(e, adj, self.active, out, st.span)
            elif v.op == "mean":
                backprop(e, div(adj, self._count(v.indices, st.extents)), self.active, out, st.span)
            elif v.op == "logsumexp":
                seed = mul(adj, ast.Call("exp", (sub(f32(e), access(st.target, J)),)))
                backprop(e, seed, self.active, out, st.span)
            else:                                           # max, min: the first arg-extremum
                lin = None
                for ix in v.indices:
                    lin = ast.Name(ix) if lin is None else \
                        ast.Binary("+", ast.Binary("*", lin, _extent_expr(st.extents[ix])), ast.Name(ix))
                u = access(st.target, J)
                x = decompile(e) if e.dtype == st.dtype else cast(st.dtype, decompile(e))
                arg = self.fresh(st.target + "_arg")
                self.generated.add(arg)
                self.bwd.append(ast.Stmt(arg, J, None, ast.Reduce(
                    "min", v.indices, ast.Call("where", (ast.Binary("==", x, u), lin,
                                                         self._count(v.indices, st.extents))))))
                backprop(e, where(ast.Binary("==", lin, access(arg, J)), adj, None), self.active, out, st.span)
        elif isinstance(v, TSoftmax):
            rest = tuple(i for i in J if i != v.axis)
            dsum = self._attention_dsum(st, rest)
            if dsum is None:
                dsum = self.fresh(st.target + "_dsum")
                self.bwd.append(ast.Stmt(dsum, rest, None,
                                         ast.Reduce("sum", (v.axis,), mul(adj, access(st.target, J)))))
            self.generated.add(dsum)
            backprop(v.operand, mul(access(st.target, J), sub(adj, access(dsum, rest))), self.active, out, st.span)
        else:
            backprop(v, adj, self.active, out, st.span)
        for key, terms in out.items():
            self.contribute(key, total(terms), st)

    def _gemm_pair(self, adj, partner):
        """The two factors of a backward contraction term: 16-bit operands where the forward's were."""
        raw = self._sixteen(adj)
        if partner.dtype in SIXTEEN_BIT:
            if raw is not None and raw[1] == partner.dtype:
                return raw[0], decompile(partner)
            return cast(partner.dtype, adj), decompile(partner)
        if raw is not None and partner.dtype == "f32":
            return raw[0], cast(raw[1], decompile(partner))
        return adj, f32(partner)

    def _sixteen(self, e):
        """(a 16-bit expression, its dtype) that e is, or is an f32 conversion of; else None."""
        if isinstance(e, ast.Cast) and e.dtype == "f32":
            e = e.operand
        if isinstance(e, ast.Access) and e.tensor in self.infos and self.infos[e.tensor].dtype in SIXTEEN_BIT:
            return e, self.infos[e.tensor].dtype
        if isinstance(e, ast.Access) and e.tensor.startswith("d") and e.tensor[1:] in self.infos:
            src = self.infos[e.tensor[1:]]
            if self.dnames.get(src.name) == e.tensor and src.role == "out" and src.dtype in SIXTEEN_BIT:
                return e, src.dtype
        return None

    def _attention_dsum(self, st: NStmt, rest):
        """sum_j dp p as sum_e dO * O when p's one use is O = sum(j) p * V with O an output."""
        p = st.target
        uses = [s for s in self.stmts if p in tensors_read(s.value)]
        if len(uses) != 1 or not is_contraction(uses[0].value):
            return None
        o = uses[0]
        prod = o.value.operand
        side = prod.lhs if isinstance(prod.lhs, TAccess) and prod.lhs.tensor == p else \
            prod.rhs if isinstance(prod.rhs, TAccess) and prod.rhs.tensor == p else None
        if side is None or self.infos[o.target].role != "out" or o.target not in self.adj_expr:
            return None
        pos = st.indices.index(st.value.axis)
        if o.value.indices != (side.indices[pos],):
            return None
        src = tuple(ix for a, ix in enumerate(side.indices) if a != pos)
        dout = self.adj_expr[o.target]
        term = mul(dout if not self._sixteen(dout) else cast("f32", self._sixteen(dout)[0]),
                   cast("f32", access(o.target, o.indices)))
        name = self.fresh(p + "_dsum")
        body = self._transport(term, tuple(o.indices), src, rest, o.extents, reserved=set(rest))
        self.bwd.append(ast.Stmt(name, rest, None, body))
        return name

    def _count(self, indices, extents) -> ast.Expr:
        out = None
        for ix in indices:
            e = _extent_expr(extents[ix])
            out = e if out is None else ast.Binary("*", out, e)
        return out

    def _transport(self, t, F, src, canon, extents, reserved):
        """`sum(F \\ src) t`, with src renamed to canon and the summed indices kept clear of `reserved`."""
        present = plain_indices(t)
        from .grad_rules import free_indices
        used = free_indices(t)
        extras = [f for f in F if f not in src]
        summed = [f for f in extras if f in present]
        valued = [f for f in extras if f in used and f not in present]
        if valued:
            raise KspecError(f"kspec grad cannot sum over index '{valued[0]}': it is used only as a value in the "
                             "gradient term", None)
        missing = [f for f in extras if f not in used]
        if missing:
            t = mul(t, self._count(missing, extents))
        mapping = dict(zip(src, canon))
        taken = set(reserved) | set(canon)
        for f in summed:
            mapping[f] = f if f not in taken else self.fresh(f)
            taken.add(mapping[f])
        t = self._mask_absent(t, summed, extents)
        t = rename(t, mapping, self.fresh)
        return ast.Reduce("sum", tuple(mapping[f] for f in summed), t) if summed else t

    def _mask_absent(self, t, summed, extents):
        """t, summed over `summed`, made 0 past each sequence's length for every summed index that runs
        over a packed (varlen) sequence axis, `where(t < T, .., 0.0)` (T inside an expression is the
        sequence's own length; spec_lang/check.py), unless a factor of t already is: a packed input
        read over it (absent rows of an input are 0: attention's dK = sum(i) dS * Q needs no mask)."""
        packed = [x for x in self.k.tensors if x.packed is not None]
        seqs = {x.shape[1] for x in packed}
        # the backward's packed inputs: the forward's, its packed outputs and their gradients dOUT
        ins = {x.name for x in packed if x.role in ("in", "out")} | \
              {self.dname(x.name) for x in packed if x.role == "out" and x.name in self.dnames}
        for f in summed:
            sym = extents.get(f)
            if sym in seqs and not _packed_factor(t, f, ins):
                t = where(ast.Binary("<", ast.Name(f), ast.Name(sym)), t, None)
        return t

    def canon_of(self, x: str, pattern) -> tuple[str, ...]:
        if x not in self.canon:
            if x in self.defn:
                self.canon[x] = self.defn[x].indices
            else:
                first = self._first_plain_read(x)
                names = []
                for a, (ix, dim) in enumerate(zip(first or pattern, self.infos[x].shape)):
                    if not isinstance(ix, str) or ix in names:
                        base = dim.lower() if isinstance(dim, str) and dim.isidentifier() else f"i{a}"
                        ix, n = base, 1
                        while ix in names or ix in self.infos or ix in self.k.symbols or ix in self.dnames.values():
                            n += 1
                            ix = f"{base}_{n}"
                    names.append(ix)
                self.canon[x] = tuple(names)
        return self.canon[x]

    def _first_plain_read(self, x: str):
        def find(e):
            if isinstance(e, TAccess) and e.tensor == x:
                return e.indices
            for c in texpr_children(e):
                r = find(c)
                if r is not None:
                    return r
            return None
        for st in self.stmts:
            r = find(st.value)
            if r is not None:
                return r
        return None

    def contribute(self, key, t, st: NStmt) -> None:
        kind, x = key[0], key[1]
        F = tuple(st.extents)
        if kind == "acc":
            canon = self.canon_of(x, key[2])
            term = self._transport(t, F, key[2], canon, st.extents, reserved=set(canon))
        else:
            g: TGather = key[2]
            if self.infos[x].role != "in":
                raise KspecError(f"kspec grad cannot differentiate a read of intermediate '{x}' at computed "
                                 "subscripts", g.span or st.span, "read an input there, or compute it in place")
            canon = self.canon_of(x, tuple(s if isinstance(s, str) else None for s in g.subscripts))
            # a rotation of an axis (`(e + 64) % 128` over e's 128 values) is a bijection: its adjoint
            # reads the gradient at the inverse rotation (v + n - c) % n, with no scatter
            t, F, rotated = self._invert_rotations(g, t, F, st.extents, x)
            hold = {f"__v{a}": canon[a] for a in rotated}
            src, dst, conds = [], [], []
            for a, s in enumerate(g.subscripts):
                if a in rotated:
                    continue
                if isinstance(s, str) and s not in src:
                    src.append(s)
                    dst.append(canon[a])
                else:
                    conds.append((a, s))
            # sum first over the indices no subscript mentions (a GQA read K[b, h / 4, j, e]: dK per query
            # head, sum(i) ds * Q, is a batched GEMM), then scatter over the rest (sum(h) where(h / 4 == kh, ..))
            inner = set()
            for _, sx in conds:
                if isinstance(sx, TExpr):
                    inner |= set(sx.free)
            keep = []
            for a, sx in enumerate(g.subscripts):    # in the order of x's axes: dK_part[b, h, j, e]
                if a in rotated:
                    continue
                for f in _subscript_indices(sx):
                    if f in F and f not in keep:
                        keep.append(f)
            others = [f for f in F if f not in keep]
            if others and plain_indices(t) >= set(keep):
                part = self.fresh("d" + x + "_part")
                self.generated.add(part)
                self.infos[part] = TensorInfo(part, "temp", "f32", (), "row")
                self.bwd.append(ast.Stmt(part, tuple(keep), None,
                                         ast.Reduce("sum", tuple(others), self._mask_absent(t, others, st.extents))))
                t = access(part, keep)
                F = tuple(keep)
            # `subscript == v` with v dX's own index: a placeholder for v until the statement's
            # indices are renamed (so no renaming reaches it), then v
            cond = None
            for a, s in conds:
                lhs = num(s) if isinstance(s, int) else ast.Name(s) if isinstance(s, str) else decompile(s)
                hold[f"__v{a}"] = canon[a]
                c = ast.Binary("==", lhs, ast.Name(f"__v{a}"))
                cond = c if cond is None else ast.Binary("and", cond, c)
            # rename the summed indices away from the canonical names first, then transport
            clash = {f: self.fresh(f) for f in F if f not in src and f in canon}
            t = rename(t, clash, self.fresh)
            cond = rename(cond, clash, self.fresh)
            F = tuple(clash.get(f, f) for f in F)
            ext = {clash.get(f, f): v for f, v in st.extents.items()}
            term = self._transport(t if cond is None else where(cond, t, None), F, tuple(src), tuple(dst), ext,
                                   reserved=set(canon))
            term = rename(term, hold, self.fresh)
        self.adj_terms.setdefault(x, []).append(term)

    def _invert_rotations(self, g: TGather, t, F, extents, x):
        """For each subscript of gather g that rotates an axis (grad_rules.modular_shift) by an index f
        no other subscript uses: t with f replaced by the inverse rotation of a placeholder for dX's
        own index at that axis (`__v<axis>`, renamed once the term is in dX's indices), and f dropped
        from the indices to sum.  Returns (t, F, the rotated axes)."""
        shape = self.infos[x].shape
        uses: dict[str, int] = {}
        for sx in g.subscripts:
            for f in _subscript_indices(sx):
                uses[f] = uses.get(f, 0) + 1
        rotated = []
        for a, sx in enumerate(g.subscripts):
            rot = modular_shift(sx, extents, shape[a]) if isinstance(sx, TExpr) else None
            if rot is None or uses[rot[0]] != 1 or rot[0] not in F:
                continue
            f, c, n = rot
            v = ast.Name(f"__v{a}")
            inverse = v if c == 0 else ast.Binary("%", ast.Binary("+", v, num(n - c)), num(n))
            t = substitute(t, f, inverse)
            F = tuple(i for i in F if i != f)
            rotated.append(a)
        return t, F, rotated

    # ---- 4. saved and recomputed; 5. the two kernels ----
    def emit(self, grads: list[str]):
        k = self.k
        needed = set()
        for s in self.bwd:
            needed |= _ast_names(s.value)
        saved: list[str] = []
        recompute: set[str] = set()
        lse_of: dict[str, tuple[str, tuple[str, ...]]] = {}     # softmax -> its log-sum-exp, indices
        work = [n for n in needed if n in self.defn]
        while work:
            name = work.pop()
            if name in recompute or name in saved:
                continue
            st = self.defn[name]
            if self.infos[name].role == "out":
                continue
            v = st.value
            if isinstance(v, TReduce) and not is_contraction(v):
                saved.append(name)
                continue
            recompute.add(name)
            if isinstance(v, TSoftmax):
                lse_of[name] = self._lse(st)
                lse = lse_of[name][0]
                if self.infos[lse].role != "out":
                    saved.append(lse)
                work.extend(n for n in _names_in(v.operand) if n in self.defn)
                continue
            work.extend(n for n in _names_in(v) if n in self.defn)
        saved = [s.target for s in self.stmts + self.fwd_extra if s.target in saved]

        def decl(role, name, info: TensorInfo):
            shape = None if role == "param" else tuple(_dim(d) for d in info.shape)
            default = None
            if role == "param" and info.default is not None:
                v = info.default
                default = ast.Num(v, str(v) if isinstance(v, int) else repr(float(v)))
            return ast.Decl(role, name, info.dtype, shape, None if info.layout == "row" else info.layout, default,
                            packed=info.packed)

        params = [decl("param", p.name, p) for p in k.params]
        ins = [decl("in", t.name, t) for t in k.inputs]
        outs = [decl("out", t.name, t) for t in k.outputs]
        saved_decls = [decl("out", n, self.infos[n]) for n in saved]
        fwd_stmts = []
        for s in self.stmts + self.fwd_extra:
            role = self.infos[s.target].role
            ann = None if role == "out" or s.target in saved else s.dtype
            fwd_stmts.append(ast.Stmt(s.target, s.indices, ann, decompile(s.value)))
        fwd = ast.Kernel(k.name + "_fwd", tuple(params + ins + outs + saved_decls), tuple(fwd_stmts))

        douts = [decl("in", self.dname(t.name), t) for t in k.outputs if t.name in self.dnames]
        grad_decls = [decl("out", self.dname(n), self.infos[n]) for n in grads]
        bwd_ins = [ast.Decl("in", d.name, d.dtype, d.shape, d.layout, None, packed=d.packed)
                   for d in outs + saved_decls]
        rec = []
        for s in self.stmts:
            if s.target not in recompute:
                continue
            if s.target in lse_of:
                v = s.value
                lse = access(*lse_of[s.target])
                safe = ast.Call("where", (ast.Binary("==", lse, num(float("-inf"))), num(0.0), lse))
                rec.append(ast.Stmt(s.target, s.indices, s.dtype,
                                    ast.Call("exp", (sub(f32(v.operand), safe),))))
            else:
                rec.append(ast.Stmt(s.target, s.indices, s.dtype, decompile(s.value)))
        bwd = ast.Kernel(k.name + "_bwd", tuple(params + ins + bwd_ins + douts + grad_decls), tuple(rec + self.bwd))
        header = (f"# {k.name}_fwd: the forward" + (f", saving {', '.join(saved)}" if saved else "") + "\n"
                  f"# {k.name}_bwd: gradients {', '.join(self.dname(n) for n in grads)} from "
                  f"{', '.join(d.name for d in douts)}" + (f"; recomputes {', '.join(sorted(recompute))}"
                                                           if recompute else "") + "\n")
        return fwd, bwd, header

    def _lse(self, st: NStmt) -> tuple[str, tuple[str, ...]]:
        """A logsumexp of softmax st's operand, an existing statement's or a new one: its name and the
        order of its indices.  Over packed queries it is stored packed like them, batch and sequence
        first (`p_lse : f32[B, S, H] packed(cu_q)`, what FlashAttention-4's varlen LSE is a view of)."""
        v = st.value
        want = TReduce("f32", tuple(i for i in v.operand.free if i != v.axis), None, "logsumexp", (v.axis,),
                       v.operand)
        kept = tuple(i for i in st.indices if i != v.axis)
        for s in self.stmts + self.fwd_extra:
            if isinstance(s.value, TReduce) and s.value == want and sorted(s.indices) == sorted(kept):
                return s.target, s.indices
        name = self.fresh(st.target + "_lse")
        idx, cu = _packed_first(kept, st.extents, self.k)
        self.infos[name] = TensorInfo(name, "temp", "f32", tuple(st.extents[i] for i in idx), "row", None, st.span,
                                      cu)
        self.fwd_extra.append(NStmt(name, idx, "f32", want, {i: st.extents[i] for i in st.indices}, st.span))
        return name, idx


def _packed_first(idx: tuple[str, ...], extents: dict, k: CheckedKernel) -> tuple[tuple[str, ...], str | None]:
    """idx, and None; or, when one index runs over a sequence axis of a packed tensor of k (and one
    over its batch axis), idx with those two first and the offsets they are packed by."""
    for t in k.tensors:
        if t.packed is None:
            continue
        batch, seq = t.shape[0], t.shape[1]
        b = next((i for i in idx if extents[i] == batch), None)
        s = next((i for i in idx if extents[i] == seq), None)
        if b is not None and s is not None:
            return (b, s) + tuple(i for i in idx if i not in (b, s)), t.packed
    return idx, None


def _packed_factor(t, f: str, packed_inputs: set[str]) -> bool:
    """A factor of the product t is a read of one of packed_inputs with f as its sequence index."""
    if isinstance(t, ast.Binary) and t.op == "*":
        return _packed_factor(t.lhs, f, packed_inputs) or _packed_factor(t.rhs, f, packed_inputs)
    if isinstance(t, ast.Cast):
        return _packed_factor(t.operand, f, packed_inputs)
    return isinstance(t, ast.Access) and t.tensor in packed_inputs and t.indices[1:2] == (f,)


def _subscript_indices(sx) -> tuple[str, ...]:
    """The indices a typed subscript uses: itself if an index label, an expression's free ones."""
    return (sx,) if isinstance(sx, str) else sx.free if isinstance(sx, TExpr) else ()


def _has_reduce(e) -> bool:
    if isinstance(e, ast.Reduce):
        return True
    return any(_has_reduce(c) for c in ((e.operand,) if isinstance(e, (ast.Unary, ast.Cast)) else
                                        (e.lhs, e.rhs) if isinstance(e, ast.Binary) else
                                        e.args if isinstance(e, ast.Call) else ()))
