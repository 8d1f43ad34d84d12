"""Legalization of a float32 sigmoid on CPUs (a SiLU gate: torch.export writes F.silu(x) as
x * sigmoid(x)) that vectorizes:

    sigmoid(x) = 1 / (1 + e^-x),   e^-x by TVM's polynomial `topi.fast_exp`

TVM's own legalization writes e^-x as `tir.exp`, which LLVM emits as one call to libm's `expf`
per element, inside the otherwise vectorized epilogue of the product that feeds it. fast_exp's
largest relative error is 2.8e-7 over [-80, 80] (float32 `expf`'s: 1.8e-7 over [-5, 5]),
measured against float64 `numpy.exp` (2026-12-06); a NaN stays NaN. Other dtypes keep TVM's
legalization."""
from __future__ import annotations

import tvm
from tvm import te, tirx, topi

NAME = "fast_sigmoid"   # the PrimFunc's and the block's name


def _compute(x):
    e = topi.fast_exp(topi.negative(x))
    # (fast_exp clamps its argument, which would turn a NaN into a number: NaN stays NaN)
    return te.compute(x.shape, lambda *i: tirx.Select(te.isnan(x[i]), x[i], 1.0 / (1.0 + e[i])),
                      name=NAME, tag="elemwise")


def legalize_sigmoid(bb, call):
    """`LegalizeOps`' function for relax.sigmoid: `_compute` for float32, TVM's own
    legalization otherwise."""
    x = call.args[0]
    if str(getattr(x.ty, "dtype", "")) != "float32":
        return tvm.ir.Op.get("relax.sigmoid").get_attr("FLegalize")(bb, call)
    return bb.call_te(_compute, x, primfunc_name_hint=NAME)


LEGALIZE = {"relax.sigmoid": legalize_sigmoid}   # for `relax.transform.LegalizeOps`
