"""The architectures users write, built from transformers' own modules (configs only, random
weights, no downloads) with HLA layers in place of attention: a Llama (RMSNorm, SwiGLU MLP,
grouped key/value heads, tied embeddings), GPT-2 blocks (LayerNorm, Conv1D MLP with GELU-new,
learned positions counted in the state, third order), a Qwen2 (AHLA with decay) and a
Mistral-style hybrid (HLA layers and a sliding-window softmax layer with rotary positions,
`hla_tvm.nn.SoftmaxAttention`). Each compiles and matches PyTorch through a prefill in pieces
and decode steps; int4 modules match PyTorch running the dequantized weights."""
import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.models.gpt2 import modeling_gpt2 as gpt2  # noqa: E402
from transformers.models.llama import modeling_llama as llama  # noqa: E402
from transformers.models.mistral import modeling_mistral as mistral  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2 as qwen2  # noqa: E402

from conftest import scheme_tol  # noqa: E402

from hla_tvm import compile as compile_model  # noqa: E402
from hla_tvm.nn import HLAttention, SoftmaxAttention  # noqa: E402
from hla_tvm.nn.softmax import rotary  # noqa: E402
from hla_tvm.runtime import load  # noqa: E402

VOCAB, D, HEADS, KV = 96, 64, 4, 2


class Decoder(nn.Module):
    """embed (+ learned positions) -> pre-norm blocks (attention, MLP) -> norm -> head, the
    state one dict per attention layer (+ the next position where there are positions)."""

    def __init__(self, attns, mlps, norm, *, positions=None, tied=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = None if positions is None else nn.Embedding(positions, D)
        self.attns, self.mlps = nn.ModuleList(attns), nn.ModuleList(mlps)
        self.norms1 = nn.ModuleList(norm() for _ in attns)
        self.norms2 = nn.ModuleList(norm() for _ in attns)
        self.norm = norm()
        self.head = None if tied else nn.Linear(D, VOCAB, bias=False)

    def init_state(self, batch):
        st = [a.init_state(batch) for a in self.attns]
        if self.pos is not None:
            st.append({"position": torch.zeros(batch, dtype=torch.int64)})
        return st

    def forward(self, tokens, state=None):
        x = self.embed(tokens)
        if self.pos is not None:
            start = torch.zeros(tokens.shape[0], dtype=torch.int64) if state is None else \
                state[-1]["position"]
            positions = start[:, None] + torch.arange(tokens.shape[1])
            x = x + self.pos(positions % self.pos.num_embeddings)
        new = []
        for i, (attn, mlp) in enumerate(zip(self.attns, self.mlps)):
            h, st = attn(self.norms1[i](x), None if state is None else state[i])
            new.append(st)
            x = x + h
            x = x + mlp(self.norms2[i](x))
        x = self.norm(x)
        logits = x @ self.embed.weight.T if self.head is None else self.head(x)
        if self.pos is not None:
            new.append({"position": start + tokens.shape[1]})
        return logits, new


def make_llama():
    cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=128, vocab_size=VOCAB,
                                   num_attention_heads=HEADS, num_key_value_heads=KV)
    return Decoder([HLAttention(D, HEADS, n_kv_heads=KV, chunk_size=16) for _ in range(2)],
                   [llama.LlamaMLP(cfg) for _ in range(2)],
                   lambda: llama.LlamaRMSNorm(D, eps=1e-6))


def make_gpt2():
    cfg = transformers.GPT2Config(n_embd=D, n_head=HEADS, vocab_size=VOCAB,
                                  activation_function="gelu_new", bos_token_id=0,
                                  eos_token_id=0)
    return Decoder([HLAttention(D, HEADS, order=3, chunk_size=16) for _ in range(2)],
                   [gpt2.GPT2MLP(4 * D, cfg) for _ in range(2)],
                   lambda: nn.LayerNorm(D), positions=32)


def make_qwen2():
    cfg = transformers.Qwen2Config(hidden_size=D, intermediate_size=128, vocab_size=VOCAB,
                                   num_attention_heads=HEADS, num_key_value_heads=KV)
    return Decoder([HLAttention(D, HEADS, n_kv_heads=KV, asymmetric=True, decay=[0.95, 0.9],
                                chunk_size=16) for _ in range(2)],
                   [qwen2.Qwen2MLP(cfg) for _ in range(2)],
                   lambda: qwen2.Qwen2RMSNorm(D, eps=1e-6), tied=False)


def make_hybrid():
    cfg = transformers.MistralConfig(hidden_size=D, intermediate_size=128, vocab_size=VOCAB,
                                     num_attention_heads=HEADS, num_key_value_heads=KV)
    attns = [HLAttention(D, HEADS, n_kv_heads=KV, chunk_size=16),
             SoftmaxAttention(D, HEADS, n_kv_heads=KV, max_len=12),
             HLAttention(D, HEADS, n_kv_heads=KV, decay=0.9, chunk_size=16)]
    return Decoder(attns, [mistral.MistralMLP(cfg) for _ in attns],
                   lambda: mistral.MistralRMSNorm(D, eps=1e-6))


MODELS = {"llama": make_llama, "gpt2": make_gpt2, "qwen2": make_qwen2, "hybrid": make_hybrid}


def _model(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():   # (transformers' norms start at ones: give them some shape)
        for mod in model.modules():
            if isinstance(mod, (nn.LayerNorm, llama.LlamaRMSNorm, qwen2.Qwen2RMSNorm,
                                mistral.MistralRMSNorm)):
                mod.weight.uniform_(0.5, 1.5)
    return model


def _check(module_path, ref, tol, decode_tol=None):
    """Prefill 9 + 8 tokens (two pieces), then 6 decode steps (past the hybrid's window of 12
    and the GPT-2's 32 positions wrap: 23 tokens): the module against `ref`, within `tol` of
    the largest logit (the decode steps within `decode_tol` where given)."""
    m = load(module_path)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, st = ref(tokens)
    scale = float(want.abs().max())
    state = m.init_state(2)
    a, state = m.prefill(tokens[:, :9].numpy(), state)
    b, state = m.prefill(tokens[:, 9:].numpy(), state)
    np.testing.assert_allclose(np.concatenate([a, b], 1), want.numpy(), rtol=0, atol=tol * scale)
    for step in range(6):
        tok = np.array([3 + step, 50 - step])
        got, state = m.decode(tok, state)
        with torch.no_grad():
            want, st = ref(torch.from_numpy(tok)[:, None], st)
        np.testing.assert_allclose(got, want[:, 0].numpy(), rtol=0,
                                   atol=(decode_tol or tol) * scale)


def _params(fast):
    return [pytest.param(n, marks=() if n == fast else pytest.mark.slow) for n in MODELS]


@pytest.mark.parametrize("name", _params("llama"))
def test_architecture_matches_pytorch(name, tmp_path):
    model = _model(name)
    path = compile_model(model, out=tmp_path / f"{name}.so")
    _check(path, model, 2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_int4_architecture_matches_its_dequantized_model(name, tmp_path):
    """int4 weights (group 32) wherever the compiler packs them (nn.Linear, Conv1D, the
    embedding): the module against PyTorch running the dequantized weights (decode within
    2e-4; `scheme_tol`'s wider bound where this CPU rounds the activations: int4 decode
    products on VNNI take them as one 8-bit digit a block, `quant.vnni`, and a prefill on
    bfloat16 products rounds them to bfloat16)."""
    from hla_tvm.quant import scheme
    from hla_tvm.quant.torch_weights import dequantized_model

    model = _model(name)
    path = compile_model(model, out=tmp_path / f"{name}4.so", quantize="int4")
    _check(path, dequantized_model(model, scheme("int4", None)).eval(),
           scheme_tol("int4", 5e-5), scheme_tol("int4", 2e-4))


def test_rotary_positions_equal_transformers():
    """`hla_tvm.nn.softmax.rotary` turns queries and keys as transformers' Llama does
    (LlamaRotaryEmbedding + apply_rotary_pos_emb), at positions from an offset."""
    cfg = transformers.LlamaConfig(hidden_size=D, num_attention_heads=HEADS,
                                   num_key_value_heads=KV)
    rope = llama.LlamaRotaryEmbedding(cfg)
    q, k = torch.randn(2, HEADS, 7, D // HEADS), torch.randn(2, KV, 7, D // HEADS)
    positions = torch.tensor([[5], [40]]) + torch.arange(7)
    cos, sin = rope(q, positions)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rotary(q, positions, 10000.0), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary(k, positions, 10000.0), want_k, rtol=1e-5, atol=1e-5)
