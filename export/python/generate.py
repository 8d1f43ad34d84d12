"""Generation with a module compiled by `hla-tvm compile`, needing only numpy, the
`apache-tvm-ffi` package and TVM's runtime library `libtvm_runtime.so` (no TVM Python package,
no TVM compiler, no torch, no hla_tvm):

    python generate.py model.so --prompt 5,9,2,33 --steps 12 [--temperature T --top-k K --seed S]
    python generate.py model.so --text "def fib(" --steps 200      # byte-level models

prints the generated token ids on one line, separated by spaces (as export/cpp's app does), or
for --text the prompt and the generated text. libtvm_runtime.so is found at --runtime-lib, else
$TVM_RUNTIME_LIB, else runtime/tvm/lib/ beside this script (a bundle from `hla-tvm bundle`),
else in the installed `tvm` package (found, not imported).

The module's entry points: prefill(tokens [1, T] int64, *state) -> (logits [1, T, vocab],
*state) for T >= 2, decode(tokens [1] int64, *state) -> (logits [1, vocab], *state), and
hla_tvm_meta() -> the JSON metadata ("state": [[name, shape without batch, dtype], ...],
"config": {"vocab": "bytes" for byte-level models, ...})."""
import argparse
import codecs
import ctypes
import importlib.util
import json
import os
import sys

import numpy as np

ALIGN = 64   # TVM's kernels assume 64-byte aligned tensors


def runtime_library(given=None):
    """The path of libtvm_runtime.so (see the module docstring for where it is looked for)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [given, os.environ.get("TVM_RUNTIME_LIB"),
                  os.path.join(here, "runtime", "tvm", "lib", "libtvm_runtime.so")]
    try:
        spec = importlib.util.find_spec("tvm")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(p, "lib", "libtvm_runtime.so")
                       for p in spec.submodule_search_locations]
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    raise FileNotFoundError("libtvm_runtime.so not found: give --runtime-lib PATH or set "
                            "TVM_RUNTIME_LIB (it ships in the apache-tvm wheel under tvm/lib/)")


def aligned(array):
    """A copy of `array` in 64-byte aligned memory (numpy aligns to 16 bytes only)."""
    array = np.asarray(array)
    buf = np.empty(array.nbytes + ALIGN, dtype=np.uint8)
    start = (-buf.ctypes.data) % ALIGN
    out = buf[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def load(path, runtime_lib=None):
    """(virtual machine module, metadata dict) of the compiled module at `path`."""
    import tvm_ffi   # first: loads libtvm_ffi.so, which libtvm_runtime.so links to

    ctypes.CDLL(runtime_library(runtime_lib), mode=ctypes.RTLD_GLOBAL)

    vm = tvm_ffi.load_module(path)["vm_load_executable"]()
    vm["vm_initialization"](1, 0, 2)   # kDLCPU, device 0, pooled allocator
    meta = json.loads(bytes(np.from_dlpack(vm["hla_tvm_meta"]())).decode())
    return vm, meta


def generate(vm, meta, prompt, steps, temperature=0.0, top_k=0, seed=0, on_token=None):
    """`steps` token ids following `prompt`: greedy, or sampled at `temperature` from the
    `top_k` most likely (0: all) with a seeded generator."""
    import tvm_ffi

    rng = np.random.default_rng(seed)
    state = [tvm_ffi.from_dlpack(aligned(np.zeros((1, *shape), dtype=dtype)))
             for _, shape, dtype in meta["state"]]
    entries = meta.get("entries", ["prefill", "decode"])

    def run(entry, tokens):
        nonlocal state
        out = list(vm[entry](tvm_ffi.from_dlpack(aligned(tokens)), *state))
        state = out[1:]
        logits = np.from_dlpack(out[0])
        return logits.reshape(-1, logits.shape[-1])[-1].astype(np.float64)

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
        if on_token is not None:
            on_token(nxt)
        if step + 1 < steps:
            logits = run("decode", np.array([nxt], dtype=np.int64))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module")
    p.add_argument("--prompt", default=None, help="token ids, e.g. 5,9,2")
    p.add_argument("--text", default=None, help="prompt text (byte-level models)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runtime-lib", default=None, help="path of libtvm_runtime.so")
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.text is None):
        p.error("give --prompt ids or --text TEXT")
    if args.text is not None:
        prompt = list(args.text.encode("utf-8"))
        if not prompt:
            p.error("--text must not be empty")
    else:
        try:
            prompt = [int(x) for x in args.prompt.split(",")]
        except ValueError:
            p.error("--prompt must be ids such as 5,9,2")
    if args.steps < 1 or not args.temperature >= 0 or args.top_k < 0 or min(prompt) < 0:
        p.error("--steps must be positive, --temperature and --top-k >= 0, ids >= 0")
    try:
        vm, meta = load(args.module, args.runtime_lib)
    except (OSError, ValueError) as err:
        p.error(f"cannot load {args.module}: {err}")
    vocab = meta.get("vocab_size")
    if vocab and max(prompt) >= vocab:
        p.error(f"prompt ids must lie below the vocabulary size {vocab}")
    if args.text is not None:
        if (meta.get("config") or {}).get("vocab") != "bytes":
            p.error("--text needs a byte-level model; give --prompt ids")
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(args.text)
        generate(vm, meta, prompt, args.steps, args.temperature, args.top_k, args.seed,
                 on_token=lambda t: (sys.stdout.write(dec.decode(bytes([t]))), sys.stdout.flush()))
        sys.stdout.write(dec.decode(b"", final=True) + "\n")
        return 0
    print(" ".join(map(str, generate(vm, meta, prompt, args.steps, args.temperature,
                                     args.top_k, args.seed))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
