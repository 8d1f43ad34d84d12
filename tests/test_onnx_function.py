"""The hla_tvm::HLA function bodies (standard ONNX: a Scan over chunks of F.CHUNK tokens) run in
ONNX Runtime with no plugin and match the float64 serial recurrences, for sequences shorter than
a chunk, of whole chunks and with a short last chunk; a hand-built graph with one HLA node, from
a non-zero state."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import rel_err
from onnx import TensorProto, helper

from hla_tvm import ops
from hla_tvm.onnx import function as F
from hla_tvm.ops.ahla import reference as ahla
from hla_tvm.ops.hla2 import reference as hla2
from hla_tvm.ops.hla3 import reference as hla3

REFS = {(2, False): hla2, (2, True): ahla, (3, False): hla3}
CASES = [(2, False, True, False, 0.0), (2, False, True, True, 0.0), (2, False, False, False, 0.3),
         (2, False, True, True, 0.3), (2, False, False, True, 0.3),
         (2, True, True, False, 0.0), (2, True, True, True, 0.0),
         (3, False, True, False, 0.0), (3, False, True, True, 0.0)]


def _model(order, asym, masked, normalize, ridge, arrays, decay=1.0):
    """One HLA node over the graph inputs in `arrays` (decay and state inputs when present)."""
    return F.one_node_model({n: a.shape for n, a in arrays.items()}, order=order,
                            asymmetric=asym, masked=masked, normalize=normalize, ridge=ridge,
                            decay=decay)


def _inputs(order, asym, masked, *, B=2, H=4, Hkv=4, T=11, dk=4, dv=5, state=True,
            decay="head"):
    """Graph inputs (float32) and the float64 reference's initial state for them."""
    ref = REFS[(order, asym)]
    rng = np.random.default_rng(0)
    q = np.abs(rng.standard_normal((B, H, T, dk))).astype(np.float32) / 2
    k, v = (np.abs(rng.standard_normal((B, Hkv, T, d))).astype(np.float32) / 2 for d in (dk, dv))
    arrays = {"q": q, "k": k, "v": v}
    gamma = np.repeat(np.linspace(0.5, 1.0, Hkv), H // Hkv).astype(np.float32)
    if decay == "head":
        arrays["decay"] = gamma
    elif decay is not None:
        gamma = np.full(H, decay, np.float32)
    else:
        gamma = np.ones(H, np.float32)
    st0 = None
    if state:
        opts = dict(masked=masked) if ref is hla2 else {}
        t = lambda a: _t64(_rep(a[:, :, :4], H))  # noqa: E731
        st0 = ref.serial(t(q), t(k), t(v), decay=_t64(gamma), **opts)[1]
        kv = ops.get(order, asym).kv_state
        for n, x in st0.items():
            arrays[f"{n}_in"] = (x[:, ::H // Hkv] if n in kv else x).float().numpy()
    return arrays, gamma, st0


def _t64(a):
    return torch.from_numpy(np.ascontiguousarray(a)).double()


def _rep(a, H):
    return np.repeat(a, H // a.shape[1], axis=1)


def _check_against_reference(order, asym, masked, normalize, ridge, arrays, gamma, st0, got):
    ref = REFS[(order, asym)]
    H = arrays["q"].shape[1]
    opts = dict(masked=masked, ridge=ridge) if ref is hla2 else {}
    want, want_st = ref.serial(_t64(arrays["q"]), _t64(_rep(arrays["k"], H)),
                               _t64(_rep(arrays["v"], H)), normalize=normalize,
                               decay=_t64(gamma), state=st0, **opts)
    # second order with decay and normalize divides by q^T(S m - h), a difference: float32
    # loses ~1e-4 there (as PyTorch's own float32 recurrence does; see tests/test_op_shared.py)
    tol = 5e-4 if (order, asym, normalize) == (2, False, True) and (gamma != 1).any() else 1e-4
    assert rel_err(torch.from_numpy(got[0]), want) <= tol
    kv = ops.get(order, asym).kv_state
    G = H // arrays["k"].shape[1]
    for n, x in zip(F.STATE_NAMES[(order, asym)], got[1:]):
        w = want_st[n][:, ::G] if n in kv else want_st[n]
        assert x.shape == tuple(w.shape), n
        if not w.abs().max():   # (G, h after one token from zeros: exactly zero)
            assert not np.abs(x).max(), n
            continue
        assert rel_err(torch.from_numpy(x), w) <= 1e-4, n


@pytest.mark.parametrize("T", [1, 11, F.CHUNK + 1, 2 * F.CHUNK + 13])
@pytest.mark.parametrize("order, asym, masked, normalize, ridge", CASES)
def test_function_body_in_onnxruntime(order, asym, masked, normalize, ridge, T):
    arrays, gamma, st0 = _inputs(order, asym, masked, T=T)
    model = _model(order, asym, masked, normalize, ridge, arrays)
    F.check(model)
    got = ort.InferenceSession(model.SerializeToString()).run(None, arrays)
    _check_against_reference(order, asym, masked, normalize, ridge, arrays, gamma, st0, got)


@pytest.mark.parametrize("T", [1, 2 * F.CHUNK])
@pytest.mark.parametrize("order, asym", [(2, False), (2, True), (3, False)])
@pytest.mark.parametrize("state, decay", [(False, None), (False, 0.8), (True, 0.9),
                                          (False, "head")])
def test_optional_inputs_and_grouped_heads(order, asym, state, decay, T):
    """No state inputs (fresh sequence), scalar decay attribute, grouped key/value heads; one
    token (the body's one-token branch) and two whole chunks."""
    arrays, gamma, st0 = _inputs(order, asym, True, H=4, Hkv=2, T=T, state=state,
                                 decay=decay)
    model = _model(order, asym, True, False, 0.0, arrays,
                   decay=decay if isinstance(decay, float) else 1.0)
    F.check(model)
    got = ort.InferenceSession(model.SerializeToString()).run(None, arrays)
    _check_against_reference(order, asym, True, False, 0.0, arrays, gamma, st0, got)


@pytest.mark.parametrize("order, asym", [(2, False), (2, True), (3, False)])
@pytest.mark.parametrize("state", [True, False])
def test_type_and_shape_inference(order, asym, state):
    """Every output gets its element type and dims (grouped heads: kv-only entries have Hkv)."""
    arrays, _, _ = _inputs(order, asym, True, B=2, H=4, Hkv=2, T=7, dk=3, dv=5, state=state)
    model = _model(order, asym, True, False, 0.0, arrays)
    del model.graph.output[:]
    model.graph.output.extend(helper.make_empty_tensor_value_info(n)
                              for n in model.graph.node[0].output)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    got = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
           for v in inferred.graph.value_info
           if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    want = {"o": [2, 4, 7, 5]}
    kv = ops.get(order, asym).kv_state
    shapes = REFS[(order, asym)].state_shapes(2, 4, 3, 5)
    for n, shape in shapes.items():
        want[f"{n}_out"] = [2, 2 if n in kv else 4, *shape[2:]]
    assert got == want


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="not an HLA operator"):
        F.make_function(order=3, asymmetric=True)


def test_files_with_the_per_token_body_still_load_and_run():
    """A file exported before the chunk form (its body a Scan over the tokens; tests/data holds
    one the earlier exporter wrote: B2 H4 Hkv2 T11, normalized, decay and state inputs) passes
    the body check and runs in ONNX Runtime to the float64 recurrence."""
    import os

    from hla_tvm.onnx.ort_session import session

    path = os.path.join(os.path.dirname(__file__), "data", "hla2_serial_body.onnx")
    model = onnx.load(path)
    assert model.functions[0].SerializeToString() != F.make_function(
        2, False, True, True, True, True).SerializeToString()
    arrays, gamma, st0 = _inputs(2, False, True, B=2, H=4, Hkv=2, T=11, dk=4, dv=5)
    F.check(model)
    got = session(path).run(None, arrays)
    _check_against_reference(2, False, True, True, 0.0, arrays, gamma, st0, got)
