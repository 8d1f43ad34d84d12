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

    take_op = tvm.ir.Op.get("relax.take")

    @relax.expr_functor.mutator
    class _Clip(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(take_op) and str(call.attrs.mode) == "fast":
                return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
            return call

    mutator = _Clip(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()
