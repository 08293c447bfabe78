"""kspec.artifact: manifest round trip, validation, binary integrity (no nvcc, no GPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kspec.artifact import (FORMAT_VERSION, KernelEntry, KspecArtifactError, Manifest, ParamSpec, Plan,
                            SpecRef, TensorSpec, layout_strides, make_binary, manifest_to_json,
                            read_manifest, sha256_file, stamp_interfaces, write_manifest)
from kspec.spec_lang.errors import KspecError


def _fake_artifact(d: Path, archs=("sm90a", "sm100a")) -> Manifest:
    d.mkdir(parents=True, exist_ok=True)
    bins = {}
    for arch in archs:
        (d / f"gemm_0.{arch}.cubin").write_bytes(b"cubin for " + arch.encode())
        (d / f"gemm_0.{arch}.so").write_bytes(b"glue for " + arch.encode())
        bins[arch] = make_binary(d, f"gemm_0.{arch}.cubin", f"gemm_0.{arch}.so",
                                 config={"tile": "128x128x64"}, registers=168, smem=0)
    k = KernelEntry(
        name="gemm",
        inputs=(TensorSpec("A", "f16", ("M", "K")), TensorSpec("B", "f16", ("K", "N"), "col"),
                TensorSpec("bias", "f16", ("N",))),
        outputs=(TensorSpec("D", "f16", ("M", "N")), TensorSpec("rowmax", "f32", ("M",))),
        params=(ParamSpec("alpha", "f32", 1.0), ParamSpec("beta", "f32", None)),
        intermediates=(TensorSpec("t3", "f32", ("M", "N")),),
        plans=(Plan("gemm_0", "gemm", (("M", "M"), ("N", "N"), ("K", "K"), ("L", 1)),
                    ("A", "B", "bias", "D", "rowmax"), ("alpha", 0.5), {"rowmax": "neg_inf"},
                    {"A": 16, "B": 16, "D": 16}, bins),))
    return Manifest(spec=SpecRef("gemm.kspec", "0" * 64), archs=tuple(archs), kernels=(k,),
                    toolchain={"nvcc": "13.0.88", "cutlass": "4.2.0.0"})


@pytest.fixture
def art(tmp_path) -> Path:
    d = tmp_path / "gemm"
    write_manifest(d, _fake_artifact(d))
    return d


def _edit(d: Path, fn) -> None:
    p = d / "manifest.json"
    obj = json.loads(p.read_text())
    fn(obj)
    p.write_text(json.dumps(obj))


def _plan(obj):
    return obj["kernels"][0]["plans"][0]


def test_round_trip(art):
    m = read_manifest(art)
    # the same dataclasses come back, with the digests of the host libraries as stamped with
    # their interface records (kspec.artifact.stamp_interfaces)
    assert m == stamp_interfaces(art, _fake_artifact(art))
    assert m.format_version == FORMAT_VERSION == 1
    assert m.archs == ("sm90a", "sm100a")
    k = m.kernel("gemm")
    assert k.inputs[1].layout == "col" and k.inputs[1].shape == ("K", "N")
    assert k.params[1].default is None
    p = k.plans[0]
    assert p.dims == (("M", "M"), ("N", "N"), ("K", "K"), ("L", 1))
    assert p.scalars == ("alpha", 0.5)
    assert p.binaries["sm100a"].registers == 168
    assert p.binaries["sm90a"].sha256["cubin"] == sha256_file(art / "gemm_0.sm90a.cubin")
    on_disk = json.loads((art / "manifest.json").read_text())
    assert on_disk["format"] == "kspec-artifact"
    assert on_disk == manifest_to_json(m)
    assert (art / "manifest.json").stat().st_mode & 0o044 == 0o044   # readable by others
    assert not list(art.glob(".manifest.*"))                          # no temp file left


def test_read_accepts_manifest_path(art):
    assert read_manifest(art / "manifest.json").kernels[0].name == "gemm"


def test_layout_strides():
    assert layout_strides((3, 4), "row") == (4, 1)
    assert layout_strides((3, 4), "col") == (1, 3)
    assert layout_strides((2, 3, 4), "col") == (12, 1, 3)     # batch outermost, then column-major
    assert layout_strides((5,), "row") == (1,)
    assert TensorSpec("B", "f16", ("K", "N"), "col").describe() == "f16[K, N] col"


def _error(art, match: str) -> KspecArtifactError:
    with pytest.raises(KspecArtifactError, match=match) as e:
        read_manifest(art)
    assert isinstance(e.value, KspecError)
    return e.value


def test_wrong_format(art):
    _edit(art, lambda o: o.update(format="something-else"))
    e = _error(art, "not a kspec artifact")
    assert str(art / "manifest.json") in str(e)


def test_newer_format_version(art):
    _edit(art, lambda o: o.update(format_version=2))
    e = _error(art, "unsupported artifact format version 2")
    assert "upgrade kspec" in e.hint


def test_missing_format_version(art):
    _edit(art, lambda o: o.pop("format_version"))
    _error(art, "unsupported artifact format version null")


def test_unknown_arch(art):
    _edit(art, lambda o: o.update(archs=["sm90a", "sm80"]))
    _error(art, r"archs: unknown arch \"sm80\"")


def test_binary_for_unlisted_arch(art):
    _edit(art, lambda o: o.update(archs=["sm90a"]))
    _error(art, "binary for 'sm100a', which is not in archs")


def test_plan_without_binary_for_an_arch(art):
    _edit(art, lambda o: _plan(o)["binaries"].pop("sm100a"))
    _error(art, "no binary for arch 'sm100a'")


def test_missing_binary(art):
    (art / "gemm_0.sm100a.so").unlink()
    e = _error(art, "missing")
    assert "gemm_0.sm100a.so" in str(e) and "plan 'gemm_0'" in str(e)


def test_tampered_binary(art):
    (art / "gemm_0.sm90a.cubin").write_bytes(b"evil")
    e = _error(art, "sha256 mismatch")
    assert "gemm_0.sm90a.cubin" in str(e)


def test_verify_false_skips_binaries(art):
    (art / "gemm_0.sm90a.cubin").unlink()
    assert read_manifest(art, verify=False).archs == ("sm90a", "sm100a")


def test_malformed_json(art):
    (art / "manifest.json").write_text('{"format": "kspec-artifact",\n  "format_version": 1,,}')
    e = _error(art, "malformed JSON")
    assert f"{art / 'manifest.json'}:2:" in str(e)


def test_not_an_object(art):
    (art / "manifest.json").write_text("[1, 2]")
    _error(art, "not a JSON object")


def test_no_artifact(tmp_path):
    with pytest.raises(KspecArtifactError, match="no such artifact directory"):
        read_manifest(tmp_path / "nope")
    with pytest.raises(KspecArtifactError, match="manifest.json: file not found"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("edit, match", [
    (lambda o: o["kernels"][0].pop("plans"), r"kernels\[0\]\(gemm\): missing field 'plans'"),
    (lambda o: o["kernels"][0].update(name="not valid"), "is not a valid identifier"),
    (lambda o: o["kernels"][0].update(name="class"), "Python keyword"),
    (lambda o: o["kernels"][0].update(name="__class__"), "starts with '__'"),
    (lambda o: o["kernels"][0]["inputs"][0].update(dtype="f64"), "unknown dtype 'f64'"),
    (lambda o: o["kernels"][0]["inputs"][0].update(layout="diag"), "unknown layout 'diag'"),
    (lambda o: o["kernels"][0]["inputs"][2].update(layout="col"), "needs a tensor of rank >= 2"),
    (lambda o: o["kernels"][0]["inputs"][0].update(shape=["M", -1]), "non-negative"),
    (lambda o: o["kernels"][0]["inputs"][0].update(shape=["M", 1.5]), "size symbol or an int"),
    (lambda o: o["kernels"][0]["inputs"][0].update(name="D"), "name 'D' is used twice"),
    (lambda o: o["kernels"][0]["params"][0].update(name="stream"), "reserved"),
    (lambda o: o["kernels"][0]["outputs"].clear(), "at least one output"),
    (lambda o: o["kernels"][0]["intermediates"][0].update(shape=["M", "Q"]), "'Q' occurs in no input or output"),
    (lambda o: _plan(o).update(kind="conv"), "unknown plan kind 'conv'"),
    (lambda o: _plan(o)["dims"].append(["Z", "Z"]), "'Z' occurs in no input or output"),
    (lambda o: _plan(o)["dims"].append("M"), r"expected \[role, symbol-or-int\]"),
    (lambda o: _plan(o)["args"].append("E"), "'E' is not a tensor of kernel 'gemm'"),
    (lambda o: _plan(o)["scalars"].append("gamma"), "'gamma' is not a param"),
    (lambda o: _plan(o)["scalars"].append(True), "param name or a number"),
    (lambda o: _plan(o)["init"].update(A="zero"), "'A' is not an output or intermediate"),
    (lambda o: _plan(o)["init"].update(rowmax="one"), "unknown init 'one'"),
    (lambda o: _plan(o)["alignment"].update(A=12), "positive power of two"),
    (lambda o: _plan(o)["alignment"].update(t3=16), "'t3' is not an argument of this plan"),
    (lambda o: _plan(o).update(multiples={"Z": 64}), "'Z' is not a dims role of this plan"),
    (lambda o: _plan(o).update(multiples={"K": 0}), "expected a positive int"),
    (lambda o: _plan(o).update(multiples={"K": True}), "expected a positive int"),
    (lambda o: _plan(o)["binaries"]["sm90a"].update(cubin="../../etc/passwd"), "relative and inside"),
    (lambda o: _plan(o)["binaries"]["sm90a"].update(host="/tmp/x.so"), "relative and inside"),
    (lambda o: _plan(o)["binaries"]["sm90a"]["sha256"].update(cubin="abc"), "hex sha256"),
    (lambda o: _plan(o)["binaries"]["sm90a"].update(registers="many"), "expected an integer"),
    (lambda o: o.update(archs=[]), "non-empty list"),
    (lambda o: o["kernels"].append(o["kernels"][0]), "two kernels have the same name"),
])
def test_structural_errors(art, edit, match):
    _edit(art, edit)
    e = _error(art, match)
    assert str(art / "manifest.json") in str(e)


def test_write_manifest_checks_digests(tmp_path):
    d = tmp_path / "a"
    m = _fake_artifact(d)
    (d / "gemm_0.sm90a.so").write_bytes(b"changed after make_binary")
    with pytest.raises(KspecArtifactError, match="sha256 mismatch"):
        write_manifest(d, m)
    assert not (d / "manifest.json").exists()


def test_write_manifest_validates(tmp_path):
    d = tmp_path / "a"
    m = _fake_artifact(d)
    bad = Manifest(spec=m.spec, archs=("sm90a", "sm70"), kernels=m.kernels)
    with pytest.raises(KspecArtifactError, match="unknown arch"):
        write_manifest(d, bad)
