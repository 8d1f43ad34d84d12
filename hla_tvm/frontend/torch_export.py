"""torch.export -> Relax for models built from `hla_tvm.nn`, with every `hla_tvm::hla` node lowered
onto our TensorIR kernels (`custom_convert_map` of TVM's exported-program frontend)."""
from __future__ import annotations

from tvm import relax

from .. import operators
from .relax_hla import emit_hla

OP_NAME = "hla.default"   # how TVM's frontend names torch.ops.hla_tvm.hla.default


def convert_hla_node(node, importer):
    """Relax for one `hla_tvm::hla` node: returns (o, [new state]) as the node's tuple value."""
    q, k, v, state, decay, order, asym, masked, normalize, eps, ridge, chunk = \
        importer.retrieve_args(node)
    op = operators.get(order, asym)
    bb = importer.block_builder
    H, Hkv = int(q.ty.shape[1]), int(k.ty.shape[1])
    group = H // Hkv
    names = op.state_names
    if group > 1:  # run as repeated heads; k/v-only state entries are stored per k/v head
        k, v = (bb.emit(relax.op.repeat(x, group, axis=1)) for x in (k, v))
        state = [bb.emit(relax.op.repeat(s, group, axis=1)) if n in op.kv_state else s
                 for n, s in zip(names, state)]
    opts = dict(normalize=bool(normalize), eps=float(eps))
    name = op.name
    if op.has_mask_ridge:
        opts.update(masked=bool(masked), ridge=float(ridge))
        if decay is not None:
            name = "hla2d"
    dtype = str(q.ty.dtype)
    out, new_state = emit_hla(bb, name, q, k, v, list(state), decay, chunk=int(chunk),
                              dtype=dtype, **opts)
    if group > 1:
        new_state = [bb.emit(relax.op.strided_slice(s, axes=[1], begin=[0], end=[H],
                                                    strides=[group]))
                     if n in op.kv_state else s for n, s in zip(names, new_state)]
    return out, new_state


def import_exported(ep):
    """Relax IRModule ("main") of an ExportedProgram whose HLA nodes call our kernels."""
    from tvm.relax.frontend.torch import from_exported_program

    return from_exported_program(ep, custom_convert_map={OP_NAME: convert_hla_node})
