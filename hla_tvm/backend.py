"""Running HLA operators through the compiled TensorIR kernels (torch tensors in and out).

hla2 prefill:  chunk_summary -> chunk_carry (in place on the state) -> chunk_output
ahla prefill:  chunk_summary -> scans of P, m -> chunk_cross -> scans of E, n -> chunk_output
decode:        one in-place state update and readout
The state is the reference's dict (S, C, m, G, h) in the accumulation dtype (float32 for float16,
bfloat16 and float32 inputs, float64 for float64); outputs come in the input dtype."""
from __future__ import annotations

import math

import torch

from . import build
from .kernels import _tir, ahla
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


def _scans(widths, dtype):
    return {f"chunk_scan_w{w}": _tir.chunk_scan(w, dtype=dtype) for w in widths}


def ahla_prefill_module(dk, dv, chunk_size, target, *, normalize, eps, dtype):
    spec = {"kind": "ahla_prefill", "dk": dk, "dv": dv, "chunk": chunk_size,
            "normalize": normalize, "eps": eps, "dtype": dtype}
    return build.load_or_build(spec, lambda: {
        "ahla_chunk_summary": ahla.chunk_summary(dk, dv, chunk_size, dtype=dtype),
        "ahla_chunk_cross": ahla.chunk_cross(dk, dv, dtype=dtype),
        "ahla_chunk_output": ahla.chunk_output(dk, dv, chunk_size, normalize=normalize, eps=eps,
                                               dtype=dtype),
        **_scans({dk * dv, dk}, dtype),
    }, target)


def ahla_decode_module(dk, dv, target, *, normalize, eps, dtype):
    spec = {"kind": "ahla_decode", "dk": dk, "dv": dv, "normalize": normalize, "eps": eps,
            "dtype": dtype}
    return build.load_or_build(spec, lambda: {
        "ahla_decode": ahla.decode(dk, dv, normalize=normalize, eps=eps, dtype=dtype)}, target)


def run_ahla(q, k, v, gamma, state, *, chunk_size, target, normalize, eps):
    """AHLA outputs for contiguous q, k, v; gamma [H] (ones for no decay) in the accumulation
    dtype; `state` (P, m, E, n) advanced in place."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    opts = {"normalize": bool(normalize), "eps": float(eps), "dtype": TORCH_DTYPES[q.dtype]}
    acc = accum_dtype(q.dtype)
    out = torch.empty(B, H, T, dv, dtype=q.dtype)
    P, m, E, n = (state[x] for x in ("P", "m", "E", "n"))
    if T == 1:
        ahla_decode_module(dk, dv, target, **opts)["ahla_decode"](q, k, v, gamma, P, m, E, n, out)
        return out
    mod = ahla_prefill_module(dk, dv, chunk_size, target, **opts)
    nc = math.ceil(T / chunk_size)
    e = lambda *shape: torch.empty(B, H, nc, *shape, dtype=acc)  # noqa: E731
    R, dP, dm, dE, dn, gl = e(dk, dk), e(dk, dv), e(dk), e(dk, dv), e(dk), e()
    mod["ahla_chunk_summary"](q, k, v, gamma, R, dP, dm, dE, dn, gl)
    scan_mat, scan_vec = mod[f"chunk_scan_w{dk * dv}"], mod[f"chunk_scan_w{dk}"]
    flat, flat_c = (lambda x: x.view(B, H, -1)), (lambda x: x.view(B, H, nc, -1))
    Pc, mc, Ec, ncs = e(dk, dv), e(dk), e(dk, dv), e(dk)
    scan_mat(flat(P), flat_c(dP), gl, flat_c(Pc))
    scan_vec(m, dm, gl, mc)
    mod["ahla_chunk_cross"](R, Pc, mc, dE, dn, gl, dP, dm)      # dP, dm now hold ddE, ddn
    scan_mat(flat(E), flat_c(dP), gl, flat_c(Ec))
    scan_vec(n, dm, gl, ncs)
    mod["ahla_chunk_output"](q, k, v, gamma, Ec, Pc, ncs, mc, out)
    return out
