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
    g = _gamma(decay, q)
    kk = k[..., :, None] * k[..., None, :]
    new = {
        "G": g[..., None, None] * st["G"] + kk @ st["C"],
        "h": g[..., None] * st["h"] + (kk @ st["m"][..., None])[..., 0],
        "S": g[..., None, None] * st["S"] + kk,
        "C": g[..., None, None] * st["C"] + q[..., :, None] * v[..., None, :],
        "m": g[..., None] * st["m"] + q,
    }
    return _readout(q, new, masked, normalize, eps, ridge), new


def _gamma(decay, q):
    B, H = q.shape[:2]
    if decay is None:
        return torch.ones(B, H, dtype=q.dtype, device=q.device)
    d = torch.as_tensor(decay, dtype=q.dtype, device=q.device)
    return d.expand(H).expand(B, H) if d.ndim == 0 else d.reshape(1, H).expand(B, H)


def serial(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None, state=None):
    """The serial recurrence (Algorithm 1), token by token. Returns (o [B, H, T, Dv], state)."""
    B, H, T, dk = q.shape
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    outs = []
    for t in range(T):
        o, st = step(q[:, :, t], k[:, :, t], v[:, :, t], st, masked=masked, normalize=normalize,
                     eps=eps, ridge=ridge, decay=decay)
        outs.append(o)
    return torch.stack(outs, dim=2), st


def chunked(q, k, v, *, chunk_size=64, masked=True, normalize=False, eps=1e-6, ridge=0.0,
            state=None):
    """The exact chunk-parallel form (no decay). Returns (o, state) equal to `serial`.

    With (S, C, m, G, h) the state carried into a chunk and W = L * (Q_c K_c^T) chunk-local,
    the chunk's outputs are (Figure 1(C) of the paper misses the middle term):
        masked:   Q_c ((S+lI) C - G)  +  ((Q_c (S+lI) Q_c^T) * L) V_c  +  ((W W^T) * L) V_c
        unmasked: Z C + ((Z Q_c^T) * L) V_c   with   Z = Q_c (S + lI) + W K_c
    and the carry to the next chunk (the paper's semidirect-product operator, eq. 4.1) is
        G += K^T ((K Q^T) * L_strict) V + (K^T K) C,   h likewise with m,
        S += K^T K,   C += Q^T V,   m += Q^T 1.
    """
    B, H, T, dk = q.shape
    st = state if state is not None else zero_state(B, H, dk, v.shape[-1], q.dtype, q.device)
    st = dict(st)
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    outs = []
    for c0 in range(0, T, chunk_size):
        Q, K, V = (x[:, :, c0:c0 + chunk_size] for x in (q, k, v))
        n = Q.shape[-2]
        L = _causal(n, q.device)
        S, C, m, G, h = (st[x] for x in STATE_NAMES)
        Sr = S + ridge * eye
        W = (Q @ K.transpose(-1, -2)).masked_fill(~L, 0)
        if masked:
            Z = Q @ Sr
            M = (Z @ Q.transpose(-1, -2) + W @ W.transpose(-1, -2)).masked_fill(~L, 0)
            num = Q @ (Sr @ C - G) + M @ V
            den = (Q @ (Sr @ m[..., None] - h[..., None]))[..., 0] + M.sum(-1)
        else:
            Z = Q @ Sr + W @ K
            M = (Z @ Q.transpose(-1, -2)).masked_fill(~L, 0)
            num = Z @ C + M @ V
            den = (Z @ m[..., None])[..., 0] + M.sum(-1)
        outs.append(num / (den + eps)[..., None] if normalize else num)
        KK = K.transpose(-1, -2) @ K
        A = (K @ Q.transpose(-1, -2)).tril(-1)          # A[j, s] = k_j . q_s for s < j
        st = {
            "G": G + K.transpose(-1, -2) @ (A @ V) + KK @ C,
            "h": h + (K.transpose(-1, -2) @ A.sum(-1)[..., None] + KK @ m[..., None])[..., 0],
            "S": S + KK,
            "C": C + Q.transpose(-1, -2) @ V,
            "m": m + Q.sum(-2),
        }
    return torch.cat(outs, dim=2), st
