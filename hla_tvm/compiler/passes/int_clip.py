"""Rewrite: a clip of an integer tensor with an infinite bound (what torch's one-sided
`tokens.clamp(max=N)` or `clamp(min=N)` exports as) to a clip with the dtype's own bound.

TVM's frontend writes the missing bound as a float -inf or +inf, which cannot be cast to an
integer when the clip is lowered ("Cannot convert infinity to BigInt"); the dtype's least or
greatest value clips nothing, as the infinite bound means."""
from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

from .call_rewrite import rewrite_calls


def int_clip(mod):
    """`mod` with clip(x, -inf, hi) / clip(x, lo, inf) of integer x bounded by x's dtype."""
    clip_op = tvm.ir.Op.get("relax.clip")

    def bound(value, dtype, end):
        if isinstance(value, tvm.ir.prim.expr.FloatImm) and math.isinf(value.value):
            info = np.iinfo(dtype)
            return tvm.tirx.IntImm(dtype, int(info.min if end == 0 else info.max))
        return value

    def bounded(call):
        dtype = str(getattr(call.args[0].ty, "dtype", "")) if call.args else ""
        if isinstance(call.op, tvm.ir.Op) and call.op.same_as(clip_op) and \
                dtype.startswith(("int", "uint")):
            lo, hi = bound(call.args[1], dtype, 0), bound(call.args[2], dtype, 1)
            if not (lo.same_as(call.args[1]) and hi.same_as(call.args[2])):
                return relax.op.clip(call.args[0], lo, hi)
        return call

    return rewrite_calls(mod, bounded)
