"""Emitting one HLA operator as Relax calls into the scheduled TensorIR kernels.

`emit_hla(bb, op_name, q, k, v, state, gamma, ...)`
emits the operator's kernel chain
(`ops.chains`, the one description the eager backend runs too) on Relax expressions with
(possibly symbolic) shapes q [B, H, T, Dk], k, v [B, H, T, .] and returns (o, new_state): T == 1
(static) uses the decode chain, any other T the chunked prefill, whose chunk count is
ceil(T / n) in the Relax shapes. State updates use call_tir_inplace, so a compiled module advances
the caller's state buffers in place."""
from __future__ import annotations

import contextlib
import contextvars
import json

import numpy as np
from tvm import relax
from tvm.tirx import IntImm

from .. import ops, validate
from ..ops import chains
from ..ops.common import tir as _tir
from ..schedule.gpu_limits import gpu_chunk
from ..schedule.tuning import records


def _add(bb, name, make, shapes):
    """The module's function `name`: make(), added once, carrying its argument `shapes` at the
    tuning shape (scheduled when the module is built: `schedule.tuning.model.schedule_model`)."""
    existing = [gv for gv in bb.get().get_global_vars() if gv.name_hint == name]
    if existing:
        return existing[0]
    func = make().with_attr("global_symbol", name)
    return bb.add_func(func.with_attr(records.SHAPES_ATTR, json.dumps(shapes)), name)


def _tt(shape, dtype):
    return relax.TensorType(shape, dtype)


def _shape(expr):
    return list(expr.ty.shape)


def _tag(opts):
    """A name suffix unique to the options baked into a kernel."""
    parts = [opts["dtype"], f"n{opts.get('chunk', 0)}"]
    for key in ("masked", "normalize"):
        if key in opts:
            parts.append(f"{key[0]}{int(opts[key])}")
    for key in ("eps", "ridge"):
        if key in opts:
            parts.append(f"{key[0]}{opts[key]:g}".replace(".", "p").replace("-", "m"))
    return "_".join(parts)


def _is_decode(q):
    """True where q [B, H, T, Dk] holds one token (T == 1, static): the decode chain."""
    T = _shape(q)[2]
    return isinstance(T, IntImm) and int(T) == 1


_GPU_TARGET = contextvars.ContextVar("hla_tvm_gpu_target", default=None)


@contextlib.contextmanager
def chunks_for(target):
    """Within: prefill chains emitted for a CUDA `target` use the largest chunk up to the
    model's whose tiles fit the GPU's shared memory (`schedule.gpu_limits.gpu_chunk`; the
    outputs do not depend on the chunk size). Other targets keep the model's chunk."""
    token = _GPU_TARGET.set(target if target is not None and target.kind.name == "cuda"
                            else None)
    try:
        yield
    finally:
        _GPU_TARGET.reset(token)


def emit_hla(bb, op_name, q, k, v, state, gamma, *, chunk, dtype, **opts):
    """(o, new_state list) of operator `op_name` (hla2, ahla, hla3) on q [B, H, T, Dk], k, v
    with H / group heads (query head h reads key/value head h // group), state entries in the
    operator's order (prefill: the k/v-only entries with the key/value heads; decode: every
    entry with the query heads); gamma [H] or None (no decay). Emits the kernel chain of
    `ops.chains`: T == 1 (static) its decode, any other T its prefill."""
    B, H, T, dk = _shape(q)
    dv, dk = int(_shape(v)[-1]), int(dk)
    Hkv = _shape(k)[1]
    group = int(H) // int(Hkv)
    acc = _tir.accum_dtype(dtype)
    decode = _is_decode(q)
    fam = chains.family(op_name, decayed=gamma is not None, decode=decode,
                        gpu=_GPU_TARGET.get() is not None)
    chain = chains.decode(fam) if decode else chains.prefill(fam)
    if _GPU_TARGET.get() is not None:
        opts = {**opts, **chains.gpu_options(chain)}
    if _GPU_TARGET.get() is not None and not decode:
        chunk = gpu_chunk(chain, dk, dv, _GPU_TARGET.get(), chunk=chunk, group=group,
                          dtype=dtype, **opts)
    if gamma is None and chain.takes_gamma:
        gamma = relax.const(np.ones(int(H), dtype=acc))
    tag = _tag({"dtype": dtype, "chunk": chunk, **opts}) + (f"_g{group}" if group > 1 else "")
    nc = (T + chunk - 1) // chunk
    env = {"q": q, "k": k, "v": v, "gamma": gamma, **dict(zip(chain.state_names, state))}
    gamma_kv = gamma   # the kv calls' decay: each group's first query head
    if group > 1 and gamma is not None:
        gamma_kv = bb.emit(relax.op.strided_slice(gamma, axes=[0], begin=[0], end=[int(H)],
                                                  strides=[group]))
    tune_shapes = records.chain_shapes(chain, dk, dv, chunk=chunk, group=group, dtype=dtype)
    for call, (_, call_shapes) in zip(chain.calls, tune_shapes):
        name = chains.kernel_name(chain, call, dk, dv, group)
        gv = _add(bb, f"{name}_{acc}" if call.kernel == "scan" else f"{name}_d{dk}x{dv}_{tag}",
                  lambda: chains.make_kernel(chain, call, dk, dv, chunk=chunk, dtype=dtype,
                                             group=group, **opts), call_shapes)
        args = [gamma_kv if call.kv and x == "gamma" else env[x] for x in call.reads]
        heads = Hkv if call.kv else H
        types = [_tt(_shape(args[call.reads.index(x)]), acc) for x in call.inplace]
        types += [_tt([B, H, T, dv], dtype) if kind == "o" else
                  _tt([B, heads, nc, *chains.KIND_SHAPES[kind](dk, dv, chunk)], acc)
                  for _, kind in call.writes]
        shapes = [list(ty.shape) for ty in types]   # each result's shape outside the call
        if call.kernel == "scan":   # element-wise: state, increments and record flattened
            w = chains.scan_width(call.writes[0][1], dk, dv)
            args[0] = bb.emit(relax.op.reshape(args[0], [B, heads, w]))
            args[1] = bb.emit(relax.op.reshape(args[1], [B, heads, nc, w]))
            types = [_tt([B, heads, w], acc), _tt([B, heads, nc, w], acc)]
        if call.inplace:
            idx = [call.reads.index(x) for x in call.inplace] + [-1] * len(call.writes)
            res = bb.emit(relax.call_tir_inplace(gv, args, idx, types))
        else:
            res = bb.emit(relax.call_tir(gv, args, types if len(types) > 1 else types[0]))
        results = [res] if len(types) == 1 else \
            [bb.emit(relax.TupleGetItem(res, i)) for i in range(len(types))]
        if call.kernel == "scan":
            results = [bb.emit(relax.op.reshape(r, sh)) for r, sh in zip(results, shapes)]
        for x, r in zip(call.inplace, results):
            env[x] = r
        for (x, _), r in zip(call.writes, results[len(call.inplace):]):
            env[x] = r
    return env["o"], [env[n] for n in chain.state_names]


def zero_state(bb, q, shapes):
    """Distinct zero tensors of `shapes` [B, H, ...] computed from q's shape at run time (never
    folded into module constants, which the in-place kernels would otherwise mutate)."""
    tails = [tuple(int(d) for d in sh[2:]) for sh in shapes]
    name = "hla_zero_state_" + "_".join("x".join(map(str, t)) for t in tails)
    gv = next((g for g in bb.get().get_global_vars() if g.name_hint == name), None)
    if gv is None:
        gv = bb.add_func(_tir.zero_state(tails).with_attr("global_symbol", name), name)
    res = bb.emit(relax.call_tir(gv, [q], [relax.TensorType(sh, "float32") for sh in shapes]))
    return [bb.emit(relax.TupleGetItem(res, i)) for i in range(len(shapes))]


def emit_operator(bb, order, asymmetric, q, k, v, state, decay, *, masked=True,
                  normalize=False, eps=1e-6, ridge=0.0, chunk=64):
    """(o, new_state list) of one HLA operator call with grouped key/value heads: q [B, H, T, Dk],
    k [B, Hkv, T, Dk], v [B, Hkv, T, Dv], state entries in `state_names` order (k/v-only entries
    with Hkv heads; empty for a fresh sequence, which starts from zeros), decay: per-query-head
    gamma [H] or None. The kernels run H heads, reading key/value head h // group of k, v and of
    the k/v-only entries (prefill); decode repeats those and keeps each group's first."""
    op = ops.get(order, asymmetric)
    H, Hkv = int(q.ty.shape[1]), int(k.ty.shape[1])
    group = H // Hkv
    names = op.state_names
    if not state:   # a fresh sequence
        shapes = op.state_shapes(_shape(q)[0], H, Hkv, int(q.ty.shape[3]), int(v.ty.shape[3]))
        state = zero_state(bb, q, [list(shapes[n]) for n in names])
    # the prefill kernels take the k/v-only entries per key/value head; decode the query heads'
    repeat = group > 1 and _is_decode(q)
    if repeat:
        state = [bb.emit(relax.op.repeat(s, group, axis=1)) if n in op.kv_state else s
                 for n, s in zip(names, state)]
    opts = op.options(masked=masked, normalize=normalize, eps=eps, ridge=ridge)
    out, new_state = emit_hla(bb, op.name, q, k, v, list(state), decay,
                              chunk=validate.chunk_size(
                                  int(chunk), instead="set the model's chunk_size to "
                                  f"{validate.MAX_CHUNK} or less; its weights do not change"),
                              dtype=str(q.ty.dtype), **opts)
    if repeat:
        new_state = [bb.emit(relax.op.strided_slice(s, axes=[1], begin=[0], end=[H],
                                                    strides=[group]))
                     if n in op.kv_state else s for n, s in zip(names, new_state)]
    return out, new_state
