"""An artifact is self-consistent or it does not load (issue 27, item 2): every manifest field a
binary was built for is recorded in its host library and compared on load, naming the field;
binaries are plain files inside the artifact; the manifest's size and nesting are bounded; and a
CuTe DSL kernel's parameter layout is checked against its cubin before a launch."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_artifact import _edit, _fake_artifact, _plan
from test_cute_backend import needs_dsl

from kspec.artifact import (INTERFACE_MAGIC, MAX_MANIFEST_BYTES, KspecArtifactError, read_interfaces,
                            read_manifest, sha256_file, write_manifest)


@pytest.fixture
def art(tmp_path) -> Path:
    d = tmp_path / "gemm"
    write_manifest(d, _fake_artifact(d))
    return d


def _k(o):
    return o["kernels"][0]


def _refused(art: Path, match: str) -> str:
    with pytest.raises(KspecArtifactError) as e:
        read_manifest(art)
    assert match in str(e.value), str(e.value)
    return str(e.value)


def test_every_host_library_carries_its_plans_interface(art):
    m = read_manifest(art)
    for arch in m.archs:
        host = art / m.kernels[0].plans[0].binaries[arch].host
        assert host.read_bytes().endswith(INTERFACE_MAGIC)
        (rec,) = read_interfaces(host)
        fields = dict((f, v) for f, v in rec)
        assert fields["plan"] == "gemm_0" and fields["arch"] == arch
        assert fields["args"] == ["A", "B", "bias", "D", "rowmax"]
        assert fields["B.layout"] == "col" and fields["A.dtype"] == "f16" and fields["alpha.default"] == 1.0
    # rewriting the manifest replaces the record rather than stacking another one
    before = {p.name: p.read_bytes() for p in art.glob("*.so")}
    write_manifest(art, m)
    assert {p.name: p.read_bytes() for p in art.glob("*.so")} == before


# each edit changes what the binaries were built for; the files themselves stay untouched
TAMPER = [
    ("input dtype", lambda o: _k(o)["inputs"][0].update(dtype="bf16"), "'A.dtype'"),
    ("output dtype", lambda o: _k(o)["outputs"][0].update(dtype="f32"), "'D.dtype'"),
    ("shape", lambda o: _k(o)["inputs"][0].update(shape=["K", "M"]), "'A.shape'"),
    ("layout", lambda o: _k(o)["inputs"][1].update(layout="row"), "'B.layout'"),
    ("args swapped", lambda o: _plan(o).update(args=["B", "A", "bias", "D", "rowmax"]), "'args'"),
    ("role rebound", lambda o: _plan(o).update(dims=[["M", "N"], ["N", "M"], ["K", "K"], ["L", 1]]), "'dims'"),
    ("alignment lowered", lambda o: _plan(o)["alignment"].update(A=1), "'alignment'"),
    ("alignment dropped", lambda o: _plan(o).update(alignment={}), "'alignment'"),
    ("scalar order", lambda o: _plan(o).update(scalars=[0.5, "alpha"]), "'scalars'"),
    ("param default", lambda o: _k(o)["params"][0].update(default=float("inf")), "'alpha.default'"),
    ("param dtype", lambda o: _k(o)["params"][0].update(dtype="f16"), "'alpha.dtype'"),
    ("init", lambda o: _plan(o).update(init={"rowmax": "zero"}), "'init'"),
    ("strides", lambda o: _plan(o).update(strides={"N": ["D", 0]}), "'strides'"),
    ("plan id", lambda o: _plan(o).update(id="gemm_9"), "'plan'"),
    ("kernel renamed", lambda o: _k(o).update(name="gemm2"), "'kernel'"),
    ("plan kind", lambda o: _plan(o).update(kind="elementwise"), "'kind'"),
    ("packed", lambda o: _k(o)["inputs"].append({"name": "cu", "dtype": "i32", "shape": ["B+1"]}) or
     _plan(o)["args"].append("cu"), "'args'"),
    # the launch fields: entry point, config, the cubin (swapped in with its digest)
    ("symbol", lambda o: _plan(o)["binaries"]["sm90a"].update(symbol="other_kernel"), "'launch'"),
    ("config", lambda o: _plan(o)["binaries"]["sm90a"]["config"].update(tile="64x64x64"), "'launch'"),
    ("cubins swapped", lambda o: _swap_cubins(_plan(o)["binaries"]), "'launch'"),
]


def _swap_cubins(bins: dict) -> None:
    """The two archs' cubins exchanged, each with its own (correct) digest."""
    a, b = bins["sm90a"], bins["sm100a"]
    (a["cubin"], a["sha256"]["cubin"]), (b["cubin"], b["sha256"]["cubin"]) = \
        (b["cubin"], b["sha256"]["cubin"]), (a["cubin"], a["sha256"]["cubin"])


@pytest.mark.parametrize("what, edit, field", TAMPER, ids=[t[0] for t in TAMPER])
def test_a_tampered_field_is_refused_by_name(art, what, edit, field):
    read_manifest(art)
    _edit(art, edit)
    msg = _refused(art, field)
    assert "built for" in msg and ".so" in msg and "rebuild the artifact" in msg


def test_size_multiples_travel_with_the_plan_and_cannot_be_edited_away(tmp_path):
    """plans[*].multiples (a size role the kernel needs a multiple of a number) is written only where a
    plan has them, read back, and part of the interface record: dropping or lowering it is refused."""
    from dataclasses import replace
    d = tmp_path / "gemm"
    m = _fake_artifact(d)
    k = m.kernels[0]
    m = replace(m, kernels=(replace(k, plans=(replace(k.plans[0], multiples={"K": 64}),)),))
    write_manifest(d, m)
    assert read_manifest(d).kernels[0].plans[0].multiples == {"K": 64}
    assert _plan(json.loads((d / "manifest.json").read_text()))["multiples"] == {"K": 64}
    plain = tmp_path / "plain"
    write_manifest(plain, _fake_artifact(plain))
    assert "multiples" not in _plan(json.loads((plain / "manifest.json").read_text()))
    _edit(d, lambda o: _plan(o)["multiples"].update(K=32))
    assert "built for" in _refused(d, "'multiples'")
    _edit(d, lambda o: _plan(o).pop("multiples"))
    _refused(d, "the library was built with 'multiples', which the manifest lacks")
    _edit(plain, lambda o: _plan(o).update(multiples={"K": 64}))
    _refused(plain, "the manifest has 'multiples', which the library was not built with")


def test_a_host_library_from_another_plan_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_manifest(a, _fake_artifact(a))
    other = _fake_artifact(b)
    k = other.kernels[0]
    from dataclasses import replace
    other = replace(other, kernels=(replace(k, inputs=(replace(k.inputs[0], dtype="bf16"), *k.inputs[1:])),))
    write_manifest(b, other)
    shutil.copyfile(b / "gemm_0.sm90a.so", a / "gemm_0.sm90a.so")       # and fix the digest too
    _edit(a, lambda o: _plan(o)["binaries"]["sm90a"]["sha256"].update(host=sha256_file(a / "gemm_0.sm90a.so")))
    _refused(a, "'A.dtype' is \"f16\" in the manifest but the library was built for \"bf16\"")


def test_a_host_library_without_a_record_is_refused(art):
    so = art / "gemm_0.sm90a.so"
    so.write_bytes(b"\x7fELF glue without a record")
    _edit(art, lambda o: _plan(o)["binaries"]["sm90a"]["sha256"].update(host=sha256_file(so)))
    _refused(art, "carries no interface record")
    read_manifest(art, verify=False)               # verify=False reads the manifest alone


@pytest.mark.parametrize("key", ["cubin", "host"])
def test_binaries_that_are_symlinks_are_refused(art, tmp_path, key):
    name = f"gemm_0.sm100a.{'cubin' if key == 'cubin' else 'so'}"
    outside = tmp_path / "elsewhere.bin"
    shutil.copyfile(art / name, outside)           # the same bytes: the digest still matches
    (art / name).unlink()
    os.symlink(outside, art / name)
    _refused(art, "is a symbolic link")
    (art / name).unlink()
    os.symlink(name + ".real", art / name)         # inside the artifact: still refused
    shutil.copyfile(outside, art / (name + ".real"))
    _refused(art, "is a symbolic link")


def test_a_binary_in_a_symlinked_folder_is_refused(art, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copyfile(art / "gemm_0.sm90a.cubin", outside / "k.cubin")
    os.symlink(outside, art / "sub")
    _edit(art, lambda o: _plan(o)["binaries"]["sm90a"].update(cubin="sub/k.cubin"))
    _refused(art, "is a symbolic link")


def test_deeply_nested_manifests_are_refused_without_recursion(art):
    (art / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    _refused(art, "nested 33 levels deep; a manifest nests at most 32")
    obj = json.loads((art / "manifest.json").read_text().replace("[" * 100_000, "[").replace("]" * 100_000, "]"))
    assert obj == []


def test_oversized_manifests_are_refused_unread(art):
    with open(art / "manifest.json", "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)          # sparse: nothing is written, or read
    _refused(art, f"a manifest has at most {MAX_MANIFEST_BYTES:,}")


# ------------------------------------------------------- CuTe DSL parameter layout, on the fake driver

@pytest.fixture(scope="module")
def cute_gemm(tmp_path_factory):
    from conftest import test_cache_root
    from kspec.backends.build import CompileCache
    from kspec.compile import compile_spec
    spec = Path(__file__).resolve().parent.parent / "specs" / "gemm_rowmax.kspec"
    return compile_spec(spec, ("sm90a",), tmp_path_factory.mktemp("cute"), cache=CompileCache(test_cache_root()),
                        backend="cute")


@needs_dsl
@pytest.mark.cute
def test_cute_parameter_offsets_are_checked_against_the_cubin(cute_gemm, tmp_path):
    import kspec
    from kspec.core import KspecRuntimeError
    from kspec.runtime.fakedriver import FakeDriver, fake_call
    art = tmp_path / "art"
    shutil.copytree(cute_gemm, art)
    sizes = {"M": 256, "N": 256, "K": 128}
    with FakeDriver((9, 0), sm_count=132) as fake:
        call = fake_call(kspec.load(art), "gemm_rowmax", sizes, fake)
        assert len(call.launches) == 1
    b = json.loads((art / "manifest.json").read_text())["kernels"][0]["plans"][0]["binaries"]["sm90a"]
    offs = [int(x) for x in b["config"]["param_offsets"].split(",")]
    assert len(offs) > 1 and offs == sorted(offs)
    shifted = ",".join(map(str, offs[:-1] + [offs[-1] + 8]))
    # edited in the manifest: the host library records the launch fields, so it does not load
    _edit(art, lambda o: _plan(o)["binaries"]["sm90a"]["config"].update(param_offsets=shifted))
    with pytest.raises(KspecArtifactError, match="'launch' is .* in the manifest but the library was built for"):
        kspec.load(art)
    # written consistently wrong (as a faulty build would): it loads, and the cubin check stops the launch
    from dataclasses import replace
    m = read_manifest(art, verify=False)
    k = m.kernels[0]
    b = k.plans[0].binaries["sm90a"]
    b = replace(b, config={**b.config, "param_offsets": shifted})
    write_manifest(art, replace(m, kernels=(replace(k, plans=(replace(k.plans[0], binaries={"sm90a": b}),)),)))
    mod = kspec.load(art)
    with FakeDriver((9, 0), sm_count=132) as fake:
        with pytest.raises(KspecRuntimeError, match="parameters at byte offsets .* but the kernel declares"):
            fake_call(mod, "gemm_rowmax", sizes, fake)
        assert fake.launches == []


def _gather_artifact(d: Path):
    """A cross-entropy-like plan whose `label` values index `logits` (an index range)."""
    from kspec.artifact import KernelEntry, Manifest, Plan, SpecRef, TensorSpec, make_binary
    from kspec.core import IndexRange
    d.mkdir(parents=True, exist_ok=True)
    bins = {}
    for arch in ("sm90a",):
        (d / f"ce_0.{arch}.cubin").write_bytes(b"cubin")
        (d / f"ce_0.{arch}.so").write_bytes(b"glue")
        bins[arch] = make_binary(d, f"ce_0.{arch}.cubin", f"ce_0.{arch}.so", config={}, registers=32, smem=0)
    k = KernelEntry(name="ce", inputs=(TensorSpec("logits", "f32", ("M", "V")), TensorSpec("label", "i32", ("M",))),
                    outputs=(TensorSpec("loss", "f32", ("M",)),), params=(), intermediates=(),
                    plans=(Plan("ce_0", "elementwise", (("M", "M"), ("V", "V")), ("logits", "label", "loss"), (), {},
                                {}, bins),),
                    index_ranges=(IndexRange("label", "logits", 1, "V", plans=("ce_0",)),))
    return Manifest(spec=SpecRef("ce.kspec", "0" * 64), archs=("sm90a",), kernels=(k,), toolchain={})


@pytest.mark.parametrize("edit", [
    lambda o: o["kernels"][0]["index_ranges"][0].update(negative=True),        # widened: -1 would pass
    lambda o: o["kernels"][0]["index_ranges"][0].update(extent="M"),
    lambda o: o["kernels"][0].pop("index_ranges"),                              # "not recorded": no check
    lambda o: o["kernels"][0].update(index_ranges=[]),
], ids=["negative", "extent", "dropped", "emptied"])
def test_the_index_checks_before_a_launch_cannot_be_edited_away(tmp_path, edit):
    art = tmp_path / "ce"
    write_manifest(art, _gather_artifact(art))
    assert read_manifest(art).kernels[0].index_ranges[0].extent == "V"
    _edit(art, edit)
    with pytest.raises(KspecArtifactError, match="index_ranges"):
        read_manifest(art)
