"""HLA without decay in the chunk form with every chunk at once: batched matrix
products over [B, H, NC] and prefix sums over chunks, no Python loop. Same results as the
`chunked` forms of `reference.hla2`, `reference.ahla`, `reference.hla3` (the readable forms,
whose docstrings derive them); differentiable."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference.hla2 import zero_state


def _excl_cumsum(x):
    """Sum over the chunks before each chunk (dim 2): x[:, :, :c].sum(2)."""
    return x.cumsum(2) - x


def hla2_chunked(q, k, v, *, chunk_size=64, masked=True, normalize=False, eps=1e-6, ridge=0.0,
                 state=None):
    """(o [B, H, T, Dv], state) of second-order HLA from `state` (zeros when None).

    Per chunk c with the state (S, C, m, G, h) carried into it (exclusive prefix sums of the
    chunk summaries), W = L * (Q K^T) chunk-local, Sl = S + lI:
        masked:   o = Q (Sl C - G) + ((Q Sl Q^T + W W^T) * L) V
        unmasked: o = Z C + ((Z Q^T) * L) V,   Z = Q Sl + W K
    carry: dS = K^T K, dC = Q^T V, dm = Q^T 1, G += dS C + K^T ((K Q^T) * L_strict) V,
    h likewise with m and 1."""
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
    S = st["S"].unsqueeze(2) + _excl_cumsum(dS)
    C = st["C"].unsqueeze(2) + _excl_cumsum(dC)
    m = st["m"].unsqueeze(2) + _excl_cumsum(dm)
    Bs = (K @ Qt).masked_fill(~L.tril(-1), 0)   # k_j . q_s for s < j
    dG = dS @ C + Kt @ (Bs @ V)
    dh = (dS @ m.unsqueeze(-1)).squeeze(-1) + (Kt @ Bs.sum(-1, keepdim=True)).squeeze(-1)
    G = st["G"].unsqueeze(2) + _excl_cumsum(dG)
    h = st["h"].unsqueeze(2) + _excl_cumsum(dh)
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


def _chunks(q, k, v, chunk_size):
    """(Q, K, V [B, H, NC, n, .], n, L [n, n] lower-triangular incl. the diagonal), zero tokens
    padding the last chunk (they leave every undecayed summary unchanged)."""
    B, H, T, _ = q.shape
    n = min(chunk_size, T)
    NC = -(-T // n)
    pad = NC * n - T
    Q, K, V = (F.pad(x, (0, 0, 0, pad)).view(B, H, NC, n, x.shape[-1]) for x in (q, k, v))
    return Q, K, V, torch.ones(n, n, dtype=torch.bool, device=q.device).tril()


def _mv(X, x):
    return (X @ x.unsqueeze(-1)).squeeze(-1)


def _finish(num, den, normalize, eps, T):
    B, H, NC, n, dv = num.shape
    out = num / (den + eps).unsqueeze(-1) if normalize else num
    return out.reshape(B, H, NC * n, dv)[:, :, :T]


def ahla_chunked(q, k, v, *, chunk_size=64, normalize=False, eps=1e-6, state=None):
    """(o [B, H, T, Dv], state) of AHLA without decay from `state` (zeros when None); the
    same result as `reference.ahla.chunked`. Per chunk, with (P, m, E, n) carried in
    (exclusive prefix sums), A = L * (Q K^T), R = K^T Q:
        o = Q E + (A Q) P + ((A A) * L) V,      den = Q n + (A Q) m + ((A A) * L) 1
        P += K^T V,  m += K^T 1,  E += R P + K^T (A V),  n += R m + K^T (A 1)."""
    from ..reference.ahla import zero_state as ahla_zero

    B, H, T, dk = q.shape
    Q, K, V, L = _chunks(q, k, v, chunk_size)
    st = state if state is not None else ahla_zero(B, H, dk, v.shape[-1], q.dtype, q.device)
    Kt = K.transpose(-1, -2)
    A = (Q @ Kt).masked_fill(~L, 0)
    dP, dm = Kt @ V, Kt.sum(-1)
    P = st["P"].unsqueeze(2) + _excl_cumsum(dP)
    m = st["m"].unsqueeze(2) + _excl_cumsum(dm)
    R = Kt @ Q
    dE, dn = R @ P + Kt @ (A @ V), _mv(R, m) + _mv(Kt, A.sum(-1))
    E = st["E"].unsqueeze(2) + _excl_cumsum(dE)
    nn = st["n"].unsqueeze(2) + _excl_cumsum(dn)
    AQ = A @ Q
    M = (A @ A).masked_fill(~L, 0)
    num = Q @ E + AQ @ P + M @ V
    den = _mv(Q, nn) + _mv(AQ, m) + M.sum(-1) if normalize else None
    last = {"P": P[:, :, -1] + dP[:, :, -1], "m": m[:, :, -1] + dm[:, :, -1],
            "E": E[:, :, -1] + dE[:, :, -1], "n": nn[:, :, -1] + dn[:, :, -1]}
    return _finish(num, den, normalize, eps, T), last


def hla3_chunked(q, k, v, *, chunk_size=64, normalize=False, eps=1e-6, state=None):
    """(o [B, H, T, Dv], state) of third-order HLA without decay from `state` (zeros when None);
    the same result as `reference.hla3.chunked`. Per chunk, with (S, P, m, F, eta) carried in
    (exclusive prefix sums), W = L * (Q K^T):
        Y = Q P + W V,  y = Q m + W 1,  M = (Q S Q^T + W W^T) * L
        o = Q F + M Y,  den = Q eta + M y
        S += K^T K,  P += K^T V,  m += K^T 1,  F += U Y,  eta += U y,  U = S Q^T + K^T W^T."""
    from ..reference.hla3 import zero_state as hla3_zero

    B, H, T, dk = q.shape
    Q, K, V, L = _chunks(q, k, v, chunk_size)
    st = state if state is not None else hla3_zero(B, H, dk, v.shape[-1], q.dtype, q.device)
    Kt, Qt = K.transpose(-1, -2), Q.transpose(-1, -2)
    W = (Q @ Kt).masked_fill(~L, 0)
    dS, dP, dm = Kt @ K, Kt @ V, Kt.sum(-1)
    S = st["S"].unsqueeze(2) + _excl_cumsum(dS)
    P = st["P"].unsqueeze(2) + _excl_cumsum(dP)
    m = st["m"].unsqueeze(2) + _excl_cumsum(dm)
    Y, y = Q @ P + W @ V, _mv(Q, m) + W.sum(-1)
    U = S @ Qt + Kt @ W.transpose(-1, -2)
    dF, deta = U @ Y, _mv(U, y)
    Fs = st["F"].unsqueeze(2) + _excl_cumsum(dF)
    eta = st["eta"].unsqueeze(2) + _excl_cumsum(deta)
    M = (Q @ S @ Qt + W @ W.transpose(-1, -2)).masked_fill(~L, 0)
    num = Q @ Fs + M @ Y
    den = _mv(Q, eta) + _mv(M, y) if normalize else None
    last = {"S": S[:, :, -1] + dS[:, :, -1], "P": P[:, :, -1] + dP[:, :, -1],
            "m": m[:, :, -1] + dm[:, :, -1], "F": Fs[:, :, -1] + dF[:, :, -1],
            "eta": eta[:, :, -1] + deta[:, :, -1]}
    return _finish(num, den, normalize, eps, T), last


# every chunk at once, no decay (with decay the reference's chunk loop is the PyTorch form)
CHUNKED = {"hla2": hla2_chunked, "ahla": ahla_chunked, "hla3": hla3_chunked}
