"""HLA in the chunk form with every chunk at once: batched matrix products over [B, H, NC] and
prefix sums over chunks (with decay, decayed prefix sums: a decay-matrix product per block of
chunks, `_carry`). Same results as the `chunked` forms of `reference.hla2`, `reference.ahla`,
`reference.hla3` (the readable forms, whose docstrings derive them); differentiable."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference._common import decay_matrix, gamma
from ..reference.hla2 import zero_state


def _excl_cumsum(x):
    """Sum over the chunks before each chunk (dim 2): x[:, :, :c].sum(2)."""
    return x.cumsum(2) - x


def _decays(g, n, T, shift=0):
    """Decay weights of chunks of n tokens (the last T - (NC - 1) n long) for g [B, H]:
    pw [B, H, n + 1] = g^0 .. g^n, tail [B, H, NC, n, 1] = g^(len - s) for s = 1..len (0 past
    the chunk's end), gl [B, H, NC, 1, 1] = g^len; with shift 1 every exponent one lower
    (pw[0] = 0 in place of g^-1; tail 0 at s = len)."""
    NC = -(-T // n)
    lens = torch.full((NC,), n, dtype=torch.long, device=g.device) - shift
    lens[-1] = T - (NC - 1) * n - shift
    ex = lens[:, None] - torch.arange(1, n + 1, device=g.device)[None, :]
    gg = g[..., None, None]
    tail = torch.where(ex >= 0, gg ** ex.clamp(min=0).to(g.dtype), torch.zeros((), dtype=g.dtype,
                                                                                 device=g.device))
    gl = g[..., None] ** lens.to(g.dtype)
    ep = torch.arange(n + 1, device=g.device) - shift
    pw = torch.where(ep >= 0, g[..., None] ** ep.clamp(min=0).to(g.dtype),
                     torch.zeros((), dtype=g.dtype, device=g.device))
    return pw, tail[..., None], gl[..., None, None]


CARRY_BLOCK = 16   # chunks per decay-matrix product of `_carry`


def _carry(x0, dx, g, n, T):
    """(X [B, H, NC, ...] the state entering each chunk, the final state) of X' = g^len X + dx
    over the chunks from x0 [B, H, ...] (g None: no decay, prefix sums). With decay, per block
    of b = CARRY_BLOCK chunks from chunk b0 (E_c = c n the first token of chunk c, E_NC = T):
    X_c = g^(E_c - E_b0) X_b0 + sum_(b0 <= j < c) g^(E_c - E_(j+1)) dx_j for c = b0 .. b0 + b,
    one product with a (b + 1) x b decay matrix; the last row starts the next block."""
    if g is None:
        X = x0.unsqueeze(2) + _excl_cumsum(dx)
        return X, X[:, :, -1] + dx[:, :, -1]
    B, H, NC = dx.shape[:3]
    E = torch.arange(NC + 1, device=g.device) * n
    E[-1] = T
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    flat = dx.reshape(B, H, NC, -1)
    X = x0.reshape(B, H, 1, -1)
    rows = []
    for b0 in range(0, NC, CARRY_BLOCK):
        b1 = min(b0 + CARRY_BLOCK, NC)
        Eb = E[b0:b1 + 1]
        ex = Eb[:, None] - Eb[None, 1:]                # E_c - E_(j+1), [b + 1, b]
        D = torch.where(ex >= 0, g[..., None, None] ** ex.clamp(min=0).to(g.dtype), zero)
        w0 = g[..., None] ** (Eb - Eb[0]).to(g.dtype)  # g^(E_c - E_b0), [B, H, b + 1]
        Xb = w0[..., None] * X + D @ flat[:, :, b0:b1]
        rows.append(Xb[:, :, :-1])
        X = Xb[:, :, -1:]
    Xs = torch.cat(rows, 2).view(B, H, NC, *dx.shape[3:])
    return Xs, X.view(B, H, *dx.shape[3:])


def hla2_chunked(q, k, v, *, chunk_size=64, masked=True, normalize=False, eps=1e-6, ridge=0.0,
                 decay=None, state=None):
    """(o [B, H, T, Dv], state) of second-order HLA from `state` (zeros when None); with decay
    Algorithm 1 (`_hla2_decayed`).

    Per chunk c with the state (S, C, m, G, h) carried into it (exclusive prefix sums of the
    chunk summaries), W = L * (Q K^T) chunk-local, Sl = S + lI:
        masked:   o = Q (Sl C - G) + ((Q Sl Q^T + W W^T) * L) V
        unmasked: o = Z C + ((Z Q^T) * L) V,   Z = Q Sl + W K
    carry: dS = K^T K, dC = Q^T V, dm = Q^T 1, G += dS C + K^T ((K Q^T) * L_strict) V,
    h likewise with m and 1."""
    if decay is not None:
        return _hla2_decayed(q, k, v, _gamma(decay, q), chunk_size=chunk_size, masked=masked,
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
    """(Q, K, V [B, H, NC, n, .], L [n, n] lower-triangular incl. the diagonal), zero tokens
    padding the last chunk (they add nothing to a chunk's summaries; the decay weights count
    the chunk's own tokens: `_decays`)."""
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


def _hla2_decayed(q, k, v, g, *, chunk_size, masked, normalize, eps, ridge, state):
    """Second-order HLA with decay g [B, H] (Algorithm 1: the state scaled by g per token, the
    cross term k k^T C_(t-1) not), every chunk at once; the same result as the decayed
    `reference.hla2.chunked`, whose docstring derives it. Per chunk, with (S, C, m, G, h)
    carried in, W = L * (Q K^T), B = (K Q^T) strictly lower, Gamma[t, s] = g^(t-s) [s <= t],
    Gamma'[t, s] = g^(t-1-s) [s < t], tail_s = g^(len-s), tail1_s = g^(len-1-s):
        o = diag(g^t) (diag(g^t) Q S C - Q G + l Q C) + KW (K C) + M V,
        KW = (Q K^T) * (diag(g^t) Gamma - g^(t-1) L),
        M = (diag(g^t) Q S Q^T + l Q Q^T) * Gamma + ((W * Gamma) K Q^T) * Gamma - (W B) * Gamma'
        dS = K^T (tail K),  dC = Q^T (tail V),  dm = Q^T tail,
        dG = K^T (g^(len-1) K C + B (tail1 V)),  dh likewise with m, 1
    (unmasked: without the G, h terms, the g^(t-1) L weight and W B)."""
    B, H, T, dk = q.shape
    Q, K, V, L = _chunks(q, k, v, chunk_size)
    n = Q.shape[-2]
    w = _Weights(g, n, T, L)
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    mk = 1.0 if masked else 0.0
    Kt, Qt = K.transpose(-1, -2), Q.transpose(-1, -2)
    S, S_last = w.carry(st["S"], Kt @ w.tails(K))
    C, C_last = w.carry(st["C"], Qt @ w.tails(V))
    m, m_last = w.carry(st["m"], w.tail_sum(Qt))
    KQ = K @ Qt
    Bs = KQ.masked_fill(~L.tril(-1), 0)
    KC, Km = K @ C, _mv(K, m)
    # powers one lower, from their exponents (never divided by g): g^(len-1) per chunk,
    # tail1_s = g^(len-1-s) (0 at s = len), g^(t-1), Gamma'
    pw1, tail1, gl1 = _decays(g, n, T, shift=1)
    G, G_last = w.carry(st["G"], Kt @ (gl1 * KC + Bs @ (tail1 * V)))
    h, h_last = w.carry(st["h"], _mv(Kt, gl1[..., 0] * Km + _mv(Bs, tail1[..., 0])))
    W0 = Q @ Kt
    W = W0.masked_fill(~L, 0)
    gt, Gam = w.gt, w.Gam
    gt1 = pw1[..., 1:, None].unsqueeze(2)                 # g^(t-1), t = 1..n
    QS = Q @ S
    X = gt * (QS @ C)
    x = gt[..., 0] * _mv(QS, m)
    Mq = gt * (QS @ Qt)
    if masked:
        X, x = X - Q @ G, x - _mv(Q, h)
    if ridge:
        X, x = X + ridge * (Q @ C), x + ridge * _mv(Q, m)
        Mq = Mq + ridge * (Q @ Qt)
    M = Mq * Gam + ((W * Gam) @ KQ) * Gam
    if masked:
        M = M - (W @ Bs) * decay_matrix(g, n, -1, shift=1).unsqueeze(2)
    KW = W0 * (gt * Gam - mk * gt1 * L)
    num = gt * X + KW @ KC + M @ V
    den = gt[..., 0] * x + _mv(KW, Km) + M.sum(-1) if normalize else None
    return _finish(num, den, normalize, eps, T), {"S": S_last, "C": C_last, "m": m_last,
                                                   "G": G_last, "h": h_last}


class _Weights:
    """The decay weights a chunk form multiplies by (every one 1 without decay, g None: then
    nothing is multiplied): g^t of the rows (t = 1..n), tail g^(len-s), gl g^len per chunk, and
    Gamma[t, s] = g^(t-s) [s <= t]."""

    def __init__(self, g, n, T, L):
        self.g, self.n, self.T, self.L = g, n, T, L
        if g is not None:
            pw, self.tail, self.gl = _decays(g, n, T)
            self.gt = pw[..., 1:, None].unsqueeze(2)            # [B, H, 1, n, 1]
            self.Gam = decay_matrix(g, n).unsqueeze(2)           # [B, H, 1, n, n]

    def rows(self, x):
        """diag(g^t) x for x [B, H, NC, n, .]; x[..., t] g^t for x [B, H, NC, n]."""
        if self.g is None:
            return x
        return self.gt * x if x.dim() == 5 else self.gt[..., 0] * x

    def tails(self, x):
        """diag(g^(len-s)) x (x [B, H, NC, n, .] or [B, H, NC, n])."""
        if self.g is None:
            return x
        return self.tail * x if x.dim() == 5 else self.tail[..., 0] * x

    def chunk(self, x):
        """g^len x per chunk (x [B, H, NC, ...])."""
        if self.g is None:
            return x
        gl = self.gl if x.dim() == 5 else self.gl[..., 0]
        return gl * x

    def lower(self, x):
        """x * Gamma (x [B, H, NC, n, n]); x * L without decay."""
        return x.masked_fill(~self.L, 0) if self.g is None else x * self.Gam

    def tail_sum(self, X):
        """X diag(tail) 1 = sum_s X[.., s] g^(len-s) (X [.., r, n])."""
        return X.sum(-1) if self.g is None else _mv(X, self.tail[..., 0])

    def carry(self, x0, dx):
        return _carry(x0, dx, self.g, self.n, self.T)


def _gamma(decay, q):
    """g [B, H] in q's dtype for `decay` (None, a float, or a tensor [H]); None without decay."""
    return None if decay is None else gamma(decay, q)


def ahla_chunked(q, k, v, *, chunk_size=64, normalize=False, eps=1e-6, decay=None, state=None):
    """(o [B, H, T, Dv], state) of AHLA from `state` (zeros when None); the same result as
    `reference.ahla.chunked`. Per chunk, with (P, m, E, n) carried in (decayed prefix sums:
    `_carry`), A = L * (Q K^T), Gamma[t, s] = g^(t-s) [s <= t], tail_s = g^(len-s):
        o = diag(g^t) (Q E + A (Q P)) + ((A A) * Gamma) V = D Q E + At (D Q P + At V),
        den = g^t (Q n + A (Q m)) + ((A A) * Gamma) 1 = D Q n + At (D Q m + At 1)
        (D = diag(g^t), At = A * Gamma = D A D^-1: four products, not five)
        dP = K^T (tail V),  dm = K^T tail,  dE = K^T (g^len Q P + A (tail V)),
        dn = K^T (g^len Q m + A tail)."""
    from ..reference.ahla import zero_state as ahla_zero

    B, H, T, dk = q.shape
    Q, K, V, L = _chunks(q, k, v, chunk_size)
    w = _Weights(_gamma(decay, q), Q.shape[-2], T, L)
    st = state if state is not None else ahla_zero(B, H, dk, v.shape[-1], q.dtype, q.device)
    Kt = K.transpose(-1, -2)
    A = (Q @ Kt).masked_fill(~L, 0)
    tV = w.tails(V)
    P, P_last = w.carry(st["P"], Kt @ tV)
    m, m_last = w.carry(st["m"], w.tail_sum(Kt))
    QP, Qm = Q @ P, _mv(Q, m)
    E, E_last = w.carry(st["E"], Kt @ (w.chunk(QP) + A @ tV))
    nn, n_last = w.carry(st["n"], _mv(Kt, w.chunk(Qm) + w.tail_sum(A)))
    At = w.lower(A)
    num = w.rows(Q @ E) + At @ (w.rows(QP) + At @ V)
    den = w.rows(_mv(Q, nn)) + _mv(At, w.rows(Qm) + At.sum(-1)) if normalize else None
    return _finish(num, den, normalize, eps, T), {"P": P_last, "m": m_last, "E": E_last,
                                                   "n": n_last}


def hla3_chunked(q, k, v, *, chunk_size=64, normalize=False, eps=1e-6, decay=None, state=None):
    """(o [B, H, T, Dv], state) of third-order HLA from `state` (zeros when None); the same
    result as `reference.hla3.chunked`. Per chunk, with (S, P, m, F, eta) carried in (decayed
    prefix sums: `_carry`), W = L * (Q K^T), WG = W * Gamma, tail_s = g^(len-s):
        Y = diag(g^t) Q P + WG V,  y = g^t Q m + WG 1,
        dS = K^T (tail K),  dP = K^T (tail V),  dm = K^T tail,
        dF = U (tail Y),  deta = U (tail y),  U = (diag(g^t) Q S)^T + K^T WG^T (S symmetric),
        M = (Q U) * Gamma  (= (diag(g^t) Q S Q^T + WG W^T) * L: column s of U is S_s q_s),
        o = diag(g^t) Q F + M Y,  den = g^t Q eta + M y."""
    from ..reference.hla3 import zero_state as hla3_zero

    B, H, T, dk = q.shape
    Q, K, V, L = _chunks(q, k, v, chunk_size)
    w = _Weights(_gamma(decay, q), Q.shape[-2], T, L)
    st = state if state is not None else hla3_zero(B, H, dk, v.shape[-1], q.dtype, q.device)
    Kt = K.transpose(-1, -2)
    WG = w.lower((Q @ Kt).masked_fill(~L, 0))
    S, S_last = w.carry(st["S"], Kt @ w.tails(K))
    P, P_last = w.carry(st["P"], Kt @ w.tails(V))
    m, m_last = w.carry(st["m"], w.tail_sum(Kt))
    Y, y = w.rows(Q @ P) + WG @ V, w.rows(_mv(Q, m)) + WG.sum(-1)
    QS = Q @ S
    U = w.rows(QS).transpose(-1, -2) + Kt @ WG.transpose(-1, -2)
    Fs, F_last = w.carry(st["F"], U @ w.tails(Y))
    eta, eta_last = w.carry(st["eta"], _mv(U, w.tails(y)))
    M = w.lower(Q @ U)
    num = w.rows(Q @ Fs) + M @ Y
    den = w.rows(_mv(Q, eta)) + _mv(M, y) if normalize else None
    return _finish(num, den, normalize, eps, T), {"S": S_last, "P": P_last, "m": m_last,
                                                   "F": F_last, "eta": eta_last}


# every chunk at once, with or without decay
CHUNKED = {"hla2": hla2_chunked, "ahla": ahla_chunked, "hla3": hla3_chunked}
