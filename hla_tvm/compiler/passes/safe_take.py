"""Rewrite: every Relax `take` in "fast" mode (an out-of-range index reads out of bounds) to a
mode that cannot read out of bounds and keeps PyTorch's indexing: a negative index counts from
the axis' end (index + axis length).

- the token-id lookup (the indices are the entry's `tokens`, through reshapes only): "clip"
  (the index clamped to the axis). The frontends emit the embedding lookup as take(weight,
  tokens, axis=0, mode="fast"), which TVM lowers with a warning that it segfaults on
  out-of-range ids. The runtime range-checks token ids before every call (an embedding has no
  negative ids: PyTorch raises on them); clamping inside the kernel keeps a bad id that slips
  past (a direct VM call) from reading out of bounds, at the cost of two integer comparisons a
  row.
- constant indices (`x[:, -1]`, `x[:, 3]`: torch's select.int): negative ones wrapped here when
  the axis length is static, then "clip"; on an axis of symbolic length (the time axis) with a
  negative index, "wrap".
- any other indices (positions, gathered rows): "wrap", which maps -n..n-1 onto 0..n-1 as
  PyTorch does (and an index out of range, which PyTorch refuses, to some row in range).

"clip" alone would clamp index -1 to row 0: `x[:, -1]` (last-token pooling, a token shift)
returned the first row."""
from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax


def safe_take(mod, param="tokens"):
    """`mod` with take(..., mode="fast") in every function replaced as the module docstring
    says: "clip" for the lookups of the token ids (the parameter `param` of a function, through
    the operators of _ID_PRESERVING), constant indices wrapped then "clip", "wrap" otherwise."""
    take_op = tvm.ir.Op.get("relax.take")
    preserving = [tvm.ir.Op.get(name) for name in _ID_PRESERVING]

    @relax.expr_functor.mutator
    class _Safe(relax.PyExprMutator):
        def _token_ids(self, expr):
            """Whether `expr` is the parameter `param`, moved or reshaped only."""
            while isinstance(expr, relax.Var):
                if expr.name == param and self.lookup_binding(expr) is None:
                    return True
                value = self.lookup_binding(expr)
                if not isinstance(value, relax.Call) or \
                        not any(value.op.same_as(op) for op in preserving):
                    return False
                expr = value.args[0]
            return False

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not call.op.same_as(take_op) or str(call.attrs.mode) != "fast":
                return call
            data, indices = call.args
            axis = call.attrs.axis
            if self._token_ids(indices):
                return relax.op.take(data, indices, axis, mode="clip")
            if isinstance(indices, tvm.ir.expr.Constant):
                idx = indices.value.numpy()
                n = _axis_length(data, axis)
                if n is not None and (idx < 0).any():
                    idx = np.where(idx < 0, idx + n, idx).astype(idx.dtype)
                    indices = relax.const(idx, str(idx.dtype))
                if (idx >= 0).all():
                    return relax.op.take(data, indices, axis, mode="clip")
            return relax.op.take(data, indices, axis, mode="wrap")

    mutator = _Safe(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


def _axis_length(data, axis):
    """The static length of `data`'s axis `axis` (None: the flattened tensor), or None where it
    is symbolic or unknown."""
    shape = getattr(data.ty, "shape", None)
    if shape is None or not hasattr(shape, "__len__"):
        return None
    dims = list(shape) if axis is None else [list(shape)[int(axis)]]
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return math.prod(int(d) for d in dims)


# operators that move or reshape the token ids without changing them
_ID_PRESERVING = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten",
                  "relax.permute_dims", "relax.astype", "relax.strided_slice",
                  "relax.broadcast_to")


def token_rows(mod, param="tokens"):
    """The number of valid token ids of the entry functions of `mod` (those with a parameter
    named `param`): the fewest rows among the tables the ids index (`take` along axis 0 of a
    table with a static row count, the ids reaching it through reshapes only), or None when no
    such lookup is found. A lookup with other indices (positions) does not count."""
    preserving = [tvm.ir.Op.get(name) for name in _ID_PRESERVING]
    take_op = tvm.ir.Op.get("relax.take")
    rows = []
    for _, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        ids = [p for p in func.params if p.name == param]
        for block in func.body.blocks if ids else ():
            for binding in block.bindings:
                value = binding.value
                if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
                    continue
                if any(value.op.same_as(op) for op in preserving) and \
                        any(value.args[0].same_as(x) for x in ids):
                    ids.append(binding.var)
                elif value.op.same_as(take_op) and int(value.attrs.axis) == 0 and \
                        any(value.args[1].same_as(x) for x in ids):
                    shape = getattr(value.args[0].ty, "shape", None)
                    if shape is not None and isinstance(shape[0], tvm.tirx.IntImm):
                        rows.append(int(shape[0]))
    return min(rows) if rows else None
