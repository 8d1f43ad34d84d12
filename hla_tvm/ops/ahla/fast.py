"""AHLA in fast PyTorch forms: `chunked`, every chunk at once (with or without decay), and
`step_`, one token with the state advanced in place; the same results as `reference.chunked`
and `reference.step`; differentiable."""
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
    """(o [B, H, T, Dv], state) of AHLA from `state` (zeros when None); the same result as
    `reference.ahla.chunked`. Per chunk, with (P, m, E, n) carried in (decayed prefix sums:
    `carry`), A = L * (Q K^T), Gamma[t, s] = g^(t-s) [s <= t], tail_s = g^(len-s):
        o = diag(g^t) (Q E + A (Q P)) + ((A A) * Gamma) V = D Q E + At (D Q P + At V),
        den = g^t (Q n + A (Q m)) + ((A A) * Gamma) 1 = D Q n + At (D Q m + At 1)
        (D = diag(g^t), At = A * Gamma = D A D^-1: four products, not five)
        dP = K^T (tail V),  dm = K^T tail,  dE = K^T (g^len Q P + A (tail V)),
        dn = K^T (g^len Q m + A tail)."""
    B, H, T, dk = q.shape
    Q, K, V, L = chunks(q, k, v, chunk_size)
    w = Weights(gamma_or_none(decay, q), Q.shape[-2], T, L)
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    Kt = K.transpose(-1, -2)
    A = (Q @ Kt).masked_fill(~L, 0)
    tV = w.tails(V)
    P, P_last = w.carry(st["P"], Kt @ tV)
    m, m_last = w.carry(st["m"], w.tail_sum(Kt))
    QP, Qm = Q @ P, mv(Q, m)
    E, E_last = w.carry(st["E"], Kt @ (w.chunk(QP) + A @ tV))
    nn, n_last = w.carry(st["n"], mv(Kt, w.chunk(Qm) + w.tail_sum(A)))
    At = w.lower(A)
    num = w.rows(Q @ E) + At @ (w.rows(QP) + At @ V)
    den = w.rows(mv(Q, nn)) + mv(At, w.rows(Qm) + At.sum(-1)) if normalize else None
    return finish(num, den, normalize, eps, T), {"P": P_last, "m": m_last, "E": E_last,
                                                   "n": n_last}


def step_(q, k, v, st, *, normalize=False, eps=1e-6, decay=None):
    """P = gP + k v^T, m = gm + k, E = gE + k (q^T P), n = gn + k (q^T m); o = q^T E."""
    P, m, E, n = st["P"], st["m"], st["E"], st["n"]
    rank1_(P, k, v, decay)
    axpy_(m, k, decay)
    rank1_(E, k, vecmat(q, P), decay)
    axpy_(n, k, decay, (q * m).sum(-1, keepdim=True))
    out = vecmat(q, E)
    return out / ((q * n).sum(-1, keepdim=True) + eps) if normalize else out
