"""The OpSchema of `hla_tvm::HLA` (domain hla_tvm, version 1), registered with onnx so that
onnx's checker and onnxscript (which the torch.onnx exporter uses) know the operator. Types and
shapes of the outputs are inferred through the model's function bodies (`function.py`)."""
from __future__ import annotations

import onnx
from onnx import defs

from .function import ATTRIBUTES, DOMAIN, OP_TYPE, STATE_NAMES, VECTOR_STATES

VERSION = 1
MAX_STATE = max(len(n) for n in STATE_NAMES.values())

DOC = """Higher-order linear attention (arXiv 2510.27258) over [B, H, T, D] heads: o and the final
recurrent state. order 2: second-order HLA (asymmetric=1: AHLA); order 3: third order. State
inputs, all or none (none: a fresh sequence), advance from where they left off, so one node
expresses a prefill and one decode step. The optional decay input [H] replaces the decay
attribute."""


def _attribute(name, default):
    return defs.OpSchema.Attribute(name, onnx.helper.make_attribute(name, default), name)


def _dims(type_proto):
    """The dims (DimensionProto list) of a tensor type, None when the rank is unknown."""
    tt = type_proto.tensor_type
    return list(tt.shape.dim) if tt.HasField("shape") else None


def _tensor_type(elem_type, dims):
    t = onnx.TypeProto()
    t.tensor_type.elem_type = elem_type
    if dims is not None:
        t.tensor_type.shape.SetInParent()
        for d in dims:
            t.tensor_type.shape.dim.add().CopyFrom(d)
    return t


def infer(ctx):
    """o [B, H, T, Dv]; state outputs as their inputs, or from q, k, v for a fresh sequence:
    key/value-only entries have Hkv heads, matrices are [Dk, Dk] (S) or [Dk, Dv]."""
    # ops imports torch: the package imports this module with onnx alone
    from .. import ops

    def attr(name):
        a = ctx.get_attribute(name)
        return ATTRIBUTES[name] if a is None else onnx.helper.get_attribute_value(a)

    q_t, k_t, v_t = (ctx.get_input_type(i) for i in range(3))
    elem = q_t.tensor_type.elem_type
    q, k, v = _dims(q_t), _dims(k_t), _dims(v_t)
    ok = all(d is not None and len(d) == 4 for d in (q, k, v))
    ctx.set_output_type(0, _tensor_type(elem, q[:3] + v[3:] if ok else None))
    op = (attr("order"), bool(attr("asymmetric")))
    if op not in STATE_NAMES:
        return
    kv = ops.get(*op).kv_state
    for i, name in enumerate(STATE_NAMES[op][:ctx.get_num_outputs() - 1]):
        if ctx.get_num_inputs() > 4 + i and ctx.has_input(4 + i):
            ctx.set_output_type(1 + i, ctx.get_input_type(4 + i))
            continue
        dims = None
        if ok:
            heads = k[1] if name in kv else q[1]
            dims = [q[0], heads, q[3]] + ([] if name in VECTOR_STATES else
                                          [q[3]] if name == "S" else [v[3]])
        ctx.set_output_type(1 + i, _tensor_type(elem, dims))


def schema():
    P = defs.OpSchema.FormalParameter
    Opt = defs.OpSchema.FormalParameterOption
    return defs.OpSchema(
        OP_TYPE, DOMAIN, VERSION, DOC,
        inputs=[P("q", "T", "queries [B, H, T, Dk]"), P("k", "T", "keys [B, Hkv, T, Dk]"),
                P("v", "T", "values [B, Hkv, T, Dv]"),
                P("decay_heads", "T", "per-head decay [H] (replaces the decay attribute)",
                  param_option=Opt.Optional)
                ] + [P(f"state_{i}", "T", f"state entry {i} in (all entries or none)",
                   param_option=Opt.Optional) for i in range(MAX_STATE)],
        # state entries are separate optional parameters, not variadics: torch.onnx's
        # exporter maps a variadic input onto every argument and makes one variadic output
        outputs=[P("o", "T", "output [B, H, T, Dv]")] + [
            P(f"state_out_{i}", "T", f"final state entry {i} (second order S, C, m, G, h; AHLA "
              "P, m, E, n; third order S, P, m, F, eta)", param_option=Opt.Optional)
            for i in range(MAX_STATE)],
        type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[_attribute(n, d) for n, d in ATTRIBUTES.items()]
    ).set_type_and_shape_inference_function(infer)


def register():
    """Register the schema once per process (idempotent)."""
    if not defs.has(OP_TYPE, DOMAIN):
        defs.register_schema(schema())
