"""Rewriting the Relax calls of every function of a module, one call at a time."""
from __future__ import annotations

from tvm import relax


def rewrite_calls(mod, rewrite):
    """`mod` with every call in its Relax functions passed through rewrite(call), arguments
    first: rewrite returns the call unchanged or the expression that replaces it."""
    @relax.expr_functor.mutator
    class _Rewrite(relax.PyExprMutator):
        def visit_call_(self, call):
            return rewrite(super().visit_call_(call))

    mutator = _Rewrite(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()
