"""Third-order HLA as TensorIR; mirrors `hla_tvm.ops.hla3.reference` (decay always on: pass
gamma = 1 for none). State (S, P, m, F, eta). Chunk form, local s, t = 1..len, W = L * (Q K^T),
WG = W * Gamma (Gamma[t, s] = g^(t-s) [s <= t]), tail_s = g^(len-s), gl = g^len, gt = g^t:

    chunk_ksummary dS = K^T (tail K), dP = K^T (tail V), dm = K^T tail, gl = g^len,
                   per key/value head                                                  (parallel)
    chunk_scan     S, P, m (key/value heads): record Sc, Pc, mc                        (sequential)
    chunk_cross    Y = diag(gt) Q Pc + WG V,  y = diag(gt) Q mc + WG 1,
                   U^T = diag(gt) Q Sc + WG K,  ddF = U (tail * Y),  ddeta = U (tail * y),
                   M = (Q U) * Gamma;   writes ddF, ddeta, M, Y, y                  (parallel)
    chunk_scan     F, eta with ddF, ddeta                                             (sequential)
    chunk_output   O = diag(gt) Q Fc + M Y  [/ (gt Q etac + M y + eps)]                (parallel)
    decode         one token in place: S, P, m, then F = gF + (S q)(q^T P),
                   eta = g eta + (S q)(q^T m), o = q^T F [/ (q^T eta + eps)]

F' = gl F + sum_s g^(len-s) (S_s q_s)(q_s^T P_s) with S_s q_s = g^s Sc q_s + (K^T WG^T)_s and
q_s^T P_s = g^s q_s^T Pc + (WG V)_s (rows of U and Y); S is symmetric (a sum of k k^T), so
(Sc Q^T)^T = Q Sc serves U, and M[t, s] = g^(t-s) q_t^T S_s q_s = g^(t-s) q_t . (U^T)_s is one
product of Q and U (the same as (diag(gt) Q Sc Q^T + WG W^T) * L, which took two, one of them
n^3). Eleven d^3-sized products a chunk, all but two (Q Fc, M Y) before the scan of F. With
grouped heads (group > 1) query head h reads the key/value-head buffers (S, P, m, their
records, gl) at head h // group (the decay is equal within a group).
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from ..common.tir import (
    accum_dtype,
    const,
    cross_step as _cross_step,
    decay_weights as _decay_weights,
    load_token as _load_token,
    matmul as _matmul,
    matvec as _matvec,
    powers as _powers,
    scale_rows as _scale_rows,
    stage as _stage,
    transpose as _transpose,
    update_outer as _update_outer,
    vecmat as _vecmat,
)


def decode(dk: int, dv: int, *, normalize=False, eps=1e-6, dtype="float32", group=1):
    """One token, state (S, P, m, F, eta) [B, H, ...] updated in place; gamma [H]:
    S = gS + k k^T, P = gP + k v^T, m = gm + k, F = gF + (S q)(q^T P), eta = g eta + (q.m) S q
    (S, P, m after the token); o = q^T F [/ (q.eta + eps)]."""
    io, acc = dtype, accum_dtype(dtype)

    @T.prim_func(s_tir=True)
    def hla3_decode(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, S_h: T.handle,
                    P_h: T.handle, m_h: T.handle, F_h: T.handle, eta_h: T.handle,
                    o_h: T.handle):
        B = T.int64()
        H = T.int64()
        q = T.match_buffer(q_h, (B, H, 1, dk), io)
        k = T.match_buffer(k_h, (B, H // group, 1, dk), io)
        v = T.match_buffer(v_h, (B, H // group, 1, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        S = T.match_buffer(S_h, (B, H, dk, dk), acc)
        P = T.match_buffer(P_h, (B, H, dk, dv), acc)
        m = T.match_buffer(m_h, (B, H, dk), acc)
        F = T.match_buffer(F_h, (B, H, dk, dv), acc)
        eta = T.match_buffer(eta_h, (B, H, dk), acc)
        o = T.match_buffer(o_h, (B, H, 1, dv), io)
        for b, h in T.grid(B, H):
            qa = T.alloc_buffer((dk,), acc)
            ka = T.alloc_buffer((dk,), acc)
            va = T.alloc_buffer((dv,), acc)
            Sq = T.alloc_buffer((dk,), acc)
            _load_token(qa, ka, va, q, k, v, b, h, dk, dv, group)
            _update_outer(S, g, ka, ka, b, h, dk, dk, "S")
            _vecmat(Sq, qa, S, b, h, dk, dk, "Sq")      # S q = q^T S (S symmetric)
            _cross_step(P, m, F, eta, g, qa, ka, va, Sq, o, b, h, dk, dv, eps, normalize)

    return hla3_decode


def chunk_ksummary(dk: int, dv: int, n: int, *, dtype="float32"):
    """Per chunk: dS = K^T (tail K) [B, H, NC, dk, dk], dP = K^T (tail V) [.., dk, dv],
    dm = K^T tail [.., dk], gl = g^len [B, H, NC]; run on the key/value heads (g of those)."""
    io, acc = dtype, accum_dtype(dtype)

    @T.prim_func(s_tir=True)
    def hla3_chunk_ksummary(g_h: T.handle, k_h: T.handle, v_h: T.handle, dS_h: T.handle,
                           dP_h: T.handle, dm_h: T.handle, gl_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        g = T.match_buffer(g_h, (H,), acc)
        k = T.match_buffer(k_h, (B, H, L, dk), io)
        v = T.match_buffer(v_h, (B, H, L, dv), io)
        dS = T.match_buffer(dS_h, (B, H, NC, dk, dk), acc)
        dP = T.match_buffer(dP_h, (B, H, NC, dk, dv), acc)
        dm = T.match_buffer(dm_h, (B, H, NC, dk), acc)
        gl = T.match_buffer(gl_h, (B, H, NC), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        KT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        tail = T.sblock_alloc_buffer((B, H, NC, n), acc)
        Kt = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        Vt = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc")
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc")
            _decay_weights(tail, gl, g, b, hh, c, n, L)
            _scale_rows(Kt, tail, Kc, b, hh, c, n, dk, "Kt")
            _scale_rows(Vt, tail, Vc, b, hh, c, n, dv, "Vt")
            _matmul(dS, Kc, Kt, b, hh, c, dk, dk, n, True, "dS")
            _matmul(dP, Kc, Vt, b, hh, c, dk, dv, n, True, "dP")
            _matvec(dm, KT, tail, b, hh, c, dk, n, False, "dm")

    return hla3_chunk_ksummary


def chunk_cross(dk: int, dv: int, n: int, *, dtype="float32", group=1):
    """Per chunk, from the key/value heads' recorded Sc, Pc, mc [B, H / group, NC, ..] (module
    docstring): ddF [B, H, NC, dk, dv],
    ddeta [.., dk], and for the output M [.., n, n], Y [.., n, dv], y [.., n]."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)

    @T.prim_func(s_tir=True)
    def hla3_chunk_cross(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle,
                         Sc_h: T.handle, Pc_h: T.handle, mc_h: T.handle, ddF_h: T.handle,
                         ddeta_h: T.handle, M_h: T.handle, Y_h: T.handle, y_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H // group, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        Sc = T.match_buffer(Sc_h, (B, H // group, NC, dk, dk), acc)
        Pc = T.match_buffer(Pc_h, (B, H // group, NC, dk, dv), acc)
        mc = T.match_buffer(mc_h, (B, H // group, NC, dk), acc)
        ddF = T.match_buffer(ddF_h, (B, H, NC, dk, dv), acc)
        ddeta = T.match_buffer(ddeta_h, (B, H, NC, dk), acc)
        M = T.match_buffer(M_h, (B, H, NC, n, n), acc)
        Y = T.match_buffer(Y_h, (B, H, NC, n, dv), acc)
        y = T.match_buffer(y_h, (B, H, NC, n), acc)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        KT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        tail = T.sblock_alloc_buffer((B, H, NC, n), acc)
        gl = T.sblock_alloc_buffer((B, H, NC), acc)
        pw = T.sblock_alloc_buffer((B, H, NC, n + 1), acc)
        W0 = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        WG = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        QP = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        WGV = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        QS = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        WGK = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        UT = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        tY = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        ty = T.sblock_alloc_buffer((B, H, NC, n), acc)
        UTt = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        QU = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc", group)
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            _decay_weights(tail, gl, g, b, hh, c, n, L)
            _powers(pw, g, b, hh, c, n + 1)
            _matmul(W0, Qc, KT, b, hh, c, n, n, dk, False, "W0")
            for t, s in T.grid(n, n):
                with T.sblock("WG"):
                    vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                    WG[vb, vh, vc, vt, vs] = T.Select(
                        vs <= vt, W0[vb, vh, vc, vt, vs] * pw[vb, vh, vc, T.max(vt - vs, 0)], _c(0))
            _matmul(QP, Qc, Pc, b, hh, c, n, dv, dk, False, "QP", bgroup=group)
            _matmul(WGV, WG, Vc, b, hh, c, n, dv, n, False, "WGV", True)
            for t, x in T.grid(n, dv):
                with T.sblock("Y"):
                    vb, vh, vc, vt, vx = T.axis.remap("SSSSS", [b, hh, c, t, x])
                    Y[vb, vh, vc, vt, vx] = pw[vb, vh, vc, vt + 1] \
                        * QP[vb, vh, vc, vt, vx] + WGV[vb, vh, vc, vt, vx]
            for t, x in T.grid(n, dv):
                with T.sblock("tY"):
                    vb, vh, vc, vt, vx = T.axis.remap("SSSSS", [b, hh, c, t, x])
                    tY[vb, vh, vc, vt, vx] = tail[vb, vh, vc, vt] * Y[vb, vh, vc, vt, vx]
            for t, j in T.grid(n, dk + n):
                with T.sblock("y"):
                    vb, vh, vc, vt, vj = T.axis.remap("SSSSR", [b, hh, c, t, j])
                    with T.init():
                        y[vb, vh, vc, vt] = _c(0)
                    y[vb, vh, vc, vt] = y[vb, vh, vc, vt] + T.if_then_else(
                        vj < dk,
                        pw[vb, vh, vc, vt + 1] * Qc[vb, vh, vc, vt, T.min(vj, dk - 1)]
                        * mc[vb, vh // group, vc, T.min(vj, dk - 1)],
                        WG[vb, vh, vc, vt, T.max(vj - dk, 0)])
            for t in T.serial(n):
                with T.sblock("ty"):
                    vb, vh, vc, vt = T.axis.remap("SSSS", [b, hh, c, t])
                    ty[vb, vh, vc, vt] = tail[vb, vh, vc, vt] * y[vb, vh, vc, vt]
            _matmul(QS, Qc, Sc, b, hh, c, n, dk, dk, False, "QS", bgroup=group)
            _matmul(WGK, WG, Kc, b, hh, c, n, dk, n, False, "WGK", True)
            for s, i in T.grid(n, dk):
                with T.sblock("UT"):
                    vb, vh, vc, vs, vi = T.axis.remap("SSSSS", [b, hh, c, s, i])
                    UT[vb, vh, vc, vs, vi] = pw[vb, vh, vc, vs + 1] \
                        * QS[vb, vh, vc, vs, vi] + WGK[vb, vh, vc, vs, vi]
            _matmul(ddF, UT, tY, b, hh, c, dk, dv, n, True, "ddF")
            _matvec(ddeta, UT, ty, b, hh, c, dk, n, True, "ddeta")
            _transpose(UTt, UT, b, hh, c, n, dk, "UTt")
            _matmul(QU, Qc, UTt, b, hh, c, n, n, dk, False, "QU")
            for t, s in T.grid(n, n):
                with T.sblock("M"):
                    vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                    M[vb, vh, vc, vt, vs] = T.Select(
                        vs <= vt, pw[vb, vh, vc, T.max(vt - vs, 0)] * QU[vb, vh, vc, vt, vs],
                        _c(0))

    return hla3_chunk_cross


def chunk_output(dk: int, dv: int, n: int, *, normalize=False, eps=1e-6, dtype="float32"):
    """O = diag(gt) Q Fc + M Y  [/ (gt Q etac + M y + eps)] per chunk, M, Y, y from
    `chunk_cross` (module docstring)."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)

    @T.prim_func(s_tir=True)
    def hla3_chunk_output(q_h: T.handle, g_h: T.handle, Fc_h: T.handle, etac_h: T.handle,
                          M_h: T.handle, Y_h: T.handle, y_h: T.handle, o_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        g = T.match_buffer(g_h, (H,), acc)
        Fc = T.match_buffer(Fc_h, (B, H, NC, dk, dv), acc)
        etac = T.match_buffer(etac_h, (B, H, NC, dk), acc)
        M = T.match_buffer(M_h, (B, H, NC, n, n), acc)
        Y = T.match_buffer(Y_h, (B, H, NC, n, dv), acc)
        y = T.match_buffer(y_h, (B, H, NC, n), acc)
        o = T.match_buffer(o_h, (B, H, L, dv), io)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        QF = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        MY = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        den = T.sblock_alloc_buffer((B, H, NC, n), acc)
        pw = T.sblock_alloc_buffer((B, H, NC, n + 1), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _powers(pw, g, b, hh, c, n + 1)
            _matmul(QF, Qc, Fc, b, hh, c, n, dv, dk, False, "QF")
            _matmul(MY, M, Y, b, hh, c, n, dv, n, False, "MY", True)
            if normalize:
                for t, j in T.grid(n, dk + n):
                    with T.sblock("den"):
                        vb, vh, vc, vt, vj = T.axis.remap("SSSSR", [b, hh, c, t, j])
                        with T.init():
                            den[vb, vh, vc, vt] = _c(eps)
                        den[vb, vh, vc, vt] = den[vb, vh, vc, vt] + T.if_then_else(
                            vj < dk,
                            pw[vb, vh, vc, vt + 1] * Qc[vb, vh, vc, vt, T.min(vj, dk - 1)]
                            * etac[vb, vh, vc, T.min(vj, dk - 1)],
                            T.Select(vj - dk <= vt,
                                     M[vb, vh, vc, vt, T.max(vj - dk, 0)]
                                     * y[vb, vh, vc, T.max(vj - dk, 0)], _c(0)))
            for t, x in T.grid(n, dv):
                with T.sblock("o"):
                    vb, vh, vc, vt, vx = T.axis.remap("SSSSS", [b, hh, c, t, x])
                    T.where(c * n + t < L)
                    if normalize:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, (
                            pw[vb, vh, vc, vt + 1] * QF[vb, vh, vc, vt, vx]
                            + MY[vb, vh, vc, vt, vx]) / den[vb, vh, vc, vt])
                    else:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, (
                            pw[vb, vh, vc, vt + 1] * QF[vb, vh, vc, vt, vx]
                            + MY[vb, vh, vc, vt, vx]))

    return hla3_chunk_output
