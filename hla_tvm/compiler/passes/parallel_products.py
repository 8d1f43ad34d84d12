"""Rewrite: the products of one input with several constant weights as one product.

An attention layer projects its input three times (q, k, v) and a SwiGLU MLP twice (gate,
up), each a product of the same activation x with a weight of its own:

    y_i = matmul(x, W_i [K, N_i])    (or matmul(x, permute_dims(W_i [N_i, K])))
 -> y = matmul(x, concat_i W_i [K, sum N_i]);   y_i = strided_slice(y, last axis, its columns)

with the W_i Relax constants (a model's parameters) of one K and dtype. Every output column is
the same dot product as before, so the values do not change; the concatenated weight is one
constant, which `pack_weights` stores packed like any other (a quantization scheme's groups run
along K, so each column keeps its scales). One kernel then reads all the weights of the input:
a decode step streams them in one pass, a prefill runs one larger product. The slices fuse
into the element-wise work that reads them (a scale, SiLU, a transpose)."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .pack_weights import weight_matrix, weight_operand


def parallel_products(mod, *, min_weights=2):
    """`mod` with, in every Relax function, the products of one input with `min_weights` or
    more constant float32 [K, N] weights (directly or through a 2-d transpose) made one product
    of the concatenated weight and slices of its result. Everything else is left as it is; the
    caller's module is unchanged."""
    matmul_op = tvm.ir.Op.get("relax.matmul")

    def static_k(x):
        """x's last dimension as an int, or None (unknown or symbolic)."""
        shape = getattr(x.ty, "shape", None)
        if not isinstance(x, relax.Var) or getattr(x.ty, "dtype", None) != "float32" or \
                shape is None or not isinstance(shape[-1], tvm.tirx.IntImm):
            return None
        return int(shape[-1])

    def groups(func):
        """{first binding's var: [(var, [K, N] weight)]} of the products to combine: those of
        one input within one dataflow block."""
        bound, plan = {}, {}
        for block in func.body.blocks:
            found = {}
            for b in block.bindings:
                bound[b.var] = b.value
                v = b.value
                if not (isinstance(v, relax.Call) and v.op.same_as(matmul_op)) or \
                        v.attrs.out_dtype not in (None, "", "float32", "void"):
                    continue
                x, k = v.args[0], static_k(v.args[0])
                w = None if k is None else weight_operand(v.args[1], bound.get)
                if w is None:
                    continue
                const, transposed = w
                if int(const.ty.shape[1 if transposed else 0]) == k:
                    found.setdefault(x, []).append((b.var, w))
            for members in found.values():
                if len(members) >= min_weights:
                    plan[members[0][0]] = [(var, weight_matrix(w)) for var, w in members]
        return plan

    @relax.expr_functor.mutator
    class _Combine(relax.PyExprMutator):
        def __init__(self, mod, plan):
            super().__init__(mod)
            self.plan = plan       # {first var: members}
            self.slices = {}       # var -> (combined product var, begin, end)

        def visit_var_binding_(self, binding):
            if binding.var in self.plan:
                members = self.plan[binding.var]
                x = self.visit_expr(binding.value.args[0])
                w = np.ascontiguousarray(np.concatenate([m[1] for m in members], axis=1))
                y = self.builder_.emit(relax.op.matmul(x, relax.const(w)),
                                        name_hint="merged")
                at = 0
                for var, m in members:
                    self.slices[var] = (y, at, at + m.shape[1])
                    at += m.shape[1]
            if binding.var in self.slices:
                y, begin, end = self.slices[binding.var]
                axis = binding.var.ty.ndim - 1
                value = self.builder_.normalize(
                    relax.op.strided_slice(y, axes=[axis], begin=[begin], end=[end]))
                self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
                return
            super().visit_var_binding_(binding)

    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
            plan = groups(func)
            if plan:
                mutator = _Combine(out, plan)
                out.update_func(gv, relax.analysis.remove_all_unused(mutator.visit_expr(func)))
    return out
