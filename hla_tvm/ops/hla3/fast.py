"""Third-order HLA in fast PyTorch forms: `chunked`, every chunk at once (with or without
decay), and `step_`, one token with the state advanced in place; the same results as
`reference.chunked` and `reference.step`; differentiable."""
from __future__ import annotations

from ..common.fast import (
    Weights,
    axpy_,
    chunks,
    finish,
    gamma_or_none,
    mv,
    rank1_,
    vecmat,
)
from .reference import zero_state


def chunked(q, k, v, *, chunk_size=64, normalize=False, eps=1e-6, decay=None, state=None):
    """(o [B, H, T, Dv], state) of third-order HLA from `state` (zeros when None); the same
    result as `reference.chunked`. Per chunk, with (S, P, m, F, eta) carried in (decayed
    prefix sums: `carry`), W = L * (Q K^T), WG = W * Gamma, tail_s = g^(len-s):
        Y = diag(g^t) Q P + WG V,  y = g^t Q m + WG 1,
        dS = K^T (tail K),  dP = K^T (tail V),  dm = K^T tail,
        dF = U (tail Y),  deta = U (tail y),  U = (diag(g^t) Q S)^T + K^T WG^T (S symmetric),
        M = (Q U) * Gamma  (= (diag(g^t) Q S Q^T + WG W^T) * L: column s of U is S_s q_s),
        o = diag(g^t) Q F + M Y,  den = g^t Q eta + M y."""
    B, H, T, dk = q.shape
    Q, K, V, L = chunks(q, k, v, chunk_size)
    w = Weights(gamma_or_none(decay, q), Q.shape[-2], T, L)
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    Kt = K.transpose(-1, -2)
    WG = w.lower((Q @ Kt).masked_fill(~L, 0))
    S, S_last = w.carry(st["S"], Kt @ w.tails(K))
    P, P_last = w.carry(st["P"], Kt @ w.tails(V))
    m, m_last = w.carry(st["m"], w.tail_sum(Kt))
    Y, y = w.rows(Q @ P) + WG @ V, w.rows(mv(Q, m)) + WG.sum(-1)
    QS = Q @ S
    U = w.rows(QS).transpose(-1, -2) + Kt @ WG.transpose(-1, -2)
    Fs, F_last = w.carry(st["F"], U @ w.tails(Y))
    eta, eta_last = w.carry(st["eta"], mv(U, w.tails(y)))
    M = w.lower(Q @ U)
    num = w.rows(Q @ Fs) + M @ Y
    den = w.rows(mv(Q, eta)) + mv(M, y) if normalize else None
    return finish(num, den, normalize, eps, T), {"S": S_last, "P": P_last, "m": m_last,
                                                   "F": F_last, "eta": eta_last}


def step_(q, k, v, st, *, normalize=False, eps=1e-6, decay=None):
    """S = gS + k k^T, P = gP + k v^T, m = gm + k, F = gF + (S q)(q^T P),
    eta = g eta + (S q)(q^T m); o = q^T F."""
    S, P, m, F, eta = st["S"], st["P"], st["m"], st["F"], st["eta"]
    rank1_(S, k, k, decay)
    rank1_(P, k, v, decay)
    axpy_(m, k, decay)
    Sq = vecmat(q, S)    # S is symmetric
    rank1_(F, Sq, vecmat(q, P), decay)
    axpy_(eta, Sq, decay, (q * m).sum(-1, keepdim=True))
    out = vecmat(q, F)
    return out / ((q * eta).sum(-1, keepdim=True) + eps) if normalize else out
