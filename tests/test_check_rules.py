"""The checker owns the rules (issue 27, item 4): whatever planning, lowering, compiling or the
manifest writer would refuse about names, self-reference and structure, `kspec check` refuses
first, at a location; long chains plan in linear time; oversized input is refused unread."""
from __future__ import annotations

import time

import pytest
from test_artifact import _edit, _error, art  # noqa: F401  (the fixture)

from kspec.compile import emit_spec, plan_spec, write_emitted
from kspec.core import (EXCERPT_MAX, NAME_MAX, RESERVED_ARG_NAMES, RESERVED_KERNEL_NAMES, KspecError, file_stem,
                        name_problem)
from kspec.runtime.module import Module
from kspec.spec_lang import load_spec
from kspec.spec_lang.parser import MAX_SOURCE_BYTES

EW = "kernel {k} {{\n  in {a} : f32[M]\n  param {p} : f32 = 1.0\n  out D : f32[M]\n  {t}[m] = {a}[m] * {p}\n  D[m] = {t}[m] + 1.0\n}}\n"


def spec(k="k", a="A", p="alpha", t="t"):
    return EW.format(k=k, a=a, p=p, t=t)


def refused(text: str, match: str) -> KspecError:
    with pytest.raises(KspecError, match=match) as e:
        load_spec(text, is_text=True, file="x.kspec")
    assert e.value.span is not None and e.value.span.file == "x.kspec", e.value
    return e.value


def test_a_spec_of_good_names_is_accepted():
    prog = load_spec(spec(), is_text=True)
    assert [t.name for t in prog.kernels[0].tensors] == ["A", "alpha", "D", "t"]


@pytest.mark.parametrize("where", ["k", "a", "p", "t"])
@pytest.mark.parametrize("name, why", [
    ("lambda", "Python keyword"), ("class", "Python keyword"), ("None", "Python keyword"),
    ("__class__", "starts with '__'"), ("x" * (NAME_MAX + 1), f"at most {NAME_MAX}"),
])
def test_names_that_cannot_reach_python_are_refused_at_the_name(where, name, why):
    e = refused(spec(**{where: name}), why)
    line = {"k": 1, "a": 2, "p": 3, "t": 5}[where]
    assert e.span.line == line and e.span.end_col - e.span.col == len(name)
    assert len(str(e)) < 3 * EXCERPT_MAX + 300          # the name is abbreviated, the line cut


@pytest.mark.parametrize("name", sorted(RESERVED_ARG_NAMES))
@pytest.mark.parametrize("where", ["a", "p", "t"])
def test_the_runtime_keywords_are_not_tensor_or_param_names(name, where):
    refused(spec(**{where: name}), "reserved by the runtime")
    load_spec(spec(k=name), is_text=True)                 # a kernel may be called `stream`


@pytest.mark.parametrize("name", sorted(RESERVED_KERNEL_NAMES))
def test_module_attributes_are_not_kernel_names(name):
    refused(spec(k=name), "attribute of every loaded module")
    load_spec(spec(t=name), is_text=True)                 # ... but may name a tensor


def test_reserved_kernel_names_are_the_loaded_modules_attributes():
    """The table in kspec.core is what a Module really has (so a kernel never shadows one)."""
    public = {n for n in dir(Module) if not n.startswith("_")}
    m = Module.__new__(Module)
    m.__dict__.update(path=None, manifest=None, archs=(), kernels=())   # the attributes __init__ sets
    assert public | {"path", "manifest", "archs", "kernels"} == set(RESERVED_KERNEL_NAMES)


@pytest.mark.parametrize("what, field, name", [
    ("kernel", lambda o, v: o["kernels"][0].update(name=v), "__class__"),
    ("kernel", lambda o, v: o["kernels"][0].update(name=v), "glue"),
    ("tensor", lambda o, v: o["kernels"][0]["inputs"][0].update(name=v), "lambda"),
    ("tensor", lambda o, v: o["kernels"][0]["intermediates"][0].update(name=v), "device"),
    ("param", lambda o, v: o["kernels"][0]["params"][0].update(name=v), "self"),
])
def test_the_manifest_reader_applies_the_same_rule(art, what, field, name):  # noqa: F811
    assert name_problem(name, what) is not None
    _edit(art, lambda o: field(o, name))
    e = _error(art, f"{what} name \"{name}\"")
    assert name_problem(name, what) in str(e)


def test_an_output_read_by_its_own_statement_is_refused():
    text = "kernel k {\n  in A : f32[M]\n  out D : f32[M]\n  D[m] = D[m] + A[m]\n}\n"
    e = refused(text, "output 'D' is read by the statement that writes it")
    assert (e.span.line, e.span.col) == (4, 10)
    refused(text.replace("D[m] = D[m]", "t[m] = t[m]").replace("}\n", "  D[m] = t[m]\n}\n"),
            "'t' is read by the statement that defines it")
    # read after it is written: fine
    load_spec("kernel k {\n  in A : f32[M]\n  out D : f32[M]\n  out E : f32[M]\n  D[m] = A[m] + 1.0\n"
              "  E[m] = D[m] * 2.0\n}\n", is_text=True)


def chain(n: int) -> str:
    body = "".join(f"  t{i}[m] = t{i - 1}[m] + 1.0\n" for i in range(1, n))
    return f"kernel k {{\n  in A : f32[M]\n  out D : f32[M]\n  t0[m] = A[m] + 1.0\n{body}  D[m] = t{n - 1}[m]\n}}\n"


def _plans_in(n: int, seconds: float):
    t = time.perf_counter()
    prog = load_spec(chain(n), is_text=True)
    (sched,) = plan_spec(prog, ("sm90a",))
    took = time.perf_counter() - t
    assert [p.kind for p in sched.plans] == ["elementwise"], sched.plans       # one fused kernel
    assert took < seconds, f"{n} statements took {took:.1f} s"


def test_a_chain_of_2000_statements_plans_without_recursion():
    _plans_in(2000, 20)


@pytest.mark.slow
def test_a_chain_of_10000_statements_plans_in_seconds():
    _plans_in(10000, 40)


def test_an_error_excerpt_is_cut_around_the_caret():
    terms = " + ".join(["A[m]"] * 45)
    text = f"kernel k {{\n  in A : f32[M]\n  out D : f32[M]\n  D[m] = {terms} + B[m] + {terms}\n}}\n"
    e = refused(text, "unknown name 'B'")
    line, caret = str(e).splitlines()[1:3]
    assert len(line) <= EXCERPT_MAX + 12 and line.strip().startswith("...") and line.endswith("...")
    assert line[caret.index("^"):caret.index("^") + 4] == "B[m]" and caret.count("^") == 4


def test_oversized_input_is_refused_unread(tmp_path):
    big = tmp_path / "big.kspec"
    big.write_text("kernel k {\n  in A : f32[M]\n  out D : f32[M]\n  D[m] = " + " + ".join(["A[m]"] * 150_000) + "\n}\n")
    assert big.stat().st_size > 2 * MAX_SOURCE_BYTES
    t = time.perf_counter()
    with pytest.raises(KspecError, match=f"at most {MAX_SOURCE_BYTES:,} bytes"):
        load_spec(big)
    with pytest.raises(KspecError, match="at most"):
        load_spec(big.read_text(), is_text=True)
    assert time.perf_counter() - t < 2


@pytest.mark.parametrize("value", ["f32(m)", "w[m] + M", "f32(m) * w[m]"])
def test_an_index_or_size_as_a_value_is_planned_only_where_it_is_built(value, tmp_path):
    """`kspec graph` never plans what `kspec compile` rejects: either planning refuses it at the
    expression (no backend builds it), or every planned kernel's code is generated."""
    text = f"kernel k {{\n  in w : f32[M]\n  out y : f32[M]\n  y[m] = {value}\n}}\n"
    prog = load_spec(text, is_text=True, file="x.kspec")
    try:
        plan_spec(prog, ("sm90a",), strict=False)
    except KspecError as e:
        assert e.span is not None and e.span.line == 4, e
        assert "no backend can build" in str(e)
        return
    f = tmp_path / "x.kspec"
    f.write_text(text)
    emit_spec(f, ("sm90a",))


def test_long_plan_ids_become_short_file_names(tmp_path):
    name = "k" * NAME_MAX
    assert file_stem(f"{name}_0") != file_stem(f"{name}_1") and len(file_stem(f"{name}_0")) == 64
    assert file_stem("gemm_0") == "gemm_0"
    f = tmp_path / "long.kspec"
    f.write_text(spec(k=name))
    paths = write_emitted(emit_spec(f, ("sm90a",)), tmp_path / "out", "long")
    assert paths and all(len(p.name) < 80 and p.name.startswith(name[:55]) for p in paths)


def test_a_long_chain_after_a_gemm_plans_with_a_bounded_epilogue():
    from kspec.compiler.fusion import MAX_EPILOGUE_DEPTH
    n = 400
    body = "".join(f"  t{i}[m, n] = t{i - 1}[m, n] * 0.5 + 1.0\n" for i in range(1, n))
    text = (f"kernel k {{\n  in A : f16[M, K]\n  in B : f16[K, N]\n  out D : f16[M, N]\n"
            f"  t0[m, n] : f32 = sum(k) A[m, k] * B[k, n]\n{body}  D[m, n] = f16(t{n - 1}[m, n])\n}}\n")
    t = time.perf_counter()
    (sched,) = plan_spec(load_spec(text, is_text=True), ("sm90a",))
    assert time.perf_counter() - t < 20
    gemm = sched.plans[0]
    ops = [n for n in gemm.group.nodes if sched.graph.nodes[n]["op"].kind not in ("const", "contraction")]
    assert gemm.kind == "gemm" and MAX_EPILOGUE_DEPTH - 1 <= len(ops) <= MAX_EPILOGUE_DEPTH
    assert [p.kind for p in sched.plans[1:]] == ["elementwise"]
    assert any(f"already {MAX_EPILOGUE_DEPTH} ops deep" in note for note in sched.fusion.notes)
