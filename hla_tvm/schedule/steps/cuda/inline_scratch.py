"""Rule: element-wise stages computed from scratch alone are computed where they are read.

A transpose, a causal mask or a row scaling of a chunk tile reads only other scratch (no kernel
argument): it costs little to recompute at each use, and inlining it frees its shared-memory
tile (a chunk kernel's tiles must fit one thread block's shared memory). Stages that read the
kernel's arguments (the staged chunk of q, k, v) stay, as do those calling exp (the decay
powers, computed once on purpose)."""
from __future__ import annotations

from ...common import among, is_elementwise, root_blocks, root_scratch, walk


def _calls_exp(stmt):
    found = []
    walk(stmt, lambda node: found.append(node) if getattr(getattr(node, "op", None), "name", "")
         in ("tirx.exp", "tirx.log") else None)
    return bool(found)


def inline_scratch(sch, func_name):
    """compute_inline every element-wise block whose reads are all scratch buffers and whose
    body calls no exp or log, into its consumers (a block that cannot be inlined stays)."""
    scratch = root_scratch(sch)
    for block in root_blocks(sch):
        stmt = sch.get(block)
        if stmt.init is not None or not is_elementwise(sch, block):
            continue
        if not all(among(r.source, scratch) for r in list(stmt.reads) + list(stmt.writes)):
            continue
        if _calls_exp(stmt.body):
            continue
        try:
            sch.compute_inline(block)
        except Exception:  # noqa: BLE001 - not inlinable (several writes, an opaque read)
            continue
