"""One decode step's int4 product (batch 1, group 32, weights in panels, scheduled by
`GroupMatvec`) in cache, from memory, and beside a PyTorch sum over as many bytes, in one
process:

    python benchmarks/int4_matvec_floor.py [--rounds 9]

Both TVM and PyTorch run one worker per physical core. "in cache" calls the product on one
copy of its weights; "from memory" cycles through copies
that together exceed the last-level cache (about 200 MB), as a model's step reads each
weight once; "PyTorch sum" reads float32 tensors of the same bytes the same way. Medians of
the rounds, each case once per round. Each product is checked against numpy's float64 product
of the dequantized weight first."""
import argparse
import time

import numpy as np
import torch

SHAPES = ((768, 3072), (3072, 768), (768, 2304))   # the 120 M model's products (K x N)
GROUP = 32
SPAN = 200e6   # bytes cycled through "from memory"


def build(k, n):
    """(function, its arguments, the output, the weights' copies, bytes of one copy)."""
    import tvm
    from tvm import te, tirx

    from hla_tvm.compiler import resolve_model_target
    from hla_tvm.compiler.passes.pack_weights import panel_width
    from hla_tvm.quant.kernels import matmul
    from hla_tvm.quant.panels import to_panels
    from hla_tvm.quant.scheme import dequantize, quantize, scheme
    from hla_tvm.schedule.rules.cpu.group_matvec import GroupMatvec

    one = tirx.IntImm("int64", 1)
    tgt = resolve_model_target("llvm")
    sch, p = scheme("int4", GROUP), panel_width(n, tgt)
    x = te.placeholder((one, one, tirx.IntImm("int64", k)), name="x")
    q = te.placeholder((n // p, k // 2, p), "uint8", name="q")
    s = te.placeholder((k // GROUP, n), name="s")
    out = matmul(x, q, s, sch=sch, k=k, n=n, group=GROUP, panel=p, grouped=True)
    func = te.create_prim_func([x, q, s, out]).with_attr("global_symbol", "main")
    scheduled = GroupMatvec().apply(func, tgt, False)
    with tgt:
        fn = tvm.compile(scheduled.mod, target=tgt)["main"]
    rng = np.random.default_rng(0)
    packed = quantize(sch, rng.standard_normal((k, n)).astype(np.float32) * 0.1)
    xs = rng.standard_normal((1, 1, k)).astype(np.float32)
    weights, scales = to_panels(packed["q"], p), packed["scale"]
    got = tvm.runtime.tensor(np.zeros((1, 1, n), np.float32))
    args = [tvm.runtime.tensor(a) for a in (xs, weights, scales)]
    fn(*args, got)
    want = xs.astype(np.float64) @ dequantize(sch, packed).astype(np.float64)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    nbytes = weights.nbytes + scales.nbytes
    copies = max(1, int(SPAN // nbytes))
    cycle = [(tvm.runtime.tensor(weights.copy()), tvm.runtime.tensor(scales.copy()))
             for _ in range(copies)]
    return fn, args, got, cycle, nbytes


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    rounds = p.parse_args().rounds
    from hla_tvm.runtime.pool import default_threads, use_threads

    use_threads(default_threads())   # TVM's workers: one per physical core, as a module's
    torch.set_num_threads(default_threads())
    print("K x N | in cache | from memory | a PyTorch sum over as many bytes")
    for k, n in SHAPES:
        fn, args, got, cycle, nbytes = build(k, n)
        sums = [torch.ones(nbytes // 4) for _ in cycle]
        for x in sums[:20]:   # (PyTorch's first calls warm up)
            x.sum()
        times = {"cache": [], "memory": [], "sum": []}
        for _ in range(rounds):
            for _ in range(20):
                fn(*args, got)
            t = time.perf_counter()
            for _ in range(200):
                fn(*args, got)
            times["cache"].append((time.perf_counter() - t) / 200)
            t = time.perf_counter()
            for w, s in cycle:
                fn(args[0], w, s, got)
            times["memory"].append((time.perf_counter() - t) / len(cycle))
            t = time.perf_counter()
            for x in sums:
                x.sum()
            times["sum"].append((time.perf_counter() - t) / len(sums))
        med = {key: float(np.median(v)) for key, v in times.items()}
        print(f"{k} x {n} ({nbytes / 1e6:.2f} MB) | {med['cache'] * 1e6:.1f} us "
              f"({k * n / med['cache'] / 1e9:.0f} G weights/s) | {med['memory'] * 1e6:.1f} us | "
              f"{med['sum'] * 1e6:.1f} us ({nbytes / med['sum'] / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
