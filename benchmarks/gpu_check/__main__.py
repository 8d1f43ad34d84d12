"""`python benchmarks/gpu_check <command> ...`: each command's arguments, and the call of its
function (the modules of the package: `gpu_check/__init__.py`)."""
import argparse
import os
import sys

if not __package__:   # run as `python benchmarks/gpu_check`: sys.path[0] is this folder
    _here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0]) == _here:
        sys.path[0] = os.path.dirname(_here)   # benchmarks/, as for the script this was
    else:
        sys.path.insert(0, os.path.dirname(_here))

import gpu_check
from gpu_check import ROOT
from gpu_check.api import api
from gpu_check.bundle import prepare
from gpu_check.checks import worker_checks
from gpu_check.emulate import emulate
from gpu_check.models import model_worker, models
from gpu_check.run import run
from gpu_check.timing import worker_timing


def main(argv=None):
    ap = argparse.ArgumentParser(description=gpu_check.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="compile the bundle (needs TVM's compiler and nvcc)")
    p.add_argument("--bundle", default=os.path.join(ROOT, "gpu_bundle"))
    p.add_argument("--arch", default="sm_90", help="CUDA architecture of the GPU (sm_90: H100, "
                   "H200; sm_80: A100)")
    p = sub.add_parser("emulate", help="(no GPU) the checks with the CUDA kernels emulated on "
                       "the CPU, threads in forward and reverse order")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--only", help="semicolon-separated prefixes of 'family,dtype,head size' "
                   "(e.g. 'hla2_decay,float32,8;ahla')")
    p = sub.add_parser("run", help="run the checks and timings on the GPU")
    p.add_argument("--bundle", default=os.path.join(ROOT, "gpu_bundle"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--check-seconds", type=float, default=180)
    p.add_argument("--timing-seconds", type=float, default=300)
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--prefill-families", default="hla2_decay,ahla,hla3,hla2_decay:0.99",
                   help="comma-separated kernel families whose prefill is timed (hla2_decay: "
                   "second order as hla() runs it on a GPU; hla2: its serial carry; ahla, hla3; no "
                   "decay), each beside its schedule variants (VARIANTS); FAMILY:G times it "
                   "with decay G beside the PyTorch forms with decay G (no variants)")
    p.add_argument("--skip-checks", action="store_true", help="timings only")
    p.add_argument("--compile-all", action="store_true",
                   help="torch.compile every decode step (default: second order's)")
    p = sub.add_parser("api", help="hla()/decode_() on CUDA tensors (needs TVM's compiler on "
                       "the GPU machine)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--device", default="cuda", help="torch device (cpu: the same checks of the "
                   "CPU kernels)")
    p = sub.add_parser("models", help="compiled models on the GPU with the TVM runtime alone, "
                       "against PyTorch")
    p.add_argument("--bundle", default=os.path.join(ROOT, "gpu_bundle"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("model-worker")
    p.add_argument("--device", default="cuda")
    p.add_argument("--module", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--prompt", type=int, required=True)
    p.add_argument("--result", required=True)
    p = sub.add_parser("worker-checks")
    p.add_argument("--bundle", required=True)
    p.add_argument("--checks", required=True)
    p.add_argument("--result", required=True)
    p = sub.add_parser("worker-timing")
    p.add_argument("--bundle", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--deadline", type=float, required=True)
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--prefill-families", default="hla2_decay,ahla,hla3,hla2_decay:0.99")
    p.add_argument("--compile-all", action="store_true")
    args = ap.parse_args(argv)
    if hasattr(args, "bundle"):
        args.bundle = os.path.abspath(args.bundle)
    {"prepare": prepare, "emulate": emulate, "run": run, "api": api, "models": models,
     "model-worker": model_worker, "worker-checks": worker_checks,
     "worker-timing": worker_timing}[args.cmd](args)


if __name__ == "__main__":
    main()
