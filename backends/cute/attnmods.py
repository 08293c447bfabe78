"""An attention kernel IR's score modification and mask (compiler/kir.py `AttentionStructure.score_mod`
/ `.mask`) -> what FlashAttention-4 takes: its native causal/sliding-window masking where the mask is
one (block skipping), else generated `score_mod` / `mask_mod` functions.

    analyse(a, roles) -> Mods
    analyse_bwd(a, roles) -> Mods        an attention backward's: score_mod and its derivative, score_mod_bwd

**Native masks.**  A mask that is an `and` of at most one upper and one lower bound on `j - i`, each
linear in the sequence lengths S and T (`j <= i + (T - S)`, `j <= i`, `j > i - 128`, ...), is
FA4's local window: FA4 keeps key j of query i when
    i + (T - S) - window_left  <=  j  <=  i + (T - S) + window_right
(bottom-right aligned).  So `j - i <= k_up` gives window_right = k_up - (T - S) and `j - i >= k_lo`
gives window_left = (T - S) - k_lo.  Both are linear forms over (S, T, 1) that the host glue evaluates
at launch; the bottom-right causal mask (k_up = T - S, no lower bound) is FA4's `causal`.
The IR's own `causal` flag is top-left (j <= i), i.e. k_up = 0.

**Generated mods.**  Anything else becomes Python source (one module per kernel, written to the build
directory) over `dslops` (`F.add`, `F.le`, `F.gather`, ...), FA4's contract:
    kspec_score_mod(score, b_idx, h_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=[, aux_scalars=])
    kspec_mask_mod(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors[, aux_scalars])
with every value a length-1 register vector (`__vec_size__ = 1`).  The score is already scaled.  No
user text reaches the source: aux tensors and scalars are positional, constants are printed with
repr().  A test runs the same source with numpy (`run_numpy`).  The FA4 cache hashes a callable by
its source; the functions also carry `__cute_hash__` (the source digest), so two mods that differ
only in a constant never share a kernel.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from kspec.compiler.kir import AuxLoad, Const, Index, Load, Op, Score, ScoreGrad, Size
from kspec.core import INT_DTYPES, KspecInternalError

_COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
_BOOL = _COMPARE | {"and", "or", "not"}
_INT_OPS = {"add", "sub", "mul", "floordiv", "mod", "neg", "maximum", "minimum", "abs"}
_FLOAT_FNS = {"add", "sub", "mul", "div", "neg", "maximum", "minimum", "relu", "gelu", "gelu_tanh", "silu",
              "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "clamp"}
_RENAME = {"and": "land", "or": "lor", "not": "lnot"}

Linear = tuple[tuple[str, int], ...]          # ((var, coefficient), ...) over "S", "T", "1", "param:<name>"
PARAM = "param:"                               # a window term: an integer scalar param's runtime value


@dataclass(frozen=True)
class Window:
    """FA4's window bounds as linear forms over the sizes S, T (None: unbounded on that side)."""
    left: Linear | None
    right: Linear | None


@dataclass(frozen=True)
class Mods:
    causal: bool                                   # FA4 causal (bottom-right), no mask_mod
    window: Window | None                          # FA4 local window, no mask_mod
    score_mod: str | None                          # generated source (function kspec_score_mod)
    mask_mod: str | None                           # generated source (function kspec_mask_mod)
    aux: tuple[str, ...] = ()                      # aux tensors (IR buffer names), aux_tensors order
    scalars: tuple[tuple[str, str], ...] = ()      # aux_scalars: ("param", name) | ("size", symbol)
    notes: tuple[str, ...] = field(default=(), compare=False)
    score_mod_bwd: str | None = None               # an attention backward's: generated source (kspec_score_mod_bwd)

    @property
    def source(self) -> str:
        return "".join(s for s in (self.score_mod, self.mask_mod, self.score_mod_bwd) if s)


# ---------------------------------------------------------------------------------------------
# native masks
# ---------------------------------------------------------------------------------------------

def _linear(e, labels: dict[str, str], sizes: dict[str, str]) -> dict[str, int] | None:
    """e as {var: coefficient} over i, j, S, T, 1 and integer scalar params ("param:<name>"), or None
    when it is not such a linear form."""
    if isinstance(e, Load):
        return {PARAM + e.name: 1} if e.kind == "scalar" and e.dtype in INT_DTYPES else None
    if isinstance(e, Const):
        if not math.isfinite(e.value) or e.value != int(e.value):
            return None
        return {"1": int(e.value)}
    if isinstance(e, Index):
        var = labels.get(e.label)
        return {var: 1} if var in ("i", "j") else None
    if isinstance(e, Size):
        var = sizes.get(e.name)
        return {var: 1} if var else None
    if isinstance(e, Op):
        if e.fn == "neg":
            a = _linear(e.args[0], labels, sizes)
            return None if a is None else {k: -v for k, v in a.items()}
        if e.fn in ("add", "sub"):
            a, b = (_linear(x, labels, sizes) for x in e.args)
            if a is None or b is None:
                return None
            sign = 1 if e.fn == "add" else -1
            out = dict(a)
            for k, v in b.items():
                out[k] = out.get(k, 0) + sign * v
            return {k: v for k, v in out.items() if v}
        if e.fn == "mul":
            a, b = (_linear(x, labels, sizes) for x in e.args)
            if a is None or b is None:
                return None
            for x, y in ((a, b), (b, a)):
                if set(x) <= {"1"}:
                    c = x.get("1", 0)
                    return {k: c * v for k, v in y.items() if c * v}
    return None


def _bound(e, labels, sizes) -> tuple[str, dict[str, int]] | None:
    """A comparison as ("upper", k) for j - i <= k or ("lower", k) for j - i >= k (k over S, T, 1)."""
    if not (isinstance(e, Op) and e.fn in ("lt", "le", "gt", "ge")):
        return None
    a, b = (_linear(x, labels, sizes) for x in e.args)
    if a is None or b is None:
        return None
    f = dict(a)
    for k, v in b.items():
        f[k] = f.get(k, 0) - v
    # normalise to g <= 0 over integers
    if e.fn == "le":
        g = f
    elif e.fn == "lt":
        g = {**f, "1": f.get("1", 0) + 1}
    elif e.fn == "ge":
        g = {k: -v for k, v in f.items()}
    else:  # gt: f >= 1
        g = {k: -v for k, v in f.items()}
        g["1"] = g.get("1", 0) + 1
    cj, ci = g.get("j", 0), g.get("i", 0)
    if cj not in (1, -1) or ci != -cj:
        return None
    rest = {k: v for k, v in g.items() if k not in ("i", "j") and v}
    if cj == 1:         # j - i + rest <= 0
        return "upper", {k: -v for k, v in rest.items()}
    return "lower", rest  # -(j - i) + rest <= 0


def _conjuncts(e):
    if isinstance(e, Op) and e.fn == "and":
        for a in e.args:
            yield from _conjuncts(a)
    else:
        yield e


def _as_linear(d: dict[str, int]) -> Linear:
    return tuple(sorted((k, v) for k, v in d.items() if v))


def native_window(mask, top_left_causal: bool, labels, sizes, same_length: bool = False
                  ) -> tuple[bool, Window | None] | None:
    """(causal, window) when the mask (and the IR's top-left causal flag) is FA4-native, else None.
    same_length: S and T are one size symbol (self-attention), so T - S is 0."""
    bounds: dict[str, dict[str, int]] = {}
    if top_left_causal:
        bounds["upper"] = {}
    for c in (_conjuncts(mask) if mask is not None else ()):
        b = _bound(c, labels, sizes)
        if b is None or b[0] in bounds:
            return None
        bounds[b[0]] = b[1]
    if not bounds:
        return False, None
    t_minus_s = {"T": 1, "S": -1}

    def minus(x, y):
        out = dict(x)
        for k, v in y.items():
            out[k] = out.get(k, 0) - v
        return {k: v for k, v in out.items() if v}

    right = minus(bounds["upper"], t_minus_s) if "upper" in bounds else None
    left = minus(t_minus_s, bounds["lower"]) if "lower" in bounds else None
    if same_length:
        def fold(d):
            if d is None:
                return None
            out = {k: v for k, v in d.items() if k not in ("S", "T")}
            st = d.get("S", 0) + d.get("T", 0)
            return {**out, "S": st} if st else out
        left, right = fold(left), fold(right)
    if left is None and right is not None and not right:
        return True, None                        # j <= i + (T - S): FA4's bottom-right causal
    return False, Window(None if left is None else _as_linear(left), None if right is None else _as_linear(right))


# ---------------------------------------------------------------------------------------------
# generated mods
# ---------------------------------------------------------------------------------------------

class _Gen:
    def __init__(self, labels: dict[str, str], sizes: dict[str, str], aux: dict[str, int], scalars: list):
        self.labels, self.sizes, self.aux, self.scalars = labels, sizes, aux, scalars
        self.lines: list[str] = []
        self.memo: dict = {}

    def scalar(self, key: tuple[str, str]) -> str:
        if key not in self.scalars:
            self.scalars.append(key)
        return f"aux_scalars[{self.scalars.index(key)}]"

    def emit(self, e, want: str | None = None) -> tuple[str, str]:
        """(reference, type) with type in f32 | i32 | bool | int (a Python int constant) | float."""
        if isinstance(e, Const):
            v = e.value
            if not math.isfinite(v):
                return ("float('inf')" if v > 0 else "float('-inf')"), "float"
            if want in ("i32", "int") and v == int(v):
                return repr(int(v)), "int"
            return repr(float(v)), "float"
        if e in self.memo:
            return self.memo[e]
        if isinstance(e, Score):
            out = ("score", "f32")
        elif isinstance(e, ScoreGrad):
            out = ("grad", "f32")
        elif isinstance(e, Index):
            var = {"b": "b_idx", "h": "h_idx", "i": "q_idx", "j": "kv_idx"}.get(self.labels.get(e.label, ""))
            if var is None:
                raise KspecInternalError(f"attention mod reads index {e.label!r}, which is not b, h, i or j")
            out = (var, "i32")
        elif isinstance(e, Size):
            role = self.sizes.get(e.name)
            if role == "S":
                out = self._line("F.to_i32(seqlen_info.seqlen_q)", "i32")
            elif role == "T":
                out = self._line("F.to_i32(seqlen_info.seqlen_k)", "i32")
            else:
                out = self._line(f"F.to_i32({self.scalar(('size', e.name))})", "i32")
        elif isinstance(e, Load):
            if e.kind != "scalar":
                raise KspecInternalError(f"attention mod loads {e.kind} input {e.name}")
            out = (self.scalar(("param", e.name)), "float")
        elif isinstance(e, AuxLoad):
            idx = [self._int(x) for x in e.index]
            out = self._line(f"F.gather(aux_tensors[{self.aux[e.buffer]}], {', '.join(idx)})", "f32")
        elif isinstance(e, Op):
            out = self._op(e)
        else:
            raise KspecInternalError(f"unknown attention mod expression {e!r}")
        self.memo[e] = out
        return out

    def _line(self, call: str, ty: str) -> tuple[str, str]:
        ref = f"v{len(self.lines)}"
        self.lines.append(f"    {ref} = {call}")
        return ref, ty

    def _int(self, e) -> str:
        ref, ty = self.emit(e, "i32")
        if ty not in ("i32", "int"):
            raise KspecInternalError("an aux tensor subscript is not an integer expression")
        return ref

    def _float(self, e) -> str:
        ref, ty = self.emit(e, "f32")
        if ty == "i32":
            return self._line(f"F.to_f32({ref})", "f32")[0]
        if ty == "int":
            return repr(float(ref))
        if ty == "bool":
            raise KspecInternalError("a boolean used as a number in an attention mod")
        return ref

    def _op(self, e: Op) -> tuple[str, str]:
        fn = e.fn
        if fn == "where":
            c, _ = self.emit(e.args[0])
            a, ta = self.emit(e.args[1])
            b, tb = self.emit(e.args[2])
            if {ta, tb} <= {"i32", "int"}:
                return self._line(f"F.where({c}, {a}, {b})", "i32")
            if ta == "bool" and tb == "bool":
                return self._line(f"F.where({c}, {a}, {b})", "bool")
            return self._line(f"F.where({c}, {self._float(e.args[1])}, {self._float(e.args[2])})", "f32")
        if fn in ("and", "or"):
            a, b = (self.emit(x)[0] for x in e.args)
            return self._line(f"F.{_RENAME[fn]}({a}, {b})", "bool")
        if fn == "not":
            return self._line(f"F.lnot({self.emit(e.args[0])[0]})", "bool")
        types = [self.emit(x, "i32")[1] for x in e.args]
        integral = all(t in ("i32", "int") for t in types)
        if fn in _COMPARE:
            if integral:
                args = [self.emit(x, "i32")[0] for x in e.args]
            else:
                args = [self._float(x) for x in e.args]
            return self._line(f"F.{fn}({', '.join(args)})", "bool")
        if integral and fn in _INT_OPS:
            args = [self.emit(x, "i32")[0] for x in e.args]
            if fn == "neg":
                return self._line(f"F.mul({args[0]}, -1)", "i32")
            if fn == "abs":
                return self._line(f"F.maximum({args[0]}, F.mul({args[0]}, -1))", "i32")
            return self._line(f"F.{fn}({', '.join(args)})", "i32")
        if fn in ("floordiv", "mod"):
            raise KspecInternalError(f"{fn} of a non-integer in an attention mod")
        if fn.startswith("cast:"):
            return self._line(f"F.cast({self._float(e.args[0])}, {fn[5:]!r})", "f32")
        if fn not in _FLOAT_FNS:
            raise KspecInternalError(f"attention mod function {fn!r} has no CuTe DSL form")
        args = [self._float(x) for x in e.args]
        return self._line(f"F.{fn}({', '.join(args)})", "f32")


def unsupported(expr) -> str | None:
    """Why a mod expression cannot be generated (None when it can)."""
    def walk(e):
        yield e
        if isinstance(e, Op):
            for a in e.args:
                yield from walk(a)
        elif isinstance(e, AuxLoad):
            for a in e.index:
                yield from walk(a)
    for e in walk(expr):
        if isinstance(e, Op):
            fn = e.fn
            if not (fn in _FLOAT_FNS or fn in _BOOL or fn in ("where", "floordiv", "mod") or fn.startswith("cast:")):
                return f"function '{fn}' in a score modification or mask"
        elif isinstance(e, Load) and e.kind != "scalar":
            return f"{e.kind} load in a score modification"
        elif isinstance(e, Const) and math.isnan(e.value):
            return "a NaN constant in a score modification"
    return None


def _function(name: str, params: str, gen: _Gen, result: str) -> str:
    body = "\n".join(gen.lines + [f"    return {result}"])
    return f"def {name}({params}):\n{body}\n"


def _finish(name: str, src: str) -> str:
    digest = hashlib.sha256(src.encode()).hexdigest()
    return src + f"{name}.__vec_size__ = 1\n{name}.__cute_hash__ = {digest!r}\n"


def _names(a, roles: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(label -> b | h | i | j, size symbol -> "S" | "T") of an attention structure."""
    labels = {a.query: "i", a.key: "j"}
    if a.batch:
        labels[a.batch[-1]] = "h"
        if len(a.batch) > 1:
            labels[a.batch[0]] = "b"
    sizes: dict[str, str] = {}
    for role in ("T", "S"):            # S wins when S and T are one symbol (self-attention)
        if isinstance(roles.get(role), str):
            sizes[roles[role]] = role
    return labels, sizes


_SCORE_MOD_PARAMS = "score, b_idx, h_idx, q_idx=None, kv_idx=None, seqlen_info=None, aux_tensors=(), aux_scalars=()"


def analyse_bwd(a, roles: dict[str, str]) -> Mods:
    """The FA4 form of an attention backward's (kir.AttentionBwdStructure) score modification: the
    forward's kspec_score_mod and its derivative as kspec_score_mod_bwd, FA4's contract
        kspec_score_mod_bwd(grad, score, b_idx, h_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=[, aux_scalars=])
    returning grad * d score_mod / d score (a.score_mod_grad with ScoreGrad() = grad); the mask is
    FA4's causal flag.  The aux scalars are numbered across both functions."""
    labels, sizes = _names(a, roles)
    aux = {name: k for k, name in enumerate(a.aux)}
    scalars: list = []
    srcs = []
    for name, expr, params in (("kspec_score_mod", a.score_mod, _SCORE_MOD_PARAMS),
                               ("kspec_score_mod_bwd", a.score_mod_grad, "grad, " + _SCORE_MOD_PARAMS)):
        g = _Gen(labels, sizes, aux, scalars)
        srcs.append(_function(name, params, g, g._float(expr)))
    return Mods(bool(a.causal), None, _finish("kspec_score_mod", srcs[0]), None, tuple(a.aux), tuple(scalars),
                score_mod_bwd=_finish("kspec_score_mod_bwd", srcs[1]))


def analyse(a, roles: dict[str, str]) -> Mods:
    """The FA4 form of an AttentionStructure's causal flag, score_mod and mask.  roles: dims role
    ("S", "T") -> size symbol."""
    labels, sizes = _names(a, roles)
    aux = {name: k for k, name in enumerate(a.aux)}
    scalars: list = []
    same = isinstance(roles.get("S"), str) and roles.get("S") == roles.get("T")
    native = native_window(a.mask, a.causal, labels, sizes, same)
    causal, window, mask_src = False, None, None
    if native is not None:
        causal, window = native
    else:
        g = _Gen(labels, sizes, aux, scalars)
        conds = []
        if a.causal:
            conds.append(g._line("F.le(kv_idx, q_idx)", "bool")[0])
        if a.mask is not None:
            ref, ty = g.emit(a.mask)
            if ty != "bool":
                raise KspecInternalError("the attention mask is not a boolean expression")
            conds.append(ref)
        res = conds[0]
        for c in conds[1:]:
            res = g._line(f"F.land({res}, {c})", "bool")[0]
        mask_src = _function("kspec_mask_mod", "b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, "
                             "aux_scalars=()", g, res)
    score_src = None
    if a.score_mod is not None:
        g = _Gen(labels, sizes, aux, scalars)
        ref = g._float(a.score_mod)
        score_src = _function("kspec_score_mod", _SCORE_MOD_PARAMS, g, ref)
    # the scalars are numbered across both mods: finish after both are generated
    return Mods(causal, window, score_src and _finish("kspec_score_mod", score_src),
                mask_src and _finish("kspec_mask_mod", mask_src), tuple(a.aux), tuple(scalars))


def window_params(window: Window | None) -> tuple[str, ...]:
    """The integer scalar params a native window's bounds read, in first-use order."""
    out: list[str] = []
    for form in (() if window is None else (window.left or (), window.right or ())):
        out += [v[len(PARAM):] for v, _ in form if v.startswith(PARAM) and v[len(PARAM):] not in out]
    return tuple(out)


def rename_window_params(window: Window | None, rename) -> Window | None:
    """The window with each param term's name mapped by `rename` (spec name -> ABI name)."""
    if window is None:
        return None

    def form(f):
        return None if f is None else tuple((PARAM + rename(v[len(PARAM):]) if v.startswith(PARAM) else v, c)
                                            for v, c in f)
    return Window(form(window.left), form(window.right))


def _numpy_namespace(mods: Mods) -> dict:
    """The generated mods' functions, defined over numpy (dslops.numpy_ops)."""
    from .dslops import numpy_ops
    ns = {"F": numpy_ops()}
    if mods.source:
        exec(compile(mods.source, "<kspec_attention_mods>", "exec"), ns)   # noqa: S102  (generated by kspec)
    return ns


def run_numpy_bwd(mods: Mods, *, grad, score, b, h, i, j, S, T, aux=(), scalars=()):
    """Evaluate a backward's generated kspec_score_mod_bwd with numpy (tests): grad * d score_mod /
    d score over broadcast index arrays; the same source the kernel traces."""
    import types

    import numpy as np
    ns = _numpy_namespace(mods)
    info = types.SimpleNamespace(seqlen_q=S, seqlen_k=T)
    b, h, i, j = (np.asarray(x, np.int64) for x in (b, h, i, j))
    return ns["kspec_score_mod_bwd"](np.asarray(grad, np.float32), np.asarray(score, np.float32), b, h, q_idx=i,
                                     kv_idx=j, seqlen_info=info, aux_tensors=aux, aux_scalars=scalars)


def run_numpy(mods: Mods, *, score, b, h, i, j, S, T, aux=(), scalars=(), params=None):
    """Evaluate the generated mods with numpy (tests): (modified score, keep mask) over broadcast
    index arrays; the same source the kernel traces.  params: values of the window's params."""
    import types

    import numpy as np
    ns = _numpy_namespace(mods)
    info = types.SimpleNamespace(seqlen_q=S, seqlen_k=T)
    b, h, i, j = (np.asarray(x, np.int64) for x in (b, h, i, j))
    s = np.asarray(score, np.float32)
    if mods.score_mod:
        s = ns["kspec_score_mod"](s, b, h, q_idx=i, kv_idx=j, seqlen_info=info, aux_tensors=aux, aux_scalars=scalars)
    keep = np.ones(np.broadcast(b, h, i, j).shape, bool)
    if mods.mask_mod:
        keep = np.broadcast_to(ns["kspec_mask_mod"](b, h, i, j, info, aux, scalars), keep.shape)
    if mods.causal:
        keep = keep & (j <= i + (T - S))
    if mods.window is not None:
        def value(form):
            env = {"S": S, "T": T, "1": 1, **{PARAM + k: v for k, v in (params or {}).items()}}
            return sum(c * env[k] for k, c in form)
        if mods.window.right is not None:
            keep = keep & (j <= i + (T - S) + value(mods.window.right))
        if mods.window.left is not None:
            keep = keep & (j >= i + (T - S) - value(mods.window.left))
    return np.broadcast_to(s, keep.shape), keep
