"""What the fast PyTorch forms of the operators share: chunking with every chunk at once
(batched matrix products over [B, H, NC] and prefix sums over chunks; with decay, decayed prefix
sums: a decay-matrix product per block of chunks, `carry`), and the in-place batched rank-1
updates of the one-token steps (baddbmm)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import decay_matrix, gamma


def excl_cumsum(x):
    """Sum over the chunks before each chunk (dim 2): x[:, :, :c].sum(2)."""
    return x.cumsum(2) - x


def decays(g, n, T, shift=0):
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


CARRY_BLOCK = 16   # chunks per decay-matrix product of `carry`


def carry(x0, dx, g, n, T):
    """(X [B, H, NC, ...] the state entering each chunk, the final state) of X' = g^len X + dx
    over the chunks from x0 [B, H, ...] (g None: no decay, prefix sums). With decay, per block
    of b = CARRY_BLOCK chunks from chunk b0 (E_c = c n the first token of chunk c, E_NC = T):
    X_c = g^(E_c - E_b0) X_b0 + sum_(b0 <= j < c) g^(E_c - E_(j+1)) dx_j for c = b0 .. b0 + b,
    one product with a (b + 1) x b decay matrix; the last row starts the next block."""
    if g is None:
        X = x0.unsqueeze(2) + excl_cumsum(dx)
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


def chunks(q, k, v, chunk_size):
    """(Q, K, V [B, H, NC, n, .], L [n, n] lower-triangular incl. the diagonal), zero tokens
    padding the last chunk (they add nothing to a chunk's summaries; the decay weights count
    the chunk's own tokens: `decays`)."""
    B, H, T, _ = q.shape
    n = min(chunk_size, T)
    NC = -(-T // n)
    pad = NC * n - T
    Q, K, V = (F.pad(x, (0, 0, 0, pad)).view(B, H, NC, n, x.shape[-1]) for x in (q, k, v))
    return Q, K, V, torch.ones(n, n, dtype=torch.bool, device=q.device).tril()


def mv(X, x):
    return (X @ x.unsqueeze(-1)).squeeze(-1)


def finish(num, den, normalize, eps, T):
    B, H, NC, n, dv = num.shape
    out = num / (den + eps).unsqueeze(-1) if normalize else num
    return out.reshape(B, H, NC * n, dv)[:, :, :T]


class Weights:
    """The decay weights a chunk form multiplies by (every one 1 without decay, g None: then
    nothing is multiplied): g^t of the rows (t = 1..n), tail g^(len-s), gl g^len per chunk, and
    Gamma[t, s] = g^(t-s) [s <= t]."""

    def __init__(self, g, n, T, L):
        self.g, self.n, self.T, self.L = g, n, T, L
        if g is not None:
            pw, self.tail, self.gl = decays(g, n, T)
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
        return X.sum(-1) if self.g is None else mv(X, self.tail[..., 0])

    def carry(self, x0, dx):
        return carry(x0, dx, self.g, self.n, self.T)


def gamma_or_none(decay, q):
    """g [B, H] in q's dtype for `decay` (None, a float, or a tensor [H]); None without decay."""
    return None if decay is None else gamma(decay, q)


def scale_(x, g):
    """x *= g per head (g None: nothing; a float; a tensor [H])."""
    if g is None:
        return x
    if isinstance(g, torch.Tensor):
        return x.mul_(g.view(1, -1, *([1] * (x.dim() - 2))))
    return x.mul_(g)


def rank1_(X, a, b, g):
    """X = g X + a b^T in place, for X [B, H, d, e], a [B, H, d], b [B, H, e]."""
    scale_(X, g)
    d, e = X.shape[-2:]
    X.view(-1, d, e).baddbmm_(a.reshape(-1, d, 1), b.reshape(-1, 1, e))
    return X


def axpy_(x, a, g, scale=None):
    """x = g x + scale a in place (scale [B, H, 1] or None)."""
    scale_(x, g)
    return x.add_(a if scale is None else a * scale)


def vecmat(x, M):
    """x^T M for x [B, H, d], M [B, H, d, e]."""
    return (x.unsqueeze(-2) @ M).squeeze(-2)
