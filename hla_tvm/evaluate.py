"""Evaluation (`hla-tvm eval`): how well models predict one text, side by side: bits per byte for byte-level
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

import math

import numpy as np



class ModuleLM:
    """A compiled module (`runtime.load`): logits of a piece, the state carried."""

    def __init__(self, model):
        # the runtime, torch and the models are imported where used: `hla-tvm eval --help` imports
        # this module (numpy alone)
        from .runtime.model import scheme_name

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


def open_model(path, sch=None):
    """The model at `path`; a PyTorch one with its weights under the scheme `sch` (None:
    float32)."""
    if str(path).endswith(".so"):
        from .runtime import load

        return ModuleLM(load(path))
    if str(path).endswith(".onnx"):
        raise ValueError(f"{path}: an ONNX model; eval takes compiled modules and checkpoints: "
                         f"`hla-tvm compile {path} -o model.so`, then eval model.so")
    from .models.source import load

    model = load(path)
    if sch is None:
        return TorchLM(model)
    from .quant.torch_weights import dequantized_model
    from .runtime.model import scheme_name

    return TorchLM(dequantized_model(model, sch),
                   weights=f"{scheme_name({'quantize': sch.as_meta()})} (PyTorch)")


def held_out_bytes():
    """The validation split of `hla-tvm train` as int64 byte ids."""
    from .train import stdlib_corpus

    return stdlib_corpus()[1].numpy().astype(np.int64)


def shared_tokenizer(paths, models):
    """The tokenizer the compiled modules among `models` keep (`runtime.text`), None where
    none keeps one; ValueError where two keep different ones (their ids would differ)."""
    from .runtime.text import TOKENIZER

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
