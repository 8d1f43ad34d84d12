"""What a cold cache costs a decode step called from Python: `decode_` (B1 H8 D64, second
order) and the pieces of its path, each timed alone in a quiet loop and right after work that
empties the caches, in one process:

    python benchmarks/cold_decode.py [--rounds 5]

The work before each timed call: nothing; a 1024 x 1024 `torch.mm` (as `hla-tvm bench`'s
mixed rows); a numpy sum over 12 MB; a numpy sum over 64 MB (on one thread, no PyTorch worker).
The pieces: an empty Python function, `torch.empty_like` of the output, an `unsqueeze`, the
compiled decode kernel alone (the plan's function, on the state `decode_` advances), the
state copy (the floor of a step), `decode_` whole. Medians of 30 calls a round, medians of the
rounds."""
import argparse
import time

import numpy as np
import torch


def main():
    from hla_tvm import decode_, hla, options
    from hla_tvm.decode import decode_plan

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    rounds = p.parse_args().rounds
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 17, 64) * 0.3 for _ in range(3))
    _, st = hla(q[:, :, :16], k[:, :, :16], v[:, :, :16], return_state=True)
    q1, k1, v1 = (x[:, :, 16].contiguous() for x in (q, k, v))
    decode_(q1, k1, v1, st)
    q4, k4, v4 = (x.unsqueeze(2) for x in (q1, k1, v1))
    plan = decode_plan(q1, k1, v1, dict(options.DEFAULTS))   # the plan decode_ keeps
    state = plan.get(st)
    o = torch.empty_like(q4)
    dst = {n: torch.empty_like(x) for n, x in st.items()}

    def copy():
        for n, x in st.items():
            dst[n].copy_(x)

    pieces = {
        "an empty Python function": lambda: None,
        "torch.empty_like": lambda: torch.empty_like(q4),
        "unsqueeze": lambda: q1.unsqueeze(2),
        "the decode kernel alone": lambda: plan.fn(q4, k4, v4, plan.gamma, *state, o),
        "state copy": copy,
        "decode_": lambda: decode_(q1, k1, v1, st),
    }
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    mb12, mb64 = np.ones(3 << 20, np.float32), np.ones(16 << 20, np.float32)
    before = {"nothing": None, "torch.mm 1024": lambda: torch.mm(a, b),
              "reading 12 MB": mb12.sum, "reading 64 MB": mb64.sum}
    times = {}
    for _ in range(rounds):
        for name, pre in before.items():
            for piece, fn in pieces.items():
                calls = []
                for _ in range(30):
                    if pre is not None:
                        pre()
                    t = time.perf_counter()
                    fn()
                    calls.append(time.perf_counter() - t)
                times.setdefault((name, piece), []).append(np.median(calls))
    print("timed after | " + " | ".join(pieces))
    for name in before:
        print(f"{name} | " + " | ".join(f"{np.median(times[(name, p)]) * 1e6:.2f} us"
                                         for p in pieces))


if __name__ == "__main__":
    main()
