"""`hla-tvm bench`: TVM kernels vs PyTorch eager, side by side in one run, best of `repeat`.

PyTorch eager runs the reference chunk form (`reference.hla2.chunked`, float32, same chunk size)
for prefill and the reference one-token update (`reference.hla2.step`) for decode."""
from __future__ import annotations

import time

import torch


def _best(fn, repeat, number=1):
    fn()  # warm up (compiles on first use)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def measure(batch=1, heads=8, length=8192, head_dim=64, chunk_size=64, repeat=5,
            decode_steps=200):
    """{case: (tvm seconds, torch seconds)} for prefill of `length` tokens and one decode step."""
    from . import hla
    from .reference import hla2 as ref

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=g) / head_dim ** 0.5
               for _ in range(3))
    res = {}
    res["prefill"] = (
        _best(lambda: hla(q, k, v, chunk_size=chunk_size), repeat),
        _best(lambda: ref.chunked(q, k, v, chunk_size=chunk_size), repeat))
    _, st = hla(q[:, :, :64], k[:, :, :64], v[:, :, :64], return_state=True)
    q1, k1, v1 = (x[:, :, 64:65].contiguous() for x in (q, k, v))
    st_ref = {n: x.clone() for n, x in st.items()}
    res["decode"] = (
        _best(lambda: hla(q1, k1, v1, state=st, return_state=True), repeat, decode_steps),
        _best(lambda: ref.step(q1[:, :, 0], k1[:, :, 0], v1[:, :, 0], st_ref), repeat,
              decode_steps))
    return res


def run(batch=1, heads=8, length=8192, head_dim=64, chunk_size=64, repeat=5):
    torch.set_num_threads(torch.get_num_threads())
    print(f"hla-tvm bench: second-order masked HLA, B={batch} H={heads} D={head_dim}, "
          f"chunk {chunk_size}, {torch.get_num_threads()} threads; best of {repeat}")
    res = measure(batch, heads, length, head_dim, chunk_size, repeat)
    print(f"{'case':<24}{'tvm':>12}{'torch eager':>14}{'torch/tvm':>12}")
    for case, (t_tvm, t_torch) in res.items():
        label = f"prefill T={length}" if case == "prefill" else "decode (1 token)"
        print(f"{label:<24}{_fmt(t_tvm):>12}{_fmt(t_torch):>14}{t_torch / t_tvm:>11.2f}x")
    return 0


def _fmt(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"
