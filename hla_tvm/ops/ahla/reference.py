"""Asymmetric HLA (AHLA, paper Section 6) in plain PyTorch.

Masked form ((A A) * L) V with A = L * (Q K^T), i.e. o_t = sum_{s <= j <= t} (q_t.k_j)(q_j.k_s) v_s.
State per (batch, head):
    P_t = sum_{s<=t} k_s v_s^T,  m_t = sum_{s<=t} k_s,
    E_t = sum_{j<=t} k_j (q_j^T P_j),  n_t = sum_{j<=t} k_j (q_j^T m_j)
    o_t = q_t^T E_t, normalized by q_t^T n_t + eps.
Decay gamma (Algorithm 2): every summary is scaled by gamma before the token's term is added.
"""
from __future__ import annotations

import torch

from ..common.reference import causal, decay_matrix, fold, gamma, matvec, outer, powers, vecmat

STATE_NAMES = ("P", "m", "E", "n")


def state_shapes(batch, heads, dk, dv):
    return {"P": (batch, heads, dk, dv), "m": (batch, heads, dk), "E": (batch, heads, dk, dv),
            "n": (batch, heads, dk)}


def zero_state(batch, heads, dk, dv, dtype=torch.float64, device="cpu"):
    return {k: torch.zeros(*s, dtype=dtype, device=device)
            for k, s in state_shapes(batch, heads, dk, dv).items()}


def quadratic(q, k, v, *, normalize=False, eps=1e-6):
    """((A A) * L) V, A = L * (Q K^T), from a zero state (no decay)."""
    L = causal(q.shape[-2], q.device)
    A = (q @ k.transpose(-1, -2)).masked_fill(~L, 0)
    M = A @ A
    out = M @ v
    return out / (M.sum(-1, keepdim=True) + eps) if normalize else out


def step(q, k, v, st, *, normalize=False, eps=1e-6, decay=None):
    """One token: P, m, then E += k (q^T P), n += k (q^T m) with the updated P, m."""
    g = gamma(decay, q)
    g2, g1 = g[..., None, None], g[..., None]
    P = g2 * st["P"] + outer(k, v)
    m = g1 * st["m"] + k
    E = g2 * st["E"] + outer(k, vecmat(q, P))
    n = g1 * st["n"] + k * (q * m).sum(-1, keepdim=True)
    out = vecmat(q, E)
    if normalize:
        out = out / ((q * n).sum(-1) + eps)[..., None]
    return out, {"P": P, "m": m, "E": E, "n": n}


def serial(q, k, v, *, normalize=False, eps=1e-6, decay=None, state=None):
    """The serial recurrence (Algorithm 2), token by token. Returns (o [B, H, T, Dv], state)."""
    return fold(step, zero_state, q, k, v, state, normalize=normalize, eps=eps, decay=decay)


def chunked(q, k, v, *, chunk_size=64, normalize=False, eps=1e-6, decay=None, state=None):
    """Exact chunk form (segment concatenation, eq. 6.2), with decay.

    For a chunk of n tokens (local t = 1..n), state (P, m, E, n) carried in, A = L * (Q K^T),
    Gamma[t, s] = g^(t-s) [s <= t], R = K^T Q the key-query moment:
        O = diag(g^t) (Q E + (A Q) P) + ((A A) * Gamma) V
        P' = g^n P + K^T diag(g^(n-s)) V,   m' likewise with 1,
        E' = g^n (E + R P) + K^T (A diag(g^(n-s)) V),   n' likewise with m, 1.
    With decay the cross term is the undecayed key-query moment R times g^t."""
    B, H, T, dk = q.shape
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    g = gamma(decay, q)
    outs = []
    for c0 in range(0, T, chunk_size):
        Q, K, V = (x[:, :, c0:c0 + chunk_size] for x in (q, k, v))
        n = Q.shape[-2]
        pw = powers(g, n)                        # g^0 .. g^n
        gt = pw[..., 1:, None]                   # g^t, t = 1..n
        tail = pw.flip(-1)[..., 1:]              # g^(n-s), s = 1..n
        A = (Q @ K.transpose(-1, -2)).masked_fill(~causal(n, q.device), 0)
        AQ = A @ Q
        M = (A @ A) * decay_matrix(g, n)
        num = gt * (Q @ st["E"] + AQ @ st["P"]) + M @ V
        den = gt[..., 0] * (matvec(Q, st["n"]) + matvec(AQ, st["m"])) + M.sum(-1)
        outs.append(num / (den + eps)[..., None] if normalize else num)
        gn = pw[..., n, None, None]
        R = K.transpose(-1, -2) @ Q
        Kt = K.transpose(-1, -2)
        tV, t1 = tail[..., None] * V, tail
        st = {
            "E": gn * (st["E"] + R @ st["P"]) + Kt @ (A @ tV),
            "n": gn[..., 0] * (st["n"] + matvec(R, st["m"])) + matvec(Kt, matvec(A, t1)),
            "P": gn * st["P"] + Kt @ tV,
            "m": gn[..., 0] * st["m"] + matvec(Kt, t1),
        }
    return torch.cat(outs, 2), st
