"""A compiled module on a machine shared with busy processes: decode tokens/s and prefill times
of the shipped demo model with the default worker count (chosen per call by timing,
`hla_tvm.runtime.pool.Adaptive`) beside fixed counts, on a quiet machine and beside N processes that
each spin on one core. Every case runs in a fresh process (TVM sizes its pool once per
thread), the cases in rounds so that a noisy spell falls on all of them.

    python benchmarks/shared_machine.py [--busy 0,1] [--rounds 3] [--steps 300]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CASE = r"""
import json, subprocess, sys, time
import numpy as np
from hla_tvm.runtime import load
path, threads, busy, steps = sys.argv[1], int(sys.argv[2]) or None, int(sys.argv[3]), \
    int(sys.argv[4])
spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
try:
    time.sleep(0.2)
    m = load(path, threads=threads)
    st = m.init_state(1)
    _, st = m.prefill(np.array([[1, 2, 3]]), st)
    tok = np.array([5])
    for _ in range(20):
        _, st = m.decode(tok, st)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, st = m.decode(tok, st)
    decode = steps / (time.perf_counter() - t0)
    prefill = {}
    for T in (3, 4096):
        toks = np.random.default_rng(0).integers(0, 256, (1, T))
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            m.prefill(toks, m.init_state(1), logits="last")
            times.append(time.perf_counter() - t0)
        prefill[T] = sorted(times)[len(times) // 2]
    print(json.dumps({"decode": decode, "prefill": prefill}))
finally:
    for p in spin:
        p.kill()
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", default="0,1", help="busy processes beside it, e.g. 0,1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="decode steps timed")
    a = p.parse_args()
    from hla_tvm import demo
    from hla_tvm.models import HLALM
    from hla_tvm.runtime.pool import physical_cores
    from hla_tvm.target import resolve

    # the module `hla-tvm demo` runs (compiled for demo.STREAMS streams)
    path, _ = demo.compiled_module(HLALM.load(demo.SHIPPED), resolve("llvm"),
                                   max_batch=demo.STREAMS)
    counts = {"auto": 0, "1": 1, str(physical_cores()): physical_cores()}
    rows = {}
    for _ in range(a.rounds):
        for busy in [int(b) for b in a.busy.split(",")]:
            for name, n in counts.items():
                run = subprocess.run([sys.executable, "-c", CASE, path, str(n), str(busy),
                                      str(a.steps)], capture_output=True, text=True)
                if run.returncode:
                    sys.exit(run.stderr)
                rows.setdefault((busy, name), []).append(json.loads(run.stdout))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} CPUs; medians of {a.rounds} rounds (range)")
    print(f"{'busy':>4} {'workers':>8} {'decode tokens/s':>22} {'prefill 3 (ms)':>18} "
          f"{'prefill 4096 (ms)':>20}")
    for (busy, name), runs in rows.items():
        def cell(values, fmt):
            return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"
        dec = [r["decode"] for r in runs]
        p3 = [r["prefill"]["3"] * 1e3 for r in runs]
        p4k = [r["prefill"]["4096"] * 1e3 for r in runs]
        print(f"{busy:>4} {name:>8} {cell(dec, lambda v: f'{v:.0f}'):>22} "
              f"{cell(p3, lambda v: f'{v:.1f}'):>18} {cell(p4k, lambda v: f'{v:.0f}'):>20}")


if __name__ == "__main__":
    main()
