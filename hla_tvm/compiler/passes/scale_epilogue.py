"""Rewrites that let a projection's scale run inside the projection's kernel.

How attention layers arrive from torch.export, q = (x @ Wq).view(B, T, H, d).transpose(1, 2)
/ sqrt(d), runs the scale as a kernel of its own: TVM fuses an element-wise consumer into a
matrix product only when it reads the product directly, and here a reshape and a transpose
stand between them. Two exact rewrites remove what stands between:

- A transpose that moves only axes of size 1 (at decode T = 1, so [B, 1, H, d] ->
  [B, H, 1, d]) keeps every element's place in memory: it is a reshape, which the VM runs as a
  view.
- y = reshape(z) * c (or / c, c * y, c / y) with c a 0-d constant is reshape(z * c), the same
  values in the same order; moved down a chain of reshapes, the scale meets the product and
  fusion makes it the product's epilogue.

Without them a decode step runs the q and k scales as two kernels a layer of their own.
Prefill's transposes move T and stay transposes."""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

_SCALES = ("relax.multiply", "relax.divide")


def _static_one(dim):
    return isinstance(dim, tvm.tirx.IntImm) and int(dim) == 1


def moves_units_only(shape, axes):
    """Whether permute_dims(x, axes) of an x of `shape` leaves the axes not of static size 1 in
    their order (then it is a reshape)."""
    kept = [a for a in axes if not _static_one(shape[a])]
    return kept == sorted(kept)


def scale_epilogue(mod):
    """`mod` with, in every Relax function, each permute_dims that moves only size-1 axes made a
    reshape, then each product of a reshape and a 0-d constant (multiply, divide, either
    operand order) made the reshape of the product of its input and the constant. Everything
    else is left as it is; the caller's module is unchanged."""
    x = wildcard()
    transpose = is_op("relax.permute_dims")(x)

    def as_reshape(expr, found):
        shape = getattr(found[x].ty, "shape", None)
        if shape is None:
            return expr
        axes = expr.attrs.axes
        axes = list(reversed(range(len(shape)))) if axes is None else [int(a) for a in axes]
        if not moves_units_only(shape, axes):
            return expr
        return relax.op.reshape(found[x], expr.ty.shape)

    z, c = wildcard(), is_const()
    reshaped = is_op("relax.reshape")(z, wildcard())

    def scale_first(const_first):
        def rewrite(expr, found):
            # (matched through bindings: the call's arguments may be variables, so the operand
            # order comes from the pattern, not from looking for the constant among them)
            const = found[c]
            if const.value.numpy().ndim != 0 or getattr(expr.ty, "shape", None) is None:
                return expr
            args = [const, found[z]] if const_first else [found[z], const]
            return relax.op.reshape(relax.Call(expr.op, args), expr.ty.shape)
        return rewrite

    scalings = [(is_op(op)(c, reshaped) if first else is_op(op)(reshaped, c), scale_first(first))
                for op in _SCALES for first in (False, True)]

    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            func = rewrite_call(transpose, as_reshape, func)   # (each to a fixed point)
            for pattern, rewrite in scalings:
                func = rewrite_call(pattern, rewrite, func)
            out.update_func(gv, func)
    return out
