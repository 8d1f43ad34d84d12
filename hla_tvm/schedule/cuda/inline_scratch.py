"""Rule: element-wise stages computed from scratch alone are computed where they are read.

A transpose, a causal mask or a row scaling of a chunk tile reads only other scratch (no kernel
argument): it costs little to recompute at each use, and inlining it frees its shared-memory
tile (a chunk kernel's tiles must fit one thread block's shared memory). Stages that read the
kernel's arguments (the staged chunk of q, k, v) stay, as do those calling exp (the decay
powers, computed once on purpose)."""
from __future__ import annotations


def _calls_exp(stmt):
    from .stage_syncs import _walk

    found = []

    def visit(node):
        op = getattr(node, "op", None)
        if op is not None and getattr(op, "name", "") in ("tirx.exp", "tirx.log", "tir.exp"):
            found.append(node)

    _walk_expr(stmt, visit)
    return bool(found)


def _walk_expr(node, visit):
    """Call visit on every expression and statement node under `node`."""
    visit(node)
    for name in ("body", "value", "a", "b", "condition", "true_value", "false_value", "then_case",
                 "else_case"):
        child = getattr(node, name, None)
        if child is not None and not isinstance(child, (str, int, float, bool)):
            _walk_expr(child, visit)
    for child in list(getattr(node, "args", None) or ()) + list(getattr(node, "seq", None) or ()):
        _walk_expr(child, visit)


def inline_scratch(sch, func_name):
    """compute_inline every element-wise block whose reads are all scratch buffers and whose
    body calls no exp or log, into its consumers (a block that cannot be inlined stays)."""
    from ..common import is_elementwise

    root = sch.get(sch.get_sblock("root"))
    scratch = list(root.alloc_buffers)
    for block in list(sch.get_child_blocks(sch.get_sblock("root"))):
        stmt = sch.get(block)
        if stmt.init is not None or not is_elementwise(sch, block):
            continue
        if not all(any(r.source.same_as(b) for b in scratch) for r in stmt.reads):
            continue
        if not all(any(w.source.same_as(b) for b in scratch) for w in stmt.writes):
            continue
        if _calls_exp(stmt.body):
            continue
        try:
            sch.compute_inline(block)
        except Exception:  # noqa: BLE001 - not inlinable (several writes, an opaque read)
            continue
