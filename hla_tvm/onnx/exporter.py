"""`hla_tvm.onnx.export`: an `hla_tvm` PyTorch model to an ONNX file whose HLA layers are
`hla_tvm::HLA` nodes (torch.onnx's dynamo exporter with a custom translation for
`torch.ops.hla_tvm.hla`), carrying the operator's function bodies so any ONNX runtime runs it.

For an HLALM-like model (forward(tokens, state), init_state(batch)) the graph is
    prefill: tokens [B, T] int64, *state -> logits [B, T, vocab], *state     (decode=False)
    decode:  tokens [B] int64,    *state -> logits [B, vocab], *state        (decode=True)
with dynamic B and T; state entries are named like `hla_tvm.compile`'s (layer0.S, ...) and the
outputs `<name>.out`. By default the prefill graph starts a fresh sequence from the tokens alone
(its HLA nodes take no state inputs; the new state is still returned); from_state=True adds the
state inputs. The model's config, state layout and a sha256 of the model's content (everything
but metadata_props, `content_digest`) go into metadata_props; readers verify it."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import warnings

import onnx
import torch
from torch.export import Dim

from .. import validate
from ..compiler import Decode, Fresh, Prefill, flat_state_spec, flatten_state
from ..nn import hla_op  # defining it registers torch.ops.hla_tvm.hla
from ..nn.ops import state_names
from ..quant import scheme
from ..runtime.paths import replacing
from . import function, quantized, schema

FORMAT = "hla_tvm.onnx/1"
META_FORMAT, META_ENTRY, META_STATE, META_CONFIG, META_DIGEST = (
    "hla_tvm.format", "hla_tvm.entry", "hla_tvm.state", "hla_tvm.config", "hla_tvm.sha256")


def content_digest(proto):
    """sha256 (hex) of `proto` serialized without its metadata_props (which carry the digest)."""
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    del bare.metadata_props[:]
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).hexdigest()


def _translate(q, k, v, state, decay, order, asymmetric, masked, normalize, eps, ridge,
               chunk_size):
    """torch.ops.hla_tvm.hla -> one hla_tvm::HLA node (chunk_size is a PyTorch-side detail)."""
    # onnxscript and TVM (compiler.torch_export) are imported where used: the importer and ONNX
    # Runtime sessions (onnx.ort_session) import this module
    import onnxscript

    hla = onnxscript.values.Opset(function.DOMAIN, schema.VERSION)
    outs = hla.HLA(q, k, v, decay, *state, order=int(order), asymmetric=int(asymmetric),
                   masked=int(masked), normalize=int(normalize), eps=float(eps),
                   ridge=float(ridge))
    # no state inputs (a fresh sequence): the node still returns the new state
    return list(outs[:1 + len(state_names(int(order), bool(asymmetric)))])


def translation_table():
    """The custom_translation_table entry torch.onnx.export needs for hla_tvm models."""
    return {hla_op._opoverload: _translate}


def _example_tokens(example_tokens, decode):
    if example_tokens is None:
        example_tokens = torch.zeros(2, 1 if decode else 8, dtype=torch.int64)
    tokens = torch.as_tensor(example_tokens)
    if tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() not in (1, 2):
        raise ValueError(f"example_tokens must be an integer tensor [B, T] (or [B] for decode), "
                         f"got {tokens.dtype} {list(tokens.shape)}")
    tokens = tokens.long()
    if decode:
        return tokens.reshape(tokens.shape[0], -1)[:, -1].contiguous()
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.shape[1] < 2:   # torch.export specialises a length-1 axis
        tokens = tokens.repeat(1, 2)
    return tokens


def _trim_unused_outputs(proto):
    """Drop the trailing outputs of HLA nodes that nothing reads (the schema declares the most
    any variant has)."""
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    for n in function.hla_nodes(proto.graph):
        while len(n.output) > 1 and n.output[-1] not in used:
            n.output.pop()


@contextlib.contextmanager
def _quiet():
    """torch.onnx's notes that do not concern the user (torchvision absent, Dim names merged,
    a pytree deprecation inside torch)."""
    from ..compiler.torch_export import quiet_pytree_deprecation

    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), quiet_pytree_deprecation():
            warnings.filterwarnings("ignore", message=".*axis name.*will not be used")
            yield
    finally:
        logger.setLevel(level)


def export(model, path, example_tokens=None, *, decode=False, from_state=False, quantize=None,
           group_size=None):
    """Write `model` (an HLALM-like `hla_tvm` model) to `path` as ONNX; returns the ModelProto.

    The prefill graph takes tokens [B, T] alone and starts a fresh sequence; with
    from_state=True it also takes the state to continue from. decode=True exports the
    one-token step (tokens [B] and state in). Both return logits and the new state.
    example_tokens: int tensor [B, T] used to trace (any values; default zeros [2, 8]).
    Batch and length stay dynamic.
    quantize, group_size: as for `hla_tvm.compile`; the weights are stored so in standard ops
    (`onnx.quantized`: DequantizeLinear of INT8/INT4 initializers, opset 21)."""
    sch = scheme(quantize, group_size)

    for attr in ("init_state", "forward"):
        if not callable(getattr(model, attr, None)):
            raise TypeError(f"model must be an HLALM-like torch module with forward(tokens, "
                            f"state) and init_state(batch); {type(model).__name__} has no {attr}")

    path = validate.output_path("path", path)
    model = copy.deepcopy(model).eval().float()
    layout = [tuple(layer) for layer in model.init_state(1)]
    tokens = _example_tokens(example_tokens, decode)
    B = tokens.shape[0]
    with_state = decode or from_state
    state = flatten_state(model.init_state(B)) if with_state else []
    spec = flat_state_spec(model)
    batch = Dim("batch", min=1)
    tok_dims = {0: batch} if decode else {0: batch, 1: Dim("seq", min=2)}
    wrapper = (Decode if decode else Prefill if from_state else Fresh)(model, layout).eval()
    with torch.no_grad(), _quiet():
        program = torch.onnx.export(
            wrapper, (tokens, *state), dynamo=True, opset_version=function.OPSET,
            custom_translation_table=translation_table(),
            dynamic_shapes=(tok_dims, tuple({0: batch} for _ in state)) if with_state
            else (tok_dims,),
            input_names=["tokens"] + ([n for n, _, _ in spec] if with_state else []),
            output_names=["logits"] + [f"{n}.out" for n, _, _ in spec],
            report=False, verbose=False)
    proto = program.model_proto
    _trim_unused_outputs(proto)
    if sch is not None:   # the graph's ops mean the same at opset 21 (types were added)
        for o in proto.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = quantized.OPSET
        quantized.quantize_initializers(proto, sch)
    function.add_functions(proto)
    meta = {META_FORMAT: FORMAT, META_ENTRY: "decode" if decode else "prefill",
            META_STATE: json.dumps(spec), META_CONFIG: json.dumps(getattr(model, "config", None))}
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
    function.check(proto)
    proto.metadata_props.add(key=META_DIGEST, value=content_digest(proto))
    with replacing(path) as f:
        onnx.save(proto, f)
    return proto
