"""`hla-tvm demo`: the arguments, and a call into `hla_tvm.demo`."""
from __future__ import annotations

from ..demo import DEFAULT_PROMPT, run
from ..runtime.generate import TEXT_TEMPERATURE, TEXT_TOP_K
from ..target import parse
from .args import checked_scheme, positive, quantize_arguments

DESCRIPTION = ("Compile the shipped model (a second-order HLALM trained on "
               "Python's standard library with `hla-tvm train`) for this CPU with "
               "the tuned records (cached after the first run), stream a "
               "continuation of the prompt as the compiled module decodes it, then "
               "print decode tokens/s of the compiled module beside the same model "
               "in PyTorch eager mode and the largest logit difference between "
               "them (exit code 1 when it exceeds 1e-3 of the largest logit). With "
               "--quantize the module's weights are packed (bf16, int8 or int4), PyTorch "
               "runs the same dequantized weights, and the held-out bits/byte of both "
               "schemes are printed.")


def add_arguments(p):
    """The command's options."""
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue")
    p.add_argument("--tokens", type=positive, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=TEXT_TEMPERATURE,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=TEXT_TOP_K,
                   help="sample from the k most likely bytes (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--target", default="llvm",
                   help='"llvm" for this CPU, or an llvm target as JSON (as for compile)')
    quantize_arguments(p, "compile the model with its weights packed (as `compile --quantize`)")


def main(args):
    checked_scheme(args)   # a bad scheme named by the flags, before any work
    return run(prompt=args.prompt, tokens=args.tokens, temperature=args.temperature,
               top_k=args.top_k, seed=args.seed, target=parse(args.target),
               quantize=args.quantize, group_size=args.group_size)
