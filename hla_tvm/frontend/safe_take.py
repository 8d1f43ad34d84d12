"""Rewrite: every Relax `take` in "fast" mode (an out-of-range index reads out of bounds) to
"clip" mode (the index is clamped to the axis).

The frontends emit the embedding lookup as take(weight, tokens, axis=0, mode="fast"), which TVM
lowers with a warning that it segfaults on out-of-range ids. The runtime range-checks token ids
before every call; clamping inside the kernel keeps a bad id that slips past (a direct VM call)
from reading out of bounds, at the cost of two integer comparisons a row."""
from __future__ import annotations


def safe_take(mod):
    """`mod` with take(..., mode="fast") replaced by take(..., mode="clip") in every function."""
    import tvm
    from tvm import relax

    from .call_rewrite import rewrite_calls

    take_op = tvm.ir.Op.get("relax.take")

    def clip(call):
        if call.op.same_as(take_op) and str(call.attrs.mode) == "fast":
            return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
        return call

    return rewrite_calls(mod, clip)



# operators that move or reshape the token ids without changing them
_ID_PRESERVING = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten",
                  "relax.permute_dims", "relax.astype", "relax.strided_slice",
                  "relax.broadcast_to")


def token_rows(mod, param="tokens"):
    """The number of valid token ids of the entry functions of `mod` (those with a parameter
    named `param`): the fewest rows among the tables the ids index (`take` along axis 0 of a
    table with a static row count, the ids reaching it through reshapes only), or None when no
    such lookup is found. A lookup with other indices (positions) does not count."""
    import tvm
    from tvm import relax

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
