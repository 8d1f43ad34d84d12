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
