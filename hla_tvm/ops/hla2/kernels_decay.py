"""Second-order HLA with decay (the paper's Algorithm 1) as TensorIR; mirrors the decayed branch
of `hla_tvm.ops.hla2.reference.chunked`. Algorithm 1 scales S, C, m, G, h by g per token but adds
the cross term k k^T C_{t-1} undecayed, so X = S C - G no longer advances on its own and the
undecayed chunk carry of `hla2.chunk_carry` does not apply. Instead, local s, t = 1..len,
tail_s = g^(len-s), tail1_s = g^(len-1-s), B[j, s] = k_j.q_s [s < j]:

    chunk_ksummary dS = K^T (tail K), gl = g^len, per key/value head                  (parallel)
    chunk_summary  dC = Q^T (tail V), dm = Q^T tail                                  (parallel)
    chunk_scan     S (key/value heads), C, m: record Sc, Cc, mc                        (sequential)
    chunk_cross    KC = K Cc, Km = K mc (kept for the output),                         (parallel)
                   ddG = K^T (g^(len-1) KC + B (tail1 V)),  ddh = K^T (g^(len-1) Km + B tail1)
    chunk_scan     G, h                                                                (sequential)
    chunk_output   (W = L * (Q K^T), Gamma[t, s] = g^(t-s) [s <= t], Gamma'[t, s] = g^(t-1-s) [s < t])
        num = g^t (g^t Q Sc Cc - Q Gc + l Q Cc) + KW KC + M V
        KW  = (Q K^T) * (g^t Gamma - g^(t-1) L)
        M   = (g^t Q Sc Q^T + l Q Q^T) * Gamma + ((W * Gamma) K Q^T) * Gamma - (W B) * Gamma'
        den = the same with Cc -> mc, Gc -> hc, KC -> Km, V -> 1, plus eps (parallel)
    (unmasked drops every G, h term, the g^(t-1) L weight and the W B term; ridge = 0 every l
    term: those products are not computed.)
    The cross term K^T K Cc is summed as K^T (K Cc), in one product with the chunk's own term
    K^T (B (tail1 V)): 2 n dk dv multiply-adds per chunk where (K^T K) Cc took dk^2 (n + dv) and
    the own term a K^T product of its own; K Cc serves the output too.
    decode         Algorithm 1 for one token, in place, each state element read and written
                   once (rows on CPUs, columns on GPUs).
With grouped heads (group > 1) the key/value-head buffers (k, v, S, dS, Sc, gl) are read at head
h // group by query head h (the decay is equal within a group).
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from ..common.tir import (
    accum_dtype,
    chunk_len,
    const,
    cross_sums as _cross_sums,
    decay_weights as _decay_weights,
    gpow,
    load_token as _load_token,
    matmul as _matmul,
    matvec as _matvec,
    powers as _powers,
    scale_rows as _scale_rows,
    stage as _stage,
    transpose as _transpose,
    update_axpy as _update_axpy,
    update_row as _update_row,
    vecdot as _vecdot,
    vecmat_row as _vecmat_row,
    write_token as _write_token,
)


def decode(dk: int, dv: int, *, masked=True, normalize=False, eps=1e-6, ridge=0.0,
           dtype="float32", group=1, columns=False):
    """G = gG + k (k^T C), h = gh + k (k^T m) (C, m before the token), S = gS + k k^T,
    C = gC + q v^T, m = gm + q; o = q^T((S + lI) C - G) [/ (q^T((S + lI) m - h) + eps)]
    (without the G, h terms when unmasked). gamma [H]: ones for no decay.

    Each element of S, C and G is read once and written once, in three passes (S, then C,
    then G; S symmetric), using o = u^T C_new - q^T G_new = g u^T C + (u.q) v^T - g q^T G
    - (q.k) (k^T C) (C, G before the token):
      S pass: S_new = gS + k k^T, and u = (S_new + lI) q summed along it;
      C pass: k^T C and u^T C summed while C_new = gC + q v^T is written;
      G pass: q^T G summed while G_new = gG + k (k^T C) is written.
    The CPU's form (`_rows`) walks rows (contiguous: a row's update and its sums are vector
    operations); columns=True (GPUs: a thread a column) walks columns."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)
    mk = 1.0 if masked else 0.0
    step = _columns if columns else _rows

    @T.prim_func(s_tir=True)
    def hla2_decay_decode(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, S_h: T.handle,
                     C_h: T.handle, m_h: T.handle, G_h: T.handle, h_h: T.handle, o_h: T.handle):
        B = T.int64()
        H = T.int64()
        q = T.match_buffer(q_h, (B, H, 1, dk), io)
        k = T.match_buffer(k_h, (B, H // group, 1, dk), io)
        v = T.match_buffer(v_h, (B, H // group, 1, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        S = T.match_buffer(S_h, (B, H, dk, dk), acc)
        C = T.match_buffer(C_h, (B, H, dk, dv), acc)
        m = T.match_buffer(m_h, (B, H, dk), acc)
        G = T.match_buffer(G_h, (B, H, dk, dv), acc)
        h_ = T.match_buffer(h_h, (B, H, dk), acc)
        o = T.match_buffer(o_h, (B, H, 1, dv), io)
        for b, h in T.grid(B, H):
            qa = T.alloc_buffer((dk,), acc)
            ka = T.alloc_buffer((dk,), acc)
            va = T.alloc_buffer((dv,), acc)
            kC = T.alloc_buffer((dv,), acc)
            km = T.alloc_buffer((1,), acc)
            u = T.alloc_buffer((dk,), acc)
            num = T.alloc_buffer((dv,), acc)
            den = T.alloc_buffer((1,), acc)
            qk = T.alloc_buffer((1,), acc)
            uq = T.alloc_buffer((1,), acc)
            uC = T.alloc_buffer((dv,), acc)
            qG = T.alloc_buffer((dv,), acc)
            _load_token(qa, ka, va, q, k, v, b, h, dk, dv, group)
            _dot(qk, qa, ka, b, h, dk, "qk")
            _vecdot(km, ka, m, b, h, dk, "km")
            step(qa, ka, va, g, S, C, m, G, h_, kC, km, u, num, qk, uq, uC, qG, b, h, dk, dv,
                 ridge, mk, acc)
            for i in T.serial(dk):
                with T.sblock("den"):   # u.m - q.h (eps added by _write_token)
                    vb, vh, vi = T.axis.remap("SSR", [b, h, i])
                    with T.init():
                        den[0] = _c(0)
                    den[0] = den[0] + u[vi] * m[vb, vh, vi] - _c(mk) * qa[vi] * h_[vb, vh, vi]
            _write_token(o, num, den, b, h, dv, normalize, eps)

    return hla2_decay_decode

@T.macro
def _dot(out, x, y, b, h, n, name):
    """out[0] = x.y (vectors of n)."""
    for i in T.serial(n):
        with T.sblock(name):
            vb, vh, vi = T.axis.remap("SSR", [b, h, i])
            with T.init():
                out[0] = const(0, out.dtype)
            out[0] = out[0] + x[vi] * y[vi]


@T.macro
def _rows(qa, ka, va, g, S, C, m, G, h_, kC, km, u, num, qk, uq, uC, qG, b, h, dk, dv,
          ridge, mk, acc):
    """`decode`'s step on a CPU after q.k and k.m, before the denominator: S, C, G, h, m
    advanced in place row by row, u = (S_new + lI) q, num = u^T C_new - q^T G_new."""
    for l in T.serial(dk):
        _update_row(S, g, ka, ka, b, h, l, dk, "S")
        for i in T.serial(dk):
            with T.sblock("u"):   # S symmetric: u = (S_new + lI) q summed over its rows
                vb, vh, vl, vi = T.axis.remap("SSRS", [b, h, l, i])
                with T.init():
                    u[vi] = const(ridge, acc) * qa[vi]
                u[vi] = u[vi] + S[vb, vh, vl, vi] * qa[vl]
    _dot(uq, u, qa, b, h, dk, "uq")
    for i in T.serial(dk):   # C's rows: k^T C and u^T C summed, then the row advanced
        _vecmat_row(kC, ka, C, b, h, i, dv, "kC")
        _vecmat_row(uC, u, C, b, h, i, dv, "uC")
        _update_row(C, g, qa, va, b, h, i, dv, "C")
    for i in T.serial(dk):   # G's rows: q^T G summed, then the row advanced with k^T C
        _vecmat_row(qG, qa, G, b, h, i, dv, "qG")
        _update_row(G, g, ka, kC, b, h, i, dv, "G")
    for j in T.serial(dv):
        with T.sblock("num"):
            vb, vh, vj = T.axis.remap("SSS", [b, h, j])
            num[vj] = g[vh] * uC[vj] + uq[0] * va[vj] \
                - const(mk, acc) * (g[vh] * qG[vj] + qk[0] * kC[vj])
    _update_axpy(h_, g, ka, km[0], b, h, dk, "h")
    _update_axpy(m, g, qa, const(1, acc), b, h, dk, "m")


@T.macro
def _columns(qa, ka, va, g, S, C, m, G, h_, kC, km, u, num, qk, uq, uC, qG, b, h, dk, dv,
             ridge, mk, acc):
    """`decode`'s columns=True step after q.k and k.m, before the denominator: S, C, G, h, m
    advanced in place, u = (S_new + lI) q, num = u^T C_new - q^T G_new."""
    for i in T.serial(dk):
        with T.sblock("S_col"):   # S symmetric: column i is row i
            vu = T.axis.reduce(1, 0)   # in place (_tir's note)
            vb, vh, vi = T.axis.remap("SSS", [b, h, i])
            with T.init():
                u[vi] = const(0, acc)
            u[vi] = const(0, acc)
            for l in T.serial(dk):
                u[vi] = u[vi] + S[vb, vh, l, vi] * qa[l]
                S[vb, vh, l, vi] = g[vh] * S[vb, vh, l, vi] + ka[l] * ka[vi]
            u[vi] = g[vh] * u[vi] + ka[vi] * qk[0] + const(ridge, acc) * qa[vi]
    _dot(uq, u, qa, b, h, dk, "uq")
    for j in T.serial(dv):
        with T.sblock("CG_col"):
            vu = T.axis.reduce(1, 0)   # in place (_tir's note)
            vb, vh, vj = T.axis.remap("SSS", [b, h, j])
            with T.init():
                kC[vj] = const(0, acc)
            kC[vj] = const(0, acc)
            uC[vj] = const(0, acc)
            qG[vj] = const(0, acc)
            for i in T.serial(dk):
                kC[vj] = kC[vj] + ka[i] * C[vb, vh, i, vj]
                uC[vj] = uC[vj] + u[i] * C[vb, vh, i, vj]
                C[vb, vh, i, vj] = g[vh] * C[vb, vh, i, vj] + qa[i] * va[vj]
            for i in T.serial(dk):
                qG[vj] = qG[vj] + qa[i] * G[vb, vh, i, vj]
                G[vb, vh, i, vj] = g[vh] * G[vb, vh, i, vj] + ka[i] * kC[vj]
            num[vj] = g[vh] * uC[vj] + uq[0] * va[vj] \
                - const(mk, acc) * (g[vh] * qG[vj] + qk[0] * kC[vj])
    _update_axpy(h_, g, ka, km[0], b, h, dk, "h")
    _update_axpy(m, g, qa, const(1, acc), b, h, dk, "m")


def chunk_ksummary(dk: int, n: int, *, dtype="float32"):
    """Per chunk of the key/value heads: dS = K^T (tail K) [B, H, NC, dk, dk], gl = g^len
    [B, H, NC]; k [B, H, T, dk], g [H]."""
    io, acc = dtype, accum_dtype(dtype)

    @T.prim_func(s_tir=True)
    def hla2_decay_chunk_ksummary(k_h: T.handle, g_h: T.handle, dS_h: T.handle, gl_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        k = T.match_buffer(k_h, (B, H, L, dk), io)
        g = T.match_buffer(g_h, (H,), acc)
        dS = T.match_buffer(dS_h, (B, H, NC, dk, dk), acc)
        gl = T.match_buffer(gl_h, (B, H, NC), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        tail = T.sblock_alloc_buffer((B, H, NC, n), acc)
        Kt = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc")
            _decay_weights(tail, gl, g, b, hh, c, n, L)
            _scale_rows(Kt, tail, Kc, b, hh, c, n, dk, "Kt")
            _matmul(dS, Kc, Kt, b, hh, c, dk, dk, n, True, "dS")

    return hla2_decay_chunk_ksummary


def chunk_summary(dk: int, dv: int, n: int, *, dtype="float32", group=1):
    """Per chunk: dC = Q^T (tail V) [B, H, NC, dk, dv], dm = Q^T tail [.., dk]; v of the
    key/value heads."""
    io, acc = dtype, accum_dtype(dtype)

    @T.prim_func(s_tir=True)
    def hla2_decay_chunk_summary(q_h: T.handle, v_h: T.handle, g_h: T.handle, dC_h: T.handle,
                            dm_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        dC = T.match_buffer(dC_h, (B, H, NC, dk, dv), acc)
        dm = T.match_buffer(dm_h, (B, H, NC, dk), acc)
        gl = T.sblock_alloc_buffer((B, H, NC), acc)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        tail = T.sblock_alloc_buffer((B, H, NC, n), acc)
        Vt = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            _decay_weights(tail, gl, g, b, hh, c, n, L)
            _scale_rows(Vt, tail, Vc, b, hh, c, n, dv, "Vt")
            _matmul(dC, Qc, Vt, b, hh, c, dk, dv, n, True, "dC")
            _matvec(dm, Qc, tail, b, hh, c, dk, n, True, "dm")

    return hla2_decay_chunk_summary


def chunk_cross(dk: int, dv: int, n: int, *, dtype="float32", group=1):
    """KC = K Cc [B, H, NC, n, dv], Km = K mc [.., n] (kept for the output),
    ddG = K^T (g^(len-1) KC + B (tail1 V)) [B, H, NC, dk, dv],
    ddh = K^T (g^(len-1) Km + B tail1) [.., dk]; k, v of the key/value heads."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)

    @T.prim_func(s_tir=True)
    def hla2_decay_chunk_cross(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle,
                          Cc_h: T.handle, mc_h: T.handle, ddG_h: T.handle, ddh_h: T.handle,
                          KC_h: T.handle, Km_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H // group, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        Cc = T.match_buffer(Cc_h, (B, H, NC, dk, dv), acc)
        mc = T.match_buffer(mc_h, (B, H, NC, dk), acc)
        ddG = T.match_buffer(ddG_h, (B, H, NC, dk, dv), acc)
        ddh = T.match_buffer(ddh_h, (B, H, NC, dk), acc)
        KC = T.match_buffer(KC_h, (B, H, NC, n, dv), acc)
        Km = T.match_buffer(Km_h, (B, H, NC, n), acc)
        w = T.sblock_alloc_buffer((B, H, NC), acc)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        QT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        tail1 = T.sblock_alloc_buffer((B, H, NC, n), acc)
        Vt1 = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        KQ = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        Bs = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        BV = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        B1 = T.sblock_alloc_buffer((B, H, NC, n), acc)
        KCs = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        Kms = T.sblock_alloc_buffer((B, H, NC, n), acc)
        X = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        x = T.sblock_alloc_buffer((B, H, NC, n), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _transpose(QT, Qc, b, hh, c, n, dk, "QT")
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc", group)
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            with T.sblock("w"):
                vb, vh, vc = T.axis.remap("SSS", [b, hh, c])
                w[vb, vh, vc] = gpow(T.log(g[vh]), chunk_len(vc, n, L) - 1, acc)
            for s in T.serial(n):
                with T.sblock("tail1"):
                    vb, vh, vc, vs = T.axis.remap("SSSS", [b, hh, c, s])
                    tail1[vb, vh, vc, vs] = T.Select(
                        T.Cast("int64", vs) + 1 < chunk_len(vc, n, L),
                        gpow(T.log(g[vh]), chunk_len(vc, n, L) - 2 - T.Cast("int64", vs), acc),
                        _c(0))
            _scale_rows(Vt1, tail1, Vc, b, hh, c, n, dv, "Vt1")
            _matmul(KQ, Kc, QT, b, hh, c, n, n, dk, False, "KQ")
            for j, s in T.grid(n, n):
                with T.sblock("Bs"):
                    vb, vh, vc, vj, vs = T.axis.remap("SSSSS", [b, hh, c, j, s])
                    Bs[vb, vh, vc, vj, vs] = T.Select(vs < vj, KQ[vb, vh, vc, vj, vs], _c(0))
            _matmul(BV, Bs, Vt1, b, hh, c, n, dv, n, False, "BV")
            _matvec(B1, Bs, tail1, b, hh, c, n, n, False, "B1")
            _matmul(KCs, Kc, Cc, b, hh, c, n, dv, dk, False, "KCs")
            _matvec(Kms, Kc, mc, b, hh, c, n, dk, False, "Kms")
            _cross_sums(ddG, ddh, Kc, KCs, Kms, BV, B1, X, x, KC, Km, w, b, hh, c, n, dk, dv)

    return hla2_decay_chunk_cross


def chunk_output(dk: int, dv: int, n: int, *, masked=True, normalize=False, eps=1e-6,
                 ridge=0.0, dtype="float32", group=1):
    """Outputs of each chunk from the recorded Sc, Cc, mc, Gc, hc and the cross kernel's KC, Km
    (module docstring)."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)
    mk = 1.0 if masked else 0.0

    @T.prim_func(s_tir=True)
    def hla2_decay_chunk_output(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle,
                           Sc_h: T.handle, Cc_h: T.handle, mc_h: T.handle, Gc_h: T.handle,
                           hc_h: T.handle, KC_h: T.handle, Km_h: T.handle, o_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H // group, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        g = T.match_buffer(g_h, (H,), acc)
        Sc = T.match_buffer(Sc_h, (B, H // group, NC, dk, dk), acc)
        Cc = T.match_buffer(Cc_h, (B, H, NC, dk, dv), acc)
        mc = T.match_buffer(mc_h, (B, H, NC, dk), acc)
        Gc = T.match_buffer(Gc_h, (B, H, NC, dk, dv), acc)
        hc = T.match_buffer(hc_h, (B, H, NC, dk), acc)
        KC = T.match_buffer(KC_h, (B, H, NC, n, dv), acc)
        Km = T.match_buffer(Km_h, (B, H, NC, n), acc)
        o = T.match_buffer(o_h, (B, H, L, dv), io)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        QT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        KT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        W0 = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        W = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        WG = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        KW = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        KQ = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        Bs = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        Z = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        ZC = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        QG = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        QC = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        QSQ = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        QQ = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        WKQ = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        WB = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        M = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        KWKC = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        MV = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        pw = T.sblock_alloc_buffer((B, H, NC, 2 * n + 1), acc)
        den = T.sblock_alloc_buffer((B, H, NC, n), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _powers(pw, g, b, hh, c, 2 * n + 1)
            _transpose(QT, Qc, b, hh, c, n, dk, "QT")
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc", group)
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            _matmul(W0, Qc, KT, b, hh, c, n, n, dk, False, "W0")
            _matmul(KQ, Kc, QT, b, hh, c, n, n, dk, False, "KQ")
            for t, s in T.grid(n, n):
                with T.sblock("weights"):
                    vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                    W[vb, vh, vc, vt, vs] = T.Select(vs <= vt, W0[vb, vh, vc, vt, vs], _c(0))
                    WG[vb, vh, vc, vt, vs] = T.Select(
                        vs <= vt, W0[vb, vh, vc, vt, vs] * pw[vb, vh, vc, T.max(vt - vs, 0)], _c(0))
                    KW[vb, vh, vc, vt, vs] = T.Select(
                        vs <= vt, W0[vb, vh, vc, vt, vs] * (
                            pw[vb, vh, vc, T.max(vt + 1 + vt - vs, 0)]
                            - _c(mk) * pw[vb, vh, vc, vt]), _c(0))
                    if masked:
                        Bs[vb, vh, vc, vt, vs] = T.Select(vs < vt, KQ[vb, vh, vc, vt, vs], _c(0))
            _matmul(Z, Qc, Sc, b, hh, c, n, dk, dk, False, "Z", bgroup=group)
            _matmul(ZC, Z, Cc, b, hh, c, n, dv, dk, False, "ZC")
            if masked:
                _matmul(QG, Qc, Gc, b, hh, c, n, dv, dk, False, "QG")
                _matmul(WB, W, Bs, b, hh, c, n, n, n, False, "WB", True)
            if ridge != 0.0:
                _matmul(QC, Qc, Cc, b, hh, c, n, dv, dk, False, "QC")
                _matmul(QQ, Qc, QT, b, hh, c, n, n, dk, False, "QQ")
            _matmul(QSQ, Z, QT, b, hh, c, n, n, dk, False, "QSQ")
            _matmul(WKQ, WG, KQ, b, hh, c, n, n, n, False, "WKQ", True)
            for t, s in T.grid(n, n):
                with T.sblock("M"):
                    vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                    M[vb, vh, vc, vt, vs] = T.Select(
                        vs <= vt,
                        (pw[vb, vh, vc, vt + 1] * QSQ[vb, vh, vc, vt, vs]
                         + (_c(ridge) * QQ[vb, vh, vc, vt, vs] if ridge != 0.0 else _c(0))
                         + WKQ[vb, vh, vc, vt, vs])
                        * pw[vb, vh, vc, T.max(vt - vs, 0)]
                        - (T.Select(vs < vt, WB[vb, vh, vc, vt, vs]
                                    * pw[vb, vh, vc, T.max(vt - 1 - vs, 0)], _c(0))
                           if masked else _c(0)),
                        _c(0))
            _matmul(KWKC, KW, KC, b, hh, c, n, dv, n, False, "KWKC", True)
            _matmul(MV, M, Vc, b, hh, c, n, dv, n, False, "MV", True)
            if normalize:
                for t, j in T.grid(n, dk + n):
                    with T.sblock("den"):
                        vb, vh, vc, vt, vj = T.axis.remap("SSSSR", [b, hh, c, t, j])
                        with T.init():
                            den[vb, vh, vc, vt] = _c(eps)
                        den[vb, vh, vc, vt] = den[vb, vh, vc, vt] + T.if_then_else(
                            vj < dk,
                            pw[vb, vh, vc, vt + 1] * (
                                pw[vb, vh, vc, vt + 1] * Z[vb, vh, vc, vt, T.min(vj, dk - 1)]
                                * mc[vb, vh, vc, T.min(vj, dk - 1)]
                                - _c(mk) * Qc[vb, vh, vc, vt, T.min(vj, dk - 1)] * hc[vb, vh, vc, T.min(vj, dk - 1)]
                                + _c(ridge) * Qc[vb, vh, vc, vt, T.min(vj, dk - 1)] * mc[vb, vh, vc, T.min(vj, dk - 1)]),
                            T.Select(vj - dk <= vt,
                                     KW[vb, vh, vc, vt, T.max(vj - dk, 0)]
                                     * Km[vb, vh, vc, T.max(vj - dk, 0)], _c(0))
                            + M[vb, vh, vc, vt, T.max(vj - dk, 0)])
            for t, x in T.grid(n, dv):
                with T.sblock("o"):
                    vb, vh, vc, vt, vx = T.axis.remap("SSSSS", [b, hh, c, t, x])
                    T.where(c * n + t < L)
                    if normalize:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, (
                            pw[vb, vh, vc, vt + 1] * (
                                pw[vb, vh, vc, vt + 1] * ZC[vb, vh, vc, vt, vx]
                                - (QG[vb, vh, vc, vt, vx] if masked else _c(0))
                                + (_c(ridge) * QC[vb, vh, vc, vt, vx] if ridge != 0.0 else _c(0)))
                            + KWKC[vb, vh, vc, vt, vx] + MV[vb, vh, vc, vt, vx]) / den[vb, vh, vc, vt])
                    else:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, (
                            pw[vb, vh, vc, vt + 1] * (
                                pw[vb, vh, vc, vt + 1] * ZC[vb, vh, vc, vt, vx]
                                - (QG[vb, vh, vc, vt, vx] if masked else _c(0))
                                + (_c(ridge) * QC[vb, vh, vc, vt, vx] if ridge != 0.0 else _c(0)))
                            + KWKC[vb, vh, vc, vt, vx] + MV[vb, vh, vc, vt, vx]))

    return hla2_decay_chunk_output
