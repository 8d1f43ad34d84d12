"""Helpers shared by the reference operators."""
from __future__ import annotations

import torch


def causal(T, device, diagonal=0):
    """Boolean [T, T] lower-triangular mask (with the diagonal for diagonal=0, strict for -1)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril(diagonal)


def gamma(decay, q):
    """Per (batch, head) decay [B, H] in q's dtype: 1 for None, a float, or a tensor [H]."""
    B, H = q.shape[:2]
    if decay is None:
        return torch.ones(B, H, dtype=q.dtype, device=q.device)
    d = torch.as_tensor(decay, dtype=q.dtype, device=q.device)
    return d.expand(B, H) if d.ndim == 0 else d.reshape(1, H).expand(B, H)


def powers(g, n):
    """g^0 .. g^n for g [B, H]: [B, H, n + 1]."""
    return g[..., None] ** torch.arange(n + 1, dtype=g.dtype, device=g.device)


def decay_matrix(g, n, diagonal=0, shift=0):
    """Gamma[t, s] = g^(t - s - shift) for s <= t (s < t for diagonal=-1), else 0:
    [B, H, n, n]."""
    idx = torch.arange(n, device=g.device)
    diff = (idx[:, None] - idx[None, :] - shift).clamp(min=0).to(g.dtype)
    return (g[..., None, None] ** diff) * causal(n, g.device, diagonal)


def outer(a, b):
    """Per-token outer products a b^T for a [..., d], b [..., e]."""
    return a[..., :, None] * b[..., None, :]


def matvec(M, x):
    """M x for M [..., d, e], x [..., e]."""
    return (M @ x[..., None])[..., 0]


def vecmat(x, M):
    """x^T M for x [..., d], M [..., d, e]."""
    return (x[..., None, :] @ M)[..., 0, :]


def fold(step, zero_state, q, k, v, state=None, mask=None, **opts):
    """Run a one-token `step(q_t, k_t, v_t, state, **opts) -> (o_t, state)` over the sequence,
    from `state` (zero_state(B, H, Dk, Dv, dtype, device) when None). With mask [B, T] (bool),
    padded tokens keep the state as it was and output zeros. Returns (o [B, H, T, Dv], state)."""
    B, H, T, dk = q.shape
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    outs = []
    for t in range(T):
        o, new = step(q[:, :, t], k[:, :, t], v[:, :, t], st, **opts)
        if mask is not None:
            keep = mask[:, t]
            new = {n: torch.where(keep.view(B, *[1] * (x.dim() - 1)), new[n], st[n])
                   for n, x in st.items()}
            o = torch.where(keep.view(B, 1, 1), o, torch.zeros((), dtype=o.dtype))
        st = new
        outs.append(o)
    return torch.stack(outs, 2), st
