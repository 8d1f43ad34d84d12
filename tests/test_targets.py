"""Named targets and cross-compiling: the presets, a clear error before any model work when the
cross linker is missing, and an aarch64 module run by the cross-built C++ app of its bundle
under qemu, giving the tokens the x86 module gives (skipped where the cross tools are
missing; .ci/run installs them where it can)."""
import os
import shutil
import subprocess

import pytest
import torch
from conftest import greedy_ids

import hla_tvm
from hla_tvm.cli import main
from hla_tvm.models import HLALM
from hla_tvm.target import resolve

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)

CROSS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++", "qemu-aarch64-static", "cmake")


def test_presets_resolve_to_targets():
    arm = resolve("aarch64")
    assert arm.kind.name == "llvm" and str(arm.attrs["mtriple"]) == "aarch64-linux-gnu"
    assert str(resolve("x86-64").attrs["mcpu"]) == "x86-64"
    assert resolve("cuda").kind.name == "cuda"
    with pytest.raises(ValueError, match="aarch64"):   # the error lists the presets
        resolve("arm-something")


def test_missing_cross_linker_fails_before_model_work(monkeypatch, capsys):
    real = shutil.which
    monkeypatch.setattr(shutil, "which",
                        lambda cmd, *a, **k: None if "aarch64" in cmd else real(cmd, *a, **k))
    model = HLALM(40, 16, 1, 2)
    with pytest.raises(ValueError, match="apt install gcc-aarch64-linux-gnu"):
        hla_tvm.compile(model, target="aarch64", out="never.so")
    assert main(["compile", "no-such.pt", "--target", "aarch64"]) == 2   # (the target first)
    assert "gcc-aarch64-linux-gnu" in capsys.readouterr().err
    with pytest.raises(NotImplementedError, match="cuda"):
        hla_tvm.compile(model, target={"kind": "c"}, out="never.so")


@pytest.mark.skipif(any(shutil.which(c) is None for c in CROSS),
                    reason="needs " + ", ".join(CROSS) + " (Debian: apt install "
                           "gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user-static)")
def test_aarch64_bundle_app_under_qemu_gives_the_x86_tokens(tmp_path, capsys):
    from hla_tvm.bundle import elf_machine, fetch_runtime

    try:
        runtime = fetch_runtime("aarch64")
    except OSError as err:
        pytest.skip(f"the aarch64 TVM runtime could not be downloaded: {err}")
    torch.manual_seed(1)
    model = HLALM(40, 32, 2, 4, chunk_size=16).eval()
    with torch.no_grad():   # larger weights: greedy tokens that depend on the context
        for p in model.parameters():
            p.mul_(4)
    arm, x86 = tmp_path / "arm.so", tmp_path / "x86.so"
    hla_tvm.compile(model, target="aarch64", out=arm)
    hla_tvm.compile(model, out=x86, schedules="default")
    assert elf_machine(str(arm)) == "aarch64"
    capsys.readouterr()   # described here without loading it (its metadata is in the library)
    assert main(["run", str(arm), "--info"]) == 0
    assert "runs on: an aarch64 CPU" in capsys.readouterr().out
    prompt = [5, 9, 2, 33, 7, 1, 0, 12]
    want = greedy_ids(str(x86), prompt, 20)
    out = tmp_path / "bundle"
    assert main(["bundle", str(arm), "-o", str(out), "--runtime-from", runtime]) == 0
    assert elf_machine(str(out / "runtime/tvm/lib/libtvm_runtime.so")) == "aarch64"
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(out / "cpp"), "-B", str(build),
                    "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++",
                    "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
                    f"-DTVM_ROOT={out}/runtime/tvm", f"-DTVM_FFI_ROOT={out}/runtime/tvm_ffi"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    assert elf_machine(str(build / "hla_tvm_app")) == "aarch64"
    run = subprocess.run(["qemu-aarch64-static", "-L", "/usr/aarch64-linux-gnu",
                          str(build / "hla_tvm_app"), str(out / "model.so"), "--prompt",
                          ",".join(map(str, prompt)), "--steps", "20"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TVM_NUM_THREADS": "2"})
    assert run.returncode == 0, run.stderr
    assert [int(t) for t in run.stdout.split()] == want
    assert len(set(want)) > 2
