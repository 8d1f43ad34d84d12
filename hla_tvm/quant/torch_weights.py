"""A PyTorch model with its weights replaced by what a quantized module computes with: the
float32 weights a scheme's packed values dequantize to (`scheme.dequantize`), for checking a
quantized module against PyTorch and for measuring a scheme's accuracy in PyTorch."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .scheme import dequantize, quantize


def dequantized_weight(sch, weight, transposed=True):
    """The float32 tensor `weight` ([N, K] as nn.Linear keeps it, or an embedding table
    [rows, K]; [K, N] where not `transposed`, as transformers' Conv1D keeps it) after packing
    under `sch` and unpacking, as the compiled kernels see it (packed in the [K, N] layout);
    unchanged where K does not split into the scheme's groups."""
    w = weight.detach().float().cpu().numpy()
    w = w.T if transposed else w
    if not sch.fits(w.shape[0]):
        return weight.detach().float().clone()
    out = dequantize(sch, quantize(sch, w))
    return torch.from_numpy((out.T if transposed else out).copy()).to(weight.device)


def is_conv1d(module):
    """Whether `module` is transformers' Conv1D (GPT-2's projections): x @ weight [K, N] +
    bias, which a compiled module packs as it packs nn.Linear's weight."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
        and module.weight.dim() == 2


def dequantized_model(model, sch):
    """A copy of `model` (float32) whose nn.Linear, transformers' Conv1D and nn.Embedding
    weights are `dequantized_weight`s (a weight shared by several modules, a tied head, stays
    shared); for bf16 the products' inputs are rounded to bfloat16 too
    (`scheme.activations`), as a bf16 module's products take them."""
    out = copy.deepcopy(model).float()
    done = {}
    with torch.no_grad():
        for module in out.modules():
            conv = is_conv1d(module)
            if isinstance(module, (nn.Linear, nn.Embedding)) or conv:
                w = module.weight
                if id(w) not in done:
                    done[id(w)] = dequantized_weight(sch, w, transposed=not conv)
                    w.copy_(done[id(w)])
                k = w.shape[0] if conv else w.shape[1]
                if sch.name == "bf16" and (isinstance(module, nn.Linear) or conv) and \
                        sch.fits(k):
                    module.register_forward_pre_hook(_bf16_inputs)
    return out


def _bf16_inputs(_module, args):
    """A forward pre-hook: the first input rounded to bfloat16 (nearest even), as float32."""
    return (args[0].to(torch.bfloat16).float(), *args[1:])
