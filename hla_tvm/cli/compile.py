"""`hla-tvm compile`: a checkpoint or an ONNX model to a deployable module."""
from __future__ import annotations

import os
import sys

from .args import checked_scheme, describe_target, positive, quantize_arguments


def add_arguments(p):
    """The command's options."""
    p.add_argument("checkpoint", metavar="MODEL",
                   help="a checkpoint written by HLALM.save, a .onnx file with hla_tvm::HLA "
                        "nodes, or module:factory, a Python module and a function in it that "
                        "returns your own model (forward(tokens, state) -> (logits, state) and "
                        "init_state(batch); docs/usage.md, 'Your own model')")
    p.add_argument("-o", "--output", default="model.so", help="output library")
    p.add_argument("--tokenizer", default=None, metavar="tokenizer.json",
                   help="a Hugging Face `tokenizers` file kept in the module, so that `run "
                        "--prompt`, `serve` and the runtime take and give text (byte-level "
                        "models have text without one); a tokenizer_config.json beside it "
                        "gives the module its chat template")
    p.add_argument("--target", default="llvm",
                   help='"llvm" for this CPU, a preset (x86-64, aarch64, cuda), a TVM target '
                        'as JSON, e.g. \'{"kind": "llvm", "mcpu": "znver4"}\', or a target '
                        'string TVM parses')
    p.add_argument("--arch", default=None, metavar="sm_XY",
                   help="with --target cuda: the GPU architecture (sm_80 A100, sm_86, sm_89, "
                        "sm_90 H100/H200; default sm_80)")
    p.add_argument("--max-batch", type=positive, default=None,
                   help="upper bound of the batch size (lets TVM plan memory statically; "
                        "larger batches are refused at run time)")
    p.add_argument("--schedules", default="auto", metavar="auto|default|DIR",
                   help="auto: tuned records for the target where they exist (the user's from "
                        "`hla-tvm tune`, else the shipped ones), the default schedules for the "
                        "other kernels; default: no records; DIR: that records folder")
    quantize_arguments(p, "store the weights of the projections, the embedding and the output "
                          "head packed, dequantized inside the kernels that read them (bf16: "
                          "half the bytes; int8: a quarter, one scale per output channel; int4: "
                          "about a sixth, one scale per group); activations, norms and the HLA "
                          "state stay float32")

def main(args):
    # torch, TVM and the library are imported once the arguments are parsed: `hla-tvm compile
    # --help` (and `hla-tvm --help`) import this module
    from ..compiler import resolve_model_target
    from ..target import parse

    target = parse(args.target)
    if args.arch is not None:
        kind = target.get("kind") if isinstance(target, dict) else target
        if kind != "cuda":
            raise ValueError(f"--arch {args.arch} applies to CUDA targets: give --target cuda")
        target = {**(target if isinstance(target, dict) else {"kind": "cuda"}), "arch": args.arch}
    tgt = resolve_model_target(target)   # a bad target fails before any model work
    from .. import validate

    # and a bad scheme (--group-size without --quantize, or with bf16); this object goes on
    # to the packing
    sch = checked_scheme(args)

    validate.output_path("-o", args.output)   # and a bad output path
    validate.not_an_input("-o", args.output, args.checkpoint)
    if args.checkpoint.endswith(".onnx"):
        from ..onnx import compile as compile_onnx

        if args.max_batch is not None:
            raise ValueError("--max-batch applies to checkpoints, not ONNX models")
        print(f"compiling {args.checkpoint} (ONNX, hla_tvm::HLA nodes onto the TVM kernels) for "
              f"{describe_target(tgt)} ...", flush=True)
        out = compile_onnx(args.checkpoint, target=tgt, out=args.output,
                           schedules=args.schedules, quantize=sch, tokenizer=args.tokenizer)
    else:
        from ..compiler import compile as compile_model
        from ..models.source import load

        model = load(args.checkpoint)
        print(f"compiling {args.checkpoint} ({sum(p.numel() for p in model.parameters())} "
              f"parameters) for {describe_target(tgt)} ...", flush=True)
        out = compile_model(model, target=tgt, out=args.output, max_batch=args.max_batch,
                            schedules=args.schedules, quantize=sch, tokenizer=args.tokenizer)
    print(f"wrote {out} (hla-tvm run {out} --info describes it)")
    # (an ONNX file's own scheme is compiled as it is: a remedy then means exporting again)
    _report_weights(out, exported=args.checkpoint.endswith(".onnx") and args.quantize is None)
    if tgt.kind.name == "cuda":
        from ..runtime.device_code import folder_beside

        shipped = folder_beside(out)
        print(f"wrote its device code to {shipped}/ (keep it beside the module)"
              if os.path.isdir(shipped) else "no nvcc here: the GPU machine builds the device "
              "code when it loads the module (it needs nvcc there)")
    return 0


def _report_weights(path, exported=False):
    """For a module with packed weights (--quantize, or an ONNX file that stores them), print
    them, and a warning with the remedy where its scheme left weights float32 (their K not a
    multiple of the group size): other options of this command, or, `exported` (the scheme
    an ONNX file stores), of `hla-tvm export-onnx`."""
    from ..quant.scheme import GROUP_SIZES, Scheme, from_meta
    from ..runtime import read_meta
    from ..runtime.model import weights_summary

    meta = read_meta(path)
    sch = from_meta(meta)
    if sch is None:
        return
    print(f"weights: {weights_summary(meta)}")
    for w in meta["quantize"].get("unpacked") or ():
        print(f"note: a float32 weight {w['shape']} read by {w['op']} stays float32 (only "
              "nn.Linear-style products and embedding lookups are packed)", file=sys.stderr)
    ks = sorted({shape[0] for shape in meta["quantize"].get("kept") or ()})
    if not ks:
        return
    fits = [g for g in GROUP_SIZES if all(Scheme(sch.name, g).fits(k) for k in ks)]
    remedy = f"--quantize {sch.name} --group-size {fits[-1]}" if fits else \
        "--quantize int8 without --group-size (a scale per output channel) or bf16"
    print(f"warning: weights with K = {', '.join(map(str, ks))} stay float32 (not a multiple "
          f"of the group size {sch.group_size}); "
          + ("exporting the ONNX file again with " if exported else "") + f"{remedy} packs "
          "them", file=sys.stderr)
