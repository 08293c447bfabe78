"""`kspec selftest` on CPU: the no-GPU exit, the launch-ABI mode (--fake), and the numeric path
through a fake driver that emulates the fixture's kernels on host memory (so uploads in declared
layouts, offset placement, downloads and the comparison with the reference are all exercised)."""
from __future__ import annotations

import io
import json
import shutil
import struct

import numpy as np
import pytest

from kspec.runtime import selftest as fixture

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None or fixture.find_cxx() is None,
                                reason="the fixture artifact needs nvcc and a C++ compiler")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return fixture.build_fixture(tmp_path_factory.mktemp("st") / "fixture", ("sm90a", "sm100a"))


def test_no_gpu_exits_3(art, tmp_path, capsys):
    from kspec.cli import main
    from kspec.runtime import cuda_available
    if cuda_available()[0]:
        pytest.skip("this machine has a GPU")
    rc = main(["selftest", str(art), "--json", str(tmp_path / "r.json")])
    assert rc == 3
    assert "no CUDA device" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "no-gpu"


@pytest.mark.parametrize("arch", ["sm90a", "sm100a"])
def test_fake_mode_checks_every_launch(art, arch, tmp_path):
    from kspec.selftest import run
    out = io.StringIO()
    rc = run([str(art)], fake=arch, bench=False, json_path=str(tmp_path / "r.json"), out=out)
    text = out.getvalue()
    assert rc == 0, text
    res = json.loads((tmp_path / "r.json").read_text())
    # 2 kernels x 3 size sets x 2 variants
    assert len(res["checks"]) == 12 and all(c["ok"] for c in res["checks"])
    assert "ABI ok" in text


def _emulator(fake, corrupt: bool = False):
    """Run the fixture's kernels on the fake device's host memory, from the recorded parameter blob."""
    def on_launch(rec):
        if "scale_add" in rec.what:
            pa, pb, pd, pr, M, N, alpha = struct.unpack_from("<4Qqqf", rec.params)
            A = np.frombuffer(fake.download(pa, 4 * M * N), np.float32).reshape(M, N)
            B = np.frombuffer(fake.download(pb, 4 * M * N), np.float32).reshape(N, M).T   # col layout
            D = (np.float32(alpha) * A + B).astype(np.float32)
            if corrupt:
                D[-1, -1] += 1.0
            fake.upload(pd, D.tobytes())
            fake.upload(pr, D.max(axis=1).astype(np.float32).tobytes())
        else:
            px, py, n, a, b = struct.unpack_from("<QQqff", rec.params)
            x = np.frombuffer(fake.download(px, 4 * n), np.float32)
            fake.upload(py, (np.float32(a) * x + np.float32(b)).astype(np.float32).tobytes())
    return on_launch


@pytest.mark.parametrize("corrupt", [False, True])
def test_numeric_path_with_an_emulating_fake(art, corrupt, tmp_path):
    from kspec.runtime.fakedriver import FakeDriver
    from kspec.selftest import run
    fake = FakeDriver((9, 0))
    fake.on_launch = _emulator(fake, corrupt)
    out = io.StringIO()
    rc = run([str(art)], driver=fake, bench=False, json_path=str(tmp_path / "r.json"), out=out)
    res = json.loads((tmp_path / "r.json").read_text())
    by = {(c["kernel"], c["sizes"], c["variant"]): c for c in res["checks"]}
    assert len(by) == 12
    two = [c for k, c in by.items() if k[0] == "two_step"]
    assert all(c["ok"] and c["errors"]["Y"] < 1e-6 for c in two), out.getvalue()
    sa = [c for k, c in by.items() if k[0] == "scale_add"]
    if corrupt:
        assert rc == 1 and not any(c["ok"] for c in sa)
        assert all("D: max relative error" in c["detail"] for c in sa)
    else:
        assert rc == 0, out.getvalue()
        assert all(c["errors"]["D"] < 1e-6 and c["errors"]["rmax"] < 1e-6 for c in sa)



def test_a_faulted_context_hands_the_remaining_artifacts_to_a_fresh_process(art):
    """After a kernel faults (a sticky CUDA error: every later call in the process fails the same
    way) the remaining artifacts are checked by `kspec selftest` in a fresh process, whose output
    is passed on and whose JSON results are merged (on the H200 one faulting benchmark failed all
    later artifacts).  Here the fresh process finds no GPU: exit 3, no checks, its reason passed on."""
    from kspec.runtime import cuda_available
    from kspec.selftest import _continue_elsewhere, context_lost
    assert context_lost("error: cuCtxSynchronize failed: CUDA_ERROR_ILLEGAL_INSTRUCTION (an illegal instruction)")
    assert context_lost("AcceleratorError: CUDA error: an illegal memory access was encountered")
    assert not context_lost("O: max relative error 0.5 > 0.01")
    assert not context_lost("error: argument 'A': dtype f32, expected f16")
    if cuda_available()[0]:
        pytest.skip("this machine has a GPU")
    said: list[str] = []
    checks, rows, rc = _continue_elsewhere([str(art)], {"M": 64}, True, 3, 0, said.append)
    assert (checks, rows, rc) == ([], [], 3)
    assert any("no CUDA device" in line for line in said), said
