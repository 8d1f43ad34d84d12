"""`hla-tvm eval`: how well models predict one text, side by side: bits per byte for byte-level
models (bits per token for others), the difference to the first model, and the largest logit
difference to it over the same tokens.

A model is a compiled module (`.so`, run by TVM's runtime alone: quantized modules as they
ship), a checkpoint (`HLALM.save`) or `module:factory` (`models.source`), both run by PyTorch in
float32; with `--quantize` PyTorch runs them with the weights a module of that scheme computes
with (`quant.torch_weights.dequantized_model`), so a scheme's accuracy is measured without
compiling. The text runs through each
model as one sequence, `--piece` tokens per prefill call with the state carried, so every
prediction sees all the text before it."""
from __future__ import annotations

import json
import math

import numpy as np

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


class ModuleLM:
    """A compiled module (`runtime.load`): logits of a piece, the state carried."""

    def __init__(self, model):
        from ..runtime.model import scheme_name

        self.model = model
        self.state = model.init_state(1)
        self.vocab = model.vocab
        self.vocab_size = model.vocab_size
        self.weights = scheme_name(model.meta) + " (compiled)"

    def logits(self, piece):
        return np.asarray(self.model.prefill(piece[None], self.state)[0])[0]


class TorchLM:
    """An HLALM in PyTorch (float32): logits of a piece, the state carried."""

    def __init__(self, model, weights="float32 (PyTorch)"):
        self.model = model.eval().float()
        self.state = None
        config = getattr(model, "config", None) or {}
        self.vocab = config.get("vocab")
        self.vocab_size = config.get("vocab_size")
        self.weights = weights

    def logits(self, piece):
        import torch

        with torch.no_grad():
            out, self.state = self.model(torch.from_numpy(piece)[None], self.state)
        return out[0].numpy()


def _open(path, sch=None):
    """The model at `path`; a PyTorch one with its weights under the scheme `sch` (None:
    float32)."""
    if str(path).endswith(".so"):
        from ..runtime import load

        return ModuleLM(load(path))
    if str(path).endswith(".onnx"):
        raise ValueError(f"{path}: an ONNX model; eval takes compiled modules and checkpoints: "
                         f"`hla-tvm compile {path} -o model.so`, then eval model.so")
    from ..models.source import load

    model = load(path)
    if sch is None:
        return TorchLM(model)
    from ..quant.torch_weights import dequantized_model
    from ..runtime.model import scheme_name

    return TorchLM(dequantized_model(model, sch),
                   weights=f"{scheme_name({'quantize': sch.as_meta()})} (PyTorch)")


def held_out_bytes():
    """The validation split of `hla-tvm train` as int64 byte ids."""
    from .train import stdlib_corpus

    return stdlib_corpus()[1].numpy().astype(np.int64)


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


def _shared_tokenizer(paths, models):
    """The tokenizer the compiled modules among `models` keep (`runtime.text`), None where
    none keeps one; ValueError where two keep different ones (their ids would differ)."""
    from ..runtime.text import TOKENIZER

    kept = [(p, m) for p, m in zip(paths, models)
            if isinstance(m, ModuleLM) and m.model.meta.get(TOKENIZER)]
    if not kept:
        return None
    first_path, first = kept[0]
    for path, m in kept[1:]:
        if m.model.meta[TOKENIZER] != first.model.meta[TOKENIZER]:
            raise ValueError(f"{path} and {first_path} keep different tokenizers: give the "
                             "text as token ids, or evaluate them apart")
    return first.model.text


def evaluate(models, ids, piece):
    """[{"bits": per token, "max_logit_diff": to models[0]}] of `models` over the token ids."""
    nll = [0.0] * len(models)
    diff = [0.0] * len(models)
    for start in range(0, ids.size - 1, piece):
        chunk = ids[start:start + piece + 1]
        inputs, targets = chunk[:-1], chunk[1:]
        ref = None
        for i, m in enumerate(models):
            logits = m.logits(inputs).astype(np.float64)
            top = logits.max(axis=-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
            nll[i] -= float(logp[np.arange(targets.size), targets].sum())
            if ref is None:
                ref = logits
            else:
                diff[i] = max(diff[i], float(np.abs(logits - ref).max()))
    count = ids.size - 1
    return [{"bits": n / count / math.log(2), "max_logit_diff": d} for n, d in zip(nll, diff)]


def main(args):

    sch = checked_scheme(args)
    if sch is not None and all(str(p).endswith(".so") for p in args.models):
        raise ValueError("--quantize applies to checkpoints and module:factory models (run in "
                         "PyTorch); compiled modules keep the scheme they were compiled with, "
                         "and every MODEL given is one")
    models = [_open(path, sch) for path in args.models]
    byte_level = {m.vocab == "bytes" for m in models}
    if len(byte_level) != 1:
        raise ValueError("the models must all be byte-level or all not: their bits are of "
                         "different units otherwise")
    byte_level = byte_level.pop()
    ids = _tokens(args, byte_level, _shared_tokenizer(args.models, models))
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
        from ..runtime.paths import replacing

        with replacing(args.json, "w") as f:
            json.dump({"tokens": int(ids.size), "unit": unit, "models": [
                {"path": str(p), "weights": m.weights, **r}
                for p, m, r in zip(args.models, models, results)]}, f, indent=1)
    return 0
