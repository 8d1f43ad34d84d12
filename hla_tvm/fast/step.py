"""One token of each operator in PyTorch, the state dict advanced in place with batched
rank-1 updates (baddbmm): the strongest plain-PyTorch decode step, eager or under
torch.compile. Same math as `reference.*.step`; q, k, v [B, H, D] (no grouped heads),
decay None, a float or a tensor [H]."""
from __future__ import annotations

import torch


def _scale_(x, g):
    """x *= g per head (g None: nothing; a float; a tensor [H])."""
    if g is None:
        return x
    if isinstance(g, torch.Tensor):
        return x.mul_(g.view(1, -1, *([1] * (x.dim() - 2))))
    return x.mul_(g)


def _rank1_(X, a, b, g):
    """X = g X + a b^T in place, for X [B, H, d, e], a [B, H, d], b [B, H, e]."""
    _scale_(X, g)
    d, e = X.shape[-2:]
    X.view(-1, d, e).baddbmm_(a.reshape(-1, d, 1), b.reshape(-1, 1, e))
    return X


def _axpy_(x, a, g, scale=None):
    """x = g x + scale a in place (scale [B, H, 1] or None)."""
    _scale_(x, g)
    return x.add_(a if scale is None else a * scale)


def _vecmat(x, M):
    """x^T M for x [B, H, d], M [B, H, d, e]."""
    return (x.unsqueeze(-2) @ M).squeeze(-2)


def hla2_step_(q, k, v, st, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None):
    """o_t = q^T((S + lI) C - G) [/ (q^T((S + lI) m - h) + eps)] after
    G = gG + k k^T C, h = gh + k k^T m (C, m before the token), S = gS + k k^T, C = gC + q v^T,
    m = gm + q."""
    S, C, m, G, h = st["S"], st["C"], st["m"], st["G"], st["h"]
    kC, km = _vecmat(k, C), (k * m).sum(-1, keepdim=True)
    _rank1_(G, k, kC, decay)
    _axpy_(h, k, decay, km)
    _rank1_(S, k, k, decay)
    _rank1_(C, q, v, decay)
    _axpy_(m, q, decay)
    u = _vecmat(q, S)
    if ridge:
        u = u + ridge * q
    num = _vecmat(u, C)
    if masked:
        num = num - _vecmat(q, G)
    if not normalize:
        return num
    den = (u * m).sum(-1, keepdim=True)
    if masked:
        den = den - (q * h).sum(-1, keepdim=True)
    return num / (den + eps)


def ahla_step_(q, k, v, st, *, normalize=False, eps=1e-6, decay=None):
    """P = gP + k v^T, m = gm + k, E = gE + k (q^T P), n = gn + k (q^T m); o = q^T E."""
    P, m, E, n = st["P"], st["m"], st["E"], st["n"]
    _rank1_(P, k, v, decay)
    _axpy_(m, k, decay)
    _rank1_(E, k, _vecmat(q, P), decay)
    _axpy_(n, k, decay, (q * m).sum(-1, keepdim=True))
    out = _vecmat(q, E)
    return out / ((q * n).sum(-1, keepdim=True) + eps) if normalize else out


def hla3_step_(q, k, v, st, *, normalize=False, eps=1e-6, decay=None):
    """S = gS + k k^T, P = gP + k v^T, m = gm + k, F = gF + (S q)(q^T P),
    eta = g eta + (S q)(q^T m); o = q^T F."""
    S, P, m, F, eta = st["S"], st["P"], st["m"], st["F"], st["eta"]
    _rank1_(S, k, k, decay)
    _rank1_(P, k, v, decay)
    _axpy_(m, k, decay)
    Sq = _vecmat(q, S)    # S is symmetric
    _rank1_(F, Sq, _vecmat(q, P), decay)
    _axpy_(eta, Sq, decay, (q * m).sum(-1, keepdim=True))
    out = _vecmat(q, F)
    return out / ((q * eta).sum(-1, keepdim=True) + eps) if normalize else out


STEPS = {"hla2": hla2_step_, "ahla": ahla_step_, "hla3": hla3_step_}
