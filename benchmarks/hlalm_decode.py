"""Decode tokens/s of a 2-layer d_model 256 HLALM: compiled TVM module vs PyTorch eager.

    python benchmarks/hlalm_decode.py [--order 2|3] [--asymmetric] [--steps 200]
"""
import argparse
import tempfile
import time

import numpy as np
import torch

from hla_tvm.compiler import compile as compile_model
from hla_tvm.models import HLALM
from hla_tvm.runtime import load


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--order", type=int, default=2)
    p.add_argument("--asymmetric", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    torch.manual_seed(0)
    model = HLALM(1000, 256, 2, 4, order=a.order, asymmetric=a.asymmetric).eval()
    with tempfile.TemporaryDirectory() as d:
        path = compile_model(model, out=f"{d}/m.so")
        m = load(path)
        prompt = np.random.default_rng(0).integers(0, 1000, (a.batch, 32))
        _, state = m.prefill(prompt, m.init_state(a.batch))
        tok = prompt[:, -1]
        for _ in range(10):
            _, state = m.decode(tok, state)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            _, state = m.decode(tok, state)
        tvm_rate = a.steps * a.batch / (time.perf_counter() - t0)
    with torch.no_grad():
        _, st = model(torch.as_tensor(prompt))
        t = torch.as_tensor(tok)[:, None]
        for _ in range(10):
            _, st = model(t, st)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            _, st = model(t, st)
        torch_rate = a.steps * a.batch / (time.perf_counter() - t0)
    kind = "AHLA" if a.asymmetric else f"order {a.order}"
    print(f"HLALM 2 layers, d_model 256, 4 heads, {kind}, batch {a.batch}: decode "
          f"tvm {tvm_rate:.0f} tokens/s, torch eager {torch_rate:.0f} tokens/s, "
          f"ratio {tvm_rate / torch_rate:.2f}x")


if __name__ == "__main__":
    main()
