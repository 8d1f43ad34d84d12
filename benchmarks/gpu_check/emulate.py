"""`emulate` (here, no GPU): the checks of `run` with every CUDA kernel emulated on the CPU
thread by thread (`EmulatedKernels`)."""
import json
import sys

from .checks import judged
from .entries import CHECKS, entries
from .report import markdown


class EmulatedKernels:
    """The check's kernel chains under the default CUDA schedules for `target`, emulated on
    the CPU thread by thread (`hla_tvm.tools.cuda_emulator`; threads and blocks in the
    order `self.mode` names, which may change between runs: the kernels are built once):
    `run` and `synchronize` as `Kernels` has them, on CPU tensors."""

    def __init__(self, target, checks, mode):
        self.target, self.mode = target, mode
        self.entries = {e[0]: e[1:] for e in entries(target, checks, timed=False)}
        self._fns = {}

    def synchronize(self):
        pass

    def run(self, eid, env, out):
        import functools

        from hla_tvm import backend
        from hla_tvm.tools import cuda_emulator as emulator

        chain, d, group, chunk, opts = self.entries[eid]
        if eid not in self._fns:
            self._fns[eid] = emulator.chain_functions(chain, d, d, self.target, chunk=chunk,
                                                      group=group, **opts)
        fns = [functools.partial(fn, mode=self.mode) for fn in self._fns[eid]]
        return backend.run_chain(chain, fns, env, out, chunk or 1)


def emulate(args):
    """(here, no GPU) `run`'s checks with every CUDA kernel emulated on the CPU, once with the
    threads and blocks of each kernel in forward order and once in reverse (a result that
    depends on the order is a race); a table of the rows, exit status 1 when one fails."""
    from hla_tvm.target import resolve
    from hla_tvm.tools import cuda_emulator as emulator

    target = resolve({"kind": "cuda", "arch": args.arch})
    checks = [c for c in CHECKS if args.only is None or
              any(f"{c[0]},{c[1]},{c[2]}".startswith(x) for x in args.only.split(";"))]
    rows = []
    kern = EmulatedKernels(target, checks, emulator.FORWARD)
    for mode in (emulator.FORWARD, emulator.REVERSE):
        kern.mode = mode
        for fam, dtype, d, group, normalize in checks:
            for r in judged(kern, fam, dtype, d, group, normalize, device="cpu"):
                r["entry"] += " (reverse order)" if mode == emulator.REVERSE else ""
                print(json.dumps(r), flush=True)
                rows.append(r)
    print(markdown({"gpu": f"none: emulated on the CPU ({len(checks)} checks, forward and "
                           "reverse thread order)", "torch": "", "arch": args.arch,
                    "tvm": "", "checks": rows, "timing": []}))
    sys.exit(0 if all(r["pass"] for r in rows) else 1)
