"""Scheduling a compiled model's tunable functions: each from its tuned record where the records
hold one, else by the default CPU rules.

Tunable are the HLA kernels (`compiler.relax_hla.emit_hla` gives them their argument shapes at
the tuning shape, `records.SHAPES_ATTR`) and, once the model is legalized, its projections with
their epilogues (`cpu.matmul_tiles`; tuned at batch 1 and TUNE_SHAPE's length). The other
functions (norms, element-wise work) keep the Relax pipeline's default rules."""
from __future__ import annotations

import json

from tvm import s_tir, tirx

from .. import TUNED, default_rules
from ..rules.cpu import matmul_tiles
from . import records


def kernels(mod):
    """{name: (PrimFunc without the shapes attribute, argument shapes)} of the HLA kernels in
    the IRModule `mod` that are not scheduled yet."""
    out = {}
    for gv, func in mod.functions.items():
        attrs = func.attrs if hasattr(func, "attrs") and func.attrs else {}
        if records.SHAPES_ATTR in attrs and "tirx.is_scheduled" not in attrs:
            shapes = [(tuple(s), d) for s, d in json.loads(str(attrs[records.SHAPES_ATTR]))]
            out[gv.name_hint] = (func.without_attr(records.SHAPES_ATTR), shapes)
    return out


def matmuls(mod, target):
    """{name: (PrimFunc marked `matmul_tiles.MODEL_MATMUL`, argument shapes)} of the legalized
    model functions `matmul_tiles` schedules: the projections, at batch 1 and TUNE_SHAPE's
    length (a symbolic leading dimension is the batch, any other the length)."""
    lanes = matmul_tiles.vector_lanes(target)
    out = {}
    for gv, func in mod.functions.items():
        attrs = func.attrs if isinstance(func, tirx.PrimFunc) and func.attrs else {}
        if not isinstance(func, tirx.PrimFunc) or "tirx.is_scheduled" in attrs \
                or records.SHAPES_ATTR in attrs:
            continue
        try:
            if not matmul_tiles.schedule(s_tir.Schedule(func), lanes):
                continue
        except (s_tir.ScheduleError, ValueError):
            continue
        shapes = _tuning_shapes(func)
        if shapes is not None:
            out[gv.name_hint] = (func.with_attr(matmul_tiles.MODEL_MATMUL, True), shapes)
    return out


def _tuning_shapes(func):
    """[(shape, dtype)] of func's buffer parameters with a symbolic first dimension as batch 1
    and any other symbolic dimension as TUNE_SHAPE's length; None for other shapes."""
    batch = {str(p.shape[0]) for p in func.params
             if getattr(p, "shape", None) and isinstance(p.shape[0], tirx.Var)}
    shapes = []
    for p in func.params:
        if not getattr(p, "shape", None):
            return None
        dims = []
        for d in p.shape:
            if isinstance(d, tirx.IntImm):
                dims.append(int(d))
            elif isinstance(d, tirx.Var):
                dims.append(records.TUNE_SHAPE["batch"] if str(d) in batch
                            else records.TUNE_SHAPE["seq"])
            else:
                return None
        shapes.append((tuple(dims), str(p.dtype)))
    return shapes


def tunable(mod, target):
    """The HLA kernels and projections of the legalized model `mod`, as `tune.tune` takes them
    ({name: (PrimFunc, argument shapes at the tuning shape)})."""
    return {**kernels(mod), **matmuls(mod, target)}


def schedule_model(mod, target, path=None):
    """(legalized `mod` with its HLA kernels scheduled for `target` and its projections where
    the records folder `path` holds their records, {"from_records": [names], "default":
    [names]}; a record holds a kernel's best trial, or its default schedule where no trial
    beat that):
    HLA kernels without a record get their default rules here, projections later (the Relax
    pipeline's `MatmulTiles`)."""
    projections = matmuls(mod, target) if path is not None else {}
    found = {**kernels(mod), **projections}
    if not found:
        return mod, {"from_records": [], "default": []}
    db = None if path is None else records.load(path)
    picked = records.pick(found, db, target, quiet=set(projections),   # (notice: HLA kernels)
                          path=path)
    used = {"from_records": sorted(n for n, f in picked.items() if TUNED in f.attrs),
            "default": sorted(n for n, f in picked.items() if TUNED not in f.attrs)}
    mod = mod.clone()
    for name, func in picked.items():
        if TUNED not in func.attrs:
            if name in projections:
                continue   # MatmulTiles schedules it in the pipeline
            func = default_rules(target)(func, target)
        mod.update_func(mod.get_global_var(name), func.with_attr("tirx.is_scheduled", True))
    return mod, used
