"""Softmax attention with a fixed-size key/value cache in its state, for hybrid models (a few
softmax layers among HLA ones) that compile, prefill in pieces and decode exactly."""
from __future__ import annotations

import math

import torch
from torch import nn

from .layers import RMSNorm

# a score no visible one falls below: exp(-1e30 - max) is 0 without an infinity (compiled code
# runs with LLVM's fast-math flags, which assume no infinities)
HIDDEN = -1e30


def rotary(x, positions, theta):
    """Rotary position embedding (rotate-half form, as transformers' Llama): x [B, H, T, D] with
    D even, positions [B, T] int64; each pair (x_i, x_{i+D/2}) turned by the angle
    positions * theta^(-2i/D)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions[:, None, :, None].to(torch.float32) * inv_freq   # [B, 1, T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class SoftmaxAttention(nn.Module):
    """Causal softmax attention, softmax(Q K^T / sqrt(D)) V per head, whose keys and values live
    in a fixed-size cache of `max_len` tokens in the state, beside a position counter:
    state = {"k": [B, Hkv, max_len, D], "v": [B, Hkv, max_len, D], "position": [B] int64}.

    A query at position a sees the keys at positions b with a - max_len < b <= a: every earlier
    token while the sequence is at most max_len long, a sliding window of max_len tokens after
    (`max_len` is the window). Token a's key and value sit in slot a mod max_len, so a prompt
    prefilled in pieces, or token by token, gives the same outputs as in one piece. Keys are
    stored after the rotary embedding (`rope_theta`; None: no positions), grouped key/value
    heads (`n_kv_heads` dividing `n_heads`) are shared by their query heads, and each head's
    output is RMS-normed before the output projection (`out_norm`), as in `HLAttention`.

    forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], state); None: a fresh
    sequence. The state's shapes are fixed: compiled modules keep it in their state pool."""

    state_names = ("k", "v", "position")

    def __init__(self, d_model, n_heads, *, max_len, head_dim=None, n_kv_heads=None,
                 rope_theta=10000.0, out_norm=True, bias=False):
        super().__init__()
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
            raise ValueError(f"max_len must be a positive int (the cache's tokens), got "
                             f"{max_len!r}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        if n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={n_heads}")
        self.head_dim = head_dim or d_model // n_heads
        if rope_theta is not None and (self.head_dim % 2 or not rope_theta > 0):
            raise ValueError(f"rotary positions need an even head_dim and rope_theta > 0, got "
                             f"head_dim={self.head_dim}, rope_theta={rope_theta!r}")
        self.max_len, self.rope_theta = max_len, rope_theta
        hd, hkv = self.head_dim, self.n_kv_heads
        self.q_proj = nn.Linear(d_model, n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d_model, hkv * hd, bias=bias)
        self.v_proj = nn.Linear(d_model, hkv * hd, bias=bias)
        self.o_proj = nn.Linear(n_heads * hd, d_model, bias=False)
        self.out_norm = RMSNorm(hd) if out_norm else None

    def init_state(self, batch, dtype=torch.float32, device="cpu"):
        """The empty cache of a fresh sequence (position 0)."""
        shape = (batch, self.n_kv_heads, self.max_len, self.head_dim)
        return {"k": torch.zeros(shape, dtype=dtype, device=device),
                "v": torch.zeros(shape, dtype=dtype, device=device),
                "position": torch.zeros(batch, dtype=torch.int64, device=device)}

    def forward(self, x, state=None):
        B, T, _ = x.shape
        H, Hkv, D, L = self.n_heads, self.n_kv_heads, self.head_dim, self.max_len
        if state is None:
            state = self.init_state(B, x.dtype, x.device)
        start = state["position"]                                    # [B]
        steps = torch.arange(T, device=x.device)
        pos = start[:, None] + steps                                 # [B, T]
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        if self.rope_theta is not None:
            q, k = rotary(q, pos, self.rope_theta), rotary(k, pos, self.rope_theta)
        # the position each cache slot holds: the latest one before `start` in its residue
        # class (negative: empty)
        slots = torch.arange(L, device=x.device)
        held = start[:, None] - 1 - torch.remainder(start[:, None] - 1 - slots, L)   # [B, L]
        key_pos = torch.cat([held, pos], 1)[:, None, :]              # [B, 1, L + T]
        seen = pos[:, :, None] - key_pos                             # [B, T, L + T]
        visible = (key_pos >= 0) & (seen >= 0) & (seen < L)
        keys = torch.cat([state["k"], k], 2)                         # [B, Hkv, L + T, D]
        values = torch.cat([state["v"], v], 2)
        g = H // Hkv   # query heads per key/value head, sharing its keys by broadcasting
        # (no size computed from T in a reshape: ONNX importers keep such sizes apart)
        scores = (q.view(B, Hkv, g, T, D) @ keys[:, :, None].transpose(-1, -2)) / math.sqrt(D)
        scores = torch.where(visible[:, None, None], scores, HIDDEN)  # [B, Hkv, g, T, L + T]
        o = (torch.softmax(scores, -1) @ values[:, :, None]).view(B, H, T, D)
        if self.out_norm is not None:
            o = self.out_norm(o)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))
        # slot s takes the last of this piece's tokens whose position is s mod L, if any
        # (from positions, not from T, as above)
        last_pos = pos[:, -1:]                                       # [B, 1]
        last = last_pos - torch.remainder(last_pos - slots, L) - start[:, None]   # [B, L]
        written = (last >= 0)[:, None, :, None]
        index = last.clamp(min=0)[:, None, :, None].expand(B, Hkv, L, D)
        new_k = torch.where(written, torch.gather(k, 2, index), state["k"])
        new_v = torch.where(written, torch.gather(v, 2, index), state["v"])
        return y, {"k": new_k, "v": new_v, "position": start + T}
