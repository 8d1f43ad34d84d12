"""`hla-tvm tune`: auto-tuning of an operator's or a model's kernels (`schedule.tuning.tune`)."""
from __future__ import annotations

import os

from .args import checked_scheme, positive, quantize_arguments

DESCRIPTION = ("Tune the prefill and decode kernels of one operator configuration "
               "(--op and options) or the HLA kernels and projections of a model "
               "(a checkpoint or an ONNX file) "
               "with TVM's meta_schedule (evolutionary search, XGBoost cost model, "
               "local runner, or the devices of an RPC tracker) at batch 1, 8 "
               "heads, 4096 tokens, then time each kernel's best trial beside its "
               "default schedule, both as their records run (on the kernel with "
               "symbolic batch, heads and length), and keep the tuned one only when "
               "it is 3 percent faster. Records go to "
               "~/.cache/hla_tvm/schedules/<target>/ (or -o DIR; run again with the "
               "same folder to resume and add trials). On a 2-core machine a trial "
               "takes about 3 s after a minute of start up; 48 trials (3 minutes) "
               "give each kernel of an operator a few candidates. On the CPUs "
               "tuned so far (Zen 3, 4 and 5) every shipped record holds the "
               "default schedule: see docs/tuning.md.")


def add_arguments(p):
    """The command's options."""
    p.add_argument("model", nargs="?", default=None,
                   help="a checkpoint (HLALM.save) or an ONNX model with hla_tvm::HLA nodes: "
                        "tune the HLA kernels and projections `hla-tvm compile` builds for it "
                        "(instead of --op and the options below)")
    p.add_argument("--op", choices=("hla2", "ahla", "hla3"), default="hla2",
                   help="operator: second order, asymmetric (AHLA) or third order")
    p.add_argument("--decay", action="store_true",
                   help="the kernels with decay (second order has separate ones)")
    p.add_argument("--normalize", action="store_true", help="the normalized variant")
    p.add_argument("--dk", type=positive, default=64, help="key/query head size")
    p.add_argument("--dv", type=positive, default=None, help="value head size (default: dk)")
    p.add_argument("--heads", type=positive, default=8, help="query heads (with --kv-heads)")
    p.add_argument("--kv-heads", type=positive, default=8,
                   help="key/value heads (grouped heads when fewer than --heads)")
    p.add_argument("--chunk-size", "--chunk", type=positive, default=64, help="prefill chunk size")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"),
                   default="float32", help="input dtype")
    p.add_argument("--target", default="llvm", help="the CPU to tune for (as for compile)")
    p.add_argument("--trials", type=positive, default=100,
                   help="measured candidates in all, shared among the kernels")
    p.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="records folder (default: the user's folder for the target)")
    p.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on devices registered with this TVM RPC tracker (python -m "
                        "tvm.exec.rpc_tracker) instead of this machine; candidates are built "
                        "here (cross-linked for an aarch64 --target)")
    quantize_arguments(p, "with a model: tune the projections of its module with weights "
                          "packed so (as `compile --quantize`: the dequantizing products of "
                          "its prefill; a decode step's int8 / int4 products keep their "
                          "default schedule, GroupMatvec)")
    p.add_argument("--rpc-key", default=None, metavar="KEY",
                   help="the key the device's server registered with (python -m "
                        "tvm.exec.rpc_server --tracker HOST:PORT --key KEY)")


def _model_kernels(path, target, sch=None):
    """The tunable functions of the model at `path` (a checkpoint or an ONNX file) as `compile`
    builds them for `target`: its HLA kernels and projections, {name: (PrimFunc, argument
    shapes at the tuning shape)}."""
    # torch, TVM and the library are imported once the arguments are parsed: `hla-tvm tune --help`
    # (and `hla-tvm --help`) import this module
    from ..compiler import prepare, target_entries
    from ..schedule.tuning.model import tunable

    if str(path).endswith(".onnx"):
        from ..onnx.importer import lm_module

        mod = lm_module(path)[0]
    else:
        from ..compiler import to_relax
        from ..models import HLALM

        mod = to_relax(HLALM.load(path))
    mod = target_entries(mod, target)
    found = tunable(prepare(mod, target) if sch is None else prepare(mod, target, sch)[0],
                    target)
    if not found:
        raise ValueError(f"{path}: the model holds no HLA kernels or projections to tune")
    return found


def main(args):
    import torch

    from .. import ops
    from ..schedule.tuning import records, tune
    from ..target import cross_compiler, parse, resolve

    target = resolve(parse(args.target))
    if target.kind.name != "llvm":
        raise NotImplementedError(f"tuning for {target.kind.name} targets is not written yet "
                                  "(llvm only)")
    if (args.rpc_tracker is None) != (args.rpc_key is None):
        raise ValueError("--rpc-tracker and --rpc-key go together")
    rpc = (args.rpc_tracker, args.rpc_key) if args.rpc_tracker else None
    if rpc is None and cross_compiler(target) is not None:
        raise ValueError(f"this machine cannot run code for {target.attrs.get('mtriple')}: "
                         "measure on the device with --rpc-tracker HOST:PORT --rpc-key KEY")
    runner = tune.rpc_runner(*rpc) if rpc else None   # (an unreachable tracker fails here)

    sch = checked_scheme(args)
    if sch is not None and not args.model:
        raise ValueError("--quantize applies to a model's projections: give a model")
    if args.model:
        kernels, what = _model_kernels(args.model, target, sch), args.model
    else:
        op = ops.get(3 if args.op == "hla3" else 2, args.op == "ahla")
        if args.heads % args.kv_heads:
            raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
        kernels, what = tune.operator_kernels(
            op, decayed=args.decay, dk=args.dk, dv=args.dv or args.dk, chunk=args.chunk_size,
            group=args.heads // args.kv_heads, dtype=getattr(torch, args.dtype), target=target,
            **op.options(masked=True, normalize=args.normalize, eps=1e-6, ridge=0.0)), args.op
    out = args.output or os.path.join(records.user_root(), records.target_folder(target))
    print(f"tuning {len(kernels)} kernels of {what} for {records.target_folder(target)} "
          f"({args.trials} trials); records go to {out}")
    report = tune.tune(kernels, target, args.trials, out, runner=runner)
    records.forget()
    print(f"{'kernel':<28}{'default':>12}{'tuned':>12}  kept")
    for name, r in report.items():
        tuned = "-" if r["tuned_s"] is None else f"{r['tuned_s'] * 1e3:.3f} ms"
        print(f"{name:<28}{r['default_s'] * 1e3:>9.3f} ms{tuned:>12}  {r['kept']}")
    found = records.resolve("auto", target)
    use = "schedules='auto' (the default)" if found and os.path.samefile(found, out) else \
        f"schedules={out!r}"
    print(f"hla(), decode_(), hla_tvm.compile() and hla-tvm compile use these records with "
          f"{use}")
    return 0
