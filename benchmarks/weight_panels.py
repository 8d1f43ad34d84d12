"""One projection x [rows, K] @ W [K, N] through `MatmulTiles`, with W stored [K, N] and in the
panels compiled models store (`hla_tvm/quant/panels.py`), timed in turn in one process:

    python benchmarks/weight_panels.py [K N ROWS ...]   (default: 3072 8192 1 3072 8192 8
                                                         768 3072 512)

Prints each layout's median time and its weight-read rate, and checks both against float64.
Kernels run on one TVM worker per physical core, as compiled models do (`pool.size_once`;
TVM's own default is half the logical CPUs: one thread on a 2-core VM)."""
import sys

import numpy as np
import tvm
from tvm import te
from tvm.s_tir import dlight as dl

from hla_tvm.compiler.passes.pack_weights import panel_width
from hla_tvm.quant.panels import at, to_panels
from hla_tvm.runtime import pool
from hla_tvm.schedule.rules.cpu import MatmulTiles
from hla_tvm.target import host_target


def build(k, n, p, target):
    """The compiled product for panels of width `p` (None: W as [K, N]); rows symbolic."""
    rows = te.var("rows", "int64")
    x = te.placeholder((rows, k), "float32", name="x")
    stored = te.placeholder((k, n) if p is None else (n // p, k, p), "float32", name="w")
    w = te.compute((k, n), lambda r, c: at(stored, r, c, p), name="dequantize")
    red = te.reduce_axis((0, k), "k")
    out = te.compute((rows, n), lambda i, j: te.sum(x[i, red] * w[red, j], axis=red),
                     name="matmul")
    mod = tvm.IRModule({"main": te.create_prim_func([x, stored, out])})
    with target:
        mod = dl.ApplyDefaultSchedule(MatmulTiles())(mod)
    return tvm.compile(mod, target=target).mod


def run(k, n, rows, rounds=5):
    target = host_target()
    p = panel_width(n, target)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n), dtype=np.float32)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    want = x.astype(np.float64) @ w
    cases = {"[K, N]": (build(k, n, None, target), w),
             f"panels of {p}": (build(k, n, p, target), to_panels(w, p))}
    times = {name: [] for name in cases}
    args = {}
    for name, (f, stored) in cases.items():
        args[name] = [tvm.runtime.tensor(x), tvm.runtime.tensor(stored),
                      tvm.runtime.tensor(np.zeros((rows, n), np.float32))]
        f(*args[name])
        err = np.abs(args[name][2].numpy() - want).max() / np.abs(want).max()
        assert err < 1e-5, (name, err)
    for _ in range(rounds):
        for name, (f, _) in cases.items():
            timer = f.time_evaluator("main", tvm.cpu(), number=5, repeat=1)
            times[name].append(timer(*args[name]).mean)
    for name, t in times.items():
        t = float(np.median(t))
        print(f"K {k} x N {n}, {rows} row(s), {name:14s}: {t * 1e3:8.3f} ms  "
              f"{w.nbytes / t / 1e9:6.1f} GB/s of weight  {2 * rows * k * n / t / 1e9:6.1f} "
              "GFLOP/s")


if __name__ == "__main__":
    pool.size_once()
    sizes = [int(a) for a in sys.argv[1:]] or [3072, 8192, 1, 3072, 8192, 8, 768, 3072, 512]
    for i in range(0, len(sizes) - 2, 3):
        run(*sizes[i:i + 3])
