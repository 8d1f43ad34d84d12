"""The shapes kernels are specialized to: for tuning, for finding their tuned records
(`tuning.records`, matched by structural hash) and for checking a GPU's limits
(`gpu_limits`). A kernel has symbolic batch, heads and length; `TUNE_SHAPE` fixes them
(batch 1, 8 query heads, 4096 tokens; one for decode)."""
from __future__ import annotations

import tvm
from tvm import tirx

from ..ops import chains

TUNE_SHAPE = {"batch": 1, "heads": 8, "seq": 4096}


def chain_shapes(chain, dk, dv, *, chunk=None, group=1, dtype):
    """[(call, argument shapes)] of every call of `chain` (`ops.chains`) at the tuning
    shape: batch 1, 8 query heads (or the next multiple of group), 4096 tokens (one for
    decode); what its kernels are specialized to for tuning and for finding their records."""
    H = -(-TUNE_SHAPE["heads"] // group) * group
    T = 1 if chain.calls[0].kernel == "decode" else TUNE_SHAPE["seq"]
    return chains.argument_shapes(chain, TUNE_SHAPE["batch"], H, H // group, T, dk, dv,
                                  chunk or 1, dtype)


def specialize(func, shapes):
    """`func` with its symbolic batch, heads and lengths fixed by the argument shapes `shapes`
    [(shape, dtype)], one per parameter (as meta_schedule measures it)."""
    def dims(param, shape):
        return [tvm.tirx.IntImm("int64", int(v)) if isinstance(d, tvm.ir.expr.Var) else d
                for d, v in zip(param.shape, shape)]

    if len(shapes) != len(func.params):
        raise ValueError(f"{len(shapes)} argument shapes for a kernel of {len(func.params)} "
                         "parameters")
    return func.specialize({p: tirx.decl_buffer(dims(p, shape), dtype, name=p.name,
                                                elem_offset=p.elem_offset)
                            for p, (shape, dtype) in zip(func.params, shapes)})


def tuning_kernels(chain, dk, dv, *, chunk=None, group=1, dtype, **opts):
    """{function name: (PrimFunc, argument shapes)} of `chain`'s kernels, the shapes those of a
    call at the tuning shape (`chain_shapes`)."""
    funcs = chains.kernels(chain, dk, dv, chunk=chunk, group=group, dtype=dtype, **opts)
    out = {}
    for call, shapes in chain_shapes(chain, dk, dv, chunk=chunk, group=group, dtype=dtype):
        name = chains.kernel_name(chain, call, dk, dv, group)
        out[name] = (funcs[name], shapes)
    return out
