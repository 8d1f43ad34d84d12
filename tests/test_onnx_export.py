"""HLALM -> ONNX (hla_tvm::HLA nodes with function bodies) -> ONNX Runtime and -> TVM, both
against the PyTorch model: prefill from a fresh state, then the decode-step graph with state in
and out."""
import numpy as np
import onnx
import pytest
import torch
from conftest import rel_err

from hla_tvm import onnx as hla_onnx
from hla_tvm.cli import main
from hla_tvm.models import HLALM
from hla_tvm.runtime import load

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)

VOCAB = 40
CONFIGS = {"hla2": dict(), "hla2_decay": dict(decay=[0.9, 0.7], n_kv_heads=2),
           "ahla": dict(asymmetric=True), "ahla_decay": dict(asymmetric=True, decay=0.9),
           "hla3": dict(order=3), "hla3_decay": dict(order=3, decay=[0.9, 0.8], n_kv_heads=2)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def exported(request, tmp_path_factory):
    """(model, prefill .onnx, decode .onnx, compiled library of the prefill file)."""
    torch.manual_seed(0)
    model = HLALM(VOCAB, 32, 2, 4, chunk_size=16, **CONFIGS[request.param]).eval()
    folder = tmp_path_factory.mktemp(request.param)
    prefill, decode = folder / "prefill.onnx", folder / "decode.onnx"
    hla_onnx.export(model, prefill, torch.randint(0, VOCAB, (2, 8)))
    hla_onnx.export(model, decode, decode=True)
    lib = hla_onnx.compile(prefill, out=folder / "model.so")
    return model, prefill, decode, lib


def _torch(model, tokens, state=None):
    with torch.no_grad():
        logits, st = model(torch.as_tensor(tokens), state)
    return logits, st


def _feed(sess, tokens, state):
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, [tokens, *state])))


def test_onnx_runtime_matches_pytorch(exported):
    model, prefill, decode, _ = exported
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (2, 19))
    # the default prefill graph starts a fresh sequence from the tokens alone
    logits, *state = hla_onnx.session(prefill).run(None, {"tokens": tokens})
    ref, ref_state = _torch(model, tokens)
    assert rel_err(torch.from_numpy(logits), ref) <= 1e-4
    step = hla_onnx.session(decode)
    for _ in range(5):
        tok = rng.integers(0, VOCAB, (2,))
        logits, *state = _feed(step, tok, state)
        ref, ref_state = _torch(model, tok[:, None], ref_state)
        assert rel_err(torch.from_numpy(logits), ref[:, 0]) <= 1e-4
    flat = [x for layer in ref_state for x in layer.values()]
    assert all(rel_err(torch.from_numpy(s), r) <= 1e-4 for s, r in zip(state, flat))


def test_tvm_from_onnx_matches_pytorch(exported):
    model, _, _, lib = exported
    m = load(lib)
    rng = np.random.default_rng(1)
    for T in (5, 37):
        tokens = rng.integers(0, VOCAB, (3, T))
        logits, state = m.prefill(tokens, m.init_state(3))
        ref, ref_state = _torch(model, tokens)
        assert logits.shape == (3, T, VOCAB)
        assert rel_err(torch.from_numpy(logits), ref) <= 1e-4
    for _ in range(5):
        tok = rng.integers(0, VOCAB, (3,))
        logits, state = m.decode(tok, state)
        ref, ref_state = _torch(model, tok[:, None], ref_state)
        assert rel_err(torch.from_numpy(logits), ref[:, 0]) <= 1e-4


def test_the_file_is_standard_onnx_with_hla_nodes(exported):
    model, prefill, decode, _ = exported
    for path in (prefill, decode):
        proto = onnx.load(path)
        hla_onnx.check(proto)     # function bodies present, full checker
        nodes = [n for n in proto.graph.node if n.domain == "hla_tvm"]
        assert len(nodes) == len(model.blocks) and {n.op_type for n in nodes} == {"HLA"}
        assert {(f.domain, f.name) for f in proto.functions} == {("hla_tvm", "HLA")}


def test_decode_graph_compiles_to_a_decode_only_module(tmp_path):
    """A decode-step file compiles too; the runtime runs a prompt through it token by token."""
    torch.manual_seed(1)
    model = HLALM(VOCAB, 32, 1, 2, order=3, decay=0.95).eval()
    path = tmp_path / "decode.onnx"
    hla_onnx.export(model, path, decode=True)
    m = load(hla_onnx.compile(path, out=tmp_path / "step.so"))
    assert m.entries == ("decode", "decode_1")   # (decode_1: one stream's step, static shapes)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 6))
    logits, state = m.prefill(tokens, m.init_state(2))
    ref, ref_state = _torch(model, tokens)
    assert rel_err(torch.from_numpy(logits), ref) <= 1e-4
    logits, _ = m.decode(tokens[:, 0], state)
    assert rel_err(torch.from_numpy(logits), _torch(model, tokens[:, :1], ref_state)[0][:, 0]) \
        <= 1e-4


def test_cli_export_then_compile(tmp_path, capsys):
    torch.manual_seed(2)
    model = HLALM(VOCAB, 16, 1, 2)
    ckpt = tmp_path / "m.pt"
    model.save(ckpt)
    onnx_path, lib = tmp_path / "m.onnx", tmp_path / "m.so"
    assert main(["export-onnx", str(ckpt), "-o", str(onnx_path)]) == 0
    assert "1 hla_tvm::HLA" in capsys.readouterr().out
    assert main(["compile", str(onnx_path), "-o", str(lib)]) == 0
    tokens = np.array([[1, 2, 3, 4]])
    m = load(lib)
    logits, _ = m.prefill(tokens, m.init_state(1))
    assert rel_err(torch.from_numpy(logits), _torch(model.eval(), tokens)[0]) <= 1e-4


def test_export_refuses_other_modules(tmp_path):
    with pytest.raises(TypeError, match="HLALM-like"):
        hla_onnx.export(torch.nn.Linear(2, 2), tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="example_tokens"):
        hla_onnx.export(HLALM(VOCAB, 16, 1, 2), tmp_path / "x.onnx", torch.zeros(2, 3))


def test_prefill_from_state_is_an_export_option(tmp_path):
    """from_state=True: the prefill graph continues a given state (ORT and TVM), and the
    default graph's ONNX Runtime session needs nothing but the tokens."""
    torch.manual_seed(3)
    model = HLALM(VOCAB, 32, 1, 4, decay=[0.9, 0.8], n_kv_heads=2).eval()
    fresh, cont = tmp_path / "fresh.onnx", tmp_path / "cont.onnx"
    hla_onnx.export(model, fresh)
    hla_onnx.export(model, cont, from_state=True)
    assert [i.name for i in hla_onnx.session(fresh).get_inputs()] == ["tokens"]
    rng = np.random.default_rng(4)
    first, second = rng.integers(0, VOCAB, (2, 7)), rng.integers(0, VOCAB, (2, 9))
    _, state = _torch(model, first)
    ref, _ = _torch(model, second, state)
    flat = [x.numpy() for layer in state for x in layer.values()]
    logits, *_ = _feed(hla_onnx.session(cont), second, flat)
    assert rel_err(torch.from_numpy(logits), ref) <= 1e-4
    for path in (fresh, cont):   # both compile to prefill-from-state modules
        m = load(hla_onnx.compile(path, out=tmp_path / f"{path.stem}.so"))
        _, st = m.prefill(first, m.init_state(2))
        logits, _ = m.prefill(second, st)
        assert rel_err(torch.from_numpy(logits), ref) <= 1e-4


def test_hybrid_with_positions_on_onnx_runtime(tmp_path):
    """A hybrid HLALM (a softmax layer whose key/value cache and int64 position counter are
    state entries) exported with its state: ONNX Runtime continues a state and decodes as
    PyTorch. (TVM's ONNX importer loses the shapes of its cache update: compile the model
    itself, `hla_tvm.compile`, tests/test_hybrid.py.)"""
    torch.manual_seed(5)
    model = HLALM(VOCAB, 32, 2, 4, chunk_size=16, softmax_layers=[0], max_len=8).eval()
    cont, step = tmp_path / "cont.onnx", tmp_path / "step.onnx"
    hla_onnx.export(model, cont, from_state=True)
    hla_onnx.export(model, step, decode=True)
    rng = np.random.default_rng(6)
    first, second = rng.integers(0, VOCAB, (2, 5)), rng.integers(0, VOCAB, (2, 6))
    _, st = _torch(model, first)
    flat = [x.numpy() for layer in st for x in layer.values()]
    ref, st = _torch(model, second, st)
    logits, *state = _feed(hla_onnx.session(cont), second, flat)
    assert rel_err(torch.from_numpy(logits), ref) <= 1e-4
    tok = rng.integers(0, VOCAB, (2,))
    logits, *_ = _feed(hla_onnx.session(step), tok, state)
    want, _ = _torch(model, tok[:, None], st)
    assert rel_err(torch.from_numpy(logits), want[:, 0]) <= 1e-4


class PositionsLM(torch.nn.Module):
    """Learned positions, the next one an int64 state entry of the model's own."""

    def __init__(self):
        super().__init__()
        from hla_tvm.nn import HLAttention

        self.emb, self.pos = torch.nn.Embedding(VOCAB, 16), torch.nn.Embedding(8, 16)
        self.attn, self.head = HLAttention(16, 2, chunk_size=16), torch.nn.Linear(16, VOCAB)

    def init_state(self, batch):
        return [self.attn.init_state(batch), {"position": torch.zeros(batch, dtype=torch.int64)}]

    def forward(self, tokens, state=None):
        start = torch.zeros(tokens.shape[0], dtype=torch.int64) if state is None else \
            state[1]["position"]
        x = self.emb(tokens) + self.pos((start[:, None] + torch.arange(tokens.shape[1])) % 8)
        y, st = self.attn(x, None if state is None else state[0])
        return self.head(x + y), [st, {"position": start + tokens.shape[1]}]


def test_int64_state_entries_are_part_of_the_signature(tmp_path):
    """A position counter (int64 [B]) is a state entry like the float32 ones for
    `hla_onnx.compile`'s reader of the graph's interface (it refused all but float32). TVM's
    ONNX importer itself then refuses the size arithmetic torch writes for positions
    (`Squeeze(Shape(tokens)[1:2])`) in one line naming the node: compile such a model with
    `hla_tvm.compile`."""
    from hla_tvm.onnx.importer import lm_signature

    torch.manual_seed(7)
    path = tmp_path / "pos.onnx"
    hla_onnx.export(PositionsLM().eval(), path, from_state=True)
    sig = lm_signature(onnx.load(path))
    assert sig["entry"] == "prefill"
    assert [(s, d) for _, s, d in sig["state"]][-1] == ([], "int64")
    with pytest.raises(ValueError, match=r"at a Squeeze node"):
        hla_onnx.compile(path, out=tmp_path / "pos.so")
