"""`torch.ops.hla_tvm.hla`: the HLA operator as one opaque node for torch.export.

    hla(q, k, v, state: list[Tensor], decay: Tensor?, order, asymmetric, masked, normalize,
        eps, ridge, chunk_size) -> [o, *new_state]

(one flat list of tensors, so exporters map it onto one node with 1 + len(state) outputs)

state lists the operator's summaries in `state_names(order, asymmetric)` order, or is empty for
a fresh sequence (the new state is returned either way: float64 for float64 inputs, else
float32); it runs the PyTorch reference (`hla_tvm.hla(..., backend="torch")`) and is
differentiable in q, k, v, the state and decay. The compile path maps this node onto the TensorIR
kernels."""
from __future__ import annotations

import torch

from .. import ops, validate
from ..api import hla as _hla
from ..ops import state_dtype


def state_names(order=2, asymmetric=False):
    """The operator's state entries, in the order the custom op takes and returns them."""
    return tuple(ops.get(order, asymmetric).state_names)


def _run(q, k, v, state, decay, order, asymmetric, masked, normalize, eps, ridge, chunk_size):
    names = state_names(order, asymmetric)
    extra = dict(masked=masked, ridge=ridge) if ops.get(order, asymmetric).has_mask_ridge \
        else {}
    # (under torch.autocast the operator keeps its own precision: inputs as given, the state
    # float32; autocast's casts inside it would mix dtypes in its in-place updates)
    with torch.autocast(q.device.type, enabled=False):
        out, st = _hla(q, k, v, order=order, asymmetric=asymmetric, normalize=normalize,
                       eps=eps, decay=decay, state=dict(zip(names, state)) if state else None,
                       return_state=True, backend="torch", chunk_size=chunk_size, **extra)
    dtypes = [x.dtype for x in state] if state else [state_dtype(q.dtype)] * len(names)
    return out, [st[n].to(dt) for n, dt in zip(names, dtypes)]


@torch.library.custom_op("hla_tvm::hla", mutates_args=())
def hla_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: list[torch.Tensor],
           decay: torch.Tensor | None, order: int, asymmetric: bool, masked: bool,
           normalize: bool, eps: float, ridge: float, chunk_size: int
           ) -> list[torch.Tensor]:
    out, st = _run(q, k, v, state, decay, order, asymmetric, masked, normalize, eps, ridge,
                   chunk_size)
    return [out.contiguous()] + [x.contiguous() for x in st]


@hla_op.register_fake
def _(q, k, v, state, decay, order, asymmetric, masked, normalize, eps, ridge, chunk_size):
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    if state:
        return [out] + [torch.empty_like(x) for x in state]
    shapes = ops.get(order, asymmetric).state_shapes(
        q.shape[0], q.shape[1], k.shape[1], q.shape[-1], v.shape[-1])
    return [out] + [q.new_empty(shapes[n], dtype=state_dtype(q.dtype))
                    for n in state_names(order, asymmetric)]


def _setup_context(ctx, inputs, output):
    q, k, v, state, decay, *opts = inputs
    ctx.save_for_backward(q, k, v, decay, *state)
    ctx.opts, ctx.n_state = opts, len(state)


def _backward(ctx, grads_out):
    """Recompute through the differentiable reference and pull the gradients back (to q, k, v,
    the state and decay)."""
    grad_out, grad_state = grads_out[0], grads_out[1:]
    q, k, v, decay, *state = ctx.saved_tensors
    q, k, v, *state = (x.detach().requires_grad_() for x in (q, k, v, *state))
    wrt = [q, k, v, *state]
    if decay is not None and ctx.needs_input_grad[4]:
        decay = decay.detach().requires_grad_()
        wrt.append(decay)
    with torch.enable_grad(), validate.recomputing():
        out, st = _run(q, k, v, state, decay, *ctx.opts)
        pairs = [(out, grad_out)] + [(s, g) for s, g in zip(st, grad_state) if g is not None]
        grads = torch.autograd.grad([p for p, _ in pairs], wrt, [g for _, g in pairs],
                                    allow_unused=True)
    gq, gk, gv = grads[:3]
    gs = grads[3:3 + ctx.n_state]
    gd = grads[3 + ctx.n_state] if len(grads) > 3 + ctx.n_state else None
    return gq, gk, gv, list(gs), gd, None, None, None, None, None, None, None


hla_op.register_autograd(_backward, setup_context=_setup_context)
