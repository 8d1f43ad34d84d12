"""Rewrite: x * rsqrt(mean(x ** 2, axis=-1, keepdims) + eps) * w, how an RMSNorm written in
PyTorch (`hla_tvm.nn.RMSNorm`) arrives from torch.export, to one `relax.nn.rms_norm`.

TVM's operator fusion does not fuse an element-wise producer into the reduction that reads
it, so the form as exported runs two kernels (x ** 2, then the mean fused with the rest):
the shipped demo model's decode ran 13 of its 70 kernels a token for its 13 norms.
`relax.nn.rms_norm` lowers to one function, x * w / sqrt(mean(x ** 2) + eps) over the last
axis, the same formula, computed in float32 (so only float32 norms are rewritten)."""
from __future__ import annotations

import functools

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard


def _scalar(expr, value=None):
    """The float of a scalar Relax constant `expr` (equal to `value` when given), else None."""
    if not isinstance(expr, tvm.ir.expr.Constant):
        return None
    array = expr.value.numpy()
    if array.ndim != 0:
        return None
    got = float(array)
    return got if value is None or got == value else None


def fused_rms_norm(mod):
    """`mod` with every x * rsqrt(mean(x ** 2, [-1], keepdims=True) + eps) * w (x float32 of
    rank 2 or more with a static last dimension, w a constant of that size, eps and the
    exponent 0-d constants) replaced by rms_norm(x, w, [-1], eps) in every Relax function;
    anything else is left as it is. (TVM's rms_norm computes in float32: other dtypes keep
    their form.)"""
    x, w, two, eps = wildcard(), is_const(), is_const(), is_const()
    mean = is_op("relax.mean")(is_op("relax.power")(x, two))
    scale = is_op("relax.rsqrt")(is_op("relax.add")(mean, eps))
    pattern = is_op("relax.multiply")(is_op("relax.multiply")(x, scale), w)

    def rewrite(expr, found):
        data, weight, m = found[x], found[w], found[mean]
        epsilon = _scalar(found[eps])
        shape = getattr(data.ty, "shape", None)
        if _scalar(found[two], 2.0) is None or epsilon is None or shape is None or \
                len(shape) < 2 or not isinstance(shape[-1], tvm.tirx.IntImm) or \
                m.attrs.axis is None or not m.attrs.keepdims or \
                [int(a) for a in m.attrs.axis] not in ([-1], [len(shape) - 1]) or \
                list(weight.value.shape) != [int(shape[-1])] or \
                data.ty.dtype != "float32" or weight.ty.dtype != "float32":
            return expr
        lead = [d for d in list(shape)[:-1]
                if not (isinstance(d, tvm.tirx.IntImm) and int(d) == 1)]
        if len(lead) < 2:
            return relax.op.nn.rms_norm(data, weight, axes=[-1], epsilon=epsilon)
        # rows over several axes (a prefill's [B, T, D]): one axis of rows, which the norm's
        # schedule (dlight's CPU Reduction) runs in parallel, where it takes the first alone
        rows = functools.reduce(lambda a, b: a * b, list(shape)[:-1])
        flat = relax.op.reshape(data, [rows, shape[-1]])
        return relax.op.reshape(relax.op.nn.rms_norm(flat, weight, axes=[-1], epsilon=epsilon),
                                list(shape))

    out = mod.clone()   # (the caller's module stays as it was)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            out.update_func(gv, rewrite_call(pattern, rewrite, func))
    return out
