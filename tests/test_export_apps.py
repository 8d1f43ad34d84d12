"""export/: the C++ app, built with CMake against the installed wheel's TVM runtime, and the
Python script (numpy, apache-tvm-ffi and libtvm_runtime.so) generate the same greedy tokens as
`hla_tvm.runtime` for a compiled model (a many-token prompt through prefill, a one-token prompt
through decode); bad arguments are refused (--text on a model without a byte vocabulary too).
The script runs where torch, hla_tvm and TVM's Python package cannot be imported. (Text
generation with a byte-level model: test_shipped_model.py.)"""
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from conftest import greedy_ids, sealed_without_note

from hla_tvm.compiler import compile as compile_model
from hla_tvm.models import HLALM

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                                 reason="building the C++ app needs cmake and a C++ compiler")


@pytest.fixture(scope="module")
def app(cpp_app):
    return cpp_app


def _compiled(tmp_path_factory, folder, **options):
    """The apps' model compiled (with `options` for `hla_tvm.compile`) into `folder`."""
    torch.manual_seed(1)
    model = HLALM(40, 32, 2, 4, chunk_size=16).eval()
    with torch.no_grad():   # larger weights: greedy tokens that depend on the context
        for p in model.parameters():
            p.mul_(4)
    path = tmp_path_factory.mktemp(folder) / "model.so"
    compile_model(model, out=path, schedules="default", **options)
    return str(path)


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    return _compiled(tmp_path_factory, "cpp_model")


# a prompt past one prefill piece (4096 tokens): pieces [0, 4080, 4097] at chunk 16 (no
# one-token last piece), in hla_tvm.runtime, the C++ app and the script alike
LONG = [int(t) for t in np.random.default_rng(3).integers(0, 40, 4097)]


@needs_cmake
@pytest.mark.parametrize("prompt", [[5, 9, 2, 33, 7, 1, 0, 12], [5], LONG],
                         ids=["prompt", "one", "long"])
def test_cpp_app_tokens_equal_the_python_runtime(app, module, prompt):
    want = greedy_ids(module, prompt, 20)
    run = subprocess.run([app, module, "--prompt", ",".join(map(str, prompt)), "--steps", "20"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [int(t) for t in run.stdout.split()] == want
    if 1 < len(prompt) < 100:
        assert len(set(want)) > 2   # (a context-dependent sequence, not one repeated token)


@needs_cmake
def test_cpp_app_sampling_is_seeded_and_bad_arguments_fail(app, module):
    args = [app, module, "--prompt", "3,4,5", "--steps", "16", "--temperature", "1.0",
            "--top-k", "8", "--seed"]
    a, b = (subprocess.run(args + ["7"], capture_output=True, text=True, timeout=120).stdout
            for _ in range(2))
    assert a == b and len(a.split()) == 16 and all(0 <= int(t) < 40 for t in a.split())
    for bad in (["--prompt", "1,x"], ["--prompt", "99"], ["--steps", "0", "--prompt", "1"], [],
                ["--text", "def "], ["--text", "a", "--prompt", "1"]):
        run = subprocess.run([app, module, *bad], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "hla_tvm_app:" in run.stderr, (bad, run.stderr)
    run = subprocess.run([app, module + ".missing", "--prompt", "1"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "hla_tvm_app:" in run.stderr


@pytest.fixture(scope="module")
def int4_module(tmp_path_factory):
    return _compiled(tmp_path_factory, "cpp_int4", quantize="int4")


@needs_cmake
def test_the_apps_run_a_quantized_module_unchanged(app, int4_module):
    """A module with int4 weights: the C++ app and the Python script give the runtime's greedy
    tokens (the packed weights and the dequantizing kernels are the module's own), with either
    spelling of their flags."""
    import sys

    prompt = [5, 9, 2, 33, 7, 1, 0, 12]
    want = greedy_ids(int4_module, prompt, 20)
    script = os.path.join(ROOT, "export", "python", "generate.py")
    # the first spellings, and those `hla-tvm run` shares (--prompt-ids, --tokens)
    for ids, count in (("--prompt", "--steps"), ("--prompt-ids", "--tokens")):
        for cmd, timeout in (([app], 120), ([sys.executable, script], 300)):
            run = subprocess.run([*cmd, int4_module, ids, ",".join(map(str, prompt)), count,
                                  "20"], capture_output=True, text=True, timeout=timeout)
            assert run.returncode == 0, run.stderr
            assert [int(t) for t in run.stdout.split()] == want, (cmd, ids, count)


@needs_cmake
def test_the_apps_run_a_hybrid_with_its_cache_and_position_counter(app, tmp_path):
    """A hybrid (a softmax layer whose key/value cache and int64 position counter are state
    entries): the C++ app and the Python script give the runtime's greedy tokens, past the
    cache's 8 tokens."""
    import sys

    torch.manual_seed(2)
    model = HLALM(40, 32, 2, 4, chunk_size=16, softmax_layers=[1], max_len=8).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)
    path = str(compile_model(model, out=tmp_path / "hybrid.so", schedules="default"))
    prompt = [5, 9, 2, 33, 7, 1]
    want = greedy_ids(path, prompt, 12)
    script = os.path.join(ROOT, "export", "python", "generate.py")
    for cmd in ([app, path], [sys.executable, script, path]):
        run = subprocess.run([*cmd, "--prompt", ",".join(map(str, prompt)), "--steps", "12"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert [int(t) for t in run.stdout.split()] == want


BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "hla_tvm", "tvm"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, _Block())
import runpy
ns = runpy.run_path(sys.argv[1], run_name="generate")
code = ns["main"](sys.argv[2:])
assert not [m for m in sys.modules if m.split(".")[0] in ("tvm", "torch")], "TVM/torch loaded"
sys.exit(code)
"""


@pytest.mark.parametrize("prompt", [[5, 9, 2, 33, 7, 1, 0, 12], [5], LONG],
                         ids=["prompt", "one", "long"])
def test_python_script_runs_without_tvm_python_torch_or_hla_tvm(module, prompt):
    import sys

    script = os.path.join(ROOT, "export", "python", "generate.py")
    import tvm

    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    env["TVM_RUNTIME_LIB"] = os.path.join(os.path.dirname(tvm.__file__), "lib",
                                          "libtvm_runtime.so")
    run = subprocess.run([sys.executable, "-c", BLOCK, script, module, "--prompt",
                          ",".join(map(str, prompt)), "--steps", "20"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert [int(t) for t in run.stdout.split()] == greedy_ids(module, prompt, 20)


def test_script_prefill_pieces_equal_the_runtime():
    """The script's prefill pieces (it imports nothing of hla_tvm) are hla_tvm.runtime's."""
    import runpy

    from hla_tvm import runtime

    ns = runpy.run_path(os.path.join(ROOT, "export", "python", "generate.py"),
                        run_name="generate")
    assert ns["PREFILL_PIECE"] == runtime.PREFILL_PIECE
    for T in [2, 3, 64, 4095, 4096, 4097, 4098, 8193, 12289, 20000]:
        for chunk in (None, 16, 48, 64, 100, 5000):
            assert ns["prefill_pieces"](T, chunk) == runtime.prefill_pieces(T, chunk), (T, chunk)


def test_script_refuses_a_module_for_features_this_cpu_lacks(monkeypatch):
    """The script knows the CPU features as hla_tvm.runtime does (the same table) and refuses,
    in one line naming the feature, a module whose code needs one this CPU lacks (its code
    would stop with SIGILL)."""
    import runpy

    from hla_tvm.runtime import cpu_features

    ns = runpy.run_path(os.path.join(ROOT, "export", "python", "generate.py"),
                        run_name="generate")
    assert ns["X86"] == cpu_features.X86
    have = ns["host_features"]()
    if have is None:
        pytest.skip("not x86-64 Linux")
    assert have == set(cpu_features.host_features())
    check = ns["check_features"]
    check("m.so", {"cpu_features": sorted(have)})   # all present: no error
    needed = sorted(have | {"avx2"})
    monkeypatch.setitem(check.__globals__, "host_features", lambda: set(needed) - {"avx2"})
    with pytest.raises(ValueError) as err:   # a CPU without AVX2, faked
        check("m.so", {"cpu_features": needed})
    assert "avx2" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_cpp_prefill_pieces_equal_the_runtime(tmp_path):
    """The C++ app's PrefillPieces (its source, compiled alone) gives hla_tvm.runtime's
    boundaries over a grid of prompt lengths and chunks (the app runs where hla_tvm is not
    installed, so it holds the rule too)."""
    import re

    from hla_tvm import runtime

    source = open(os.path.join(ROOT, "export", "cpp", "main.cc")).read()
    rule = re.search(r"^constexpr int64_t kPrefillPiece = (\d+);\n.*?^}\n", source,
                     re.M | re.S)
    assert rule and int(rule.group(1)) == runtime.PREFILL_PIECE
    (tmp_path / "pieces.cc").write_text(
        "#include <algorithm>\n#include <cstdint>\n#include <cstdio>\n#include <vector>\n"
        + rule.group(0) + "int main() {\n  long long T, chunk;\n"
        "  while (std::scanf(\"%lld %lld\", &T, &chunk) == 2) {\n"
        "    for (int64_t b : PrefillPieces(T, chunk)) std::printf(\"%lld \", (long long)b);\n"
        "    std::printf(\"\\n\");\n  }\n}\n")
    subprocess.run(["c++", "-std=c++17", "-O1", "-o", str(tmp_path / "pieces"),
                    str(tmp_path / "pieces.cc")], check=True, timeout=120)
    pairs = [(T, chunk) for T in [*range(2, 70), *range(4000, 4200), 8191, 8192, 8193, 12289,
                                  65536, 65537, 70001]
             for chunk in (0, 1, 2, 3, 16, 48, 64, 100, 128, 4096, 5000)]
    run = subprocess.run([str(tmp_path / "pieces")], input="".join(
        f"{T} {chunk}\n" for T, chunk in pairs), capture_output=True, text=True, timeout=120)
    got = [[int(b) for b in line.split()] for line in run.stdout.splitlines()]
    assert len(got) == len(pairs)
    for (T, chunk), bounds in zip(pairs, got):
        assert bounds == runtime.prefill_pieces(T, chunk or None), (T, chunk)


def test_cpp_app_knows_the_cpu_features_as_the_runtime():
    """The C++ app's table of CPU features (it refuses a module needing one this CPU lacks)
    is hla_tvm.runtime's (the app runs where hla_tvm is not installed, so it holds it too)."""
    import re

    from hla_tvm.runtime import cpu_features

    source = open(os.path.join(ROOT, "export", "cpp", "main.cc")).read()
    table = re.search(r"kX86\[\] = \{(.*?)\};", source, re.S)
    assert table
    assert dict(re.findall(r'\{"([^"]+)", "([^"]+)"\}', table.group(1))) == cpu_features.X86


@needs_cmake
def test_cpp_app_help_and_a_library_that_is_no_model(app, module, tmp_path):
    run = subprocess.run([app, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("usage: hla_tvm_app") and \
        "--temperature" in run.stdout and not run.stderr, run.stdout + run.stderr
    # a whole, sealed library without an hla_tvm model's note is refused before it is loaded
    bare = sealed_without_note(module, tmp_path / "bare.so")
    run = subprocess.run([app, str(bare), "--prompt", "1"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1 and "not an hla_tvm compiled model" in run.stderr, run.stderr


def test_script_refuses_a_library_that_is_no_model_and_samples_text_as_run(module, tmp_path):
    import runpy

    from hla_tvm.runtime import generate, libfile

    ns = runpy.run_path(os.path.join(ROOT, "export", "python", "generate.py"),
                        run_name="generate")
    # the format constants it keeps (it imports nothing of hla_tvm) are the package's
    assert (ns["TRAILER"], ns["NOTE"], ns["MODULE_FORMAT"]) == (
        libfile.TRAILER, libfile.NOTE, __import__("hla_tvm.runtime").runtime.MODULE_FORMAT)
    assert (ns["TEXT_TEMPERATURE"], ns["TEXT_TOP_K"]) == (generate.TEXT_TEMPERATURE,
                                                          generate.TEXT_TOP_K)
    ns["check_module"](module)
    bare = sealed_without_note(module, tmp_path / "bare.so")
    with pytest.raises(ValueError, match="not an hla_tvm compiled model"):
        ns["check_module"](str(bare))
