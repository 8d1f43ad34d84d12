"""`hla-tvm export-onnx`: a checkpoint to ONNX with `hla_tvm::HLA` nodes and their function
bodies."""
from __future__ import annotations

from .args import checked_scheme, quantize_arguments


def add_arguments(p):
    """The command's options."""
    p.add_argument("checkpoint", metavar="MODEL",
                   help="a checkpoint written by HLALM.save, or module:factory (a Python module "
                        "and a function in it that returns your own model, as for compile)")
    p.add_argument("-o", "--output", default="model.onnx", help="output file")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--decode", action="store_true",
                       help="export the one-token decode step (tokens [B] and state in, logits "
                            "[B, vocab] and state out) instead of the prefill graph")
    which.add_argument("--from-state", action="store_true",
                   help="the prefill graph also takes the state to continue from (by default "
                        "it starts a fresh sequence from the tokens alone)")
    quantize_arguments(p, "store the weights so, in standard ops (DequantizeLinear of INT8/INT4 "
                          "initializers, opset 21; bf16: a Cast), as `compile --quantize` packs "
                          "them")


def main(args):
    # torch, onnx and the library are imported once the arguments are parsed: `hla-tvm export-onnx
    # --help` (and `hla-tvm --help`) import this module
    from .. import validate
    from ..models.source import load
    from ..onnx import export

    checked_scheme(args)   # a bad scheme fails before any model work
    validate.output_path("-o", args.output)
    validate.not_an_input("-o", args.output, args.checkpoint)
    model = load(args.checkpoint)
    entry = "decode step" if args.decode else "prefill from a given state" if args.from_state \
        else "prefill"
    print(f"exporting {args.checkpoint} ({entry}) to ONNX ...", flush=True)
    proto = export(model, args.output, decode=args.decode, from_state=args.from_state,
                   quantize=args.quantize, group_size=args.group_size)
    n = sum(1 for node in proto.graph.node if node.domain == "hla_tvm")
    bodies = len(proto.functions)
    print(f"wrote {args.output}: {len(proto.graph.node)} nodes, {n} hla_tvm::HLA, "
          f"{bodies} function bod{'y' if bodies == 1 else 'ies'} (opset "
          f"{proto.opset_import[0].version})")
    return 0
