"""Relax rewrite: tensor shapes simplified under the sizes' known ranges (torch.export's range
constraints: the time axis >= 2, the batch >= 1).

A slice of the time axis, `h[:, :-1]` or `h[:, -1:]`, comes out of TVM's importer with the
length min(max(T - 1, 0), T), which TVM cannot simplify without knowing T >= 1; the add or
concat that meets it then loses its shape (`R.Tensor(ndim=3)`), and legalizing a reshape of it
failed ("emit_te now only supports Tensor that has ShapeExpr shape"). Here each binding whose
shape holds a min or max is simplified by an analyzer that knows the ranges, and where that
changes it, a match_cast gives the value the simplified shape (T - 1), from which the rest of
the function infers equal shapes again."""
from __future__ import annotations

from tvm import relax, sym


def _has_min_max(shape):
    """Whether a dimension of `shape` (PrimExprs) holds a min or a max."""
    return any("T.min(" in str(d) or "T.max(" in str(d) for d in shape)


def tighten_shapes(mod, ranges):
    """`mod` with every function's min/max shapes simplified under `ranges` ({symbolic
    variable name: (least, most or None)}; the variables of the functions' parameters)."""
    @relax.expr_functor.mutator
    class _Tighten(relax.PyExprMutator):
        def __init__(self, mod, analyzer):
            super().__init__(mod)
            self.analyzer = analyzer

        def visit_var_binding_(self, binding):
            value = self.visit_expr(binding.value)
            dataflow = isinstance(binding.var, relax.DataflowVar)
            var = self.builder_.emit(value) if dataflow else self.builder_.emit_output(value)
            ty = var.ty
            shape = getattr(ty, "shape", None)
            if dataflow and isinstance(ty, relax.TensorType) and \
                    isinstance(shape, relax.ShapeExpr) and _has_min_max(shape.values):
                dims = [self.analyzer.simplify(d) for d in shape.values]
                if not _has_min_max(dims):
                    var = self.builder_.match_cast(var, relax.TensorType(dims, ty.dtype))
            self.set_var_remap(binding.var, var)

    out = mod
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        analyzer = sym.Analyzer()
        for var in relax.analysis.defined_symbolic_vars(func):
            bound = ranges.get(var.name)
            if bound is None:
                continue
            least, most = bound
            most = 2 ** 62 if most is None else int(most)   # (POS_INF: no bound min() can use)
            analyzer.update(var, sym.ConstIntBound(int(least), most), override=True)
        mutator = _Tighten(out, analyzer)
        new = mutator.visit_expr(func)
        mutator.builder_.update_func(gv, new)
        out = mutator.builder_.get()
    return out


def export_ranges(ep):
    """{symbol name: (least, most or None)} of an ExportedProgram's range constraints."""
    out = {}
    for name, vr in ep.range_constraints.items():
        least, most = _int(vr.lower), _int(vr.upper)
        if least is not None:
            out[str(name)] = (least, most if most is None or most < 2 ** 62 else None)
    return out


def _int(bound):
    """A range's bound as an int, or None for an infinite one (sympy's and torch's infinities
    raise their own errors on int())."""
    try:
        return int(bound)
    except Exception:  # noqa: BLE001 - oo, -oo, int_oo
        return None
