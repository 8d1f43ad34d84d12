"""Third-order HLA in plain PyTorch: the masked form ((W W^T * L) W) V, W = L * (Q K^T).

o_t = sum_{s<=t} (q_t^T S_s q_s)(q_s^T P_s), so with the state per (batch, head)
    S_t = sum k k^T,  P_t = sum k v^T,  m_t = sum k     (inclusive of token t)
    F_t = F_{t-1} + (S_t q_t)(q_t^T P_t),   eta_t = eta_{t-1} + (S_t q_t)(q_t^T m_t)
the output is o_t = q_t^T F_t, normalized by q_t^T eta_t + eps: O(d^2 + d dv) per token.
Decay gamma: S, P, m, F, eta are each scaled by gamma before the token's term is added.

The paper's Theorem 7.1 / Algorithm 3 computes something else; `paper_algorithm3` keeps it for
reproduction (see docs/hla3_masked_form.md).
"""
from __future__ import annotations

import torch

from ..common.reference import causal, decay_matrix, fold, gamma, matvec, outer, powers, vecmat

STATE_NAMES = ("S", "P", "m", "F", "eta")


def state_shapes(batch, heads, dk, dv):
    return {"S": (batch, heads, dk, dk), "P": (batch, heads, dk, dv), "m": (batch, heads, dk),
            "F": (batch, heads, dk, dv), "eta": (batch, heads, dk)}


def zero_state(batch, heads, dk, dv, dtype=torch.float64, device="cpu"):
    return {k: torch.zeros(*s, dtype=dtype, device=device)
            for k, s in state_shapes(batch, heads, dk, dv).items()}


def quadratic(q, k, v, *, normalize=False, eps=1e-6):
    """((W W^T * L) W) V, W = L * (Q K^T), from a zero state (no decay)."""
    L = causal(q.shape[-2], q.device)
    W = (q @ k.transpose(-1, -2)).masked_fill(~L, 0)
    M = (W @ W.transpose(-1, -2)).masked_fill(~L, 0) @ W
    out = M @ v
    return out / (M.sum(-1, keepdim=True) + eps) if normalize else out


def step(q, k, v, st, *, normalize=False, eps=1e-6, decay=None):
    g = gamma(decay, q)
    g2, g1 = g[..., None, None], g[..., None]
    S = g2 * st["S"] + outer(k, k)
    P = g2 * st["P"] + outer(k, v)
    m = g1 * st["m"] + k
    Sq = matvec(S, q)
    F = g2 * st["F"] + outer(Sq, vecmat(q, P))
    eta = g1 * st["eta"] + Sq * (q * m).sum(-1, keepdim=True)
    out = vecmat(q, F)
    if normalize:
        out = out / ((q * eta).sum(-1) + eps)[..., None]
    return out, {"S": S, "P": P, "m": m, "F": F, "eta": eta}


def serial(q, k, v, *, normalize=False, eps=1e-6, decay=None, state=None):
    """The serial recurrence (F, eta form above), token by token. Returns (o [B, H, T, Dv],
    state)."""
    return fold(step, zero_state, q, k, v, state, normalize=normalize, eps=eps, decay=decay)


def chunked(q, k, v, *, chunk_size=64, normalize=False, eps=1e-6, decay=None, state=None):
    """Exact chunk form with d x d and d x dv segment summaries only.

    For a chunk (local t = 1..n), state (S, P, m, F, eta) carried in, W = L * (Q K^T),
    Gamma[t, s] = g^(t-s) [s <= t]:
        Y = diag(g^s) Q P + (W * Gamma) V                 row s: q_s^T P_s
        M = (diag(g^t) Q S Q^T + (W * Gamma) W^T) * L      M[t, s] = g^(t-s) q_t^T S_s q_s
        O = diag(g^t) Q F + M Y
    and, with U = S Q^T diag(g^s) + K^T (W^T * Gamma^T) (column s: S_s q_s),
        F' = g^n F + U diag(g^(n-s)) Y,  S' = g^n S + K^T diag(g^(n-s)) K, P', m' likewise.
    eta uses y = diag(g^s) Q m + (W * Gamma) 1 in place of Y."""
    B, H, T, dk = q.shape
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    g = gamma(decay, q)
    outs = []
    for c0 in range(0, T, chunk_size):
        Q, K, V = (x[:, :, c0:c0 + chunk_size] for x in (q, k, v))
        n = Q.shape[-2]
        L = causal(n, q.device)
        pw = powers(g, n)
        gt = pw[..., 1:, None]                   # g^t, t = 1..n
        tail = pw.flip(-1)[..., 1:, None]        # g^(n-s), s = 1..n
        Gam = decay_matrix(g, n)
        W = (Q @ K.transpose(-1, -2)).masked_fill(~L, 0)
        WG = W * Gam
        Y = gt * (Q @ st["P"]) + WG @ V
        y = gt[..., 0] * matvec(Q, st["m"]) + WG.sum(-1)
        M = (gt * (Q @ st["S"] @ Q.transpose(-1, -2)) + WG @ W.transpose(-1, -2)).masked_fill(~L, 0)
        num = gt * (Q @ st["F"]) + M @ Y
        den = gt[..., 0] * matvec(Q, st["eta"]) + matvec(M, y)
        outs.append(num / (den + eps)[..., None] if normalize else num)
        gn = pw[..., n, None, None]
        U = st["S"] @ Q.transpose(-1, -2) * gt.transpose(-1, -2) \
            + K.transpose(-1, -2) @ WG.transpose(-1, -2)
        Kt = K.transpose(-1, -2)
        st = {
            "F": gn * st["F"] + U @ (tail * Y),
            "eta": gn[..., 0] * st["eta"] + matvec(U, tail[..., 0] * y),
            "S": gn * st["S"] + Kt @ (tail * K),
            "P": gn * st["P"] + Kt @ (tail * V),
            "m": gn[..., 0] * st["m"] + matvec(Kt, tail[..., 0]),
        }
    return torch.cat(outs, 2), st


def triple_sum(q, k, v, keep):
    """Brute force sum over index triples: o_t = sum_{i, j, u <= t, keep(i, j, u)}
    (q_t.k_i)(k_i.q_j)(q_j.k_u) v_u  (i: key moment, j: query moment, u: value). O(T^4)."""
    T = q.shape[-2]
    qk = q @ k.transpose(-1, -2)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for t in range(T):
        for i in range(t + 1):
            for j in range(t + 1):
                for u in range(t + 1):
                    if keep(i, j, u):
                        w = qk[..., t, i] * qk[..., j, i] * qk[..., j, u]
                        out[..., t, :] += w[..., None] * v[..., u, :]
    return out


def paper_algorithm3(q, k, v):
    """The paper's third-order recurrence (Theorem 7.1 / Algorithm 3), no decay, unnormalized.

    Reconstructed from its stated structure: the unmasked product q_t^T S_t Q2_t P_t
    (Q2 = sum q q^T) minus three corrections, each removing the triples whose key-moment,
    query-moment or value index is a strict maximum:
        G1 += k k^T Q2_{t-1} P_{t-1},  G2 += S_{t-1} q q^T P_{t-1},  G3 += S_{t-1} Q2_{t-1} k v^T
        o_t = q_t^T (S_t Q2_t P_t - G1 - G2 - G3)
    It sums the triples (i, j, u) <= t whose largest index is attained at least twice, which is
    not ((W W^T * L) W) V: the masked form keeps the triples with i <= j, u <= j (j strict maximum
    included) and drops i = u > j. Kept to reproduce the paper; use `serial`/`chunked`."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    z = lambda *s: torch.zeros(B, H, *s, dtype=q.dtype, device=q.device)  # noqa: E731
    S, Q2, P, G = z(dk, dk), z(dk, dk), z(dk, dv), z(dk, dv)
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, :, t], k[:, :, t], v[:, :, t]
        G = G + outer(kt, kt) @ Q2 @ P + S @ outer(qt, qt) @ P + S @ Q2 @ outer(kt, vt)
        S, Q2, P = S + outer(kt, kt), Q2 + outer(qt, qt), P + outer(kt, vt)
        outs.append(vecmat(qt, S @ Q2 @ P - G))
    return torch.stack(outs, 2)
