"""Second-order HLA in plain PyTorch: the specification the kernels are tested against.

Layout: q, k [B, H, T, Dk], v [B, H, T, Dv]. Per (batch, head) the state after token t is

    S_t = sum_{i<=t} k_i k_i^T                  [Dk, Dk]
    C_t = sum_{i<=t} q_i v_i^T                  [Dk, Dv]
    m_t = sum_{i<=t} q_i                        [Dk]
    G_t = sum_{i<=t} k_i k_i^T C_{i-1}          [Dk, Dv]
    h_t = sum_{i<=t} k_i k_i^T m_{i-1}          [Dk]

and the output is (ridge lambda, eps as given)

    masked:    o_t = q_t^T ((S_t + lambda I) C_t - G_t)
    unmasked:  o_t = q_t^T  (S_t + lambda I) C_t
    normalize: o_t /= q_t^T ((S_t + lambda I) m_t - h_t) + eps     (masked; unmasked drops h_t)

Everything here is written to be read, and is exact in float64.
"""
from __future__ import annotations

import torch

from ..common.reference import decay_matrix, fold, gamma, matvec, powers

STATE_NAMES = ("S", "C", "m", "G", "h")


def zero_state(batch, heads, dk, dv, dtype=torch.float64, device="cpu"):
    """The state before the first token: all five summaries zero."""
    z = lambda *shape: torch.zeros(batch, heads, *shape, dtype=dtype, device=device)
    return {"S": z(dk, dk), "C": z(dk, dv), "m": z(dk), "G": z(dk, dv), "h": z(dk)}


def state_shapes(batch, heads, dk, dv):
    """Shape of each named state tensor."""
    return {"S": (batch, heads, dk, dk), "C": (batch, heads, dk, dv), "m": (batch, heads, dk),
            "G": (batch, heads, dk, dv), "h": (batch, heads, dk)}


def _causal(T, device):
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def quadratic(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0):
    """The quadratic (attention-matrix) form, O(T^2) memory, from a zero state.

    masked:   M = ((W W^T) + lambda Q Q^T) * L,  W = L * (Q K^T)
    unmasked: M = ((W K Q^T) + lambda Q Q^T) * L
    o = M V, or (M V) / (M 1 + eps) with normalize.  L is lower-triangular with its diagonal.
    """
    L = _causal(q.shape[-2], q.device)
    W = (q @ k.transpose(-1, -2)).masked_fill(~L, 0)
    if masked:
        M = W @ W.transpose(-1, -2)
    else:
        M = W @ (k @ q.transpose(-1, -2))
    if ridge:
        M = M + ridge * (q @ q.transpose(-1, -2))
    M = M.masked_fill(~L, 0)
    out = M @ v
    if normalize:
        out = out / (M.sum(-1, keepdim=True) + eps)
    return out


def _readout(q, st, masked, normalize, eps, ridge):
    """o = q^T((S + lambda I) C - G) [/ (q^T((S + lambda I) m - h) + eps)] for one token."""
    u = torch.einsum("bhi,bhij->bhj", q, st["S"]) + ridge * q     # q^T (S + lambda I); S symmetric
    num = torch.einsum("bhi,bhij->bhj", u, st["C"])
    den = torch.einsum("bhi,bhi->bh", u, st["m"])
    if masked:
        num = num - torch.einsum("bhi,bhij->bhj", q, st["G"])
        den = den - torch.einsum("bhi,bhi->bh", q, st["h"])
    if normalize:
        num = num / (den + eps)[..., None]
    return num


def step(q, k, v, st, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None):
    """One token of the paper's Algorithm 1; q, k [B, H, Dk], v [B, H, Dv]. Returns (o, new state).

    gamma = decay (1 when None), per head if a tensor [H]:
        G <- gamma G + k k^T C,  h <- gamma h + k k^T m     (C, m before this token, not decayed)
        S <- gamma S + k k^T,    C <- gamma C + q v^T,   m <- gamma m + q
    """
    g = gamma(decay, q)
    kk = k[..., :, None] * k[..., None, :]
    new = {
        "G": g[..., None, None] * st["G"] + kk @ st["C"],
        "h": g[..., None] * st["h"] + (kk @ st["m"][..., None])[..., 0],
        "S": g[..., None, None] * st["S"] + kk,
        "C": g[..., None, None] * st["C"] + q[..., :, None] * v[..., None, :],
        "m": g[..., None] * st["m"] + q,
    }
    return _readout(q, new, masked, normalize, eps, ridge), new


def serial(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None, state=None):
    """The serial recurrence (Algorithm 1), token by token. Returns (o [B, H, T, Dv], state)."""
    return fold(step, zero_state, q, k, v, state, masked=masked, normalize=normalize, eps=eps,
                ridge=ridge, decay=decay)


def chunked(q, k, v, *, chunk_size=64, masked=True, normalize=False, eps=1e-6, ridge=0.0,
            decay=None, state=None):
    """The exact chunk-parallel form. Returns (o, state) equal to `serial`.

    Without decay, with (S, C, m, G, h) the state carried into a chunk and W = L * (Q_c K_c^T)
    chunk-local, the chunk's outputs are (Figure 1(C) of the paper misses the middle term):
        masked:   Q_c ((S+lI) C - G)  +  ((Q_c (S+lI) Q_c^T) * L) V_c  +  ((W W^T) * L) V_c
        unmasked: Z C + ((Z Q_c^T) * L) V_c   with   Z = Q_c (S + lI) + W K_c
    and the carry to the next chunk (the paper's semidirect-product operator, eq. 4.1) is
        G += K^T ((K Q^T) * L_strict) V + (K^T K) C,   h likewise with m,
        S += K^T K,   C += Q^T V,   m += Q^T 1.

    With decay g (Algorithm 1: S, C, m, G, h scaled by g, the cross term k k^T C_{t-1} not),
    local t = 1..n, Gamma[t, s] = g^(t-s) [s <= t], Gamma'[t, s] = g^(t-1-s) [s < t],
    B[j, s] = k_j.q_s [s < j]:
        o = diag(g^2t) Q S C - diag(g^t) Q G + ((diag(g^t) Q S Q^T) * Gamma) V
            + l (diag(g^t) Q C + ((Q Q^T) * Gamma) V)                 [ridge]
            + ((Q K^T) * (diag(g^t) Gamma - g^(t-1))) (K C)          [the undecayed key moment]
            + (((W * Gamma) K Q^T) * Gamma) V - ((W B) * Gamma') V    [intra-chunk]
        G' = g^n G + g^(n-1) (K^T K) C + K^T (B diag(g^(n-1-s)) V),
        S' = g^n S + K^T diag(g^(n-j)) K
    (unmasked drops the G terms, the -g^(t-1) weight and the W B term). At g = 1 this is the
    form above: the K C term vanishes and W K Q^T - W B = W W^T."""
    B, H, T, dk = q.shape
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    g = gamma(decay, q)
    mk = 1.0 if masked else 0.0
    outs = []
    for c0 in range(0, T, chunk_size):
        Q, K, V = (x[:, :, c0:c0 + chunk_size] for x in (q, k, v))
        n = Q.shape[-2]
        S, C, m, G, h = (st[x] for x in STATE_NAMES)
        pw = powers(g, n)
        gt, gt1 = pw[..., 1:, None], pw[..., :-1, None]          # g^t, g^(t-1), t = 1..n
        Gam, Gam1 = decay_matrix(g, n), decay_matrix(g, n, -1) / g[..., None, None]
        W = (Q @ K.transpose(-1, -2)).masked_fill(~_causal(n, q.device), 0)
        KQ = K @ Q.transpose(-1, -2)
        Bs = KQ.tril(-1)                                          # k_j.q_s for s < j
        # the ridge term l q_t^T C_t = l g^t q_t^T C + l sum_s g^(t-s) (q_t.q_s) v_s
        X = gt * (Q @ (S @ C)) - mk * (Q @ G) + ridge * (Q @ C)
        x = gt[..., 0] * matvec(Q, matvec(S, m)) - mk * matvec(Q, h) + ridge * matvec(Q, m)
        M = (gt * (Q @ S @ Q.transpose(-1, -2)) + ridge * (Q @ Q.transpose(-1, -2))) * Gam \
            + ((W * Gam) @ KQ) * Gam - mk * (W @ Bs) * Gam1
        KW = (Q @ K.transpose(-1, -2)) * (gt * Gam - mk * gt1 * _causal(n, q.device))
        num = gt * X + KW @ (K @ C) + M @ V
        den = gt[..., 0] * x + matvec(KW, matvec(K, m)) + M.sum(-1)
        outs.append(num / (den + eps)[..., None] if normalize else num)
        gn, gn1 = pw[..., n, None, None], pw[..., n - 1, None, None]
        tail = pw.flip(-1)[..., 1:, None]                         # g^(n-s), s = 1..n
        tail1 = tail / g[..., None, None]                         # g^(n-1-s)
        Kt, KK = K.transpose(-1, -2), K.transpose(-1, -2) @ K
        st = {
            "G": gn * G + gn1 * KK @ C + Kt @ (Bs @ (tail1 * V)),
            "h": gn[..., 0] * h + gn1[..., 0] * matvec(KK, m)
                 + matvec(Kt, matvec(Bs, tail1[..., 0])),
            "S": gn * S + Kt @ (tail * K),
            "C": gn * C + Q.transpose(-1, -2) @ (tail * V),
            "m": gn[..., 0] * m + matvec(Q.transpose(-1, -2), tail[..., 0]),
        }
    return torch.cat(outs, dim=2), st
