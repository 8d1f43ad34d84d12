"""HLA layers for PyTorch models."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops
from .ops import hla_op, state_names


def decay_values(decay, dtype):
    """`decay` (a number, a sequence, a numpy value or a tensor) as a tensor of `dtype`, its
    shape kept; TypeError for booleans (of any of those kinds)."""
    if isinstance(decay, bool) or torch.as_tensor(decay).dtype == torch.bool:
        raise TypeError("decay must be a number in (0, 1] or one per key/value head, got a bool")
    return torch.as_tensor(decay, dtype=dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class HLAttention(nn.Module):
    """Multi-head HLA: q/k/v projections, `torch.ops.hla_tvm.hla` per head, optional RMS norm of
    each head's output, output projection. q and k are scaled by Dk^-1/2 so the higher-order
    products stay O(1).

    forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], state dict), where state holds
    the operator's summaries (`state_names`); None starts a fresh sequence.
    decay: None, a float in (0, 1], or a sequence of one value per key/value head (fixed buffer).
    """

    def __init__(self, d_model, n_heads, *, head_dim=None, n_kv_heads=None, order=2,
                 asymmetric=False, masked=True, decay=None, normalize=False, eps=1e-6,
                 ridge=0.0, out_norm=True, chunk_size=64):
        super().__init__()
        self.op = ops.get(order, asymmetric)
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        if n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={n_heads}")
        self.head_dim = head_dim or d_model // n_heads
        self.order, self.asymmetric, self.masked = order, asymmetric, masked
        self.normalize, self.eps, self.ridge, self.chunk_size = normalize, eps, ridge, chunk_size
        hd, hkv = self.head_dim, self.n_kv_heads
        self.q_proj = nn.Linear(d_model, n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d_model, hkv * hd, bias=False)
        self.v_proj = nn.Linear(d_model, hkv * hd, bias=False)
        self.o_proj = nn.Linear(n_heads * hd, d_model, bias=False)
        self.out_norm = RMSNorm(hd) if out_norm else None
        if decay is None:
            self.register_buffer("decay", None)
        else:
            g = decay_values(decay, torch.float32).flatten()
            g = g.expand(hkv) if g.numel() == 1 else g
            if g.numel() != hkv or not bool(((g > 0) & (g <= 1)).all()):
                raise ValueError(f"decay must be one value in (0, 1] or {hkv} of them (one per "
                                 f"key/value head), got {decay}")
            self.register_buffer("decay", g.repeat_interleave(n_heads // hkv).contiguous())

    @property
    def state_names(self):
        return state_names(self.order, self.asymmetric)

    def init_state(self, batch, dtype=torch.float32, device="cpu"):
        """The zero state of a fresh sequence."""
        shapes = self.op.state_shapes(batch, self.n_heads, self.n_kv_heads, self.head_dim,
                                      self.head_dim)
        return {n: torch.zeros(shapes[n], dtype=dtype, device=device) for n in self.state_names}

    def forward(self, x, state=None):
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_heads, hd).transpose(1, 2) / math.sqrt(hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2) / math.sqrt(hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        decay = None if self.decay is None else self.decay.to(q.dtype)
        # no state: a fresh sequence (the op starts from zeros and returns the new state)
        o, *st = hla_op(q.contiguous(), k.contiguous(), v.contiguous(),
                       [] if state is None else [state[n] for n in self.state_names],
                       decay, self.order,
                       self.asymmetric, self.masked, self.normalize, self.eps, self.ridge,
                       self.chunk_size)
        if self.out_norm is not None:
            o = self.out_norm(o)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * hd))
        return y, dict(zip(self.state_names, st))
