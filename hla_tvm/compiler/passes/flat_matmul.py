"""Relax rewrite: a projection that torch.export flattened around a 2-D matmul,

    reshape(matmul(reshape(x [.., T, K], [B*T, K]), W [K, N]), [.., T, N])  ->  matmul(x, W)

so the product keeps x's leading axes and FuseOps can fuse it with the element-wise ops after it
(an activation, a residual add), which a reshape in between (an injective op) prevents."""
from __future__ import annotations

from tvm import relax, sym
from tvm.relax.dpl import is_op, rewrite_call, wildcard


def _same_dims(a, b):
    ana = sym.Analyzer()
    return len(a) == len(b) and all(ana.can_prove_equal(x, y) for x, y in zip(a, b))


def unflatten_matmuls(mod):
    """`mod` with every flattened projection in its Relax functions rewritten as above."""
    x, w = wildcard(), wildcard()
    inner = is_op("relax.reshape")(x, wildcard())
    outer = is_op("relax.reshape")(is_op("relax.matmul")(inner, w), wildcard())

    def rewriter(expr, matches):
        types = [e.ty for e in (matches[x], matches[w], expr)]
        if not all(isinstance(t, relax.TensorType) and t.shape is not None for t in types):
            return expr
        xd, wd, od = (list(t.shape) for t in types)
        if len(wd) != 2 or len(xd) < 2 or not _same_dims(xd[-1:], wd[:1]) or \
                not _same_dims(od, xd[:-1] + wd[1:]):
            return expr
        return relax.op.matmul(matches[x], matches[w])

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite_call(outer, rewriter, func)
    return mod
