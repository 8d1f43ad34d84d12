"""HLALM: a small language model whose attention layers are HLA."""
from __future__ import annotations

import torch
from torch import nn

from ..nn import HLAttention, RMSNorm, SwiGLU

CHECKPOINT_FORMAT = "hla_tvm.HLALM/1"


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model, n_heads, mlp_hidden, **attn):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = HLAttention(d_model, n_heads, **attn)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, mlp_hidden)

    def forward(self, x, state=None):
        h, state = self.attn(self.attn_norm(x), state)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state


class HLALM(nn.Module):
    """Token embedding, n_layers pre-norm blocks (RMSNorm -> HLAttention -> RMSNorm -> SwiGLU),
    final norm, tied or untied output head.

    forward(tokens [B, T] int64, state=None) -> (logits [B, T, vocab], state), state being a list
    with every layer's HLA state dict (None: a fresh sequence)."""

    def __init__(self, vocab_size, d_model, n_layers, n_heads, *, order=2, asymmetric=False,
                 head_dim=None, n_kv_heads=None, decay=None, normalize=False, masked=True,
                 mlp_hidden=None, tie_embeddings=True, chunk_size=64):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                           n_heads=n_heads, order=order, asymmetric=asymmetric,
                           head_dim=head_dim, n_kv_heads=n_kv_heads,
                           decay=None if decay is None else
                           (float(decay) if isinstance(decay, (int, float)) else
                            [float(x) for x in decay]),
                           normalize=normalize, masked=masked, mlp_hidden=mlp_hidden,
                           tie_embeddings=tie_embeddings, chunk_size=chunk_size)
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, mlp_hidden or 4 * d_model, head_dim=head_dim,
                  n_kv_heads=n_kv_heads, order=order, asymmetric=asymmetric, masked=masked,
                  decay=decay, normalize=normalize, chunk_size=chunk_size)
            for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)

    def init_state(self, batch, dtype=torch.float32, device="cpu"):
        return [b.attn.init_state(batch, dtype, device) for b in self.blocks]

    def forward(self, tokens, state=None):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or \
                tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError("tokens must be an integer tensor [B, T], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                             f"{tuple(getattr(tokens, 'shape', ()))}")
        if state is not None and len(state) != len(self.blocks):
            raise ValueError(f"state must hold {len(self.blocks)} layer states, got {len(state)}")
        x = self.embed(tokens)
        new_state = []
        for i, block in enumerate(self.blocks):
            x, st = block(x, None if state is None else state[i])
            new_state.append(st)
        x = self.norm(x)
        logits = x @ self.embed.weight.T if self.head is None else self.head(x)
        return logits, new_state

    def save(self, path):
        """Config and weights in torch's weights-only format (nothing arbitrary is pickled)."""
        torch.save({"format": CHECKPOINT_FORMAT, "config": self.config,
                    "weights": self.state_dict()}, path)

    @classmethod
    def load(cls, path):
        """A model saved with `save`; refuses files that are not such checkpoints."""
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"{path}: not a readable HLALM checkpoint ({err})") from None
        if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not an HLALM checkpoint (format "
                             f"{blob.get('format') if isinstance(blob, dict) else None!r}, "
                             f"expected {CHECKPOINT_FORMAT!r})")
        model = cls(**blob["config"])
        model.load_state_dict(blob["weights"])
        return model
