"""The torch.library custom op, layers and HLALM model (PyTorch side of the deployment path)."""
import pytest
import torch
from conftest import make_qkv, rel_err

from hla_tvm.models import HLALM
from hla_tvm.nn import HLAttention, hla_op, state_names
from hla_tvm.ops.ahla import reference as ahla
from hla_tvm.ops.hla2 import reference as hla2
from hla_tvm.ops.hla3 import reference as hla3

OPS = [(2, False, hla2), (2, True, ahla), (3, False, hla3)]


@pytest.mark.parametrize("order, asym, ref", OPS)
def test_custom_op_matches_reference_and_differentiates(order, asym, ref):
    q, k, v = make_qkv(1, 2, 12, 4, 3, seed=1)
    names = state_names(order, asym)
    zero = ref.zero_state(1, 2, 4, 3)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out, *st = hla_op(*xs, [zero[n] for n in names], None, order, asym, True, False, 1e-6, 0.0, 5)
    assert rel_err(out, ref.quadratic(q, k, v)) < 1e-12
    w = torch.randn_like(out)
    (out * w).sum().backward()
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    (ref.quadratic(*ys) * w).sum().backward()
    for a, b in zip(xs, ys):
        assert rel_err(a.grad, b.grad) < 1e-8
    assert [tuple(s.shape) for s in st] == [tuple(zero[n].shape) for n in names]


def test_custom_op_gradient_through_the_state():
    """Training across segments: the gradient reaches the previous segment's q, k, v."""
    q, k, v = make_qkv(1, 1, 10, 3, 2, seed=2)
    names = state_names()
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    zero = [hla2.zero_state(1, 1, 3, 2)[n] for n in names]
    _, *st = hla_op(*(x[:, :, :6] for x in xs), zero, None, 2, False, True, False, 1e-6, 0.0, 4)
    out, *_ = hla_op(*(x[:, :, 6:] for x in xs), st, None, 2, False, True, False, 1e-6, 0.0, 4)
    out.sum().backward()
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    hla2.quadratic(*ys)[:, :, 6:].sum().backward()
    for a, b in zip(xs, ys):
        assert rel_err(a.grad, b.grad) < 1e-8


@pytest.mark.parametrize("order, asym, ref", OPS)
def test_custom_op_differentiates_in_decay(order, asym, ref):
    """A learnable per-head decay gets its gradient (float64, against the serial recurrence's
    autograd), as q, k and v do."""
    q, k, v = make_qkv(1, 2, 12, 4, 3, seed=4)
    names = state_names(order, asym)
    zero = ref.zero_state(1, 2, 4, 3)
    decay = torch.tensor([0.9, 0.7], dtype=torch.float64, requires_grad=True)
    out, *_ = hla_op(q, k, v, [zero[n] for n in names], decay, order, asym, True, False, 1e-6,
                     0.0, 5)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    want = decay.detach().clone().requires_grad_()
    (ref.serial(q, k, v, decay=want)[0] * w).sum().backward()
    assert rel_err(decay.grad, want.grad) < 1e-10


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_a_training_step_compiles_whole(kv_heads):
    """torch.compile(fullgraph=True) of a training step through an HLA layer (grouped heads
    too): its backward (the reference recomputed) traces without a branch on the values, and
    the gradients are eager's. A compiled caller of hla() itself keeps the value checks."""
    from hla_tvm import hla

    torch.manual_seed(0)
    layer = HLAttention(16, 2, n_kv_heads=kv_heads, decay=0.9)
    x = torch.randn(2, 20, 16)
    eager = torch.autograd.grad(layer(x)[0].square().sum(), list(layer.parameters()))
    step = torch.compile(lambda x: layer(x)[0].square().sum(), fullgraph=True)
    got = torch.autograd.grad(step(x), list(layer.parameters()))
    for a, b in zip(got, eager):
        assert rel_err(a, b) < 1e-5
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"decay values must lie in \(0, 1\]"):
        torch.compile(lambda q: hla(q, q, q, decay=torch.tensor([1.5, 0.5]), backend="torch"))(q)


def test_opcheck():
    q, k, v = make_qkv(1, 2, 6, 4, 4, seed=3)
    zero = hla2.zero_state(1, 2, 4, 4)
    torch.library.opcheck(hla_op, (q, k, v, [zero[n] for n in state_names()], None, 2, False,
                                   True, False, 1e-6, 0.0, 4))


@pytest.mark.parametrize("kw", [dict(), dict(asymmetric=True), dict(order=3),
                                dict(decay=0.9, n_kv_heads=2), dict(normalize=True)])
def test_hlalm_streams_like_the_whole_sequence(kw):
    torch.manual_seed(0)
    m = HLALM(40, 32, 2, 4, **kw).double()
    toks = torch.randint(0, 40, (2, 21))
    full, full_state = m(toks)
    a, st = m(toks[:, :9])
    b, st = m(toks[:, 9:20], st)
    c, st = m(toks[:, 20:], st)
    assert rel_err(torch.cat([a, b, c], 1), full) < 1e-10
    for s1, s2 in zip(st, full_state):
        for n in s1:
            assert rel_err(s1[n], s2[n]) < 1e-10


def test_attention_layer_state_shapes_follow_grouped_heads():
    layer = HLAttention(32, 4, n_kv_heads=2, order=3)
    st = layer.init_state(3)
    assert st["S"].shape == (3, 2, 8, 8) and st["F"].shape == (3, 4, 8, 8)
    with pytest.raises(ValueError, match="must divide"):
        HLAttention(32, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="decay must be one value"):
        HLAttention(32, 4, decay=[0.9, 0.8, 0.7])


def test_save_load_roundtrip(tmp_path):
    m = HLALM(30, 16, 1, 2, order=3, decay=[0.9, 0.8], tie_embeddings=False)
    m.save(tmp_path / "m.pt")
    m2 = HLALM.load(tmp_path / "m.pt")
    toks = torch.randint(0, 30, (1, 7))
    assert torch.equal(m(toks)[0], m2(toks)[0])
    (tmp_path / "bad.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not an HLALM checkpoint"):
        HLALM.load(tmp_path / "bad.pt")
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an HLALM checkpoint"):
        HLALM.load(tmp_path / "other.pt")


def test_model_rejects_bad_tokens_and_state():
    m = HLALM(10, 8, 2, 2)
    with pytest.raises(ValueError, match=r"tokens must be an integer tensor \[B, T\]"):
        m(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="state must hold 2 layer states"):
        m(torch.zeros(1, 3, dtype=torch.int64), state=[{}])


def test_export_keeps_one_node_per_layer():
    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, tokens):
            return self.m(tokens)[0]

    m = HLALM(20, 16, 3, 2).eval()
    ep = torch.export.export(Wrap(m), (torch.zeros(1, 5, dtype=torch.int64),))
    nodes = [n for n in ep.graph.nodes if n.target is torch.ops.hla_tvm.hla.default]
    assert len(nodes) == 3


def test_model_under_bfloat16_autocast_prefills_and_decodes():
    """HLALM under torch.autocast("cpu", bfloat16), as a user runs it for speed: prefill and a
    decode step (in-place state updates) run, the state stays float32 and the logits stay
    within bfloat16's precision of float32 PyTorch (the products round to 8 bits)."""
    from hla_tvm.models import HLALM

    torch.manual_seed(0)
    model = HLALM(40, 32, 2, 4, chunk_size=16).eval()
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, state = model(tokens, None)
        want_step, _ = model(tokens[:, :1], state)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, cast_state = model(tokens, None)
            step, _ = model(tokens[:, :1], cast_state)
    assert all(x.dtype == torch.float32 for layer in cast_state for x in layer.values())
    for a, b in ((got, want), (step, want_step)):
        assert float((a.float() - b).abs().max() / b.abs().max()) < 2e-2
