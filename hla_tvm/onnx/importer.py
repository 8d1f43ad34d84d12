"""ONNX models with `hla_tvm::HLA` nodes to TVM: TVM's Relax ONNX frontend for every standard
op, and each HLA node (domain hla_tvm, checked) lowered onto our TensorIR kernels
(`compiler.relax_hla.emit_operator`) instead of its function body.

TVM's frontend dispatches on op_type alone and has no custom-op hook. `_Importer` extends its
graph importer: HLA nodes of the hla_tvm domain are renamed to a private op_type in a copy of the
graph (so the domain decides, and an `HLA` of any other domain stays unsupported), the
unsupported-op check skips them, and `_convert_operator` routes them to `_convert_hla`.

    to_relax(model)                       -> IRModule whose "main" is the graph
    compile(path, target=, out=)          -> a library `hla_tvm.runtime.load` opens
"""
from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import os
import re
import sys
import warnings

import numpy as np
import onnx
from onnx import helper

from .. import validate
from ..compiler import (
    MODULE_FORMAT,
    build,
    entries,
    merge_entries,
    records_folder,
    resolve_model_target,
    tokenizer_text,
)
from ..ops import get
from ..progress import Stages
from ..quant import from_meta, scheme
from . import function
from .exporter import META_CONFIG, META_DIGEST, META_ENTRY, META_STATE, content_digest
from .quantized import dequantized

_PRIVATE_OP = "hla_tvm::HLA"   # the op_type HLA nodes carry inside the importer


def load_model(model):
    """A ModelProto from a path or a ModelProto; ValueError for files that are not ONNX, and
    for files whose content no longer matches the digest `hla_tvm.onnx.export` recorded
    (corrupt, or edited after export)."""
    if isinstance(model, onnx.ModelProto):
        return model   # what the caller holds; files are what is checked
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no ONNX model at {path}")
    try:
        proto = onnx.load(path)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: not a readable ONNX model ({reason})") from None
    if not proto.graph.node and not proto.graph.input:
        raise ValueError(f"{path}: not an ONNX model (no graph)")
    recorded = next((p.value for p in proto.metadata_props if p.key == META_DIGEST), None)
    if recorded is not None and recorded != content_digest(proto):
        raise ValueError(f"{path}: the ONNX model is corrupt or was edited after export (its "
                         f"content does not match the {META_DIGEST} digest recorded by "
                         "hla_tvm.onnx.export); export it again")
    try:   # the bodies it carries are what its attributes say (TVM compiles the attributes)
        function.check_functions(proto, require=False)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return proto


def _mark_hla_nodes(model):
    """A copy of `model` whose hla_tvm::HLA nodes have the private op_type; their variants are
    validated (ValueError naming the node)."""
    model = copy.deepcopy(model)
    for n in model.graph.node:
        if n.domain == function.DOMAIN:
            if n.op_type != function.OP_TYPE:
                raise ValueError(f"node {n.name!r}: the hla_tvm domain has no operator "
                                 f"{n.op_type!r} (only {function.OP_TYPE})")
            function.node_variant(n)
            n.op_type = _PRIVATE_OP
        elif n.op_type == function.OP_TYPE:
            raise ValueError(f"node {n.name!r}: op HLA of domain {n.domain or 'ai.onnx'!r} is not "
                             f"{function.DOMAIN}::{function.OP_TYPE}")
    return model


def _importer_class():
    # TVM (and compiler.relax_hla, compiler.passes, which import it) is imported where a graph is
    # converted: ONNX Runtime sessions (onnx.ort_session) import load_model from here
    from tvm.relax.frontend.onnx import onnx_frontend as fe

    class _Importer(fe.ONNXGraphImporter):
        def _check_for_unsupported_ops(self, graph):
            rest = onnx.GraphProto()
            rest.node.extend(n for n in graph.node if n.op_type != _PRIVATE_OP)
            super()._check_for_unsupported_ops(rest)

        def _convert_operator(self, op_name, inputs, attrs, opset):
            if op_name == _PRIVATE_OP:
                return _convert_hla(self.bb, inputs, attrs)
            return super()._convert_operator(op_name, inputs, attrs, opset)

    return _Importer


def _shape(expr, node, what):
    from tvm import relax

    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        raise ValueError(f"HLA node {node!r}: {what} must be a tensor of known rank")
    return list(ty.shape)


def _static(dim, node, what):
    from tvm.tirx import IntImm

    if not isinstance(dim, IntImm):
        raise ValueError(f"HLA node {node!r}: {what} must be static (the kernels are compiled for "
                         f"fixed head sizes), got {dim}")
    return int(dim)


def _convert_hla(bb, inputs, attrs):
    """Relax for one HLA node: a tuple (o, *state) with as many fields as the node's outputs."""
    import tvm
    from tvm import relax

    from ..compiler.relax_hla import emit_operator, zero_state

    node = attrs["tvm_custom"]["name"]
    inputs = list(inputs)   # the frontend's list pads out-of-range slices with None
    get_attr = lambda k: attrs.get(k, function.ATTRIBUTES[k])  # noqa: E731
    order, asym = get_attr("order"), bool(get_attr("asymmetric"))
    op = get(order, asym)
    q, k, v = inputs[:3]
    shapes = {}
    for name, x in zip("qkv", (q, k, v)):
        shapes[name] = _shape(x, node, name)
        if len(shapes[name]) != 4:
            raise ValueError(f"HLA node {node!r}: input {name} must have rank 4 [B, H, T, D], "
                             f"got rank {len(shapes[name])} {shapes[name]}")
        if x.ty.dtype != "float32":
            raise ValueError(f"HLA node {node!r}: input {name} must be float32, got "
                             f"{x.ty.dtype}")
    B, H, T, dk = shapes["q"]
    H = _static(H, node, "q's head count")
    Hkv = _static(shapes["k"][1], node, "k's head count")
    dk = _static(dk, node, "q's head size")
    dv = _static(shapes["v"][3], node, "v's head size")
    if _static(shapes["k"][3], node, "k's head size") != dk or \
            _static(shapes["v"][1], node, "v's head count") != Hkv or H % Hkv:
        raise ValueError(f"HLA node {node!r}: expected q [B, H, T, Dk], k [B, Hkv, T, Dk], "
                         f"v [B, Hkv, T, Dv] with Hkv dividing H; got q {shapes['q']}, "
                         f"k {shapes['k']}, v {shapes['v']}")
    decay = inputs[3] if len(inputs) > 3 else None
    if decay is not None:
        dims = _shape(decay, node, "decay_heads")
        if dims != [H] and [_static(d, node, "decay_heads") for d in dims] != [H]:
            raise ValueError(f"HLA node {node!r}: decay_heads must have shape [{H}]")
    elif get_attr("decay") != 1.0:
        decay = relax.const(np.full(H, get_attr("decay"), dtype="float32"))
    shapes = op.state_shapes(B, H, Hkv, dk, dv)
    state = list(inputs[4:4 + len(op.state_names)])
    if state:
        for n, x in zip(op.state_names, state):
            got = _shape(x, node, f"state {n}")
            if len(got) != len(shapes[n]) or any(
                    _static(g, node, f"state {n}") != w for g, w in zip(got[1:], shapes[n][1:])):
                raise ValueError(f"HLA node {node!r}: state {n} must have shape "
                                 f"[B, {', '.join(str(d) for d in shapes[n][1:])}], got {got}")
        # a constant initial state (an initializer) is copied into a run-time tensor first:
        # the kernels advance state in place
        const = [i for i, x in enumerate(state) if isinstance(x, tvm.ir.expr.Constant)]
        if const:
            zeros = zero_state(bb, q, [list(state[i].ty.shape) for i in const])
            for i, z in zip(const, zeros):
                state[i] = bb.emit(relax.op.add(z, state[i]))
    out, new_state = emit_operator(
        bb, order, asym, q, k, v, state, decay, masked=bool(get_attr("masked")),
        normalize=bool(get_attr("normalize")), eps=get_attr("eps"), ridge=get_attr("ridge"))
    return relax.Tuple([out, *new_state][:attrs["tvm_custom"]["num_outputs"]])


def to_relax(model, *, shape_dict=None):
    """The Relax IRModule ("main") of an ONNX model (path or ModelProto) whose hla_tvm::HLA nodes
    call our kernels. Every other node goes through TVM's ONNX frontend. Shapes are then
    simplified knowing that every symbolic size of the graph's inputs (batch, the prompt's
    length) is at least 1 (`compiler.passes.shape_bounds`): a slice of the time axis, `h[:,
    :-1]`, comes out of the importer with a length min(max(T - 1, 0), T) that TVM cannot
    legalize a reshape of otherwise."""
    from ..compiler.passes.shape_bounds import tighten_shapes

    model = _mark_hla_nodes(load_model(model))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    with warnings.catch_warnings():   # it renames every dotted name (layer0.S -> layer0_S)
        warnings.filterwarnings("ignore", message="Renaming name")
        mod = _importer_class()(shape_dict, "float32").from_onnx(model.graph, opset)
    sizes = {d.dim_param for vi in _graph_inputs(model) for d in vi.type.tensor_type.shape.dim
             if d.dim_param}
    return tighten_shapes(mod, {name: (1, None) for name in sizes})


def _graph_inputs(model):
    """The graph inputs that are not initializers."""
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


# the state entries' element types a module keeps (HLA summaries, caches; position counters)
STATE_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64"}


def lm_signature(model):
    """The language-model interface of an ONNX graph, as `hla_tvm.onnx.export` writes it:
    inputs tokens (int64 [B, T] for prefill or [B] for decode) then the state entries
    (float32 or int64 [B, ...] with static trailing dims); outputs logits then the new state,
    one per state input. Returns dict(entry, state=[(name, shape, dtype)], vocab_size, config)."""
    g = model.graph
    inputs = _graph_inputs(model)

    def dims(vi):
        return [d.dim_value if d.HasField("dim_value") else None
                for d in vi.type.tensor_type.shape.dim]

    if not inputs or inputs[0].type.tensor_type.elem_type != onnx.TensorProto.INT64 or \
            len(dims(inputs[0])) not in (1, 2):
        raise ValueError("the ONNX graph's first input must be the int64 tokens [B, T] (prefill) "
                         "or [B] (decode), as hla_tvm.onnx.export writes; got "
                         + (f"{inputs[0].name!r}" if inputs else "no inputs"))
    entry = "prefill" if len(dims(inputs[0])) == 2 else "decode"
    state = []
    for vi in inputs[1:]:
        d = dims(vi)
        dtype = STATE_DTYPES.get(vi.type.tensor_type.elem_type)
        if dtype is None or not d or any(x is None for x in d[1:]):
            kind = onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)
            raise ValueError(f"graph input {vi.name!r}: state inputs must be float32 or int64 "
                             f"[B, ...] with static trailing dims, got {kind} {d}")
        state.append((vi.name, d[1:], dtype))
    if len(g.output) != 1 + len(state):
        raise ValueError(f"the graph must return logits and one new state per state input "
                         f"({1 + len(state)} outputs), got {len(g.output)}")
    props = {p.key: p.value for p in model.metadata_props}
    config = json.loads(props[META_CONFIG]) if META_CONFIG in props else None
    logits = dims(g.output[0])
    vocab = (config or {}).get("vocab_size") or (logits[-1] if logits else None)
    if META_ENTRY in props and props[META_ENTRY] != entry:
        raise ValueError(f"metadata says a {props[META_ENTRY]} graph, the tokens input says "
                         f"{entry}")
    if META_STATE in props:
        names = [n for n, _, _ in json.loads(props[META_STATE])]
        state = [(n, s, d) for n, (_, s, d) in zip(names, state)] if len(names) == len(state) \
            else state
    return dict(entry=entry, state=state, vocab_size=vocab, config=config)


def with_state_inputs(model):
    """A fresh-start prefill graph (tokens alone) as the prefill-from-state graph: each HLA node
    without state inputs takes them from new graph inputs, named after the graph outputs its new
    state feeds (`<name>.out` -> `<name>`), ordered as the metadata's state layout."""
    model = copy.deepcopy(model)
    g = model.graph
    outputs = {o.name: o for o in g.output}
    added = []
    for n in function.hla_nodes(g):
        var = function.node_variant(n)
        if var["state_input"]:
            continue
        want = len(get(var["order"], var["asymmetric"]).state_names)
        names = [o[:-len(".out")] for o in n.output[1:] if o in outputs and o.endswith(".out")]
        if len(names) != want or len(n.output) != 1 + want:
            raise ValueError(f"{function.describe(n)}: a fresh-start HLA node must return its "
                             f"{want} state entries as graph outputs named <state>.out")
        while len(n.input) < 4:
            n.input.append("")
        n.input.extend(names)
        n.overload = ""
        n.overload = function.node_variant(n)["overload"]
        for name, out in zip(names, n.output[1:]):
            vi = copy.deepcopy(outputs[out])
            vi.name = name
            added.append(vi)
    props = {p.key: p.value for p in model.metadata_props}
    if META_STATE in props:
        order = [name for name, _, _ in json.loads(props[META_STATE])]
        added.sort(key=lambda vi: order.index(vi.name) if vi.name in order else len(order))
    g.input.extend(added)
    return model


def _decode_from_prefill(model):
    """The prefill graph turned into the one-token step: tokens [B] -> Unsqueeze -> the graph ->
    logits [B, 1, V] -> Squeeze -> logits [B, V]."""
    model = copy.deepcopy(model)
    g = model.graph
    tok, logits = g.input[0], g.output[0]
    step_tok, step_logits = tok.name + ".step", logits.name + ".step"
    batch = copy.deepcopy(tok.type.tensor_type.shape.dim[0])
    axis = helper.make_tensor(tok.name + ".axis", onnx.TensorProto.INT64, [1], [1])
    g.initializer.append(axis)
    g.node.insert(0, helper.make_node("Unsqueeze", [step_tok, axis.name], [tok.name]))
    g.node.append(helper.make_node("Squeeze", [logits.name, axis.name], [step_logits]))
    new_tok = helper.make_tensor_value_info(step_tok, onnx.TensorProto.INT64, [None])
    new_tok.type.tensor_type.shape.dim[0].CopyFrom(batch)
    g.input[0].CopyFrom(new_tok)
    g.output[0].CopyFrom(helper.make_tensor_value_info(
        step_logits, logits.type.tensor_type.elem_type, None))
    return model


def compile(path, *, target="llvm", out="model.so", schedules="auto", quantize=None,  # noqa: A001
            group_size=None, tokenizer=None):
    """Compile an ONNX language model with hla_tvm::HLA nodes (as `hla_tvm.onnx.export` writes)
    for `target` and write the library to `out`; `hla_tvm.runtime.load` opens it. A prefill
    graph gives both entry points (decode is the same graph at T = 1); a decode graph gives
    decode only (the runtime then runs a prompt token by token). schedules, quantize,
    group_size: as for `hla_tvm.compile` (the graph's float32 weight initializers are the
    weights quantized); a file exported with quantize= compiles under the scheme it records.
    tokenizer: as for `hla_tvm.compile`. Returns `out`."""
    sch = scheme(quantize, group_size)
    out = validate.output_path("out", out)
    validate.not_an_input("out", out, path)
    tgt = resolve_model_target(target)   # a bad target fails before any model work
    records_path = records_folder(schedules, tgt)
    from ..compiler.relax_hla import chunks_for

    stages = Stages("compile")
    stages("reading the ONNX graph (to Relax)")
    with chunks_for(tgt):   # (CUDA: prefill chunks that fit the GPU)
        mod, meta = lm_module(path)
    recorded = from_meta(meta)
    if recorded is not None and sch is not None and sch != recorded:
        raise ValueError(f"{path}: its weights are stored as {recorded.name} (group "
                         f"{recorded.group_size}) already; compile it without quantize= or "
                         f"with the same scheme, not {sch.name} (group {sch.group_size})")
    sch = sch or recorded
    meta = {**meta, "quantize": None if sch is None else sch.as_meta(),
            **tokenizer_text(tokenizer, meta.get("vocab_size"))}
    out = build(mod, meta, tgt, out, records_path, stages, sch)
    stages.done()
    return out


def lm_module(path):
    """(Relax IRModule with the prefill and decode entries, module metadata) of the ONNX
    language model at `path` (what `compile` builds; `hla-tvm tune model.onnx` tunes it).
    A graph TVM's importer cannot read is a ValueError naming the file (and the operator it
    stopped at), as every other refusal (`_refusal`)."""
    model = load_model(path)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):   # (TVM's importer prints the failing operator)
            return _lm_module(path, model)
    except MemoryError:
        raise
    except RecursionError:
        refusal = ValueError(f"{path}: the ONNX graph nests too deeply to import")
    except Exception as err:  # noqa: BLE001 - TVM's, numpy's and the frontend's own errors
        refusal = _refusal(path, err, said.getvalue())
        # the importer's frames go now: TVM warns on stderr when a builder with open blocks
        # is destroyed, which would follow the one-line refusal
        with _stderr_silenced():
            err.__traceback__ = None
            gc.collect()
    raise refusal   # (outside the except block: TVM's error is not its context)


def _refusal(path, err, said):
    """The error to raise for `err`, raised while importing the ONNX model at `path` (`said`:
    what TVM's importer printed meanwhile): one line that names the file, and the operator
    the importer stopped at; an unsupported operator stays a NotImplementedError."""
    path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "the ONNX model"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reason = lines[0] if lines else type(err).__name__
    if reason.startswith(path + ":"):
        reason = reason[len(path) + 1:].strip()
    if isinstance(err, KeyError):
        reason = f"it uses a value no node, input or initializer defines ({reason})"
    elif not isinstance(err, (ValueError, NotImplementedError)):
        reason = f"{type(err).__name__}: {reason}"
    cls = NotImplementedError if isinstance(err, NotImplementedError) else ValueError
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None and isinstance(err, ValueError) and \
            tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):   # (our own check's words)
        return cls(f"{path}: {reason}")
    found = re.search(r"Error converting operator (\S+?),", said)
    where = f" (at a {found.group(1)} node)" if found and found.group(1) != _PRIVATE_OP else ""
    return cls(f"{path}: TVM's ONNX importer refused it{where}: {reason}")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@contextlib.contextmanager
def _stderr_silenced():
    """The process's stderr (file descriptor 2: C++ logging too) to /dev/null in the block."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _lm_module(path, model):
    digest = content_digest(model)
    model, sch = dequantized(model)   # packed again by the compile, under the same scheme
    fresh = len(_graph_inputs(model)) == 1   # a fresh-start prefill graph: tokens alone
    if fresh:
        model = with_state_inputs(model)
    try:
        sig = lm_signature(model)
    except ValueError as err:
        if fresh and "one new state per state input" in str(err):
            raise ValueError(f"{err}: a fresh-start graph gains state inputs for its HLA nodes "
                             "only, and this model keeps state of its own; export it with "
                             "from_state=True (`hla-tvm export-onnx --from-state`)") from None
        raise
    if sig["entry"] == "prefill":
        mods = {"prefill": to_relax(model), "decode": to_relax(_decode_from_prefill(model))}
    else:
        mods = {"decode": to_relax(model)}
    mod = merge_entries(mods)
    meta = {"format": MODULE_FORMAT, "state": sig["state"], "vocab_size": sig["vocab_size"],
            "config": sig["config"], "entries": entries(mod), "source": "onnx",
            "max_batch": None, "onnx_sha256": digest,
            "quantize": None if sch is None else sch.as_meta()}
    return mod, meta
