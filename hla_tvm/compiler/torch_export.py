"""torch.export -> Relax for models built from `hla_tvm.nn`, with every `hla_tvm::hla` node lowered
onto our TensorIR kernels (`custom_convert_map` of TVM's exported-program frontend)."""
from __future__ import annotations

import contextlib
import os
import re
import warnings

import torch
import tvm
from torch import fx
from tvm import relax, tirx
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .passes.flat_matmul import unflatten_matmuls
from .passes.shape_bounds import export_ranges, tighten_shapes
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
    ep = without_runtime_asserts(ep)   # (decomposed there, as TVM's importer would)
    with quiet_pytree_deprecation():
        mod = _importer()().from_exported_program(
            ep, keep_params_as_input=False, unwrap_unit_return_tuple=False,
            no_bind_return_tuple=False,
            custom_convert_map={OP_NAME: convert_hla_node, "select.int": convert_select})
    return unflatten_matmuls(tighten_shapes(mod, export_ranges(ep)))


class UnsupportedPattern(ValueError):
    """A PyTorch op TVM's importer could not convert, named with the model's source line."""


def source_line(node):
    """'file:line: code' of the model's own source that made the FX `node` (the last frame
    of its stack trace), or '' where torch kept none."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(r'\s*File "([^"]+)", line (\d+)', lines[i])
        if found:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{os.path.basename(found.group(1))}:{found.group(2)}: {code}"
    return ""


def _importer():
    """TVM's ExportedProgramImporter whose every converter names the op and the model's
    source line when it fails (`UnsupportedPattern`), instead of TVM's message alone."""
    def named(name, convert):
        def run(node, *rest):
            try:
                return convert(node, *rest)
            except UnsupportedPattern:
                raise
            except Exception as err:  # noqa: BLE001 - TVM's converters raise many kinds
                where = source_line(node)
                first = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                raise UnsupportedPattern(
                    f"the model's {name} ({where or 'no source line kept'}) cannot be "
                    f"compiled: TVM's importer says {first[:300]}") from None
        return run

    class Importer(ExportedProgramImporter):
        def create_convert_map(self):
            return {k: named(k, f) for k, f in super().create_convert_map().items()}

        def update_convert_map(self, custom):
            super().update_convert_map({k: named(k, f) for k, f in custom.items()})

    return Importer


def _index_copy(x, dim, index, source):
    """x.index_copy(dim, index, source) as the scatter it is (source's slices along `dim` into
    rows `index`): torch decomposes it to an index_put with a None index per leading axis,
    which TVM's importer refuses ("IndexPut requires the number of index tensors ... to match
    the data tensor dimensions")."""
    shape = [1] * source.dim()
    shape[dim] = -1
    return x.scatter(dim, index.view(shape).expand_as(source), source)


def decomposition_table():
    """torch.export's default decompositions, with index_copy as a scatter (`_index_copy`)."""
    table = torch.export.default_decompositions()
    table[torch.ops.aten.index_copy.default] = _index_copy
    return table


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
        ep = ep.run_decompositions(decomposition_table())
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
