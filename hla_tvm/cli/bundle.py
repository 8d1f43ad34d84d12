"""`hla-tvm bundle`: a compiled module in a folder with what runs it without TVM's compiler."""
from __future__ import annotations

import os


def add_arguments(p):
    """The command's options."""
    p.add_argument("module", help="a library written by `hla-tvm compile`")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the bundle folder")
    p.add_argument("--runtime-from", default=None, metavar="DIR",
                   help="for a module of another architecture (e.g. --target aarch64): a folder "
                        "with that architecture's tvm/ and tvm_ffi/ packages (its apache-tvm "
                        "and apache-tvm-ffi wheels unzipped there)")
    p.add_argument("--force", action="store_true", help="replace a non-empty DIR")


def main(args):
    # the library is imported once the arguments are parsed: `hla-tvm bundle --help` (and `hla-tvm
    # --help`) import this module
    from ..bundle import bundle

    info = bundle(args.module, args.output, runtime_from=args.runtime_from, force=args.force)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.output)
                for f in fs)
    gpu = info["device"] == "cuda"
    where = f", NVIDIA GPU {info['gpu']}" if gpu else ""
    print(f"wrote {args.output} ({info['arch']}{where}, "
          f"{total / 1e6:.1f} MB): model.so{', its device code' if gpu else ''}, the TVM runtime "
          f"libraries{' (CUDA too)' if gpu else ''}, generate.py, the C++ app's source; "
          f"{args.output}/README.md says how to run it")
    return 0
