"""The CUDA kernels run here without a GPU: `hla_tvm.tools.cuda_emulator` compiles the CUDA
source TVM generates for the CPU and runs each thread block thread by thread, phase by phase.
The chains are checked against the float64 reference by `benchmarks/gpu_check`'s own
check (what a lent GPU runs), with the threads of every block in forward and reverse order."""
import os
import shutil
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed"),
              pytest.mark.xdist_group("cuda_emulated")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))


@pytest.fixture(scope="module")
def target():
    from hla_tvm.target import resolve

    return resolve({"kind": "cuda", "arch": "sm_90"})


def _check(target, config, modes):
    """The GPU check of `config` with its kernels emulated (built once), threads in each of
    `modes`' orders."""
    from gpu_check.checks import judged
    from gpu_check.emulate import EmulatedKernels

    kern = EmulatedKernels(target, [config], modes[0])
    for mode in modes:
        kern.mode = mode
        rows = judged(kern, *config, device="cpu")
        assert rows and all(r["pass"] for r in rows), (mode, rows)


# head size 8 and chunks of 16: stages with fewer elements than a block's 128 threads (one
# with grouped heads). Head size 32: chunk kernels of 256 threads with register tiles
# (`thread_stages.TILES`) and scans split over blocks (`scan_lanes`); head size 48: tiles
# that do not fill the last round of threads (288 tiles of 2 x 4, masked). Larger heads and the
# normalized variants: `python benchmarks/gpu_check emulate` (10 minutes). (Normalized at head size
# 8, the float32 output of these inputs is ill-conditioned: the CPU kernels miss the float64
# reference by 3.5e-4 too.)
CONFIGS = [("hla2", "float32", 8, 1, False), ("hla2_decay", "float32", 8, 1, False),
           ("ahla", "float32", 8, 2, False), ("hla3", "float32", 8, 1, False),
           ("hla2_decay", "float32", 32, 2, False), ("ahla", "bfloat16", 32, 1, False),
           ("hla3", "float32", 32, 1, False), ("hla2_decay", "float32", 48, 1, False)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_emulated_chains_match_the_float64_reference(target, config):
    from hla_tvm.tools import cuda_emulator as emulator

    _check(target, config, (emulator.FORWARD, emulator.REVERSE))


def test_the_masked_tail_of_a_register_tile_stays_in_its_block(target, monkeypatch):
    """The bug a compiled CUDA model showed on an H200 (head size 8: prefill wrong past one
    chunk, differing between runs): TVM wrote a register tile back from every thread of the
    stage's loop, the masked tail too, into the next block's elements. Without the mask
    (`thread_stages.mask_write_backs`) the emulated prefill is wrong; with it, right."""
    from hla_tvm.schedule.rules import cuda
    from hla_tvm.schedule.rules.cuda import hla_kernels
    from hla_tvm.tools import cuda_emulator as emulator

    monkeypatch.setattr(hla_kernels, "mask_write_backs", lambda func, tails: func)
    monkeypatch.setattr(cuda, "_SCHEDULED", type(cuda._SCHEDULED)())
    with pytest.raises(AssertionError):
        _check(target, ("hla2_decay", "float32", 8, 1, False), (emulator.FORWARD,))


def test_the_emulator_reports_a_barrier_that_not_every_thread_reaches():
    from hla_tvm.tools import cuda_emulator as emulator

    source = ('extern "C" __global__ void __launch_bounds__(64) k(float* __restrict__ x) {\n'
              '  if (threadIdx.x < 32) { __syncthreads(); }\n  x[threadIdx.x] = 1.0f;\n}\n')
    cpp, arity = emulator.translate(source)
    assert arity == {"k": 1}
    lib = emulator._compile(cpp)
    import ctypes

    x = torch.zeros(64)
    dims = (ctypes.c_long * 7)(1, 1, 1, 64, 1, 1, 0)
    ptrs = (ctypes.c_void_p * 1)(x.data_ptr())
    assert lib.emu_launch_k(ptrs, dims, 0, 0) == 1
    lib.emu_last_error.restype = ctypes.c_char_p
    assert b"ended while the others wait" in lib.emu_last_error()


def test_the_emulator_finds_a_missing_barrier():
    """A thread reading what another writes in the same phase: the result depends on the
    order the threads run in."""
    import ctypes

    from hla_tvm.tools import cuda_emulator as emulator

    source = ('extern "C" __global__ void __launch_bounds__(32) k(float* __restrict__ x) {\n'
              '  extern __shared__ __align__(64) float s[];\n'
              '  s[threadIdx.x] = (float)threadIdx.x;\n'
              '  x[threadIdx.x] = s[(threadIdx.x + 1) % 32];\n}\n')
    lib = emulator._compile(emulator.translate(source)[0])
    dims = (ctypes.c_long * 7)(1, 1, 1, 32, 1, 1, 128)
    results = []
    for mode in (emulator.FORWARD, emulator.REVERSE):
        x = torch.zeros(32)
        assert lib.emu_launch_k((ctypes.c_void_p * 1)(x.data_ptr()), dims, mode, 0) == 0
        results.append(x)
    # forward: threads 0..30 read s[t + 1] before it was set (NaN); reverse: thread 31 read
    # s[0] before thread 0 set it
    assert torch.isnan(results[0][:31]).all() and results[0][31] == 0
    assert torch.equal(results[1][:31], torch.arange(1.0, 32.0)) and torch.isnan(results[1][31])


@pytest.mark.parametrize("rows", [1, 24], ids=["decode", "prefill"])
@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
def test_emulated_quantized_products_match_float64(target, name, rows):
    """A quantized model's products as a CUDA module runs them (`quant.kernels.matmul`, the
    weight dequantized in the kernel, scheduled by `compiler.cuda_default_schedules`: dlight's
    GEMV for a decode step's one row, Matmul for a prefill's rows) against numpy's float64
    product of the dequantized weight; threads in forward and reverse order."""
    import numpy as np
    import tvm
    from tvm import te

    from hla_tvm.compiler import cuda_default_schedules
    from hla_tvm.quant import kernels
    from hla_tvm.quant.panels import stored as layout
    from hla_tvm.quant.scheme import activations, dequantize, quantize, scheme
    from hla_tvm.tools import cuda_emulator as emulator

    sch = scheme(name, 32 if name == "int4" else None)
    k, n = 128, 96
    rng = np.random.default_rng(0)
    packed = quantize(sch, rng.standard_normal((k, n)).astype("float32"))
    want_w = dequantize(sch, packed).astype(np.float64)
    packed = {**packed, "q": layout(sch, packed["q"], None)}   # (bf16: in row pairs)
    x = te.placeholder((2, rows, k), "float32", name="x")
    stored = [te.placeholder(a.shape, str(a.dtype), name=key) for key, a in packed.items()]
    out = kernels.matmul(x, stored[0], stored[1] if len(stored) > 1 else None, sch=sch, k=k,
                         n=n, group=sch.group(k))
    with target:
        mod = cuda_default_schedules()(tvm.IRModule({"main": te.create_prim_func(
            [x, *stored, out])}))
    shapes = [(t.shape, t.dtype) for t in (x, *stored, out)]
    kern = emulator.Emulated(mod["main"], shapes, target)
    xs = rng.standard_normal((2, rows, k)).astype("float32")
    want = activations(sch, xs).astype(np.float64) @ want_w
    for mode in (emulator.FORWARD, emulator.REVERSE):
        got = torch.full((2, rows, n), float("nan"))
        kern(torch.from_numpy(xs), *[torch.from_numpy(a) for a in packed.values()], got,
             mode=mode)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
