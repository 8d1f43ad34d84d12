"""The softmax-attention baseline of an HLALM: the same model with each HLAttention replaced by
causal softmax attention of the same projections (for comparing validation loss in `train`)."""
from __future__ import annotations

import math

from torch import nn
from torch.nn import functional as F

from ..nn import RMSNorm
from .hlalm import HLALM


class SoftmaxAttention(nn.Module):
    """softmax(Q K^T / sqrt(D) + causal mask) V per head, with HLAttention's projections and
    per-head output norm. forward(x [B, T, d_model], state=None) -> (y, None): no recurrent
    state (training and validation only)."""

    def __init__(self, d_model, n_heads, head_dim=None):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim or d_model // n_heads
        inner = n_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.out_norm = RMSNorm(self.head_dim)

    def forward(self, x, state=None):
        if state is not None:
            raise ValueError("SoftmaxAttention keeps no state: pass state=None")
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           scale=1.0 / math.sqrt(self.head_dim))
        o = self.out_norm(o)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), None


def softmax_baseline(config):
    """An HLALM built from `config` whose attention layers are `SoftmaxAttention`."""
    model = HLALM(**config)
    for block in model.blocks:
        block.attn = SoftmaxAttention(config["d_model"], config["n_heads"],
                                      config.get("head_dim"))
    return model
