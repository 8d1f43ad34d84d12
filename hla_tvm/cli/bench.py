"""`hla-tvm bench decode|prefill|model`: the arguments, and a call into `hla_tvm.bench`
(`bench.operator` for one operator's decode step or prefill, `bench.model` for a whole model)."""
from __future__ import annotations

from ..bench.model import SCHEMES, run as run_model
from ..bench.operator import run as run_operator
from .args import decay as decay_factor, positive

DESCRIPTION = ("Time one decode step or a prefill of T tokens in one process: "
               "decode: tvm (decode_), tvm_hla (hla, which copies the state), "
               "torch (in-place PyTorch step), torch_compile, "
               "torch_compile_functional (a step returning a new state), state_copy "
               "(copying the state once, the floor); prefill: tvm, torch (the chunk "
               "form with every chunk at once), torch_compile, torch_chunk_loop and "
               "torch_compile_chunk_loop (a loop over the chunks), torch_sdpa (causal "
               "softmax), onnxruntime (one exported hla_tvm::HLA node, where "
               "onnxruntime is installed), and this machine's sgemm rate. The "
               "cases are timed in rounds (each once per round), so a noisy "
               "machine's slow spells fall on all of them, each run starting once the "
               "threads of the case before are idle. The *_mixed cases run each call "
               "after a PyTorch matmul, as a model's process does. With "
               "--kv-heads the PyTorch forms repeat k, v for each group. `bench model` "
               "compiles a whole language model for each --quantize scheme and times its "
               "decode and prefill beside PyTorch eager, torch.compile, ONNX Runtime (float32 "
               "and its own 4-bit MatMulNBits) and the weight-read floor.")


def add_arguments(p):
    """The command's options, grouped by the mode they apply to."""
    p.add_argument("mode", nargs="?", choices=("decode", "prefill", "model"), default="decode",
                   help="what to time: the operator's decode step (default) or prefill, or a "
                        "whole model (compiled per scheme beside PyTorch, torch.compile and "
                        "ONNX Runtime)")
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="model: a checkpoint (HLALM.save) to time instead of --preset")
    both = p.add_argument_group("every mode")
    both.add_argument("--batch", type=positive, default=1, help="batch size B")
    both.add_argument("--repeat", type=positive, default=5,
                      help="rounds: decode and prefill report the median and the fastest of "
                           "each case's runs, model the fastest round")
    both.add_argument("--json", default=None, metavar="FILE",
                      help="also write the results as JSON")
    model = p.add_argument_group("bench model")
    model.add_argument("--preset", choices=("tiny", "demo", "120m"), default="demo",
                       help="the shipped demo model, or random weights of a tiny or a "
                            "120 M-parameter HLALM (vocab 8192, d_model 768, 12 layers)")
    model.add_argument("--quantize", default="float32,bf16,int8,int4", metavar="SCHEMES",
                       help="the weight schemes to compile and time, comma-separated "
                            "(float32, bf16, int8, int4)")
    model.add_argument("--prompt", type=positive, default=1024,
                       help="the prefill's prompt length")
    model.add_argument("--no-peers", action="store_true",
                       help="time the compiled modules and the floor only")
    op = p.add_argument_group("bench decode, bench prefill (one operator)")
    op.add_argument("--op", choices=("hla2", "ahla", "hla3"), default="hla2",
                    help="second order, asymmetric (AHLA) or third order")
    op.add_argument("--heads", type=positive, default=8, help="heads H")
    op.add_argument("--kv-heads", type=positive, default=None,
                    help="key/value heads Hkv, dividing H (grouped heads; default: H)")
    op.add_argument("--seq", "--length", dest="seq", type=positive, default=8192,
                    help="prefill length T")
    op.add_argument("--dk", "--head-dim", dest="dk", type=positive, default=64,
                    help="key/query head size")
    op.add_argument("--dv", type=positive, default=None, help="value head size (default: dk)")
    op.add_argument("--decay", type=decay_factor, default=None, help="decay factor in (0, 1]")
    op.add_argument("--chunk-size", type=positive, default=64,
                    help="chunk size of the chunked prefill")


def main(args):
    if args.mode == "model":

        schemes = [x.strip() for x in args.quantize.split(",") if x.strip()]
        bad = [x for x in schemes if x not in SCHEMES]
        if bad or not schemes:
            raise ValueError(f"--quantize takes schemes among {', '.join(SCHEMES)}, got "
                             f"{args.quantize!r}")
        run_model(args.checkpoint, args.preset, schemes, batch=args.batch, prompt=args.prompt,
                  rounds=args.repeat, peers=not args.no_peers, json_path=args.json)
        return 0
    if args.checkpoint is not None:
        raise ValueError(f"a checkpoint applies to `bench model`, not `bench {args.mode}`")
    run_operator(mode=args.mode, batch=args.batch, heads=args.heads, seq=args.seq, dk=args.dk,
        dv=args.dv, op=args.op, decay=args.decay, chunk_size=args.chunk_size,
        repeat=args.repeat, json_path=args.json, kv_heads=args.kv_heads)
    return 0
