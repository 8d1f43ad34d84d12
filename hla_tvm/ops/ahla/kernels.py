"""Asymmetric HLA (AHLA) as TensorIR; mirrors `hla_tvm.ops.ahla.reference` (decay always on: pass
gamma = 1 for none). State (P, m, E, n); chunk form, local t = 1..len, A = L * (Q K^T),
Gamma[t, s] = g^(t-s) [s <= t], tail_s = g^(len-s):

    chunk_ksummary dP = K^T (tail V), dm = K^T tail, gl = g^len, per key/value head (parallel)
    chunk_scan     P, m (key/value heads): record Pc, mc, advance               (sequential)
    chunk_cross    QP = Q Pc, Qm = Q mc (kept for the output),
                   ddE = K^T (gl QP + A (tail V)),  ddn = K^T (gl Qm + A tail)   (parallel)
    chunk_scan     E, n with ddE, ddn: record Ec, nc, advance                   (sequential)
    chunk_output   O = D Q Ec + At (D QP + At V), D = diag(g^t), At = A * Gamma: that is
                   D (Q Ec + A QP) + ((A A) * Gamma) V                          (parallel)
                   [/ (D Q nc + At (D Qm + At 1) + eps)]
    decode         one token in place: P = gP + k v^T, m = gm + k, E = gE + k (q^T P),
                   n = gn + k (q^T m), o = q^T E [/ (q^T n + eps)]
With grouped heads (group > 1) the key/value-head buffers (k, v, P, m, dP, dm, Pc, mc, gl) are
read at head h // group by query head h (the decay is equal within a group).
The cross term (K^T Q) Pc is summed as K^T (Q Pc), in one product with the chunk's own term
K^T (A (tail V)): Q Pc and K^T X take 2 n dk dv multiply-adds per chunk, where (K^T Q) Pc took
dk^2 (n + dv) and the own term a K^T product and a dk x dv buffer of its own (a summary kernel);
Q Pc serves the output's A (Q Pc) too.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from ..common.tir import (
    accum_dtype,
    const,
    cross_step as _cross_step,
    cross_sums as _cross_sums,
    decay_weights as _decay_weights,
    load_token as _load_token,
    matmul as _matmul,
    matvec as _matvec,
    powers as _powers,
    scale_rows as _scale_rows,
    stage as _stage,
    transpose as _transpose,
)


def decode(dk: int, dv: int, *, normalize=False, eps=1e-6, dtype="float32", group=1):
    """One token, state (P, m, E, n) [B, H, ...] updated in place; gamma [H]:
    P = gP + k v^T, m = gm + k, E = gE + k (q^T P), n = gn + (q.m) k (P, m after the token);
    o = q^T E [/ (q.n + eps)]."""
    io, acc = dtype, accum_dtype(dtype)

    @T.prim_func(s_tir=True)
    def ahla_decode(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, P_h: T.handle,
                    m_h: T.handle, E_h: T.handle, n_h: T.handle, o_h: T.handle):
        B = T.int64()
        H = T.int64()
        q = T.match_buffer(q_h, (B, H, 1, dk), io)
        k = T.match_buffer(k_h, (B, H // group, 1, dk), io)
        v = T.match_buffer(v_h, (B, H // group, 1, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        P = T.match_buffer(P_h, (B, H, dk, dv), acc)
        m = T.match_buffer(m_h, (B, H, dk), acc)
        E = T.match_buffer(E_h, (B, H, dk, dv), acc)
        n = T.match_buffer(n_h, (B, H, dk), acc)
        o = T.match_buffer(o_h, (B, H, 1, dv), io)
        for b, h in T.grid(B, H):
            qa = T.alloc_buffer((dk,), acc)
            ka = T.alloc_buffer((dk,), acc)
            va = T.alloc_buffer((dv,), acc)
            _load_token(qa, ka, va, q, k, v, b, h, dk, dv, group)
            _cross_step(P, m, E, n, g, qa, ka, va, ka, o, b, h, dk, dv, eps, normalize)

    return ahla_decode


def chunk_ksummary(dk: int, dv: int, n: int, *, dtype="float32"):
    """Per chunk of the key/value heads: dP = K^T (tail V) [B, H, NC, dk, dv],
    dm = K^T tail [.., dk], gl = g^len [B, H, NC]; k, v [B, H, T, .], g [H]."""
    io, acc = dtype, accum_dtype(dtype)

    @T.prim_func(s_tir=True)
    def ahla_chunk_ksummary(k_h: T.handle, v_h: T.handle, g_h: T.handle, dP_h: T.handle,
                            dm_h: T.handle, gl_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        k = T.match_buffer(k_h, (B, H, L, dk), io)
        v = T.match_buffer(v_h, (B, H, L, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        dP = T.match_buffer(dP_h, (B, H, NC, dk, dv), acc)
        dm = T.match_buffer(dm_h, (B, H, NC, dk), acc)
        gl = T.match_buffer(gl_h, (B, H, NC), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        KT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        tail = T.sblock_alloc_buffer((B, H, NC, n), acc)
        Vt = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc")
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc")
            _decay_weights(tail, gl, g, b, hh, c, n, L)
            _scale_rows(Vt, tail, Vc, b, hh, c, n, dv, "Vt")
            _matmul(dP, Kc, Vt, b, hh, c, dk, dv, n, True, "dP")
            _matvec(dm, KT, tail, b, hh, c, dk, n, False, "dm")

    return ahla_chunk_ksummary


def chunk_cross(dk: int, dv: int, n: int, *, dtype="float32", group=1):
    """QP = Q Pc [B, H, NC, n, dv], Qm = Q mc [.., n] (kept for the output),
    ddE = K^T (gl QP + A (tail V)) [B, H, NC, dk, dv], ddn = K^T (gl Qm + A tail) [.., dk];
    k, v, Pc, mc of the key/value heads [B, H / group, ..]."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)

    @T.prim_func(s_tir=True)
    def ahla_chunk_cross(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle,
                         Pc_h: T.handle, mc_h: T.handle, ddE_h: T.handle, ddn_h: T.handle,
                         QP_h: T.handle, Qm_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H // group, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        Pc = T.match_buffer(Pc_h, (B, H // group, NC, dk, dv), acc)
        mc = T.match_buffer(mc_h, (B, H // group, NC, dk), acc)
        ddE = T.match_buffer(ddE_h, (B, H, NC, dk, dv), acc)
        ddn = T.match_buffer(ddn_h, (B, H, NC, dk), acc)
        QP = T.match_buffer(QP_h, (B, H, NC, n, dv), acc)
        Qm = T.match_buffer(Qm_h, (B, H, NC, n), acc)
        gl = T.sblock_alloc_buffer((B, H, NC), acc)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        KT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        tail = T.sblock_alloc_buffer((B, H, NC, n), acc)
        Vt = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        A0 = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        A = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        AV = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        At = T.sblock_alloc_buffer((B, H, NC, n), acc)
        QPs = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        Qms = T.sblock_alloc_buffer((B, H, NC, n), acc)
        X = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        x = T.sblock_alloc_buffer((B, H, NC, n), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc", group)
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            _decay_weights(tail, gl, g, b, hh, c, n, L)
            _scale_rows(Vt, tail, Vc, b, hh, c, n, dv, "Vt")
            _matmul(A0, Qc, KT, b, hh, c, n, n, dk, False, "A0")
            for t, s in T.grid(n, n):
                with T.sblock("A"):
                    vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                    A[vb, vh, vc, vt, vs] = T.Select(vs <= vt, A0[vb, vh, vc, vt, vs], _c(0))
            _matmul(AV, A, Vt, b, hh, c, n, dv, n, False, "AV")
            _matvec(At, A, tail, b, hh, c, n, n, False, "At")
            _matmul(QPs, Qc, Pc, b, hh, c, n, dv, dk, False, "QPs", bgroup=group)
            _matvec(Qms, Qc, mc, b, hh, c, n, dk, False, "Qms", xgroup=group)
            _cross_sums(ddE, ddn, Kc, QPs, Qms, AV, At, X, x, QP, Qm, gl, b, hh, c, n, dk, dv)

    return ahla_chunk_cross


def chunk_output(dk: int, dv: int, n: int, *, normalize=False, eps=1e-6, dtype="float32", group=1):
    """O = D Q Ec + At (D QP + At V)  [/ (D Q nc + At (D Qm + At 1) + eps)] per chunk, with
    D = diag(g^t), At = A * Gamma; this is D (Q Ec + A QP) + ((A A) * Gamma) V [/ (D (Q nc +
    A Qm) + ((A A) * Gamma) 1 + eps)], since At = D A D^-1 (so At D = D A and At At =
    D (A A) D^-1 = (A A) * Gamma, A being lower triangular): four products, not five. Ec [B, H,
    NC, dk, dv], nc [B, H, NC, dk] and the cross kernel's QP = Q Pc [B, H, NC, n, dv],
    Qm = Q mc [B, H, NC, n]."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)

    @T.prim_func(s_tir=True)
    def ahla_chunk_output(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle,
                          Ec_h: T.handle, QP_h: T.handle, nc_h: T.handle, Qm_h: T.handle,
                          o_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H // group, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        Ec = T.match_buffer(Ec_h, (B, H, NC, dk, dv), acc)
        QP = T.match_buffer(QP_h, (B, H, NC, n, dv), acc)
        nc = T.match_buffer(nc_h, (B, H, NC, dk), acc)
        Qm = T.match_buffer(Qm_h, (B, H, NC, n), acc)
        o = T.match_buffer(o_h, (B, H, L, dv), io)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        KT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        A0 = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        At = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        AV = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        Y = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        QE = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        AY = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        rs = T.sblock_alloc_buffer((B, H, NC, n), acc)
        den = T.sblock_alloc_buffer((B, H, NC, n), acc)
        pw = T.sblock_alloc_buffer((B, H, NC, n + 1), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _powers(pw, g, b, hh, c, n + 1)
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc", group)
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            _matmul(A0, Qc, KT, b, hh, c, n, n, dk, False, "A0")
            for t, s in T.grid(n, n):
                with T.sblock("At"):
                    vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                    At[vb, vh, vc, vt, vs] = T.Select(
                        vs <= vt, A0[vb, vh, vc, vt, vs] * pw[vb, vh, vc, T.max(vt - vs, 0)], _c(0))
            _matmul(AV, At, Vc, b, hh, c, n, dv, n, False, "AV", True)
            for t, x in T.grid(n, dv):
                with T.sblock("Y"):
                    vb, vh, vc, vt, vx = T.axis.remap("SSSSS", [b, hh, c, t, x])
                    Y[vb, vh, vc, vt, vx] = pw[vb, vh, vc, vt + 1] * QP[vb, vh, vc, vt, vx] \
                        + AV[vb, vh, vc, vt, vx]
            _matmul(QE, Qc, Ec, b, hh, c, n, dv, dk, False, "QE")
            _matmul(AY, At, Y, b, hh, c, n, dv, n, False, "AY", True)
            if normalize:
                for t, s in T.grid(n, n):
                    with T.sblock("rs"):
                        vb, vh, vc, vt, vs = T.axis.remap("SSSSR", [b, hh, c, t, s])
                        with T.init():
                            rs[vb, vh, vc, vt] = pw[vb, vh, vc, vt + 1] * Qm[vb, vh, vc, vt]
                        rs[vb, vh, vc, vt] = rs[vb, vh, vc, vt] + At[vb, vh, vc, vt, vs]
                for t, i in T.grid(n, dk + n):
                    with T.sblock("den"):
                        vb, vh, vc, vt, vi = T.axis.remap("SSSSR", [b, hh, c, t, i])
                        with T.init():
                            den[vb, vh, vc, vt] = _c(0)
                        den[vb, vh, vc, vt] = den[vb, vh, vc, vt] + T.if_then_else(
                            vi < dk,
                            pw[vb, vh, vc, vt + 1] * Qc[vb, vh, vc, vt, T.min(vi, dk - 1)]
                            * nc[vb, vh, vc, T.min(vi, dk - 1)],
                            T.Select(vi - dk <= vt,
                                     At[vb, vh, vc, vt, T.max(vi - dk, 0)]
                                     * rs[vb, vh, vc, T.max(vi - dk, 0)], _c(0)))
            for t, x in T.grid(n, dv):
                with T.sblock("o"):
                    vb, vh, vc, vt, vx = T.axis.remap("SSSSS", [b, hh, c, t, x])
                    T.where(c * n + t < L)
                    if normalize:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, (
                            pw[vb, vh, vc, vt + 1] * QE[vb, vh, vc, vt, vx] + AY[vb, vh, vc, vt, vx])
                            / (den[vb, vh, vc, vt] + _c(eps)))
                    else:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, (
                            pw[vb, vh, vc, vt + 1] * QE[vb, vh, vc, vt, vx] + AY[vb, vh, vc, vt, vx]))

    return ahla_chunk_output
