"""Quantized weights in ONNX files, in standard ops (opset 21), so that any conforming runtime
runs the file and ONNX Runtime can fuse the dequantization into its products:

    int8, int4   DequantizeLinear(q, scale) of an INT8 / INT4 initializer (symmetric: no zero
                 point); per output channel (axis of N, no block_size) or in blocks of
                 `group_size` input elements (block_size along the axis of K)
    bf16         Cast(to=FLOAT) of a BFLOAT16 initializer; the MatMul's activations rounded
                 to bfloat16 too (Cast to BFLOAT16 and back), as a bf16 module's products take
                 them (`quant.scheme.activations`)

The weights are those `hla_tvm.quant` packs, in the layout the graph reads them: a MatMul's
B [K, N] (blocks along axis 0) and a Gather's table [rows, K] (blocks along axis 1); the values
and scales are the scheme's (`quant.scheme`), so that dequantizing them gives the weights a
module compiled with the same scheme computes with. The scheme is recorded in the metadata
(`META_QUANTIZE`).

`dequantized(model)` folds those nodes back into float32 initializers for TVM's importer (the
compile then packs them again under the recorded scheme: the same values and scales)."""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..quant.scheme import from_meta, quantize, values

OPSET = 21   # DequantizeLinear with block_size, INT4 tensors
META_QUANTIZE = "hla_tvm.quantize"


def _consumers(graph, name):
    return [(n, i) for n in graph.node for i, x in enumerate(n.input) if x == name]


def _int4_tensor(name, values):
    """An INT4 TensorProto of the int values (-8..7), two a byte, the first in the low nibble."""
    flat = values.astype(np.int8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    packed = ((flat[0::2] & 15) | ((flat[1::2] & 15) << 4)).astype(np.uint8)
    return helper.make_tensor(name, TensorProto.INT4, list(values.shape), packed.tobytes(),
                              raw=True)


def _round_input_bf16(graph, node):
    """In place: the MatMul `node`'s first input through Cast to BFLOAT16 and back to FLOAT,
    two nodes just before it."""
    x = node.input[0]
    mid, out = node.name + "_a_bf16", node.name + "_a_rounded"
    where = list(graph.node).index(node)
    graph.node.insert(where, helper.make_node("Cast", [mid], [out], to=TensorProto.FLOAT,
                                              name=out))
    graph.node.insert(where, helper.make_node("Cast", [x], [mid], to=TensorProto.BFLOAT16,
                                              name=mid))
    node.input[0] = out


def quantize_initializers(model, sch):
    """In place: every float32 2-D initializer a MatMul reads as B, or a Gather as its table
    (axis 0), stored under the scheme `sch` and dequantized by a node at the top of the graph
    (its output keeps the initializer's name). Returns {"packed": count, "kept": [shapes]}."""
    graph = model.graph
    report = {"packed": 0, "kept": []}
    nodes = []
    for init in list(graph.initializer):
        if init.data_type != TensorProto.FLOAT or len(init.dims) != 2:
            continue
        uses = _consumers(graph, init.name)
        as_b = any(n.op_type == "MatMul" and i == 1 for n, i in uses)
        as_table = any(n.op_type == "Gather" and i == 0 and
                       all(a.i == 0 for a in n.attribute if a.name == "axis") for n, i in uses)
        if not uses or not (as_b or as_table) or (as_b and as_table):
            continue
        w = numpy_helper.to_array(init)
        kn = w if as_b else w.T          # the [K, N] layout the scheme groups along K
        if not sch.fits(kn.shape[0]):
            report["kept"].append(list(w.shape))
            continue
        packed = quantize(sch, kn)
        graph.initializer.remove(init)
        name, q_name, s_name = init.name, init.name + "_quantized", init.name + "_scale"
        report["packed"] += 1
        if sch.name == "bf16":
            q = packed["q"] if as_b else packed["q"].T
            graph.initializer.append(helper.make_tensor(
                q_name, TensorProto.BFLOAT16, list(q.shape),
                np.ascontiguousarray(q).tobytes(), raw=True))
            nodes.append(helper.make_node("Cast", [q_name], [name], to=TensorProto.FLOAT,
                                          name=name + "_dequantize"))
            for n, i in uses:
                if n.op_type == "MatMul" and i == 1:
                    _round_input_bf16(graph, n)
            continue
        vals, scale = values(sch, packed), packed["scale"]
        if not as_b:
            vals, scale = vals.T, scale.T
        q_axis = 0 if as_b else 1        # the axis of K
        if sch.group_size is None:       # per output channel: the axis of N, one scale each
            attrs = dict(axis=1 - q_axis)
            scale = scale.reshape(-1)
        else:
            attrs = dict(axis=q_axis, block_size=sch.group_size)
        q = np.ascontiguousarray(vals)
        graph.initializer.append(_int4_tensor(q_name, q) if sch.name == "int4" else
                                 numpy_helper.from_array(q.astype(np.int8), q_name))
        graph.initializer.append(numpy_helper.from_array(
            np.ascontiguousarray(scale, dtype=np.float32), s_name))
        nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name], [name],
                                      name=name + "_dequantize", **attrs))
    for node in reversed(nodes):
        graph.node.insert(0, node)
    model.metadata_props.add(key=META_QUANTIZE, value=json.dumps(sch.as_meta()))
    return report


def recorded_scheme(model):
    """The Scheme an exported file records (META_QUANTIZE), or None; ValueError for a record
    that names no scheme."""
    raw = next((p.value for p in model.metadata_props if p.key == META_QUANTIZE), None)
    if raw is None:
        return None
    try:
        return from_meta({"quantize": json.loads(raw)})
    except (ValueError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"the file's {META_QUANTIZE} record is not a scheme: {err}") from None


def _initializer_array(init):
    """float32 values of an INT4 / INT8 / BFLOAT16 / FLOAT initializer."""
    if init.data_type == TensorProto.INT4:
        raw = np.frombuffer(init.raw_data, dtype=np.uint8)
        low = (raw & 15).astype(np.int8)
        high = (raw >> 4).astype(np.int8)
        vals = np.empty(raw.size * 2, dtype=np.int8)
        vals[0::2], vals[1::2] = low, high
        vals = np.where(vals > 7, vals - 16, vals)
        return vals[:int(np.prod(init.dims))].reshape(tuple(init.dims)).astype(np.float32)
    if init.data_type == TensorProto.BFLOAT16:
        bits = np.frombuffer(init.raw_data, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(tuple(init.dims))
    return numpy_helper.to_array(init).astype(np.float32)


def dequantized(model):
    """(a copy of `model` whose dequantizing nodes of initializers (DequantizeLinear without a
    zero point, Cast to float) are float32 initializers again, the recorded Scheme or None)."""
    sch = recorded_scheme(model)
    if sch is None:
        return model, None
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    for node in list(graph.node):
        if not all(x in inits for x in node.input if x) or not node.input:
            continue
        if node.op_type == "DequantizeLinear" and len([x for x in node.input if x]) == 2:
            q = _initializer_array(inits[node.input[0]])
            scale = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
            attrs = {a.name: a.i for a in node.attribute}
            axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
            if scale.ndim == 1:    # per axis
                shape = [1] * q.ndim
                shape[axis] = -1
                w = q * scale.reshape(shape)
            else:                  # blocks along `axis`
                w = q * np.repeat(scale, block, axis=axis)
        elif node.op_type == "Cast" and inits[node.input[0]].data_type == TensorProto.BFLOAT16:
            w = _initializer_array(inits[node.input[0]])
        else:
            continue
        graph.node.remove(node)
        graph.initializer.append(numpy_helper.from_array(w.astype(np.float32), node.output[0]))
        for x in node.input:
            if x and not _consumers(graph, x) and x in inits:
                graph.initializer.remove(inits.pop(x))
    if sch.name == "bf16":   # the products' own rounding (`_round_input_bf16`): the compiled
        _drop_bf16_round_trips(graph)   # bf16 kernels round their activations themselves
    return model, sch


def _drop_bf16_round_trips(graph):
    """In place: every Cast to BFLOAT16 whose one consumer is a Cast to FLOAT feeding only
    MatMuls removed, those MatMuls reading the first Cast's input."""
    def to(node):
        return next((a.i for a in node.attribute if a.name == "to"), None)

    for first in list(graph.node):
        if first.op_type != "Cast" or to(first) != TensorProto.BFLOAT16:
            continue
        uses = _consumers(graph, first.output[0])
        if len(uses) != 1 or uses[0][0].op_type != "Cast" or to(uses[0][0]) != TensorProto.FLOAT:
            continue
        second = uses[0][0]
        readers = _consumers(graph, second.output[0])
        if not readers or any(n.op_type != "MatMul" or i != 0 for n, i in readers):
            continue
        for n, i in readers:
            n.input[i] = first.input[0]
        graph.node.remove(first)
        graph.node.remove(second)
