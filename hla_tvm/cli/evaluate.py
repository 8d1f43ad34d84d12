"""`hla-tvm eval`: the arguments, the text's token ids, and a call into `hla_tvm.evaluate`
(bits per byte or token of each model, side by side)."""
from __future__ import annotations

import json

import numpy as np

from ..evaluate import evaluate, held_out_bytes, open_model, shared_tokenizer
from .args import checked_scheme, positive, quantize_arguments


def add_arguments(p):
    """The command's options."""
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="compiled modules (.so), checkpoints (HLALM.save) or module:factory "
                        "(your own model, in PyTorch); the first is the reference of the "
                        "differences. An ONNX model: `hla-tvm compile` it first")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--file", help="the text: its bytes for byte-level models; for others "
                                     "whitespace-separated token ids, or UTF-8 text that the "
                                     "tokenizer kept in the compiled modules encodes")
    text.add_argument("--held-out", action="store_true",
                      help="the validation split of `hla-tvm train` (the .py files of this "
                           "Python's standard library it holds out)")
    p.add_argument("--tokens", type=positive, default=65536,
                   help="evaluate the first N tokens of the text")
    p.add_argument("--piece", type=positive, default=4096,
                   help="tokens per prefill call (the state carries over between calls)")
    quantize_arguments(p, "run the checkpoints and module:factory models in PyTorch with their "
                          "weights as this scheme stores them (packed, then unpacked); compiled "
                          "modules keep the scheme they were compiled with")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")


def _tokens(args, byte_level, tokenizer=None):
    """The token ids of the text, int64, at most --tokens of them: bytes for byte-level models;
    else whitespace-separated ids, or UTF-8 text encoded by `tokenizer` (`runtime.text`, the
    compiled modules' own) where the file holds something else."""
    if args.held_out:
        if not byte_level:
            raise ValueError("--held-out is byte text: it needs byte-level models")
        ids = held_out_bytes()
    else:
        try:
            with open(args.file, "rb") as f:
                raw = f.read()
        except OSError as err:
            raise ValueError(f"--file {args.file}: {err.strerror}") from None
        if byte_level:
            ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
        else:
            try:
                ids = np.array([int(t) for t in raw.split()], dtype=np.int64)
            except ValueError:
                if tokenizer is None:
                    raise ValueError(f"--file {args.file}: the models are not byte-level and no "
                                     "compiled module among them keeps a tokenizer, so the file "
                                     "must hold whitespace-separated token ids") from None
                try:
                    ids = np.array(tokenizer.encode(raw.decode("utf-8")), dtype=np.int64)
                except UnicodeDecodeError as err:
                    raise ValueError(f"--file {args.file}: not UTF-8 text (byte {err.start}) "
                                     "nor token ids") from None
    if ids.size < 2:
        raise ValueError("the text needs at least 2 tokens (one to predict from, one to predict)")
    return ids[:args.tokens]


def main(args):

    sch = checked_scheme(args)
    if sch is not None and all(str(p).endswith(".so") for p in args.models):
        raise ValueError("--quantize applies to checkpoints and module:factory models (run in "
                         "PyTorch); compiled modules keep the scheme they were compiled with, "
                         "and every MODEL given is one")
    models = [open_model(path, sch) for path in args.models]
    byte_level = {m.vocab == "bytes" for m in models}
    if len(byte_level) != 1:
        raise ValueError("the models must all be byte-level or all not: their bits are of "
                         "different units otherwise")
    byte_level = byte_level.pop()
    ids = _tokens(args, byte_level, shared_tokenizer(args.models, models))
    for path, m in zip(args.models, models):
        if m.vocab_size is not None and int(ids.max()) >= m.vocab_size:
            raise ValueError(f"{path}: token id {int(ids.max())} is not below its vocabulary "
                             f"size {m.vocab_size}")
    unit = "bits/byte" if byte_level else "bits/token"
    print(f"{ids.size:,} tokens of {'the held-out split' if args.held_out else args.file}, "
          f"{args.piece} a prefill call", flush=True)
    results = evaluate(models, ids, args.piece)
    width = max(len(str(p)) for p in args.models)
    wide = max(len("weights"), *(len(m.weights) for m in models))
    print(f"{'model':<{width}}  {'weights':<{wide}} {unit:>10} {'vs first':>9} "
          f"{'max |logit diff|':>17}")
    for path, m, r in zip(args.models, models, results):
        print(f"{str(path):<{width}}  {m.weights:<{wide}} {r['bits']:>10.4f} "
              f"{r['bits'] - results[0]['bits']:>+9.4f} {r['max_logit_diff']:>17.4g}")
    if args.json:
        # the library is imported once the arguments are parsed: `hla-tvm eval --help` (and
        # `hla-tvm --help`) import this module
        from ..runtime.paths import replacing

        with replacing(args.json, "w") as f:
            json.dump({"tokens": int(ids.size), "unit": unit, "models": [
                {"path": str(p), "weights": m.weights, **r}
                for p, m, r in zip(args.models, models, results)]}, f, indent=1)
    return 0
