"""The functional entry point `hla(q, k, v, ...)`."""
from __future__ import annotations

import torch

from . import backend as tvm_backend, validate
from .backend import private_copy
from .decode import decode_plan
from .ops import chains, state_dtype
from .ops.common.reference import fold, gamma
from .options import Options
from .target import for_device

BACKENDS = ("tvm", "torch")


def hla(q, k, v, *, order=2, asymmetric=False, masked=True, normalize=False, eps=1e-6,
        ridge=0.0, decay=None, state=None, return_state=False, attention_mask=None,
        backend="tvm", target=None, chunk_size=64, schedules="auto"):
    """Higher-order linear attention, causal, per head.

    order=2 (HLA), with S, C, m, G, h the prefix summaries of `hla_tvm.ops.hla2.reference`:
        o_t = q_t^T ((S_t + ridge I) C_t - G_t)       = (((W W^T) * L) V)_t,  W = L * (Q K^T)
        o_t = q_t^T  (S_t + ridge I) C_t              with masked=False
    asymmetric=True (AHLA): ((A A) * L) V, A = L * (Q K^T)           (`reference.ahla`)
    order=3: ((W W^T * L) W) V                                        (`reference.hla3`)
    normalize=True divides each row by its row sum of the weights plus eps; decay (a float in
    (0, 1] or a tensor [H]) scales every summary per token as in the paper's Algorithms 1-2.

    q: [B, H, T, Dk]; k: [B, Hkv, T, Dk]; v: [B, Hkv, T, Dv] with H % Hkv == 0 (query head h reads
        key/value head h // (H / Hkv)); PyTorch SDPA layout.
    state: the dict a previous call returned with return_state=True; the sequence continues from
        it (the caller's tensors are not modified). Entries built from k, v alone have Hkv heads.
        S (a sum of k k^T) is symmetric in every state returned, and the chunk forms rely on
        it: a state made by hand must keep it so.
    attention_mask: [B, T], 1 = token, 0 = padding: padded tokens leave the state untouched and
        output zeros.
    backend: "tvm" runs the compiled TensorIR kernels (T == 1 uses the decode kernel, longer inputs
        the chunked prefill with `chunk_size`); "torch" runs the PyTorch reference (chunk form,
        differentiable).
    target: None for the tensors' device (this CPU; for CUDA tensors their GPU's architecture),
        "llvm" for this CPU, a preset or a dict / tvm.target.Target (a CUDA one for CUDA
        tensors, e.g. {"kind": "cuda", "arch": "sm_90"}). CUDA tensors run the CUDA kernels on
        PyTorch's current stream of their device.
    schedules: "auto" (tuned records for the target where `hla-tvm tune` wrote them, else the
        default schedules), "default", or a records folder.
    Returns o [B, H, T, Dv] in q's dtype, or (o, state) with return_state=True.

    To stream tokens use `decode_`, which advances the state in place at about the cost of the
    kernel; `hla` copies the state first (the caller's is left as it was).
    """
    if backend == "tvm":
        if torch.compiler.is_compiling():   # (torch.export and torch.compile trace fake tensors)
            raise TypeError(
                "hla_tvm.hla(backend='tvm') runs compiled kernels on real tensors and cannot be "
                "traced by torch.export or torch.compile (hla_tvm.compile exports the model): "
                "in a model's forward use the layer hla_tvm.nn.HLAttention or the custom op "
                "hla_tvm.nn.hla_op (torch.ops.hla_tvm.hla), which compile onto the kernels, or "
                "backend='torch'")
        validate.no_gradients("backend='tvm'", q=q, k=k, v=v, state=state, decay=decay)
    call = dict(order=order, asymmetric=asymmetric, masked=masked, normalize=normalize, eps=eps,
                ridge=ridge, decay=decay, target=target, schedules=schedules)
    if backend == "tvm" and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[2] == 1 \
            and q.shape[0] > 0 and isinstance(return_state, bool):
        step = _tvm_step(q, k, v, state, call, attention_mask, chunk_size)
        if step is not None:
            return step if return_state else step[0]
    B, H, Hkv, T, dk, dv = validate.qkv(q, k, v)
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be a bool, got {type(return_state).__name__}")
    opts = Options.checked(H, Hkv, **call)
    op = opts.op
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    chunk_size = validate.chunk_size(chunk_size, compiled=backend == "tvm")
    mask = validate.attention_mask(attention_mask, B, T)
    if state is not None:
        validate.state(state, op.state_shapes(B, H, Hkv, dk, dv),
                       f"{op.name} with B={B}, H={H}, Hkv={Hkv}, Dk={dk}, Dv={dv}")
    group = H // Hkv
    if backend == "tvm":
        _tvm_not_yet(op, device=q.device)
    if B == 0:   # an empty batch: an empty output and state
        shapes = op.state_shapes(B, H, Hkv, dk, dv)
        out = torch.empty(B, H, T, dv, dtype=q.dtype, device=q.device)
        new_state = {n: torch.empty(shapes[n], dtype=state_dtype(q.dtype), device=q.device)
                     for n in op.state_names}
        return (out, new_state) if return_state else out
    if backend == "torch":
        k, v, state = _expand_groups(op, k, v, state, group)
        out, new_state = _torch(q, k, v, state, opts, mask, chunk_size)
        if group > 1:
            new_state = {n: (x[:, ::group].contiguous() if n in op.kv_state else x)
                         for n, x in new_state.items()}
    else:   # the kernels take grouped k, v and the key/value-only entries per key/value head
        out, new_state = _tvm(q, k, v, state, opts, mask, chunk_size)
    return (out, new_state) if return_state else out


def _tvm_step(q, k, v, state, call, mask, chunk_size):
    """(o, new state) of one token through `decode_`'s plan (the one place that picks and calls
    the decode kernels), on a private copy of the state; None when an argument needs the full
    checks of `hla` (which then explain it). call: the keyword options (`options.DEFAULTS`)."""
    validate.chunk_size(chunk_size)
    plan = decode_plan(q, k, v, call)
    if mask is not None:
        if plan.decayed:
            return None   # refused by `_tvm`
        # a padded token is a zero token: the undecayed state stays, the output is zero
        mask = validate.attention_mask(mask, q.shape[0], 1)
        q, k, v = (_zero_padding(x, mask) for x in (q, k, v))
    if state is None:
        st = [torch.zeros(shape, dtype=plan.acc, device=plan.device) for shape in plan.shapes]
    else:
        if not isinstance(state, dict) or len(state) != len(plan.names):
            return None
        st = []
        for name, shape in zip(plan.names, plan.shapes):
            x = state.get(name)
            if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or \
                    x.shape != shape or x.is_meta:
                return None
            st.append(private_copy(x, plan.acc, plan.device))
    out = torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
    plan.run(*(validate.aligned(x.contiguous()) for x in (q, k, v)), st, out)
    return out, dict(zip(plan.names, st))


def _expand_groups(op, k, v, state, group):
    """Grouped key/value heads for the PyTorch forms: k, v and the state entries built from
    k, v alone (stored once per key/value head) repeated for the query heads."""
    if group == 1:
        return k, v, state
    if state is not None:
        state = {n: (x.repeat_interleave(group, 1) if n in op.kv_state else x)
                 for n, x in state.items()}
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), state


def _tvm_not_yet(op, *, device):
    """Options whose compiled kernels are not written yet raise NotImplementedError naming
    them."""
    missing = []
    if device.type not in ("cpu", "cuda"):
        missing.append(f"device {device} (CPU and CUDA tensors only)")
    if missing:
        raise NotImplementedError("backend='tvm' does not support yet: " + "; ".join(missing)
                                  + " (backend='torch' does)")


def _torch(q, k, v, state, opts, mask, chunk_size):
    """The PyTorch forms: the chunk form with every chunk at once (the operator's
    `fast.chunked`), in float64
    for float64 input and float32 otherwise. The
    serial recurrence runs instead where the chunk form cannot give the exact answer: padding
    together with decay, and inf/NaN inputs (the chunk form's intra-chunk products multiply the
    zero weights of later tokens by their values, and 0 * inf is NaN, which would reach earlier
    outputs)."""
    op, decay, kernel_opts = opts.op, opts.decay, opts.kernel()
    work = state_dtype(q.dtype)
    qw, kw, vw = (x.to(work) for x in (q, k, v))
    st = None if state is None else {n: x.to(work) for n, x in state.items()}
    if mask is not None and decay is None:
        # a zero token leaves every undecayed summary unchanged; select, never multiply, so an
        # inf/NaN in a padded position has no effect
        qw, kw, vw = (_zero_padding(x, mask) for x in (qw, kw, vw))
        mask = None
    # (where the custom op's backward is traced, which cannot branch on values, the chunk form
    # runs: its gradients for non-finite inputs are not finite either)
    if qw.shape[2] == 1 and mask is None and kw.shape[1] == qw.shape[1]:
        # one token (a decode step): the operator's step on a copy of the state, the serial
        # recurrence itself; the chunk form's setup costs far more than one token's work
        B, H, _, dk = qw.shape
        st = {n: x.clone() for n, x in st.items()} if st is not None else \
            op.ref.zero_state(B, H, dk, vw.shape[-1], dtype=work, device=q.device)
        out = op.fast.step_(qw[:, :, 0], kw[:, :, 0], vw[:, :, 0], st, decay=decay,
                            **kernel_opts)
        return out[:, :, None].to(q.dtype), st
    if mask is not None or (not validate.values_checked() and not all(
            bool(torch.isfinite(x).all()) for x in (qw, kw, vw))):
        out, st = fold(op.ref.step, op.ref.zero_state, qw, kw, vw, st, mask, decay=decay,
                       **kernel_opts)
    else:   # every chunk at once
        out, st = op.fast.chunked(qw, kw, vw, chunk_size=chunk_size, decay=decay, state=st,
                                  **kernel_opts)
    return out.to(q.dtype), st


def _zero_padding(x, mask):
    """x [B, H, T, D] with the padded tokens (mask [B, T] False) set to zero by selection."""
    return torch.where(mask.to(x.device)[:, None, :, None], x,
                       torch.zeros((), dtype=x.dtype, device=x.device))


def _tvm(q, k, v, state, opts, mask, chunk_size):
    op, decay = opts.op, opts.decay
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    if mask is not None:  # zero tokens leave the (undecayed) state unchanged and output zero
        if decay is not None:
            raise NotImplementedError("backend='tvm' does not support yet: attention_mask "
                                      "together with decay (backend='torch' does)")
        q, k, v = (_zero_padding(x, mask) for x in (q, k, v))
    tgt = for_device(q.device, opts.target)
    acc = state_dtype(q.dtype)
    if state is None:
        shapes = op.state_shapes(B, H, k.shape[1], dk, dv)
        st = {n: torch.zeros(shapes[n], dtype=acc, device=q.device) for n in op.state_names}
    else:  # a private copy in the accumulation dtype: the kernels update it in place
        st = {n: tvm_backend.private_copy(x, acc, q.device) for n, x in state.items()}
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    fam = chains.family(op.name, decayed=decay is not None, decode=False,
                        gpu=tgt.kind.name == "cuda")
    g = gamma(decay, torch.empty(1, H, 0, dtype=acc, device=q.device))[0].contiguous()
    out = tvm_backend.prefill(fam, q, k, v, g, st, chunk_size=chunk_size, target=tgt,
                              schedules=opts.schedules,
                              **chains.kernel_options(q.dtype, **opts.kernel()))
    return out, st
