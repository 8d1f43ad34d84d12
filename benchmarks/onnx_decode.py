"""One ONNX file, two engines: decode latency of an exported HLALM (2 layers, d_model 256,
4 heads) in ONNX Runtime (the hla_tvm::HLA function bodies, no plugin) vs the same file compiled
by TVM onto our kernels (`hla_tvm.onnx.compile`), side by side, plus a prompt (prefill).

    python benchmarks/onnx_decode.py [--order 2|3] [--asymmetric] [--steps 200] [--prompt 256]
"""
import argparse
import tempfile
import time

import numpy as np
import torch

from hla_tvm import onnx as hla_onnx
from hla_tvm.models import HLALM
from hla_tvm.runtime import load


def _rate(step, steps, warmup=10):
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def _best(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--order", type=int, default=2)
    p.add_argument("--asymmetric", action="store_true")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps (200)")
    p.add_argument("--prompt", type=int, default=256, help="prompt length for prefill (256)")
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    torch.manual_seed(0)
    model = HLALM(1000, 256, 2, 4, order=a.order, asymmetric=a.asymmetric).eval()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, (a.batch, a.prompt))
    tok = prompt[:, -1]
    with tempfile.TemporaryDirectory() as d:
        hla_onnx.export(model, f"{d}/prefill.onnx")
        hla_onnx.export(model, f"{d}/decode.onnx", decode=True)
        m = load(hla_onnx.compile(f"{d}/prefill.onnx", out=f"{d}/m.so"))
        ort_prefill, ort_decode = (hla_onnx.session(f"{d}/{n}.onnx")
                                   for n in ("prefill", "decode"))

    names = [i.name for i in ort_decode.get_inputs()]
    ort_state = ort_prefill.run(None, {"tokens": prompt})[1:]   # a fresh sequence

    def ort_step():
        nonlocal ort_state
        ort_state = ort_decode.run(None, dict(zip(names, [tok, *ort_state])))[1:]

    _, tvm_state = m.prefill(prompt, m.init_state(a.batch))

    def tvm_step():
        nonlocal tvm_state
        _, tvm_state = m.decode(tok, tvm_state)

    t_ort, t_tvm = _rate(ort_step, a.steps), _rate(tvm_step, a.steps)
    p_ort = _best(lambda: ort_prefill.run(None, {"tokens": prompt}))
    p_tvm = _best(lambda: m.prefill(prompt, m.init_state(a.batch)))
    kind = "AHLA" if a.asymmetric else f"order {a.order}"
    print(f"HLALM 2 layers, d_model 256, 4 heads, {kind}, batch {a.batch}, one ONNX file:")
    print(f"  decode step:        onnxruntime {t_ort * 1e6:8.0f} us   tvm {t_tvm * 1e6:8.0f} us"
          f"   tvm speedup {t_ort / t_tvm:.2f}x")
    print(f"  prefill {a.prompt:4d} tokens: onnxruntime {p_ort * 1e3:8.1f} ms   "
          f"tvm {p_tvm * 1e3:8.1f} ms   tvm speedup {p_ort / p_tvm:.2f}x")


if __name__ == "__main__":
    main()
