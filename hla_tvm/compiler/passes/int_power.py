"""Rewrite: x ** c for a constant whole exponent c in 2..4 (GELU-new's `torch.pow(x, 3.0)`) to
products of x, as PyTorch computes small whole powers.

TVM lowers a power to `pow`, and warns on every kernel with an exponent of 3 or more ("Detected
pow(x, y) where y >= 3"): 21 lines for one GPT-2 model. Products give x^c for negative x as
well and cost less than `pow`."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .call_rewrite import rewrite_calls

POWERS = (2, 3, 4)


def int_power(mod):
    """`mod` with power(x, c), c a scalar constant equal to a whole number in POWERS, as
    products of x (x * x, x * x * x, (x * x) * (x * x))."""
    power_op = tvm.ir.Op.get("relax.power")

    def exponent(expr):
        if not isinstance(expr, tvm.ir.expr.Constant):
            return None
        value = expr.value.numpy()
        if value.size != 1 or not np.issubdtype(value.dtype, np.floating):
            return None
        c = float(value.reshape(()))
        return int(c) if c in POWERS else None

    def products(call):
        if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(power_op)) or \
                len(call.args) != 2 or not str(getattr(call.args[0].ty, "dtype", "")
                                               ).startswith("float"):
            return call
        c = exponent(call.args[1])
        if c is None or getattr(call.args[1].ty, "ndim", 0) > getattr(call.args[0].ty,
                                                                       "ndim", 0):
            return call
        x = call.args[0]
        square = relax.op.multiply(x, x)
        return {2: square, 3: relax.op.multiply(square, x),
                4: relax.op.multiply(square, square)}[c]

    return rewrite_calls(mod, products)
