"""Second-order HLA (no decay) in the chunk form with every chunk at once: batched matrix
products over [B, H, NC] and prefix sums over chunks, no Python loop. Same result as
`reference.hla2.chunked` (the readable form, whose docstring derives it); differentiable."""
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
