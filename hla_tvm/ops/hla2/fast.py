"""Second-order HLA in fast PyTorch forms: `chunked`, every chunk at once (with decay,
Algorithm 1: `_decayed`), and `step_`, one token with the state advanced in place. The same
results as `reference.chunked` and `reference.step` (the readable forms, whose docstrings derive
them); differentiable."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.fast import (
    Weights,
    axpy_,
    chunks,
    decays,
    excl_cumsum,
    finish,
    gamma_or_none,
    mv,
    rank1_,
    vecmat,
)
from ..common.reference import decay_matrix
from .reference import zero_state


def chunked(q, k, v, *, chunk_size=64, masked=True, normalize=False, eps=1e-6, ridge=0.0,
                 decay=None, state=None):
    """(o [B, H, T, Dv], state) of second-order HLA from `state` (zeros when None); with decay
    Algorithm 1 (`_decayed`).

    Per chunk c with the state (S, C, m, G, h) carried into it (exclusive prefix sums of the
    chunk summaries), W = L * (Q K^T) chunk-local, Sl = S + lI:
        masked:   o = Q (Sl C - G) + ((Q Sl Q^T + W W^T) * L) V
        unmasked: o = Z C + ((Z Q^T) * L) V,   Z = Q Sl + W K
    carry: dS = K^T K, dC = Q^T V, dm = Q^T 1, G += dS C + K^T ((K Q^T) * L_strict) V,
    h likewise with m and 1."""
    if decay is not None:
        return _decayed(q, k, v, gamma_or_none(decay, q), chunk_size=chunk_size, masked=masked,
                             normalize=normalize, eps=eps, ridge=ridge, state=state)
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    n = min(chunk_size, T)
    NC = -(-T // n)
    pad = NC * n - T   # zero tokens leave every (undecayed) summary unchanged
    Q, K, V = (F.pad(x, (0, 0, 0, pad)).view(B, H, NC, n, x.shape[-1]) for x in (q, k, v))
    st = state if state is not None else zero_state(B, H, dk, dv, q.dtype, q.device)
    L = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    Kt, Qt = K.transpose(-1, -2), Q.transpose(-1, -2)
    dS, dC, dm = Kt @ K, Qt @ V, Qt.sum(-1)
    S = st["S"].unsqueeze(2) + excl_cumsum(dS)
    C = st["C"].unsqueeze(2) + excl_cumsum(dC)
    m = st["m"].unsqueeze(2) + excl_cumsum(dm)
    Bs = (K @ Qt).masked_fill(~L.tril(-1), 0)   # k_j . q_s for s < j
    dG = dS @ C + Kt @ (Bs @ V)
    dh = (dS @ m.unsqueeze(-1)).squeeze(-1) + (Kt @ Bs.sum(-1, keepdim=True)).squeeze(-1)
    G = st["G"].unsqueeze(2) + excl_cumsum(dG)
    h = st["h"].unsqueeze(2) + excl_cumsum(dh)
    W = (Q @ Kt).masked_fill(~L, 0)
    QS = Q @ S + ridge * Q if ridge else Q @ S
    if masked:
        M = (QS @ Qt + W @ W.transpose(-1, -2)).masked_fill(~L, 0)
        num = Q @ (S @ C + ridge * C - G) + M @ V if ridge else Q @ (S @ C - G) + M @ V
        if normalize:
            x = (S @ m.unsqueeze(-1)).squeeze(-1) + ridge * m - h
            den = (Q @ x.unsqueeze(-1)).squeeze(-1) + M.sum(-1)
    else:
        Z = QS + W @ K
        M = (Z @ Qt).masked_fill(~L, 0)
        num = Z @ C + M @ V
        if normalize:
            den = (Z @ m.unsqueeze(-1)).squeeze(-1) + M.sum(-1)
    out = num / (den + eps).unsqueeze(-1) if normalize else num
    out = out.reshape(B, H, NC * n, dv)[:, :, :T]
    last = {"S": S[:, :, -1] + dS[:, :, -1], "C": C[:, :, -1] + dC[:, :, -1],
            "m": m[:, :, -1] + dm[:, :, -1], "G": G[:, :, -1] + dG[:, :, -1],
            "h": h[:, :, -1] + dh[:, :, -1]}
    return out, last


def _decayed(q, k, v, g, *, chunk_size, masked, normalize, eps, ridge, state):
    """Second-order HLA with decay g [B, H] (Algorithm 1: the state scaled by g per token, the
    cross term k k^T C_(t-1) not), every chunk at once; the same result as the decayed
    `reference.chunked`, whose docstring derives it. Per chunk, with (S, C, m, G, h)
    carried in, W = L * (Q K^T), B = (K Q^T) strictly lower, Gamma[t, s] = g^(t-s) [s <= t],
    Gamma'[t, s] = g^(t-1-s) [s < t], tail_s = g^(len-s), tail1_s = g^(len-1-s):
        o = diag(g^t) (diag(g^t) Q S C - Q G + l Q C) + KW (K C) + M V,
        KW = (Q K^T) * (diag(g^t) Gamma - g^(t-1) L),
        M = (diag(g^t) Q S Q^T + l Q Q^T) * Gamma + ((W * Gamma) K Q^T) * Gamma - (W B) * Gamma'
        dS = K^T (tail K),  dC = Q^T (tail V),  dm = Q^T tail,
        dG = K^T (g^(len-1) K C + B (tail1 V)),  dh likewise with m, 1
    (unmasked: without the G, h terms, the g^(t-1) L weight and W B)."""
    B, H, T, dk = q.shape
    Q, K, V, L = chunks(q, k, v, chunk_size)
    n = Q.shape[-2]
    w = Weights(g, n, T, L)
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    mk = 1.0 if masked else 0.0
    Kt, Qt = K.transpose(-1, -2), Q.transpose(-1, -2)
    S, S_last = w.carry(st["S"], Kt @ w.tails(K))
    C, C_last = w.carry(st["C"], Qt @ w.tails(V))
    m, m_last = w.carry(st["m"], w.tail_sum(Qt))
    KQ = K @ Qt
    Bs = KQ.masked_fill(~L.tril(-1), 0)
    KC, Km = K @ C, mv(K, m)
    # powers one lower, from their exponents (never divided by g): g^(len-1) per chunk,
    # tail1_s = g^(len-1-s) (0 at s = len), g^(t-1), Gamma'
    pw1, tail1, gl1 = decays(g, n, T, shift=1)
    G, G_last = w.carry(st["G"], Kt @ (gl1 * KC + Bs @ (tail1 * V)))
    h, h_last = w.carry(st["h"], mv(Kt, gl1[..., 0] * Km + mv(Bs, tail1[..., 0])))
    W0 = Q @ Kt
    W = W0.masked_fill(~L, 0)
    gt, Gam = w.gt, w.Gam
    gt1 = pw1[..., 1:, None].unsqueeze(2)                 # g^(t-1), t = 1..n
    QS = Q @ S
    X = gt * (QS @ C)
    x = gt[..., 0] * mv(QS, m)
    Mq = gt * (QS @ Qt)
    if masked:
        X, x = X - Q @ G, x - mv(Q, h)
    if ridge:
        X, x = X + ridge * (Q @ C), x + ridge * mv(Q, m)
        Mq = Mq + ridge * (Q @ Qt)
    M = Mq * Gam + ((W * Gam) @ KQ) * Gam
    if masked:
        M = M - (W @ Bs) * decay_matrix(g, n, -1, shift=1).unsqueeze(2)
    KW = W0 * (gt * Gam - mk * gt1 * L)
    num = gt * X + KW @ KC + M @ V
    den = gt[..., 0] * x + mv(KW, Km) + M.sum(-1) if normalize else None
    return finish(num, den, normalize, eps, T), {"S": S_last, "C": C_last, "m": m_last,
                                                   "G": G_last, "h": h_last}


def step_(q, k, v, st, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None):
    """o_t = q^T((S + lI) C - G) [/ (q^T((S + lI) m - h) + eps)] after
    G = gG + k k^T C, h = gh + k k^T m (C, m before the token), S = gS + k k^T, C = gC + q v^T,
    m = gm + q."""
    S, C, m, G, h = st["S"], st["C"], st["m"], st["G"], st["h"]
    kC, km = vecmat(k, C), (k * m).sum(-1, keepdim=True)
    rank1_(G, k, kC, decay)
    axpy_(h, k, decay, km)
    rank1_(S, k, k, decay)
    rank1_(C, q, v, decay)
    axpy_(m, q, decay)
    u = vecmat(q, S)
    if ridge:
        u = u + ridge * q
    num = vecmat(u, C)
    if masked:
        num = num - vecmat(q, G)
    if not normalize:
        return num
    den = (u * m).sum(-1, keepdim=True)
    if masked:
        den = den - (q * h).sum(-1, keepdim=True)
    return num / (den + eps)
