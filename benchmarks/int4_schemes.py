"""Held-out accuracy of the shipped model with 4-bit weights under three rounding schemes, in
PyTorch (no compiling), to choose between a symmetric and an asymmetric int4:

    python benchmarks/int4_schemes.py [TOKENS]   (default 262144, as the README's table)

  sym7   what `hla_tvm.quant` stores: per group of G inputs, scale = max |w| / 7, levels -7..7
  sym8   scale = -w_far / 8 for the group's value farthest from zero, levels -8..7 (all 16)
  asym   scale = (max - min) / 15, an integer zero point, levels 0..15 (a zero point per group
         stored beside the scale)

Prints bits/byte over the first TOKENS bytes of `hla-tvm train`'s validation split and each
scheme's difference to float32, for groups of 32, 64 and 128 (the linear layers and the
embedding; a weight whose input width does not split into groups stays float32, as in
`quant.torch_weights`)."""
import copy
import sys

import numpy as np
import torch
from torch import nn

from hla_tvm.models import SHIPPED
from hla_tvm.evaluate import TorchLM, evaluate, held_out_bytes
from hla_tvm.models.source import load
from hla_tvm.quant.scheme import dequantize, quantize, scheme


def _groups(w, g):
    k, n = w.shape
    return w.reshape(k // g, g, n)


def sym7(w, g):
    sch = scheme("int4", g)   # (the stored scheme itself: packed, then unpacked)
    return dequantize(sch, quantize(sch, w))


def sym8(w, g):
    G = _groups(w, g)
    hi, lo = G.max(1, keepdims=True), G.min(1, keepdims=True)
    s = -np.where(np.abs(lo) >= np.abs(hi), lo, hi) / 8
    s[s == 0] = 1
    return (np.clip(np.rint(G / s), -8, 7) * s).reshape(w.shape)


def asym(w, g):
    G = _groups(w, g)
    hi, lo = G.max(1, keepdims=True), G.min(1, keepdims=True)
    s = (hi - lo) / 15
    s[s == 0] = 1
    z = np.rint(-lo / s)
    return ((np.clip(np.rint(G / s) + z, 0, 15) - z) * s).reshape(w.shape)


def rounded(model, fn, g):
    """A copy of `model` whose linear and embedding weights ([K, N] as the kernels store them)
    went through `fn` in groups of `g` inputs (shared weights once)."""
    out = copy.deepcopy(model).float()
    seen = set()
    with torch.no_grad():
        for mod in out.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)) and id(mod.weight) not in seen:
                seen.add(id(mod.weight))
                w = mod.weight.detach().double().numpy().T
                if w.shape[0] % g == 0:
                    mod.weight.copy_(torch.from_numpy(fn(w, g).T.copy()).float())
    return out


def main():
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 262144
    model = load(SHIPPED)
    names, models = ["float32"], [TorchLM(model)]
    for g in (32, 64, 128):
        for fn in (sym7, sym8, asym):
            names.append(f"int4 group {g} {fn.__name__}")
            models.append(TorchLM(rounded(model, fn, g)))
    res = evaluate(models, held_out_bytes()[:tokens], 4096)
    print(f"{'weights':24s} bits/byte  vs float32  largest logit difference")
    for name, r in zip(names, res):
        print(f"{name:24s} {r['bits']:9.4f}  {r['bits'] - res[0]['bits']:+10.4f}  "
              f"{r['max_logit_diff']:.2f}")


if __name__ == "__main__":
    main()
