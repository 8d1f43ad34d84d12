"""Marking the TensorIR functions that only a prompt's prefill runs (attribute `MANY_ROWS`): their
symbolic extents hold the prompt's tokens, so their schedules may take them for many rows.

The decode entries' functions have one row a stream (a batch that is usually small); a
prefill's element-wise work (SwiGLU's gate, residual adds, transposes) covers every token of
the prompt, 512 x 3,072 elements a layer for a 512-token prompt of the 120 M model, which
`schedule.rules.cpu.ParallelFallback` runs serially where it cannot see that size."""
from __future__ import annotations

import tvm
from tvm import relax

from ...schedule.common import MANY_ROWS
from ...schedule.tuning.records import SHAPES_ATTR

PREFILL_ENTRIES = ("prefill",)


def mark_prefill_kernels(mod, prefill=PREFILL_ENTRIES):
    """`mod` (legalized) with MANY_ROWS set on every PrimFunc but the HLA kernels that the
    Relax functions named in `prefill` call and no other Relax function does."""
    calls = tuple(tvm.ir.Op.get(f"relax.{n}") for n in ("call_tir", "call_tir_inplace"))
    callers = {}   # PrimFunc name -> names of the Relax functions that call it

    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue

        def visit(expr, entry=gv.name_hint):
            if isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in calls) and \
                    isinstance(expr.args[0], tvm.ir.GlobalVar):
                callers.setdefault(expr.args[0].name_hint, set()).add(entry)

        relax.analysis.post_order_visit(func.body, visit)
    out = mod.clone()
    for name, entries in callers.items():
        func = mod[name]
        # (not the HLA kernels: their own rules schedule them, and an attribute would change
        # the workloads by which tuned records find them)
        if entries <= set(prefill) and isinstance(func, tvm.tirx.PrimFunc) and \
                SHAPES_ATTR not in (func.attrs or {}):
            out.update_func(out.get_global_var(name), func.with_attr(MANY_ROWS, True))
    return out
