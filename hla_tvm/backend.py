"""Running HLA operators through the compiled TensorIR kernels (torch tensors in and out).

hla2 prefill:  chunk_summary -> chunk_carry (in place on the state) -> chunk_output
ahla, hla3:    chunk_summary -> scans of the prefix sums -> chunk_cross -> scans of the
               cross-term states -> chunk_output
decode:        one in-place state update and readout (chosen and called by `decode._Plan`;
               second order with or without decay shares the hla2d kernel, gamma = 1 for none)
The state is the reference's dict (S, C, m, G, h) in the accumulation dtype (float32 for float16,
bfloat16 and float32 inputs, float64 for float64); outputs come in the input dtype."""
from __future__ import annotations

import math

import torch

from . import build
from .kernels import KERNELS, STATE_NAMES, _tir
from .kernels import hla2 as K
from .operators import state_dtype


TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64"}


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


# Scratch (per-chunk summaries and records) a prefill call may hold: longer inputs run in
# consecutive segments, each advancing the state in place, so memory does not grow with T.
SCRATCH_BYTES = 128 << 20


def segment_tokens(B, H, dk, dv, chunk_size, acc):
    """Tokens per segment: whole chunks whose scratch (at most 12 dk x max(dk, dv) accumulation
    values per chunk and head, the widest operator's) fits in SCRATCH_BYTES; at least one."""
    per_chunk = B * H * 12 * dk * max(dk, dv) * (torch.finfo(acc).bits // 8)
    return chunk_size * max(1, SCRATCH_BYTES // per_chunk)


def _segmented(q, k, v, chunk_size, chain):
    """o [B, H, T, dv]: chain(q, k, v, o) on the whole input, or on consecutive segments of
    `segment_tokens` (each continuing the state the one before left)."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(B, H, T, dv, dtype=q.dtype)
    seg = segment_tokens(B, H, dk, dv, chunk_size, state_dtype(q.dtype))
    if T <= seg:
        chain(q, k, v, out)
        return out
    for start in range(0, T, seg):
        end = min(T, start + seg)
        part = torch.empty(B, H, end - start, dv, dtype=q.dtype)
        chain(*(x[:, :, start:end].contiguous() for x in (q, k, v)), part)
        out[:, :, start:end] = part
    return out


def run(q, k, v, state, *, chunk_size, target, masked, normalize, eps, ridge):
    """Outputs [B, H, T, dv] for contiguous q, k, v (one floating dtype); `state` (accumulation
    dtype, contiguous, owned by the caller) is advanced in place past the T tokens."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    opts = _options(masked, normalize, eps, ridge, q.dtype)
    acc = state_dtype(q.dtype)
    S, C, m, G, h = (state[x] for x in ("S", "C", "m", "G", "h"))
    mod = prefill_module(dk, dv, chunk_size, target, **opts)

    def chain(q, k, v, out):
        nc = math.ceil(q.shape[2] / chunk_size)
        e = lambda *shape: torch.empty(B, H, nc, *shape, dtype=acc)  # noqa: E731
        dS, dC, dm, dX, dr = e(dk, dk), e(dk, dv), e(dk), e(dk, dv), e(dk)
        Sc, Xc, rc = e(dk, dk), e(dk, dv), e(dk)
        mod["hla2_chunk_summary"](q, k, v, dS, dC, dm, dX, dr)
        mod["hla2_chunk_carry"](dS, dC, dm, dX, dr, S, C, m, G, h, Sc, Xc, rc)
        mod["hla2_chunk_output"](q, k, v, Sc, Xc, rc, out)

    return _segmented(q, k, v, chunk_size, chain)


def _scans(widths, dtype):
    return {f"chunk_scan_w{w}": _tir.chunk_scan(w, dtype=dtype) for w in widths}




def scan_family_prefill_module(name, dk, dv, chunk_size, target, *, dtype, **opts):
    """chunk_summary, chunk_cross, chunk_output and the chunk scans of operator `name`;
    opts (normalize, eps and, for hla2d, masked and ridge) shape the output kernel."""
    kmod = KERNELS[name]
    spec = {"kind": f"{name}_prefill", "dk": dk, "dv": dv, "chunk": chunk_size, "dtype": dtype,
            **opts}
    return build.load_or_build(spec, lambda: {
        f"{name}_chunk_summary": kmod.chunk_summary(dk, dv, chunk_size, dtype=dtype),
        f"{name}_chunk_cross": kmod.chunk_cross(dk, dv, dtype=dtype),
        f"{name}_chunk_output": kmod.chunk_output(dk, dv, chunk_size, dtype=dtype, **opts),
        **_scans({dk * dk, dk * dv, dk}, dtype),
    }, target)


def decode_module(name, dk, dv, target, *, dtype, **opts):
    """The one-token kernel of operator `name` (ahla, hla3, hla2d; hla2d serves undecayed
    second order too, with gamma = 1)."""
    spec = {"kind": f"{name}_decode", "dk": dk, "dv": dv, "dtype": dtype, **opts}
    return build.load_or_build(spec, lambda: {
        f"{name}_decode": KERNELS[name].decode(dk, dv, dtype=dtype, **opts)}, target)


class _Chunks:
    """Scratch tensors [B, H, NC, ...] in the accumulation dtype and the scan calls."""

    def __init__(self, mod, B, H, nc, dtype):
        self.mod, self.B, self.H, self.nc, self.dtype = mod, B, H, nc, dtype

    def empty(self, *shape):
        return torch.empty(self.B, self.H, self.nc, *shape, dtype=self.dtype)

    def scan(self, state, delta, gl):
        """Advance `state` in place by the per-chunk increments; returns its value per chunk."""
        B, H, nc = self.B, self.H, self.nc
        record = torch.empty_like(delta)
        self.mod[f"chunk_scan_w{delta[0, 0, 0].numel()}"](
            state.view(B, H, -1), delta.view(B, H, nc, -1), gl, record.view(B, H, nc, -1))
        return record


def run_scan_family(name, q, k, v, gamma, state, *, chunk_size, target, **opts):
    """Outputs of operator `name` (ahla, hla3, hla2d) for contiguous q, k, v; gamma [H] (ones for
    no decay) in the accumulation dtype; `state` (reference names) advanced in place.
    opts: normalize, eps (and masked, ridge for hla2d)."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    opts = {**{n: (float(x) if n in ("eps", "ridge") else bool(x)) for n, x in opts.items()},
            "dtype": TORCH_DTYPES[q.dtype]}
    st = [state[x] for x in STATE_NAMES[name]]
    mod = scan_family_prefill_module(name, dk, dv, chunk_size, target, **opts)
    return _segmented(q, k, v, chunk_size, lambda q, k, v, out: _scan_family_chain(
        name, mod, q, k, v, gamma, st, out, chunk_size))


def _scan_family_chain(name, mod, q, k, v, gamma, st, out, chunk_size):
    """summary -> scans of the prefix sums -> cross -> scans of the cross states -> output."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    ch = _Chunks(mod, B, H, math.ceil(T / chunk_size), state_dtype(q.dtype))
    kk, kv, vec = (dk, dk), (dk, dv), (dk,)
    if name == "ahla":
        P, m, E, n = st
        R, dP, dm, dE, dn, gl = ch.empty(*kk), ch.empty(*kv), ch.empty(*vec), ch.empty(*kv), \
            ch.empty(*vec), ch.empty()
        mod["ahla_chunk_summary"](q, k, v, gamma, R, dP, dm, dE, dn, gl)
        Pc, mc = ch.scan(P, dP, gl), ch.scan(m, dm, gl)
        mod["ahla_chunk_cross"](R, Pc, mc, dE, dn, gl, dP, dm)   # dP, dm now hold ddE, ddn
        Ec, nc = ch.scan(E, dP, gl), ch.scan(n, dm, gl)
        mod["ahla_chunk_output"](q, k, v, gamma, Ec, Pc, nc, mc, out)
    elif name == "hla2d":
        S, C, m, G, h = st
        dS, dC, dm, KK, dG, dh, gl = ch.empty(*kk), ch.empty(*kv), ch.empty(*vec), \
            ch.empty(*kk), ch.empty(*kv), ch.empty(*vec), ch.empty()
        mod["hla2d_chunk_summary"](q, k, v, gamma, dS, dC, dm, KK, dG, dh, gl)
        Sc, Cc, mc = ch.scan(S, dS, gl), ch.scan(C, dC, gl), ch.scan(m, dm, gl)
        mod["hla2d_chunk_cross"](KK, Cc, mc, dG, dh, gl, gamma, dC, dm)  # dC, dm: ddG, ddh
        Gc, hc = ch.scan(G, dC, gl), ch.scan(h, dm, gl)
        mod["hla2d_chunk_output"](q, k, v, gamma, Sc, Cc, mc, Gc, hc, out)
    else:
        S, P, m, F, eta = st
        dS, dP, dm, A1, A2, a2, A3, A4, a4, gl = (
            ch.empty(*kk), ch.empty(*kv), ch.empty(*vec), ch.empty(*kk), ch.empty(*kv),
            ch.empty(*vec), ch.empty(*kk), ch.empty(*kv), ch.empty(*vec), ch.empty())
        mod["hla3_chunk_summary"](q, k, v, gamma, dS, dP, dm, A1, A2, a2, A3, A4, a4, gl)
        Sc, Pc, mc = ch.scan(S, dS, gl), ch.scan(P, dP, gl), ch.scan(m, dm, gl)
        mod["hla3_chunk_cross"](Sc, Pc, mc, A1, A2, a2, A3, A4, a4, gl, dP, dm)  # ddF, ddeta
        Fc, etac = ch.scan(F, dP, gl), ch.scan(eta, dm, gl)
        mod["hla3_chunk_output"](q, k, v, gamma, Sc, Pc, mc, Fc, etac, out)
