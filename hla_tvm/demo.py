"""`hla-tvm demo`: compile, run a prompt and streamed decode steps, check against float64 math.

Until the deployment issue ships a model, the demo drives the operator itself: a prefill of a
random prompt through the chunked kernels, then decode steps with the recurrent state, each
compared with the float64 quadratic form of the whole sequence."""
from __future__ import annotations

import time

import torch

TOL = 1e-4


def run(length=300, heads=4, head_dim=32, steps=8, seed=0):
    from . import hla
    from .reference import hla2 as ref
    from .target import host_target

    g = torch.Generator().manual_seed(seed)
    T = length + steps
    q, k, v = (torch.randn(1, heads, T, head_dim, generator=g) / head_dim ** 0.5
               for _ in range(3))
    print(f"hla-tvm demo: second-order masked HLA, H={heads}, D={head_dim}, "
          f"prompt {length} tokens + {steps} decode steps, target {host_target()}")
    t0 = time.perf_counter()
    out, state = hla(q[:, :, :length], k[:, :, :length], v[:, :, :length], return_state=True)
    print(f"  prefill (incl. compile on first use): {time.perf_counter() - t0:.2f} s")
    outs = [out]
    t0 = time.perf_counter()
    for t in range(length, T):
        o, state = hla(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=state,
                       return_state=True)
        outs.append(o)
    print(f"  {steps} decode steps (incl. compile on first use): {time.perf_counter() - t0:.2f} s")
    got = torch.cat(outs, dim=2).double()
    want = ref.quadratic(q.double(), k.double(), v.double())
    err = ((got - want).abs().max() / want.abs().max()).item()
    ok = err <= TOL
    print(f"  max |tvm - float64 quadratic form| / max |ref| = {err:.2e}  "
          f"({'OK' if ok else 'FAIL'}, tolerance {TOL:g})")
    return 0 if ok else 1
