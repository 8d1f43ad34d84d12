"""Greedy (or seeded sampled) generation with a module compiled by `hla-tvm compile`, needing
only numpy and the TVM runtime (no torch, no hla_tvm, no TVM compiler: TVM is imported with
TVM_USE_RUNTIME_LIB=1, which loads libtvm_runtime alone).

    python generate.py model.so --prompt 5,9,2,33 --steps 12 [--temperature T --top-k K --seed S]

prints the generated token ids on one line, separated by spaces (as export/cpp's app does).
The module's entry points: prefill(tokens [1, T] int64, *state) -> (logits [1, T, vocab],
*state) for T >= 2, decode(tokens [1] int64, *state) -> (logits [1, vocab], *state), and
hla_tvm_meta() -> the JSON metadata (its "state": [[name, shape without batch, dtype], ...])."""
import argparse
import json
import os
import sys

os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm.runtime import vm as tvm_vm  # noqa: E402


def load(path):
    """(virtual machine, metadata dict) of the compiled module at `path`."""
    vm = tvm_vm.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    meta = json.loads(bytes(vm["hla_tvm_meta"]().numpy()).decode())
    return vm, meta


def generate(vm, meta, prompt, steps, temperature=0.0, top_k=0, seed=0):
    """`steps` token ids following `prompt`: greedy, or sampled at `temperature` from the
    `top_k` most likely (0: all) with a seeded generator."""
    rng = np.random.default_rng(seed)
    state = [tvm.runtime.tensor(np.zeros((1, *shape), dtype=dtype))
             for _, shape, dtype in meta["state"]]
    entries = meta.get("entries", ["prefill", "decode"])

    def run(entry, tokens):
        nonlocal state
        out = list(vm[entry](tokens, *state))
        state = out[1:]
        logits = out[0].numpy()
        return logits.reshape(-1, logits.shape[-1])[-1]

    if len(prompt) >= 2 and "prefill" in entries:   # the prefill entry takes T >= 2
        logits = run("prefill", np.array([prompt], dtype=np.int64))
    else:
        for t in prompt:
            logits = run("decode", np.array([t], dtype=np.int64))
    out = []
    for step in range(steps):
        if temperature > 0:
            order = np.argsort(-logits, kind="stable")[: top_k or len(logits)]
            p = np.exp((logits[order] - logits[order[0]]) / temperature)
            nxt = int(order[rng.choice(len(order), p=p / p.sum())])
        else:
            nxt = int(np.argmax(logits))
        out.append(nxt)
        if step + 1 < steps:
            logits = run("decode", np.array([nxt], dtype=np.int64))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module")
    p.add_argument("--prompt", required=True, help="token ids, e.g. 5,9,2")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        prompt = [int(x) for x in args.prompt.split(",")]
    except ValueError:
        p.error("--prompt must be ids such as 5,9,2")
    if args.steps < 1 or not args.temperature >= 0 or args.top_k < 0 or min(prompt) < 0:
        p.error("--steps must be positive, --temperature and --top-k >= 0, ids >= 0")
    vm, meta = load(args.module)
    vocab = meta.get("vocab_size")
    if vocab and max(prompt) >= vocab:
        p.error(f"prompt ids must lie below the vocabulary size {vocab}")
    print(" ".join(map(str, generate(vm, meta, prompt, args.steps, args.temperature,
                                     args.top_k, args.seed))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
