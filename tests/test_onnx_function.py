"""The hla_tvm::HLA function bodies (standard ONNX) run in ONNX Runtime with no plugin and match
the float64 serial recurrences; a hand-built graph with one HLA node, from a non-zero state."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from conftest import rel_err
from hla_tvm.onnx import function as F
from hla_tvm.reference import ahla, hla2, hla3

REFS = {(2, False): hla2, (2, True): ahla, (3, False): hla3}
CASES = [(2, False, True, False, 0.0), (2, False, True, True, 0.0), (2, False, False, False, 0.3),
         (2, True, True, False, 0.0), (2, True, True, True, 0.0),
         (3, False, True, False, 0.0), (3, False, True, True, 0.0)]


def _model(order, asym, masked, normalize, ridge, arrays):
    names = F.STATE_NAMES[(order, asym)]
    vi = lambda n, a: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape))  # noqa
    ins = [vi(n, arrays[n]) for n in ("q", "k", "v", "decay")] + \
        [vi(f"{n}_in", arrays[f"{n}_in"]) for n in names]
    outs = [helper.make_tensor_value_info("o", TensorProto.FLOAT, [None] * 4)] + \
        [vi(f"{n}_out", arrays[f"{n}_in"]) for n in names]
    node = F.node(["q", "k", "v", "decay"] + [f"{n}_in" for n in names],
                  ["o"] + [f"{n}_out" for n in names], order=order, asymmetric=asym,
                  masked=masked, normalize=normalize, ridge=ridge)
    graph = helper.make_graph([node], "one_hla", ins, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", F.OPSET),
                                                   helper.make_opsetid(F.DOMAIN, 1)],
                             functions=[F.make_function(order, asym, masked, normalize)])


@pytest.mark.parametrize("order, asym, masked, normalize, ridge", CASES)
def test_function_body_in_onnxruntime(order, asym, masked, normalize, ridge):
    ref = REFS[(order, asym)]
    rng = np.random.default_rng(0)
    B, H, T, dk, dv = 2, 3, 11, 4, 5
    q, k, v = (np.abs(rng.standard_normal((B, H, T, d))).astype(np.float32) / 2
               for d in (dk, dk, dv))
    decay = np.array([0.5, 0.9, 1.0], np.float32)
    t64 = lambda a: torch.from_numpy(a).double()  # noqa: E731
    opts = dict(masked=masked, ridge=ridge) if ref is hla2 else {}
    st0 = ref.serial(*(t64(x[:, :, :4]) for x in (q, k, v)), decay=t64(decay), **opts)[1]
    arrays = {"q": q, "k": k, "v": v, "decay": decay,
              **{f"{n}_in": st0[n].float().numpy() for n in st0}}
    model = _model(order, asym, masked, normalize, ridge, arrays)
    F.check(model)
    got = ort.InferenceSession(model.SerializeToString()).run(None, arrays)
    want, want_st = ref.serial(t64(q), t64(k), t64(v), normalize=normalize, decay=t64(decay),
                               state=st0, **opts)
    assert rel_err(torch.from_numpy(got[0]), want) <= 1e-4
    for n, x in zip(F.STATE_NAMES[(order, asym)], got[1:]):
        assert rel_err(torch.from_numpy(x), want_st[n]) <= 1e-4, n


def test_shape_inference_through_the_function():
    arrays = {"q": np.zeros((1, 2, 6, 4), np.float32), "k": np.zeros((1, 2, 6, 4), np.float32),
              "v": np.zeros((1, 2, 6, 3), np.float32), "decay": np.ones(2, np.float32)}
    arrays.update({f"{n}_in": np.zeros(s, np.float32)
                   for n, s in hla2.state_shapes(1, 2, 4, 3).items()})
    inferred = onnx.shape_inference.infer_shapes(_model(2, False, True, False, 0.0, arrays),
                                                 strict_mode=True)
    out = next(o for o in inferred.graph.output if o.name == "o")
    assert out.type.tensor_type.elem_type == TensorProto.FLOAT


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="not an HLA operator"):
        F.make_function(order=3, asymmetric=True)
