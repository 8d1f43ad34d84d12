"""Rewrite: a strided slice whose bounds provably lie within its input (step 1, 0 <= begin <=
end <= extent on every sliced axis) marked so (`assume_inbound`), as a time-axis slice of a
padded tensor is (`F.pad(h, (0, 0, 1, 0))[:, :T]`: T of T + 1 rows).

TVM otherwise clamps the bounds as it lowers the slice, and on a symbolic extent writes the
clamp into the output's shape as `if_then_else`, which Relax cannot type ("Cannot find the
FInferType attribute registered to op: prim.if_then_else"). Slices it cannot prove inbound
keep the clamp (and compile, or fail, as before)."""
from __future__ import annotations

import tvm
from tvm import relax

from .call_rewrite import rewrite_calls


def inbound_slices(mod):
    """`mod` with every strided_slice whose bounds the analyzer proves inbound marked
    assume_inbound (the same slice: no clamp changes anything)."""
    slice_op = tvm.ir.Op.get("relax.strided_slice")
    analyzer = tvm.sym.Analyzer()
    bound = set()

    def sizes(*exprs):
        """Every symbolic size in `exprs` known to be >= 0 (a tensor's dimension)."""
        for e in exprs:
            for v in tvm.tirx.analysis.undefined_vars(e):
                if v not in bound:
                    bound.add(v)
                    analyzer.bind(v, tvm.ir.Range.from_min_extent(0, 1 << 62))

    def values(expr):
        return list(expr.fields) if isinstance(expr, relax.Tuple) else None

    def inbound(call):
        x, axes, begin, end = call.args[:4]
        strides = call.args[4] if len(call.args) > 4 else None
        shape = getattr(x.ty, "shape", None)
        fields = [values(a) for a in (axes, begin, end)]
        if shape is None or any(f is None for f in fields):
            return False
        steps = values(strides) if strides is not None else [1] * len(fields[0])
        if steps is None:
            return False
        for axis, b, e, s in zip(*fields, steps):
            axis = int(axis.value if hasattr(axis, "value") else axis)
            if not (hasattr(s, "value") and int(s.value) == 1) and s != 1:
                return False
            extent = shape[axis]
            sizes(b, e, extent)
            if not all(analyzer.can_prove(cond) for cond in (
                    b >= 0, e >= b, e <= extent)):
                return False
        return True

    def marked(call):
        if isinstance(call.op, tvm.ir.Op) and call.op.same_as(slice_op) and \
                not call.attrs.assume_inbound and inbound(call):
            return relax.op.strided_slice(*call.args[:4],
                                          call.args[4] if len(call.args) > 4 else None,
                                          assume_inbound=True)
        return call

    return rewrite_calls(mod, marked)
