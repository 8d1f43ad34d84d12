"""`hla-tvm train`: the arguments, and a call into `hla_tvm.train` (the corpus, the loop, the
curve)."""
from __future__ import annotations

import argparse

import torch

from ..train import run
from .args import decays, positive, positive_float

DESCRIPTION = ("Train a second-order, byte-level HLALM (256 symbols) on the .py "
               "files of this interpreter's standard library, 5 percent of the "
               "files held out for validation, with the differentiable PyTorch "
               "path; writes the checkpoint and its training curve (CHECKPOINT "
               "without .pt + .json, and .png where matplotlib is installed). The "
               "same --seed gives the same starting weights and the same batches, so the same run up to "
               "floating-point rounding: PyTorch's CPU kernels do not promise "
               "bitwise equal results between runs (their threads and vector code "
               "may sum in another order), and a --seconds budget stops at "
               "another step. --attention softmax trains the "
               "same model with causal softmax attention instead (the baseline; "
               "curve only). About 10 minutes on 2 cores with the defaults.")


def add_arguments(p):
    """The command's options."""
    p.add_argument("-o", "--output", default="hlalm.pt", help="checkpoint to write")
    p.add_argument("--steps", type=positive, default=600, help="optimizer steps")
    p.add_argument("--batch", type=positive, default=16, help="windows per step")
    p.add_argument("--seq-len", type=positive, default=256, help="bytes per window")
    p.add_argument("--lr", type=positive_float, default=3e-3,
                   help="peak learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--d-model", type=positive, default=argparse.SUPPRESS,
                   help="model width (default: 128, the shipped model's)")
    p.add_argument("--layers", type=positive, default=argparse.SUPPRESS,
                   help="blocks (default: 4)")
    p.add_argument("--heads", type=positive, default=argparse.SUPPRESS,
                   help="heads (default: 2, head size 64)")
    p.add_argument("--decay", type=decays, default=argparse.SUPPRESS, metavar="G[,G...]",
                   help="HLA's per-token decay, one value in (0, 1] for every head or one per "
                        "head, or 'none' (default: 0.8,0.98 for 2 heads, the shipped "
                        "model's, spread from 0.8 to 0.98 for others: without decay a "
                        "byte-level HLALM learns far slower)")
    p.add_argument("--attention", choices=("hla", "softmax"), default="hla",
                   help="hla: the HLALM; softmax: the same-size softmax-attention baseline")
    p.add_argument("--seconds", type=positive_float, default=None,
                   help="stop after this wall time (the learning rate decays over it; "
                        "not reproducible step for step)")
    p.add_argument("--threads", type=positive, default=None,
                   help="CPU threads (default: PyTorch's, one per core)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args):
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shape = {key: getattr(args, name) for key, name in (
        ("d_model", "d_model"), ("n_layers", "layers"), ("n_heads", "heads"),
        ("decay", "decay")) if hasattr(args, name)}
    run(args.output, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, attention=args.attention, seconds=args.seconds,
        progress=not args.quiet, **shape)
    return 0
