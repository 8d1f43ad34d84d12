"""Hybrid models: `hla_tvm.nn.SoftmaxAttention` (softmax attention whose keys and values live
in a fixed-size cache in the state, rotary positions, grouped heads) checked against a float64
softmax over the whole sequence, and an HLALM with softmax layers compiled, prefilled in pieces,
decoded past its cache's length and served from a state pool, against PyTorch."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from conftest import scheme_tol

from hla_tvm import compile as compile_model
from hla_tvm.models import HLALM
from hla_tvm.nn import HLAttention, SoftmaxAttention
from hla_tvm.runtime import load
from hla_tvm.runtime.state_pool import StatePool


def reference(layer, x):
    """The layer's output for the whole sequence x in float64: each query sees the last
    max_len keys up to itself (rotary positions 0..T-1)."""
    B, T, _ = x.shape
    H, Hkv, D, L = layer.n_heads, layer.n_kv_heads, layer.head_dim, layer.max_len
    x = x.double()

    def lin(p, x, heads):
        y = x @ p.weight.double().T + (0 if p.bias is None else p.bias.double())
        return y.view(B, T, heads, D).transpose(1, 2)

    q, k, v = lin(layer.q_proj, x, H), lin(layer.k_proj, x, Hkv), lin(layer.v_proj, x, Hkv)
    if layer.rope_theta is not None:
        inv = layer.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * inv
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        q, k = ((t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin)
                for t in (q, k))
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    i = torch.arange(T)
    seen = i[:, None] - i[None, :]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill((seen < 0) | (seen >= L),
                                                                  -math.inf)
    o = torch.softmax(scores, -1) @ v
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.out_norm.weight.double()
    return o.transpose(1, 2).reshape(B, T, H * D) @ layer.o_proj.weight.double().T


@pytest.mark.parametrize("max_len,pieces", [(16, (3, 1, 6)), (8, (5, 1, 1, 13, 10)),
                                            (4, (7, 1, 12))])
def test_softmax_layer_in_pieces_matches_the_whole_sequence(max_len, pieces):
    """One piece, the pieces given and one token at a time give float64's outputs, also past
    max_len (a sliding window of max_len tokens)."""
    torch.manual_seed(max_len)
    layer = SoftmaxAttention(32, 4, n_kv_heads=2, max_len=max_len, bias=True)
    T = sum(pieces)
    x = torch.randn(2, T, 32)
    want = reference(layer, x)
    with torch.no_grad():
        for split in ((T,), pieces, (1,) * T):
            out, state, i = [], None, 0
            for n in split:
                y, state = layer(x[:, i:i + n], state)
                out.append(y)
                i += n
            got = torch.cat(out, 1).double()
            assert float((got - want).abs().max()) < 2e-5 * float(want.abs().max()), split
            assert state["position"].tolist() == [T, T]
            assert state["k"].shape == (2, 2, max_len, 8)


def test_softmax_layer_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        SoftmaxAttention(32, 4, max_len=0)
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
        SoftmaxAttention(32, 4, max_len=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="even head_dim"):
        SoftmaxAttention(28, 4, max_len=8)
    SoftmaxAttention(28, 4, max_len=8, rope_theta=None)   # (no positions: any head size)
    for bad in ((3,), (0, 0), 1, (True,)):
        with pytest.raises(ValueError, match="softmax_layers must"):
            HLALM(64, 32, 3, 4, softmax_layers=bad)


def test_hybrid_checkpoint_keeps_its_layers(tmp_path):
    torch.manual_seed(0)
    model = HLALM(64, 32, 3, 4, softmax_layers=[2, 0], max_len=16)
    assert [type(b.attn) for b in model.blocks] == [SoftmaxAttention, HLAttention,
                                                    SoftmaxAttention]
    model.save(tmp_path / "h.pt")
    back = HLALM.load(tmp_path / "h.pt")
    assert back.config["softmax_layers"] == [0, 2] and back.config["max_len"] == 16
    tokens = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens)[0], back(tokens)[0])
    # a model without softmax layers keeps the config (and digest) it had
    assert "softmax_layers" not in HLALM(64, 32, 1, 4).config


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    torch.manual_seed(0)
    model = HLALM(64, 32, 3, 4, n_kv_heads=2, chunk_size=16, softmax_layers=[1],
                  max_len=12).eval()
    path = tmp_path_factory.mktemp("hybrid") / "hybrid.so"
    compile_model(model, out=path)
    return model, str(path)


def test_compiled_hybrid_prefills_in_pieces_and_decodes_past_its_cache(hybrid):
    """Prefill in two pieces, then decode steps past max_len (12): the compiled module matches
    PyTorch; the softmax layer's cache and position counter are state entries."""
    model, path = hybrid
    m = load(path)
    names = [n for n, _, _ in m.state_spec]
    assert {"layer1.k", "layer1.v", "layer1.position"} <= set(names)
    assert dict((n, d) for n, _, d in m.state_spec)["layer1.position"] == "int64"
    tokens = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, st = model(tokens)
    state = m.init_state(1)
    first, state = m.prefill(tokens[:, :7].numpy(), state)
    rest, state = m.prefill(tokens[:, 7:].numpy(), state)
    scale = float(want.abs().max())
    np.testing.assert_allclose(np.concatenate([first, rest], 1), want.numpy(), rtol=0,
                               atol=2e-5 * scale)
    for tok in (3, 5, 60, 1, 2, 9, 4):
        got, state = m.decode(np.array([tok]), state)
        with torch.no_grad():
            want, st = model(torch.tensor([[tok]]), st)
        np.testing.assert_allclose(got, want[:, 0].numpy(), rtol=0, atol=2e-5 * scale)
    assert int(np.asarray(state[names.index("layer1.position")])[0]) == 27


def test_hybrid_streams_in_a_state_pool_decode_alone(hybrid):
    """Two streams of different lengths in one pool (the server's) decode as each alone."""
    model, path = hybrid
    m = load(path)
    pool = StatePool(m, 3)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 3, 2, 1, 9, 9, 30, 31, 2]]
    states = []
    for p in prompts:
        _, st = m.prefill(np.array([p]), m.init_state(1))
        pool.add(st)
        with torch.no_grad():
            states.append(model(torch.tensor([p]))[1])
    for step in range(3):
        tokens = np.array([11 + step, 40 - step])
        got = pool.decode(tokens)
        for row, tok in enumerate(tokens):
            with torch.no_grad():
                want, states[row] = model(torch.tensor([[int(tok)]]), states[row])
            np.testing.assert_allclose(got[row], want[0, 0].numpy(), rtol=0,
                                       atol=2e-5 * float(want.abs().max()))


class GrowingCacheLM(nn.Module):
    """A softmax layer whose cache grows (torch.cat onto the state), as eager HF code does."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def init_state(self, batch):
        return [{"k": torch.zeros(batch, 4, 8)}]

    def forward(self, tokens, state=None):
        x = self.emb(tokens)
        k = torch.cat([torch.zeros(x.shape[0], 4, 8) if state is None else state[0]["k"], x], 1)
        y = torch.softmax(x @ k.transpose(1, 2), -1) @ k
        return self.head(y), [{"k": k}]


def test_a_growing_cache_is_refused_at_compile_time_in_one_line(tmp_path):
    with pytest.raises(ValueError) as err:
        compile_model(GrowingCacheLM(), out=tmp_path / "g.so")
    msg = str(err.value)
    assert "\n" not in msg and "layer0.k" in msg and "[2, 4, 8]" in msg and "[2, 6, 8]" in msg
    assert "fixed-size" in msg and "SoftmaxAttention" in msg


@pytest.mark.slow
def test_int4_hybrid_matches_its_dequantized_model(tmp_path):
    """int4 weights in the softmax layers' projections too: the compiled module against
    PyTorch running the dequantized weights."""
    from hla_tvm.quant import scheme
    from hla_tvm.quant.torch_weights import dequantized_model

    torch.manual_seed(2)
    model = HLALM(64, 64, 2, 4, chunk_size=16, softmax_layers=[0], max_len=8).eval()
    compile_model(model, out=tmp_path / "h4.so", quantize="int4")
    m = load(tmp_path / "h4.so")
    ref = dequantized_model(model, scheme("int4", None)).eval()
    tokens = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, st = ref(tokens)
    got, state = m.prefill(tokens.numpy(), m.init_state(1))
    scale = float(want.abs().max())
    np.testing.assert_allclose(got, want.numpy(), rtol=0,
                               atol=scheme_tol("int4", 5e-5) * scale)
    for tok in (1, 2, 3):
        got, state = m.decode(np.array([tok]), state)
        with torch.no_grad():
            want, st = ref(torch.tensor([[tok]]), st)
        np.testing.assert_allclose(got, want[:, 0].numpy(), rtol=0,
                                   atol=scheme_tol("int4", 5e-5) * scale)
