"""Scheduling the HLA kernels of a compiled model: each from its tuned record where the records
hold one, else by the default CPU rules.

The kernels a model's HLA layers call (`frontend.relax_hla.emit_hla`) carry their argument
shapes at the tuning shape (`records.SHAPES_ATTR`), which is how their records are found; the
other functions of the model (projections, norms) are left to the Relax pipeline's rules."""
from __future__ import annotations

import json

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


def schedule_kernels(mod, target, path=None):
    """(mod with its HLA kernels scheduled for `target`, {"tuned": [names], "default": [names]}):
    the records folder `path` (None: the default rules for all) gives the schedule of each
    kernel it holds a record for."""
    from ..build import TUNED
    from . import cpu

    found = kernels(mod)
    if not found:
        return mod, {"tuned": [], "default": []}
    db = None if path is None else records.load(path)
    picked = records.pick(found, db, target, where=f" in {path}")
    used = {"tuned": sorted(n for n, f in picked.items() if TUNED in f.attrs),
            "default": sorted(n for n, f in picked.items() if TUNED not in f.attrs)}
    mod = mod.clone()
    for name, func in picked.items():
        if TUNED not in func.attrs:
            func = cpu.scheduled(func, target)
        mod.update_func(mod.get_global_var(name), func.with_attr("tirx.is_scheduled", True))
    return mod, used
