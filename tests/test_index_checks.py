"""Index tensors checked before launch: the compile step finds every integer input used as a
subscript (compiler/indices.py), records its valid range in the manifest (`index_ranges`), and the
runtime reads and range-checks it before launching (kspec/runtime/indexcheck.py).  CPU only: the
launches go to the recording fake driver (kspec.runtime.fakedriver); the test that compiles the
shipped cross-entropy spec is marked nvcc (its kernel is usually in the compile cache)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import kspec
from kspec.artifact import (KernelEntry, KspecArtifactError, Manifest, Plan, SpecRef, TensorSpec, make_binary,
                            read_manifest, write_manifest)
from kspec.compiler import plan_kernel
from kspec.compiler.indices import index_ranges, merge_index_ranges
from kspec.compiler.kir import AuxLoad, Const, Index, IRBuffer, Op
from kspec.core import IndexRange, KspecError
from kspec.runtime import DeviceBuffer, KspecRuntimeError
from kspec.runtime.fakedriver import FakeDriver
from kspec.spec_lang import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
LABEL = IndexRange("label", "logits", 1, "V", False, ("cross_entropy_0",))


def _irs(src_or_path) -> list:
    prog = load_spec(src_or_path) if isinstance(src_or_path, Path) else load_spec(src_or_path, is_text=True)
    return [p.ir for p in plan_kernel(prog.kernels[0]).plans]


# ---------------------------------------------------------------- the analysis (kernel IR -> ranges)

def test_cross_entropy_label_indexes_the_vocabulary():
    (ir,) = _irs(SPECS / "cross_entropy.kspec")
    assert index_ranges(ir) == (LABEL,)
    assert LABEL.describe() == "0 <= label < V (logits axis 1)"
    assert LABEL.bound({"V": 32000, "M": 4}) == 32000


def test_every_value_subscript_of_a_gather_is_found_and_literals_are_not():
    src = """kernel pick {
  in x : f32[A, B, C]
  in i : i32[M]
  in j : i8[M]
  out y : f32[M]
  y[m] = x[i[m], 2, j[m]]
}"""
    (ir,) = _irs(src)
    assert index_ranges(ir) == (IndexRange("i", "x", 0, "A", False, (ir.id,)),
                                IndexRange("j", "x", 2, "C", False, (ir.id,)))


def test_an_embedding_gather_in_an_elementwise_kernel():
    src = """kernel embed {
  in E : bf16[V, D]
  in tok : i32[T]
  out y : f32[T, D]
  y[t, d] = f32(E[tok[t], d])
}"""
    (ir,) = _irs(src)
    assert ir.kind != "rowwise"
    assert index_ranges(ir) == (IndexRange("tok", "E", 0, "V", False, (ir.id,)),)


def test_literal_extents_are_recorded_as_ints():
    src = """kernel head {
  in E : f32[16, D]
  in tok : i32[T]
  out y : f32[T, D]
  y[t, d] = E[tok[t], d]
}"""
    (ir,) = _irs(src)
    assert index_ranges(ir) == (IndexRange("tok", "E", 0, 16, False, (ir.id,)),)


def test_kernels_without_gathers_record_nothing():
    for stem in ("layernorm", "gemm_bias_relu", "attention"):
        assert all(index_ranges(ir) == () for ir in _irs(SPECS / f"{stem}.kspec")), stem


def test_a_block_table_inside_an_attention_mod_is_found():
    """`bias[b, table[b, i]]` in an attention mask (the paged-KV / varlen shape of an index): the
    table's values select along axis 1 of the indexed tensor; a table the kernel does not read
    from its inputs is not recorded."""
    (ir,) = _irs(SPECS / "attention.kspec")
    table = IRBuffer("table", "input", "i32", ("B", "NB"))
    pages = IRBuffer("pages", "input", "f32", ("B", "P"))
    inner = IRBuffer("inner", "intermediate", "i32", ("B", "NB"))
    mask = Op("and", (Op("gt", (AuxLoad("pages", (Index("b"), AuxLoad("table", (Index("b"), Index("i")), "i32")),
                                        "f32"), Const(0.0))),
                      Op("gt", (AuxLoad("pages", (AuxLoad("inner", (Index("b"), Index("j")), "i32"), Index("j")),
                                        "f32"), Const(0.0)))))
    att = replace(ir.attention, mask=mask, aux=("table", "pages", "inner"))
    ir = replace(ir, buffers=(*ir.buffers, table, pages, inner), attention=att)
    assert index_ranges(ir) == (IndexRange("table", "pages", 1, "P", False, (ir.id,)),)


def test_ranges_of_several_plans_merge():
    a = IndexRange("tok", "E", 0, "V", False, ("k_0",))
    b = IndexRange("tok", "E", 0, "V", False, ("k_2",))
    c = IndexRange("tok", "F", 0, "W", False, ("k_2",))
    assert merge_index_ranges([a, b, c, a]) == (IndexRange("tok", "E", 0, "V", False, ("k_0", "k_2")), c)


# ---------------------------------------------------------------- the manifest

def _entry(ranges, *, name="cross_entropy", binaries=None):
    plan = Plan(f"{name}_0", "elementwise", (("M", "M"), ("V", "V")), ("label", "logits", "loss"),
                binaries=binaries or {})
    return KernelEntry(name, inputs=(TensorSpec("logits", "bf16", ("M", "V")), TensorSpec("label", "i32", ("M",))),
                       outputs=(TensorSpec("loss", "f32", ("M",)),), plans=(plan,), index_ranges=ranges)


def _binaries(d: Path) -> dict:
    """Stand-in binaries: a call that gets past the checks fails loading the host glue."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "x.cubin").write_bytes(b"not a cubin")
    (d / "x.so").write_bytes(b"not a shared library")
    return {"sm90a": make_binary(d, "x.cubin", "x.so")}


def _artifact(tmp_path: Path, ranges=(LABEL,), extra=()) -> Path:
    d = tmp_path / "art"
    b = _binaries(d)
    extra = tuple(replace(k, plans=tuple(replace(p, binaries=b) for p in k.plans)) for k in extra)
    write_manifest(d, Manifest(SpecRef("ce.kspec", "0" * 64), ("sm90a",), (_entry(ranges, binaries=b), *extra)))
    return d


def test_manifest_round_trip_and_older_artifacts(tmp_path):
    d = _artifact(tmp_path)
    assert read_manifest(d).kernels[0].index_ranges == (LABEL,)
    obj = json.loads((d / "manifest.json").read_text())
    assert obj["kernels"][0]["index_ranges"] == [{"tensor": "label", "target": "logits", "axis": 1, "extent": "V",
                                                  "negative": False, "inclusive": False, "monotonic": False,
                                                  "plans": ["cross_entropy_0"]}]
    for flag in ("negative", "inclusive", "monotonic"):         # optional, false by default
        del obj["kernels"][0]["index_ranges"][0][flag]
    (d / "manifest.json").write_text(json.dumps(obj))
    assert read_manifest(d).kernels[0].index_ranges == (LABEL,)
    # a manifest written before kspec recorded them parses as "not recorded"; here, where the host
    # library records the ranges its plan was built with, dropping them is refused (test_manifest_tamper)
    del obj["kernels"][0]["index_ranges"]
    (d / "manifest.json").write_text(json.dumps(obj))
    assert read_manifest(d, verify=False).kernels[0].index_ranges is None
    with pytest.raises(KspecArtifactError, match="index_ranges"):
        read_manifest(d)
    assert read_manifest(_artifact(tmp_path / "none", ranges=())).kernels[0].index_ranges == ()


@pytest.mark.parametrize("field, value, msg", [
    ("tensor", "logits", "'logits' is not an integer input of kernel 'cross_entropy'"),
    ("tensor", "loss", "'loss' is not an integer input"),
    ("extent", "W", "size symbol 'W' occurs in no input or output shape"),
    ("axis", -1, "expected a non-negative axis"),
    ("plans", ["nope_0"], '"nope_0" is not a plan of kernel'),
    ("negative", 1, "negative: expected bool, got 1"),
    ("monotonic", "yes", 'monotonic: expected bool, got "yes"'),
])
def test_malformed_index_ranges_are_rejected(tmp_path, field, value, msg):
    d = _artifact(tmp_path)
    obj = json.loads((d / "manifest.json").read_text())
    obj["kernels"][0]["index_ranges"][0][field] = value
    (d / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(KspecArtifactError, match=r"index_ranges\[0\]") as e:
        read_manifest(d)
    assert msg in str(e.value)


# ---------------------------------------------------------------- the runtime, on the fake driver

def _call(fake, mod, labels, M=64, V=1000, **kw):
    logits = fake.alloc(M * V * 2)
    lab = fake.alloc(max(labels.nbytes, 1))
    fake.upload(lab, np.ascontiguousarray(labels, dtype=np.int32).tobytes())
    return mod.cross_entropy(DeviceBuffer(logits, (M, V), "bf16"), DeviceBuffer(lab, labels.shape, "i32"), **kw), lab


def test_an_out_of_range_label_is_refused_before_launch(tmp_path):
    mod = kspec.load(_artifact(tmp_path))
    labels = np.arange(64, dtype=np.int32)
    labels[17], labels[40] = 1000, -3
    with FakeDriver() as fake:
        with pytest.raises(KspecRuntimeError) as e:
            _call(fake, mod, labels, stream=7)
        assert fake.launches == [] and fake.fills == []
        ((ptr, nbytes, stream),) = fake.reads                    # one copy of the index tensor only
        assert (nbytes, stream) == (64 * 4, 7)
    assert e.value.message == ("cross_entropy: label[17] = 1000 is out of range for logits axis 1 (V = 1000): "
                               "expected 0 <= label < 1000 (2 values out of range)")
    assert "nothing was launched" in e.value.hint


def test_negative_labels_and_the_first_position_in_c_order(tmp_path):
    mod = kspec.load(_artifact(tmp_path))
    labels = np.zeros(64, dtype=np.int32)
    labels[5] = -1
    with FakeDriver() as fake, pytest.raises(KspecRuntimeError,
                                             match=r"label\[5\] = -1 is out of range .*expected 0 <= label < 1000\n"):
        _call(fake, mod, labels)


def test_valid_labels_pass_the_check_and_reach_the_launch(tmp_path):
    """Past the check, the call goes on to load the host glue (not a library in this artifact)."""
    mod = kspec.load(_artifact(tmp_path))
    labels = np.arange(64, dtype=np.int32) * 15               # 0 .. 945 < V
    with FakeDriver() as fake, pytest.raises(KspecRuntimeError, match="host glue of kernel .cross_entropy.*is not a whole shared library"):
        _call(fake, mod, labels)
    assert len(fake.reads) == 1


def test_help_names_the_checked_index_tensors(tmp_path):
    import pydoc
    mod = kspec.load(_artifact(tmp_path))
    assert ("Index tensors, checked before each launch unless check_indices is off: 0 <= label < V "
            "(logits axis 1).") in pydoc.render_doc(mod.cross_entropy, renderer=pydoc.plaintext)


def test_the_check_can_be_turned_off(tmp_path):
    labels = np.full(64, 5000, dtype=np.int32)
    mod = kspec.load(_artifact(tmp_path), check_indices=False)
    assert mod.cross_entropy.check_indices is False
    with FakeDriver() as fake, pytest.raises(KspecRuntimeError, match="host glue of kernel .cross_entropy.*is not a whole shared library"):
        _call(fake, mod, labels)
    assert fake.reads == []
    on = kspec.load(_artifact(tmp_path))
    on.cross_entropy.check_indices = False                     # per kernel, after loading
    with FakeDriver() as fake, pytest.raises(KspecRuntimeError, match="host glue of kernel .cross_entropy.*is not a whole shared library"):
        _call(fake, on, labels)
    assert fake.reads == []


def test_no_check_while_capturing_or_for_artifacts_without_ranges(tmp_path):
    labels = np.full(64, 5000, dtype=np.int32)
    mod = kspec.load(_artifact(tmp_path))
    with FakeDriver() as fake, pytest.raises(KspecRuntimeError, match="host glue of kernel .cross_entropy.*is not a whole shared library"):
        fake.is_capturing = lambda stream: True              # a capture cannot synchronise
        _call(fake, mod, labels)
    assert fake.reads == []
    old = kspec.load(_artifact(tmp_path / "old", ranges=None))
    with FakeDriver() as fake, pytest.raises(KspecRuntimeError, match="host glue of kernel .cross_entropy.*is not a whole shared library"):
        _call(fake, old, labels)
    assert fake.reads == []


def test_a_block_table_at_an_offset_with_an_int_extent_and_negative_sentinels(tmp_path):
    """A 2-D table read at an offset inside a larger allocation; a literal extent; a range that allows
    negative values (a sentinel that selects nothing) still has an upper bound."""
    d = tmp_path / "paged"
    b = _binaries(d)
    entry = KernelEntry(
        "paged", inputs=(TensorSpec("pages", "f32", (8, "D")), TensorSpec("table", "i32", ("B", "NB")),
                         TensorSpec("slot", "i8", ("B",))),
        outputs=(TensorSpec("y", "f32", ("B", "D")),),
        plans=(Plan("paged_0", "elementwise", (("B", "B"), ("NB", "NB"), ("D", "D")), ("pages", "table", "slot", "y"),
                    binaries=b),),
        index_ranges=(IndexRange("slot", "table", 1, "NB", True, ("paged_0",)),
                      IndexRange("table", "pages", 0, 8, False, ("paged_0",))))
    write_manifest(d, Manifest(SpecRef("p.kspec", "0" * 64), ("sm90a",), (entry,)))
    mod = kspec.load(d)
    assert "paged" in mod.kernels
    table = np.arange(12, dtype=np.int32).reshape(3, 4) % 8
    table[1, 2] = table[2, 0] = 8
    slot = np.array([-1, 3, -5], dtype=np.int8)
    with FakeDriver() as fake:
        base = fake.alloc(4096)
        fake.upload(base + 256, table.tobytes())
        fake.upload(base + 1024, slot.tobytes())
        args = dict(pages=DeviceBuffer(fake.alloc(8 * 16 * 4), (8, 16), "f32"),
                    table=DeviceBuffer(base + 256, (3, 4), "i32"), slot=DeviceBuffer(base + 1024, (3,), "i8"))
        with pytest.raises(KspecRuntimeError) as e:
            mod.paged(**args)
        assert [(p - base, n) for p, n, _ in fake.reads] == [(1024, 3), (256, 48)]
        slot[1] = 4
        fake.upload(base + 1024, slot.tobytes())
        with pytest.raises(KspecRuntimeError, match=r"paged: slot\[1\] = 4 is out of range for table axis 1 "
                                                    r"\(NB = 4\): expected slot < 4\n"):
            mod.paged(**args)
    assert e.value.message == ("paged: table[1, 2] = 8 is out of range for pages axis 0 (size 8): "
                               "expected 0 <= table < 8 (2 values out of range)")


def test_cumulative_offsets_may_reach_their_bound_and_must_not_decrease():
    """The shape of a varlen batch's cu_seqlens: B + 1 offsets into the packed token axis, each in
    [0, T] and non-decreasing (a mismatched cu_seqlens is refused before the launch)."""
    from kspec.runtime.indexcheck import check_index_values
    cu = IndexRange("cu_seqlens", "Q", 0, "T", plans=("attn_0",), inclusive=True, monotonic=True)
    assert cu.describe() == "0 <= cu_seqlens <= T (Q axis 0, non-decreasing)"
    check_index_values("attn", (cu,), {"T": 10}, {"cu_seqlens": np.array([0, 3, 3, 10], np.int32)})
    with pytest.raises(KspecRuntimeError) as e:
        check_index_values("attn", (cu,), {"T": 10}, {"cu_seqlens": np.array([0, 3, 11, 10], np.int32)})
    assert e.value.message == ("attn: cu_seqlens[2] = 11 is out of range for Q axis 0 (T = 10): "
                               "expected 0 <= cu_seqlens <= 10")
    with pytest.raises(KspecRuntimeError) as e:
        check_index_values("attn", (cu,), {"T": 10}, {"cu_seqlens": np.array([[0, 4, 2, 10], [0, 1, 2, 1]], np.int32)})
    assert e.value.message == ("attn: cu_seqlens[0, 2] = 2 is less than cu_seqlens[0, 1] = 4: expected "
                               "non-decreasing offsets along its last axis")


def test_a_scalar_index_tensor():
    from kspec.runtime.indexcheck import check_index_values
    r = IndexRange("k", "x", 0, 4, plans=("p_0",))
    check_index_values("pick", (r,), {}, {"k": np.array(3, np.int32)})
    with pytest.raises(KspecRuntimeError) as e:
        check_index_values("pick", (r,), {}, {"k": np.array(4, np.int32)})
    assert e.value.message == "pick: k = 4 is out of range for x axis 0 (size 4): expected 0 <= k < 4"


def test_read_view_follows_strides(tmp_path):
    from kspec.runtime.transfer import read_view
    from kspec.runtime.tensors import as_view
    a = np.arange(40, dtype=np.int32).reshape(5, 8)
    with FakeDriver() as fake:
        p = fake.alloc(a.nbytes)
        fake.upload(p, a.tobytes())
        view = as_view(DeviceBuffer(p + 4, (5, 3), "i32", strides=(8, 2)), "x", 0)
        np.testing.assert_array_equal(read_view(view), a[:, 1:7:2])
        assert fake.reads == [(p + 4, (4 * 8 + 4 + 1) * 4, 0)]
        assert read_view(as_view(DeviceBuffer(p, (0, 3), "i32"), "x", 0)).shape == (0, 3)


# ---------------------------------------------------------------- wrong row length: a shape mismatch

def test_a_wrong_row_length_is_a_clear_shape_error(tmp_path):
    """A LayerNorm's gamma of the wrong length, a cross-entropy's labels for the wrong number of
    rows: refused by the shape binding, before anything is read or launched."""
    ln = KernelEntry("layernorm", inputs=(TensorSpec("x", "bf16", ("M", "N")), TensorSpec("gamma", "bf16", ("N",))),
                     outputs=(TensorSpec("y", "bf16", ("M", "N")),),
                     plans=(Plan("layernorm_0", "elementwise", (("M", "M"), ("N", "N")), ("x", "gamma", "y")),),
                     index_ranges=())
    mod = kspec.load(_artifact(tmp_path, extra=(ln,)))
    with FakeDriver() as fake:
        x = DeviceBuffer(fake.alloc(64 * 128 * 2), (64, 128), "bf16")
        with pytest.raises(KspecRuntimeError) as e:
            mod.layernorm(x, DeviceBuffer(fake.alloc(200), (100,), "bf16"))
        assert e.value.message == "argument 'gamma': dimension 0 (N) is 100, but 'x' has N = 128"
        logits = DeviceBuffer(fake.alloc(64 * 1000 * 2), (64, 1000), "bf16")
        with pytest.raises(KspecRuntimeError) as e:
            mod.cross_entropy(logits, DeviceBuffer(fake.alloc(63 * 4), (63,), "i32"))
        assert e.value.message == "argument 'label': dimension 0 (M) is 63, but 'logits' has M = 64"
        assert fake.launches == [] and fake.reads == []
    ref = kspec.reference(SPECS / "layernorm.kspec")
    with pytest.raises(KspecError, match=r"argument 'gamma': N = 100, but N = 128 from argument 'x'"):
        ref(x=np.zeros((4, 128), np.float32), gamma=np.ones(100, np.float32), beta=np.ones(128, np.float32))


# ---------------------------------------------------------------- the reference path agrees

def test_the_reference_refuses_the_same_label():
    f = kspec.reference(SPECS / "cross_entropy.kspec")
    logits = np.zeros((64, 1000), dtype=np.float32)
    labels = np.arange(64, dtype=np.int32)
    labels[17] = 1000
    with pytest.raises(KspecError, match=r"subscript label\[m\] of 'logits' \(axis 1\) is 1000 at m=17, but that axis "
                                         r"has size 1000"):
        f(logits=logits, label=labels)


# ---------------------------------------------------------------- the shipped spec, compiled

@pytest.mark.nvcc
def test_the_compiled_cross_entropy_checks_its_labels(compiled):
    from kspec.runtime.fakedriver import check_call, fake_call
    art = compiled("cross_entropy", ("sm90a",))
    mod = kspec.load(art)
    assert mod.manifest.kernels[0].index_ranges == (LABEL,)
    labels = np.arange(48, dtype=np.int32) % 100
    labels[30] = 100
    with FakeDriver() as fake:
        with pytest.raises(KspecRuntimeError, match=r"cross_entropy: label\[30\] = 100 is out of range for logits "
                                                    r"axis 1 \(V = 100\): expected 0 <= label < 100\n"):
            _call(fake, mod, labels, M=48, V=100)
        assert fake.launches == []
        labels[30] = 99
        _call(fake, mod, labels, M=48, V=100)
        assert len(fake.launches) == 1 and len(fake.reads) == 2
        mod.cross_entropy.check_indices = False               # off: the kernel runs; its guard gives NaN
        labels[30] = 100
        _call(fake, mod, labels, M=48, V=100)
        assert len(fake.launches) == 2 and len(fake.reads) == 2
        mod.cross_entropy.check_indices = True
        call = fake_call(mod, "cross_entropy", {"M": 48, "V": 100}, fake, fill=0)   # zero labels: valid
        assert check_call(call, "sm90a", mod) == []


@pytest.mark.nvcc
def test_selftest_refuses_a_bad_label_before_launch(compiled):
    import io

    from kspec.selftest import run
    out = io.StringIO()
    status = run([str(compiled("cross_entropy", ("sm90a",)))], fake="sm90a", bench=False, out=out)
    text = out.getvalue()
    assert status == 0, text
    assert "PASS cross_entropy            small   bad-index cross_entropy: label[4] = 24 is out of range" in text, text


def test_the_readme_shows_the_real_message(tmp_path):
    readme = (ROOT / "README.md").read_text()
    mod = kspec.load(_artifact(tmp_path))
    labels = np.zeros(64, dtype=np.int32)
    labels[17] = 32000
    with FakeDriver() as fake, pytest.raises(KspecRuntimeError) as e:
        _call(fake, mod, labels, V=32000)
    assert f"kspec.core.KspecRuntimeError: {e.value}\n```" in readme


def test_kspec_lower_shows_the_ranges(capsys):
    from kspec.cli import main
    assert main(["lower", str(SPECS / "cross_entropy.kspec")]) == 0
    assert "  index checks before launch: 0 <= label < V (logits axis 1)\n" in capsys.readouterr().out


def test_the_driver_copies_on_the_launch_stream_then_waits_for_it():
    cu = pytest.importorskip("cuda.bindings.driver")
    from kspec.runtime.driver import Driver
    calls = []

    class Recording(Driver):
        def call(self, fn_name, *args, what=""):
            calls.append((fn_name, what))
            if fn_name == "cuMemcpyDtoHAsync":
                host, src, n, stream = args
                assert (int(src), n, int(stream)) == (0x7000, 6, 42) and isinstance(stream, cu.CUstream)
                host[:] = np.arange(6, dtype=np.uint8)
            elif fn_name == "cuStreamSynchronize":
                assert int(args[0]) == 42

    assert Recording().copy_to_host(0x7000, 6, 42, "index tensor 'label'") == bytes(range(6))
    assert calls == [("cuMemcpyDtoHAsync", "reading index tensor 'label'"),
                     ("cuStreamSynchronize", "reading index tensor 'label'")]


def test_key_counts_name_the_key_axis_as_stored():
    """K stored [B, T, H, d] (FlashAttention's layout): the key count bounds K's axis 1, not 2."""
    from kspec.compiler import plan_kernel
    from kspec.compiler.indices import index_ranges
    text = """kernel att {
  in  Q : bf16[B, S, H, 128]
  in  K : bf16[B, T, H, 128]
  in  V : bf16[B, T, H, 128]
  in  kv_len : i32[B]
  out O : bf16[B, S, H, 128]
  s[b, h, i, j] : f32 = 0.088 * sum(e) Q[b, i, h, e] * K[b, j, h, e]
  m[b, h, i, j] = where(j < kv_len[b], s[b, h, i, j], -inf)
  p[b, h, i, j] = softmax(j) m[b, h, i, j]
  O[b, i, h, e] = sum(j) p[b, h, i, j] * V[b, j, h, e]
}
"""
    from kspec.spec_lang import load_spec
    (plan,) = plan_kernel(load_spec(text, is_text=True).kernels[0]).plans
    if plan.ir.attention is None:
        pytest.skip("no backend fuses this attention here")
    (r,) = [r for r in index_ranges(plan.ir) if r.tensor == "kv_len"]
    assert (r.target, r.axis, r.extent) == ("K", 1, "T")
