"""Print an AST back to kspec source.  `parse(print_program(p)) == p` for every program."""
from __future__ import annotations

from . import ast

# binding strength, loosest first; `not` sits between `and` and the comparisons
BINARY_PREC = {"or": 1, "and": 2, "<": 4, "<=": 4, ">": 4, ">=": 4, "==": 4, "!=": 4,
               "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_NOT, _MUL, _UNARY = 3, 6, 7
_COMPARE = 4


def print_expr(e: ast.Expr) -> str:
    return _expr(e, 0, tail=True)


def _expr(e: ast.Expr, ctx: int, tail: bool) -> str:
    """ctx: binding strength of the surrounding operator position (0 top, see BINARY_PREC; 7 unary
    minus).  tail: whether nothing of multiplicative strength follows this text, which matters for
    prefix reductions, whose operand extends over the rest of the product."""
    if isinstance(e, ast.Num):
        text = e.text
        return f"({text})" if text.startswith("-") and ctx > 0 else text
    if isinstance(e, ast.Name):
        return e.name
    if isinstance(e, ast.Access):
        return f"{e.tensor}[{', '.join(e.indices)}]"
    if isinstance(e, ast.Gather):
        return f"{e.tensor}[{', '.join(print_subscript(x) for x in e.subscripts)}]"
    if isinstance(e, ast.Call):
        return f"{e.fn}({', '.join(_expr(a, 0, True) for a in e.args)})"
    if isinstance(e, ast.Cast):
        return f"{e.dtype}({_expr(e.operand, 0, True)})"
    if isinstance(e, ast.Unary) and e.op == "not":
        s = "not " + _expr(e.operand, _NOT, tail)
        return f"({s})" if ctx > _NOT else s
    if isinstance(e, ast.Unary):
        s = "-" + _expr(e.operand, _UNARY, tail)
        return f"({s})" if ctx > _UNARY else s
    if isinstance(e, ast.Reduce):
        args = list(e.indices) + [f"{o.name}={o.value}" for o in e.options]
        operand = _expr(e.operand, _MUL, True)
        if operand.startswith("-"):
            operand = f"({operand})"
        s = f"{e.op}({', '.join(args)}) {operand}"
        return f"({s})" if (not tail or ctx > _MUL) else s
    if isinstance(e, ast.Binary):
        p = BINARY_PREC[e.op]
        # a left operand is always followed by the operator; at multiplicative strength that matters.
        # Comparisons do not chain, so a comparison operand of a comparison is parenthesised.
        lhs = _expr(e.lhs, p + 1 if p == _COMPARE else p, tail=(p < _MUL))
        rhs = _expr(e.rhs, p + 1, tail=tail or ctx < _MUL or p < ctx)
        s = f"{lhs} {e.op} {rhs}"
        return f"({s})" if p < ctx else s
    raise TypeError(f"not an expression: {e!r}")


def print_subscript(x) -> str:
    if isinstance(x, ast.IndexVar):
        return x.name
    if isinstance(x, ast.Num):
        return x.text if not x.text.startswith("-") else f"({x.text})"
    if isinstance(x, ast.Name):
        return f"({x.name})"    # a bare name as a whole subscript reads back as an index
    return _expr(x, 0, True)


def _dim(d: ast.Dim) -> str:
    return f"{d.value} + {d.plus}" if d.plus else f"{d.value} / {d.div}" if d.div else str(d.value)


def print_decl(d: ast.Decl) -> str:
    s = f"{d.role} {d.name} : {d.dtype}"
    if d.shape is not None:
        s += "[" + ", ".join(_dim(x) for x in d.shape) + "]"
    if d.layout:
        s += f" {d.layout}"
    if d.packed:
        s += f" packed({d.packed})"
    if d.default is not None:
        s += f" = {d.default.text}"
    return s


def print_stmt(s: ast.Stmt) -> str:
    ann = f" : {s.dtype}" if s.dtype else ""
    return f"{s.target}[{', '.join(s.indices)}]{ann} = {print_expr(s.value)}"


def print_program(p: ast.Program) -> str:
    out: list[str] = []
    for t in p.targets:
        out.append("target " + ", ".join(t.archs))
        out.append("")
    for k in p.kernels:
        out.append(f"kernel {k.name} {{")
        out.extend("  " + print_decl(d) for d in k.decls)
        out.extend("  " + print_stmt(s) for s in k.stmts)
        out.append("}")
        out.append("")
    for sc in p.schedules:
        head = f"schedule {sc.kernel}" + (f" for {sc.arch}" if sc.arch else "")
        body = "  ".join(f"{st.key} = {st.text}" for st in sc.settings)
        out.append(f"{head} {{ {body} }}" if body else f"{head} {{ }}")
    return "\n".join(out).rstrip() + "\n"
