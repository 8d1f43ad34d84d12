"""Running second-order HLA through the compiled TensorIR kernels (torch tensors in and out).

prefill:  chunk_summary -> chunk_carry (in place on the state) -> chunk_output
decode:   one in-place state update and readout
The state is the reference's dict (S, C, m, G, h) in the accumulation dtype (float32 for float16,
bfloat16 and float32 inputs, float64 for float64); outputs come in the input dtype."""
from __future__ import annotations

import math

import torch

from . import build
from .kernels import hla2 as K


TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64"}


def accum_dtype(dtype):
    """The torch dtype of the state for inputs of torch dtype `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _options(masked, normalize, eps, ridge, dtype):
    return {"masked": bool(masked), "normalize": bool(normalize), "eps": float(eps),
            "ridge": float(ridge), "dtype": TORCH_DTYPES[dtype]}


def prefill_module(dk, dv, chunk_size, target, **opts):
    spec = {"kind": "hla2_prefill", "dk": dk, "dv": dv, "chunk": chunk_size, **opts}
    ro = {"masked": opts["masked"], "ridge": opts["ridge"], "dtype": opts["dtype"]}
    return build.load_or_build(spec, lambda: {
        "hla2_chunk_summary": K.chunk_summary(dk, dv, chunk_size, dtype=opts["dtype"]),
        "hla2_chunk_carry": K.chunk_carry(dk, dv, **ro),
        "hla2_chunk_output": K.chunk_output(dk, dv, chunk_size, **opts),
    }, target)


def decode_module(dk, dv, target, **opts):
    spec = {"kind": "hla2_decode", "dk": dk, "dv": dv, **opts}
    return build.load_or_build(spec, lambda: {"hla2_decode": K.decode(dk, dv, **opts)}, target)


def run(q, k, v, state, *, chunk_size, target, masked, normalize, eps, ridge):
    """Outputs [B, H, T, dv] for contiguous q, k, v (one floating dtype); `state` (accumulation
    dtype, contiguous, owned by the caller) is advanced in place past the T tokens."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    opts = _options(masked, normalize, eps, ridge, q.dtype)
    acc = accum_dtype(q.dtype)
    out = torch.empty(B, H, T, dv, dtype=q.dtype)
    S, C, m, G, h = (state[x] for x in ("S", "C", "m", "G", "h"))
    if T == 1:
        decode_module(dk, dv, target, **opts)["hla2_decode"](q, k, v, S, C, m, G, h, out)
        return out
    mod = prefill_module(dk, dv, chunk_size, target, **opts)
    nc = math.ceil(T / chunk_size)
    e = lambda *shape: torch.empty(B, H, nc, *shape, dtype=acc)  # noqa: E731
    dS, dC, dm, dX, dr = e(dk, dk), e(dk, dv), e(dk), e(dk, dv), e(dk)
    Sc, Xc, rc = e(dk, dk), e(dk, dv), e(dk)
    mod["hla2_chunk_summary"](q, k, v, dS, dC, dm, dX, dr)
    mod["hla2_chunk_carry"](dS, dC, dm, dX, dr, S, C, m, G, h, Sc, Xc, rc)
    mod["hla2_chunk_output"](q, k, v, Sc, Xc, rc, out)
    return out
