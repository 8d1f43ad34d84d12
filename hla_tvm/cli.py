"""The `hla-tvm` command line."""
from __future__ import annotations

import argparse
import sys


def _demo(args):
    from .demo import run

    return run(length=args.length, heads=args.heads, head_dim=args.head_dim)


def _bench(args):
    from .bench import run

    return run(batch=args.batch, heads=args.heads, length=args.length, head_dim=args.head_dim,
               chunk_size=args.chunk_size, repeat=args.repeat)


def _compile(args):
    import json

    from .compile import compile as compile_model
    from .models import HLALM

    target = args.target
    if target.strip().startswith("{"):
        try:
            target = json.loads(target)
        except json.JSONDecodeError as err:
            raise SystemExit(f"hla-tvm compile: --target is not valid JSON: {err}")
    if args.checkpoint.endswith(".onnx"):
        from .onnx import compile as compile_onnx

        if args.max_batch is not None:
            raise SystemExit("hla-tvm compile: --max-batch applies to checkpoints, not ONNX")
        print(f"compiling {args.checkpoint} (ONNX, hla_tvm::HLA nodes onto the TVM kernels) for "
              f"{target} ...", flush=True)
        out = compile_onnx(args.checkpoint, target=target, out=args.output)
    else:
        model = HLALM.load(args.checkpoint)
        print(f"compiling {args.checkpoint} ({sum(p.numel() for p in model.parameters())} "
              f"parameters) for {target} ...", flush=True)
        out = compile_model(model, target=target, out=args.output, max_batch=args.max_batch)
    print(f"wrote {out}")
    return 0


def _export_onnx(args):
    from .models import HLALM
    from .onnx import export

    model = HLALM.load(args.checkpoint)
    entry = "decode step" if args.decode else "prefill"
    print(f"exporting {args.checkpoint} ({entry}) to ONNX ...", flush=True)
    proto = export(model, args.output, decode=args.decode)
    n = sum(1 for node in proto.graph.node if node.domain == "hla_tvm")
    print(f"wrote {args.output}: {len(proto.graph.node)} nodes, {n} hla_tvm::HLA, "
          f"{len(proto.functions)} function bodies (opset {proto.opset_import[0].version})")
    return 0


def _run(args):
    import time

    import numpy as np

    from .runtime import load

    if args.threads is not None and args.threads < 1:
        raise SystemExit("hla-tvm run: --threads must be a positive integer")
    m = load(args.module, threads=args.threads)
    try:
        prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise SystemExit("hla-tvm run: --prompt-ids must be comma-separated integers")
    if not prompt:
        raise SystemExit("hla-tvm run: --prompt-ids needs at least one token")
    state = m.init_state(1)
    t0 = time.perf_counter()
    logits, state = m.prefill(np.array([prompt]), state)
    t_prefill = time.perf_counter() - t0
    tokens = [int(logits[0, -1].argmax())]
    t0 = time.perf_counter()
    for _ in range(args.steps - 1):
        logits, state = m.decode(np.array(tokens[-1:]), state)
        tokens.append(int(logits[0].argmax()))
    t_decode = time.perf_counter() - t0
    print(" ".join(map(str, tokens)))
    rate = (args.steps - 1) / t_decode if args.steps > 1 and t_decode > 0 else float("nan")
    print(f"prefill {len(prompt)} tokens: {t_prefill * 1e3:.2f} ms; decode: {rate:.1f} tokens/s",
          file=sys.stderr)
    return 0


def _cache(args):
    import os
    import shutil

    from .build import cache_dir

    path = cache_dir()
    files = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if args.clear:
        shutil.rmtree(path, ignore_errors=True)
        print(f"removed {len(files)} cached kernel module(s) from {path}")
    else:
        print(path)
        for f in files:
            print(f"  {f}  {os.path.getsize(os.path.join(path, f)) / 1e3:.0f} kB")
    return 0


def build_parser():
    p = argparse.ArgumentParser(
        prog="hla-tvm",
        description="Higher-order Linear Attention compiled with Apache TVM. Kernels are "
                    "compiled for this CPU on first use and cached (see `hla-tvm cache`).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("demo", help="compile the second-order kernels for this CPU, run a prompt "
                                    "and a few decode steps, check them against float64 math")
    d.add_argument("--length", type=int, default=300, help="prompt length (default 300)")
    d.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    d.add_argument("--head-dim", type=int, default=32, help="head size Dk = Dv (default 32)")
    d.set_defaults(func=_demo)

    b = sub.add_parser("bench", help="time prefill and decode: TVM kernels vs PyTorch eager, "
                                     "side by side, with ratios")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--heads", type=int, default=8)
    b.add_argument("--length", type=int, default=8192, help="prefill length (default 8192)")
    b.add_argument("--head-dim", type=int, default=64)
    b.add_argument("--chunk-size", type=int, default=64)
    b.add_argument("--repeat", type=int, default=5, help="timed runs, best kept (default 5)")
    b.set_defaults(func=_bench)

    k = sub.add_parser("compile", help="compile an HLALM checkpoint or an ONNX model from "
                                       "`export-onnx` into a deployable module (prefill/decode "
                                       "entry points, runtime-only loading)")
    k.add_argument("checkpoint", help="a checkpoint written by HLALM.save, or a .onnx file with "
                                      "hla_tvm::HLA nodes")
    k.add_argument("-o", "--output", default="model.so", help="output library (model.so)")
    k.add_argument("--target", default="llvm",
                   help='"llvm" for this CPU (default) or a TVM target as JSON, e.g. '
                        '\'{"kind": "llvm", "mcpu": "znver4"}\'')
    k.add_argument("--max-batch", type=int, default=None,
                   help="upper bound of the batch size (lets TVM plan memory statically)")
    k.set_defaults(func=_compile)

    x = sub.add_parser("export-onnx", help="export an HLALM checkpoint to ONNX with "
                                           "hla_tvm::HLA nodes and their function bodies (runs "
                                           "in ONNX Runtime as is; `compile` takes it too)")
    x.add_argument("checkpoint", help="a checkpoint written by HLALM.save")
    x.add_argument("-o", "--output", default="model.onnx", help="output file (model.onnx)")
    x.add_argument("--decode", action="store_true",
                   help="export the one-token decode step (tokens [B] and state in, logits "
                        "[B, vocab] and state out) instead of the prefill graph")
    x.set_defaults(func=_export_onnx)

    r = sub.add_parser("run", help="greedy generation with a compiled module (TVM runtime only)")
    r.add_argument("module", help="a library written by `hla-tvm compile`")
    r.add_argument("--prompt-ids", required=True, help="prompt token ids, e.g. 1,2,3")
    r.add_argument("--steps", type=int, default=16, help="tokens to generate (default 16)")
    r.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the kernels (default: $TVM_NUM_THREADS, else one per "
                        "physical core)")
    r.set_defaults(func=_run)

    c = sub.add_parser("cache", help="show (or --clear) the compiled-kernel cache folder")
    c.add_argument("--clear", action="store_true", help="delete every cached module")
    c.set_defaults(func=_cache)
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
