"""The functional entry point `hla(q, k, v, ...)`."""
from __future__ import annotations

import torch

from . import validate
from .reference import hla2 as ref

BACKENDS = ("tvm", "torch")


def hla(q, k, v, *, order=2, asymmetric=False, masked=True, normalize=False, eps=1e-6,
        ridge=0.0, decay=None, state=None, return_state=False, backend="tvm", target=None,
        chunk_size=64):
    """Higher-order linear attention, causal, per head.

    Second order (the default), with S, C, m, G, h the prefix summaries of `hla_tvm.reference.hla2`:
        o_t = q_t^T ((S_t + ridge I) C_t - G_t)                  masked=True
        o_t = q_t^T  (S_t + ridge I) C_t                         masked=False
        o_t /= q_t^T ((S_t + ridge I) m_t - h_t) + eps           normalize=True
    equal to ((W W^T) * L) V with W = L * (Q K^T) for masked, ridge 0.

    q: [B, H, T, Dk], k: [B, H, T, Dk], v: [B, H, T, Dv] (PyTorch SDPA layout).
    state: the dict a previous call returned with return_state=True; the sequence continues from it
        (the caller's tensors are not modified).
    backend: "tvm" runs the compiled TensorIR kernels (T == 1 uses the decode kernel, longer inputs
        the chunked prefill with `chunk_size`); "torch" runs the PyTorch reference.
    target: None or "llvm" for this CPU, or a dict / tvm.target.Target.
    Returns o [B, H, T, Dv] in q's dtype, or (o, state) with return_state=True.
    """
    B, H, Hkv, T, dk, dv = validate.qkv(q, k, v)
    order = validate.integer("order", order, choices={2, 3})
    eps = validate.real("eps", eps, low=0.0)
    ridge = validate.real("ridge", ridge, low=0.0)
    decay = validate.decay(decay, H)
    chunk_size = validate.integer("chunk_size", chunk_size, low=1)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if state is not None:
        validate.state(state, B, H, dk, dv)
    for name, flag in (("asymmetric", asymmetric), ("masked", masked), ("normalize", normalize),
                       ("return_state", return_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    _not_yet(backend, order=order, asymmetric=asymmetric, grouped=Hkv != H, decay=decay,
             dtype=q.dtype, device=q.device)
    opts = dict(masked=masked, normalize=normalize, eps=eps, ridge=ridge)
    if backend == "torch":
        out, new_state = _torch(q, k, v, state, decay, chunk_size, opts)
    else:
        out, new_state = _tvm(q, k, v, state, target, chunk_size, opts)
    return (out, new_state) if return_state else out


def _not_yet(backend, *, order, asymmetric, grouped, decay, dtype, device):
    """Options whose kernels are not written yet raise NotImplementedError naming the option."""
    missing = []
    if order != 2:
        missing.append(f"order={order}")
    if asymmetric:
        missing.append("asymmetric=True")
    if grouped:
        missing.append("grouped key/value heads (k, v with fewer heads than q)")
    if backend == "tvm":
        if decay is not None:
            missing.append("decay")
        if dtype != torch.float32:
            missing.append(f"dtype {dtype} (the kernels compute in float32 for now)")
        if device.type != "cpu":
            missing.append(f"device {device} (CPU tensors only for now)")
    if missing:
        raise NotImplementedError(f"backend={backend!r} does not support yet: "
                                  + "; ".join(missing))


def _torch(q, k, v, state, decay, chunk_size, opts):
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qw, kw, vw = (x.to(work) for x in (q, k, v))
    st = None if state is None else {n: x.to(work) for n, x in state.items()}
    if decay is None:
        out, st = ref.chunked(qw, kw, vw, chunk_size=chunk_size, state=st, **opts)
    else:
        out, st = ref.serial(qw, kw, vw, decay=decay, state=st, **opts)
    return out.to(q.dtype), st


def _tvm(q, k, v, state, target, chunk_size, opts):
    from . import backend as tvm_backend
    from .target import resolve

    B, H, T, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        st = ref.zero_state(B, H, dk, dv, torch.float32)
    else:  # a private float32 copy: the kernels update it in place
        st = {n: x.to(torch.float32).contiguous().clone() for n, x in state.items()}
    out = tvm_backend.run(q.contiguous(), k.contiguous(), v.contiguous(), st,
                          chunk_size=chunk_size, target=resolve(target), **opts)
    return out, st
