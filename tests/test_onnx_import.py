"""ONNX graphs with hla_tvm::HLA nodes compiled by TVM onto our kernels: a hand-built graph with
one node against the float64 serial recurrence; bad models refused with errors naming the node."""
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from test_onnx_function import _check_against_reference, _inputs, _model

from hla_tvm import onnx as hla_onnx
from hla_tvm.compiler import cpu_pipeline
from hla_tvm.onnx import function as F
from hla_tvm.target import host_target


def _run_tvm(model, arrays):
    mod = hla_onnx.to_relax(model)
    tgt = host_target()
    with tgt:
        exe = tvm.compile(mod, target=tgt, relax_pipeline=cpu_pipeline(tgt))
    vm = tvm.relax.VirtualMachine(exe, tvm.cpu())
    names = [i.name for i in model.graph.input]
    res = vm["main"](*[tvm.runtime.tensor(arrays[n].copy()) for n in names])
    return [r.numpy() for r in res]


@pytest.mark.parametrize("order, asym, masked, normalize, ridge, state, decay, Hkv", [
    (2, False, True, False, 0.0, True, "head", 2),
    (2, False, False, True, 0.3, False, None, 4),
    (2, True, True, True, 0.0, True, 0.8, 4),
    (3, False, True, False, 0.0, False, "head", 2),
])
def test_one_node_graph_on_tvm_matches_float64(order, asym, masked, normalize, ridge, state,
                                               decay, Hkv):
    arrays, gamma, st0 = _inputs(order, asym, masked, H=4, Hkv=Hkv, T=23, state=state,
                                 decay=decay)
    model = _model(order, asym, masked, normalize, ridge, arrays,
                   decay=decay if isinstance(decay, float) else 1.0)
    got = _run_tvm(model, arrays)
    _check_against_reference(order, asym, masked, normalize, ridge, arrays, gamma, st0, got)


def _one_node(state=False):
    arrays, _, _ = _inputs(2, False, True, H=2, Hkv=2, T=5, state=state, decay=None)
    return _model(2, False, True, False, 0.0, arrays), arrays


def test_unknown_attribute_value_names_the_node():
    model, _ = _one_node()
    node = model.graph.node[0]
    next(a for a in node.attribute if a.name == "order").i = 5
    for call in (hla_onnx.to_relax, hla_onnx.check, hla_onnx.add_functions):
        with pytest.raises(ValueError, match="HLA node 'hla0'.*order=5"):
            call(model)
    next(a for a in node.attribute if a.name == "order").i = 2
    next(a for a in node.attribute if a.name == "masked").i = 3
    with pytest.raises(ValueError, match="'hla0'.*masked must be 0 or 1"):
        hla_onnx.to_relax(model)


def test_wrong_input_rank_names_the_node():
    model, arrays = _one_node()
    q = model.graph.input[0]
    q.type.tensor_type.shape.ClearField("dim")
    for d in (2, 5, 4):
        q.type.tensor_type.shape.dim.add().dim_value = d
    with pytest.raises(ValueError, match="HLA node 'hla0': input q must have rank 4"):
        hla_onnx.to_relax(model)


def test_missing_function_body_names_the_node():
    model, arrays = _one_node()
    del model.functions[:]
    with pytest.raises(ValueError, match="HLA node 'hla0'.*no function body.*add_functions"):
        hla_onnx.check(model)
    with pytest.raises(ValueError, match="HLA node 'hla0'.*no function body"):
        hla_onnx.session(model)
    # the TVM path does not need the body
    assert len(_run_tvm(model, arrays)) == 6
    hla_onnx.session(hla_onnx.add_functions(model))


def test_hla_of_another_domain_is_not_ours():
    model, _ = _one_node()
    model.graph.node[0].domain = "com.example"
    with pytest.raises(ValueError, match="op HLA of domain 'com.example' is not hla_tvm::HLA"):
        hla_onnx.to_relax(model)


def test_wrong_input_count_and_files(tmp_path):
    model, _ = _one_node(state=True)
    del model.graph.node[0].input[5:]
    with pytest.raises(ValueError, match="'hla0'.*3, 4 or 9 inputs, got 5"):
        hla_onnx.to_relax(model)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        hla_onnx.compile(bad)
    with pytest.raises(FileNotFoundError):
        hla_onnx.compile(tmp_path / "missing.onnx")


def test_compile_wants_a_language_model_graph(tmp_path):
    """compile() needs the tokens/state interface export writes; to_relax takes any graph."""
    model, _ = _one_node()
    path = tmp_path / "one.onnx"
    onnx.save(model, path)
    with pytest.raises(ValueError, match="first input must be the int64 tokens"):
        hla_onnx.compile(path)


def test_node_builder_sets_overloads():
    n = F.node(["q", "k", "v"], ["o"], order=3)
    assert n.overload == "o3a0m1n0" and list(n.input) == ["q", "k", "v", ""]
    n = F.node(["q", "k", "v", "g"] + [f"s{i}" for i in range(5)], ["o"], normalize=True)
    assert n.overload == "o2a0m1n1_g_s"
    graph = helper.make_graph([n], "g", [], [helper.make_tensor_value_info("o", TensorProto.FLOAT,
                                                                          None)])
    assert F.node_variant(graph.node[0])["state_input"]


@pytest.mark.parametrize("state", [False, True])
def test_state_from_zeros_or_initializers_is_not_mutated_across_calls(state):
    """The kernels advance state in place: a fresh state (no state inputs) or an initial state
    stored as initializers must not carry over from one call to the next."""
    arrays, gamma, st0 = _inputs(2, False, True, H=4, Hkv=2, T=9, state=state, decay=None)
    model = _model(2, False, True, False, 0.0, arrays)
    if state:   # move the state inputs into initializers
        for name in [i.name for i in model.graph.input if i.name.endswith("_in")]:
            model.graph.initializer.append(onnx.numpy_helper.from_array(arrays.pop(name), name))
        kept = [i for i in model.graph.input if i.name in arrays]
        del model.graph.input[:]
        model.graph.input.extend(kept)
    mod = hla_onnx.to_relax(model)
    tgt = host_target()
    with tgt:
        exe = tvm.compile(mod, target=tgt, relax_pipeline=cpu_pipeline(tgt))
    vm = tvm.relax.VirtualMachine(exe, tvm.cpu())
    for _ in range(2):
        res = vm["main"](*[tvm.runtime.tensor(arrays[i.name]) for i in model.graph.input])
        _check_against_reference(2, False, True, False, 0.0, arrays, gamma, st0,
                                 [r.numpy() for r in res])
