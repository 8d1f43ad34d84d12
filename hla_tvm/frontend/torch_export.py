"""torch.export -> Relax for models built from `hla_tvm.nn`, with every `hla_tvm::hla` node lowered
onto our TensorIR kernels (`custom_convert_map` of TVM's exported-program frontend)."""
from __future__ import annotations

import contextlib
import warnings

from .relax_hla import emit_operator

OP_NAME = "hla.default"   # how TVM's frontend names torch.ops.hla_tvm.hla.default


def convert_hla_node(node, importer):
    """Relax for one `hla_tvm::hla` node: [o, *new state], the node's list value."""
    q, k, v, state, decay, order, asym, masked, normalize, eps, ridge, chunk = \
        importer.retrieve_args(node)
    out, new_state = emit_operator(importer.block_builder, order, asym, q, k, v, list(state),
                                   decay, masked=masked, normalize=normalize, eps=eps,
                                   ridge=ridge, chunk=chunk)
    return [out, *new_state]


def convert_select(node, importer):
    """Relax for torch's select.int (`x[:, i]`). TVM's own converter takes a constant index
    only (a symbolic one, `x[:, x.shape[1] - 1]`, failed: "value has to be scalar or Tensor");
    here a symbolic index becomes a one-element index tensor taken in "wrap" mode, so that a
    negative value counts from the axis' end as in PyTorch. (A constant index is taken as TVM
    takes it; `safe_take` gives its take PyTorch's meaning.)"""
    import tvm
    from torch import fx
    from tvm import relax, tirx

    x = importer.env[node.args[0]]
    dim, index = node.args[1], node.args[2]
    bb = importer.block_builder
    if not isinstance(index, fx.Node):
        return bb.emit(relax.op.take(x, relax.const(index, "int64"), dim))
    value = importer.env[index]
    if not tvm.ir.is_prim_expr(value):
        raise TypeError(f"select.int: an index of {type(value).__name__} is not supported")
    value = value if str(value.ty) == "int64" else value.astype("int64")
    one = bb.emit(relax.op.arange(relax.prim_value(value), relax.prim_value(value + 1),
                                  relax.prim_value(tirx.IntImm("int64", 1)), "int64"))
    return bb.emit(relax.op.take(x, bb.emit(relax.op.reshape(one, ())), dim, mode="wrap"))


def import_exported(ep):
    """Relax IRModule ("main") of an ExportedProgram whose HLA nodes call our kernels."""
    from tvm.relax.frontend.torch import from_exported_program

    from .flat_matmul import unflatten_matmuls
    from .shape_bounds import export_ranges, tighten_shapes

    ep = without_runtime_asserts(ep)   # (decomposed there, as TVM's importer would)
    with quiet_pytree_deprecation():
        mod = from_exported_program(ep, custom_convert_map={OP_NAME: convert_hla_node,
                                                            "select.int": convert_select},
                                    run_ep_decomposition=False)
    return unflatten_matmuls(tighten_shapes(mod, export_ranges(ep)))


ASSERTS = ("aten._assert_scalar.default", "aten._assert_async.msg",
           "aten.sym_constrain_range_for_size.default", "aten.sym_constrain_range.default")


def without_runtime_asserts(ep):
    """`ep` decomposed as TVM's importer decomposes it, less its runtime assertions on sizes
    (with their symbolic-integer arithmetic): what `prefer_deferred_runtime_asserts_over_
    guards` leaves in the graph where torch.export would otherwise refuse a length. `compile`
    exports so because torch guards a size against 1 where a slice of the time axis may have
    one row (`h[:, :-1]`: "T - 1 != 1", which refused prompts of two tokens); the graph
    computes every length alike, and TVM's importer has no converter for the assertions."""
    with quiet_pytree_deprecation():
        ep = ep.run_decompositions()
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and str(node.target) in ASSERTS:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    ep.graph_module.recompile()
    return ep


@contextlib.contextmanager
def quiet_pytree_deprecation():
    """Silence only torch's FutureWarning about `isinstance(treespec, LeafSpec)`: torch 2.13's
    own ExportedProgram.run_decompositions (and torch.onnx) deep-copy the call graph's LeafSpecs
    and warn about torch's own code; nothing of ours touches LeafSpec."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*",
                                category=FutureWarning)
        yield
