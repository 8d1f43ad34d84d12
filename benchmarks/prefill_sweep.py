"""Prefill time against sequence length: the compiled operator (`tvm`), the fast PyTorch chunk
form (`torch`) and causal softmax attention (`torch_sdpa`), T = 1k .. 64k, one process.

    python benchmarks/prefill_sweep.py [--op hla2] [--heads 8] [--dk 64] [--max 65536]
                                       [--sdpa-max 32768] [--out prefill_sweep.png]

Prints a table, writes JSON beside the plot, and draws time vs T on log-log axes (matplotlib,
`pip install -e ".[bench]"`): linear-time HLA has slope 1, softmax attention slope 2; their
crossover is where HLA starts to win. Softmax attention stops at --sdpa-max (it is quadratic:
about 47 s at 64k on a 2-core machine)."""
from __future__ import annotations

import argparse
import json
import os

from hla_tvm.bench import operator as bench, timing

CASES = ("tvm", "torch", "torch_sdpa")


def sweep(op, heads, dk, lengths, sdpa_max, chunk_size=64):
    """{case: {T: median seconds}} for the cases above."""
    times = {name: {} for name in CASES}
    for T in lengths:
        cases = bench.prefill_cases(1, heads, T, dk, dk, op, None, chunk_size)
        for name in CASES:
            if name == "torch_sdpa" and T > sdpa_max:
                continue
            runs = 3 if T <= 16384 else 1
            times[name][T] = bench._measure(cases[name], runs)[0]
        row = "  ".join(f"{n} {times[n][T] * 1e3:9.1f} ms" for n in CASES if T in times[n])
        print(f"T={T:6d}  {row}", flush=True)
    return times


def plot(times, path, title):
    try:
        import matplotlib
    except ImportError:
        print('no plot: matplotlib is not installed (pip install -e ".[bench]")')
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, series in times.items():
        xs = sorted(series)
        ax.loglog(xs, [series[x] for x in xs], marker="o", label=name)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("prefill time (s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=sorted(bench.OPS), default="hla2")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dk", type=int, default=64, help="head size (Dk = Dv)")
    p.add_argument("--min", type=int, default=1024, help="shortest T (doubled up to --max)")
    p.add_argument("--max", type=int, default=65536, help="longest T")
    p.add_argument("--sdpa-max", type=int, default=32768, help="longest T for torch_sdpa")
    p.add_argument("--out", default="prefill_sweep.png", help="plot file (JSON beside it)")
    a = p.parse_args(argv)
    lengths, T = [], a.min
    while T <= a.max:
        lengths.append(T)
        T *= 2
    info = timing.machine()
    times = sweep(a.op, a.heads, a.dk, lengths, a.sdpa_max)
    title = f"{a.op} prefill, B=1 H={a.heads} D={a.dk}; {info['cpu']} ({info['cores']} cores)"
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"shape": vars(a), "machine": info,
                   "median_s": {n: {str(t): s for t, s in v.items()} for n, v in times.items()}},
                  f, indent=1)
    tvm = times["tvm"]
    if len(tvm) > 1:
        lo, hi = min(tvm), max(tvm)
        print(f"tvm: t({hi}) / t({lo}) = {tvm[hi] / tvm[lo]:.1f} for a {hi // lo}x longer input")
    plot(times, a.out, title)


if __name__ == "__main__":
    main()
