import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """The fast subset: a test module marks itself slow whole (`pytestmark = pytest.mark.slow`)
    or names the tests it keeps fast (`FAST`: test names, with their parameters where given);
    its other tests are marked slow. Modules with neither are fast."""
    for item in items:
        fast = getattr(item.module, "FAST", None)
        if fast is not None and item.name not in fast and item.originalname not in fast:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache(tmp_path_factory):
    """Compiled kernels go to a fresh folder for the test run, not the user's cache: one folder
    that the run's xdist workers share (a kernel or model one worker built, the others load;
    the cache's writes are atomic), beside the workers' own temporary folders."""
    mp = pytest.MonkeyPatch()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "hla_tvm_cache"
        folder.mkdir(mode=0o700, exist_ok=True)   # (private, as the cache wants)
    else:
        folder = tmp_path_factory.mktemp("hla_tvm_cache")
    mp.setenv("HLA_TVM_CACHE_DIR", str(folder))
    yield
    mp.undo()


def free_port():
    """A TCP port on 127.0.0.1 free a moment ago (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy_ids(path, prompt, steps):
    """`steps` greedy token ids of the compiled module at `path` after `prompt` (ids): the
    runtime's prefill, then decode steps (what the apps and bundles must reproduce)."""
    import numpy as np

    from hla_tvm.runtime import load

    m = load(path)
    logits, state = m.prefill(np.array([prompt]), m.init_state(1))
    tokens = [int(logits[0, -1].argmax())]
    for _ in range(steps - 1):
        logits, state = m.decode(np.array(tokens[-1:]), state)
        tokens.append(int(logits[0].argmax()))
    return tokens


BF16_TOL = 4e-3   # bfloat16 products against float32 ones: a term off by one bf16 step, 2^-8
# int8 / int4 prefilled on bfloat16 products against PyTorch's float32 ones (activations and
# scaled weights rounded, which the reference does not do; measured 8.7e-3 on test_quantize's
# d_model 64 model, whose second-order layers amplify them: the kernels themselves match
# float64 within 1e-6 in test_cpu_isa.py)
INT_BF16_TOL = 1.5e-2


def scheme_tol(name, tol):
    """`tol` for a module with the scheme `name` against PyTorch running its dequantized
    weights, or BF16_TOL / INT_BF16_TOL where this CPU rounds that scheme's activations:
    prefilled on bfloat16 products (`compiler.passes.pack_weights.prefill_blocks`: bf16
    always, int8 / int4 where the CPU has AVX512-BF16 or AMX; the decode steps after such a
    prefill carry its state), or int4 decoded on VPDPBUSD (one 8-bit digit a block of
    activations, `quant.vnni.DIGITS`: within 4e-3 of the block's largest, near bfloat16's
    rounding)."""
    from hla_tvm.compiler.passes.pack_weights import prefill_blocks
    from hla_tvm.quant import vnni
    from hla_tvm.quant.scheme import scheme
    from hla_tvm.target import host_target

    if name in ("float32", None):
        return tol
    target = host_target()
    if prefill_blocks(scheme(name), target) is not None:
        return BF16_TOL if name == "bf16" else INT_BF16_TOL
    if vnni.DIGITS.get(name) == 1 and vnni.lanes(target):
        return INT_BF16_TOL
    return tol


def rel_err(got, want):
    """max |got - want| / max |want|, in float64."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max()).item()


def make_qkv(B, H, T, dk, dv, *, seed=0, positive=False, dtype=torch.float64):
    """Random q, k, v scaled so outputs stay O(1); positive features for normalized variants
    (their denominators q^T(S m - h) are then sums of positive terms, far from zero)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for d in (dk, dk, dv))
    if positive:
        q, k = q.abs(), k.abs()
    q, k = q / dk ** 0.5, k / dk ** 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype)


def sealed_without_note(lib, out):
    """Write to `out` the compiled module `lib` without its metadata note, sealed: a whole
    library that does not say it is an hla_tvm model. Returns `out`."""
    from hla_tvm.runtime import libfile

    data = open(lib, "rb").read()
    image = len(data) - libfile.TRAILER
    size = int.from_bytes(data[image - 16:image - 8], "little")
    with open(out, "wb") as f:
        f.write(data[:image - 16 - size])
    libfile.seal(out)
    return out


_COMPILED = {}


@pytest.fixture(scope="session")
def cpp_app(tmp_path_factory):
    """export/cpp's app, built once per session with CMake against the installed wheel's TVM
    runtime (tests needing it skip where cmake or a C++ compiler is missing)."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the C++ app needs cmake and a C++ compiler")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build = tmp_path_factory.mktemp("cpp_build")
    subprocess.run(["cmake", "-S", os.path.join(root, "export", "cpp"), "-B", str(build),
                    f"-DPython_EXECUTABLE={sys.executable}"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    return str(build / "hla_tvm_app")


@pytest.fixture(scope="session")
def compiled_lm(tmp_path_factory):
    """get(name, vocab_size=40, **config) -> (model, path): HLALM(vocab_size, 32, 2, 4,
    chunk_size=16, **config) from seed 0, compiled once per session and shared by the test files
    that need one (the server's tests: get("bytes", vocab_size=256, vocab="bytes"))."""
    def get(name, vocab_size=40, **config):
        if name not in _COMPILED:
            from hla_tvm.compiler import compile as compile_model
            from hla_tvm.models import HLALM

            torch.manual_seed(0)
            model = HLALM(vocab_size, 32, 2, 4, chunk_size=16, **config).eval()
            path = tmp_path_factory.mktemp(f"lm_{name}") / "model.so"
            compile_model(model, out=path)
            _COMPILED[name] = (model, path)
        return _COMPILED[name]
    return get
