"""Second-order HLA as TensorIR.

Each builder returns an s_tir PrimFunc; batch B, heads H, length T and the chunk count NC are
symbolic, head sizes and the chunk size are fixed at build time. The functions mirror
`hla_tvm.ops.hla2.reference` and are composed by `hla_tvm.backend` (one token: `hla2_decay.decode`
with gamma = 1):

    chunk_ksummary     per chunk c, per key/value head:  dS = K^T K
    chunk_scan         (_tir, plain prefix sum) S: records Sc[c] = S before chunk c, advances
    chunk_summary      per chunk c:  dC = Q^T V, dm = Q^T 1,
                       dX = K^T (((K Q^T) * U) V), dr = K^T (((K Q^T) * U) 1)    (U: j <= s)
    chunk_carry        sequential over chunks, in place on (C, m, G, h): records the readout
                       matrices of each chunk, then X += Sc dC + dX, r += Sc dm + dr,
                       C += dC, m += dm;  X = S C - G, r = S m - h
    chunk_output       per chunk, from the recorded readout (see `chunk_output`)

X = S C - G obeys X_t = X_{t-1} + S_t q_t v_t^T, so the carry needs one d x d x dv product a
chunk; G and h are recovered at the end as S C - X and S m - r. With grouped heads (group > 1)
S, dS and Sc belong to the key/value heads: query head h reads those of head h // group.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from ..common import pairs
from ..common.tir import (
    accum_dtype,
    const,
    matmul as _matmul,
    matvec as _matvec,
    stage as _stage,
    transpose as _transpose,
)


def _pairs(bf16_products, dtype, *sizes):
    """Whether a kernel runs its input products over bfloat16 pairs: asked for, inputs in
    bfloat16 (whose values the pairs hold exactly) and every reduction length even."""
    return bool(bf16_products) and dtype == "bfloat16" and all(x % 2 == 0 for x in sizes)


def chunk_ksummary(dk: int, n: int, *, dtype="float32", bf16_products=False):
    """Per chunk c (rows c*n .. c*n+n-1, zero past T): dS = K^T K.
    Shapes: k [B, H, T, dk] (H: the key/value heads), dS [B, H, NC, dk, dk].
    bf16_products: K^T K over pairs of tokens (`ops.common.pairs`; bfloat16 inputs)."""
    io, acc = dtype, accum_dtype(dtype)
    pairs_ok = _pairs(bf16_products, dtype, n)

    @T.prim_func(s_tir=True)
    def hla2_chunk_ksummary(k_h: T.handle, dS_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        k = T.match_buffer(k_h, (B, H, L, dk), io)
        dS = T.match_buffer(dS_h, (B, H, NC, dk, dk), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        if pairs_ok:
            Kp = T.sblock_alloc_buffer((B, H, NC, n // 2, dk), "uint32")
            # (K^T K's second operand: the same pairs in a buffer of its own, `pairs.matmul`)
            Kq = T.sblock_alloc_buffer((B, H, NC, n // 2, dk), "uint32")
        for b, hh, c in T.grid(B, H, NC):
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc")
            if pairs_ok:
                pairs.pack(Kp, Kc, b, hh, c, n // 2, dk, "Kp")
                pairs.pack(Kq, Kc, b, hh, c, n // 2, dk, "Kq")
                pairs.matmul(dS, Kp, Kq, b, hh, c, dk, dk, n // 2, "dS")
            else:
                _matmul(dS, Kc, Kc, b, hh, c, dk, dk, n, True, "dS")

    return hla2_chunk_ksummary


def chunk_summary(dk: int, dv: int, n: int, *, dtype="float32", group=1):
    """Per chunk c (rows c*n .. c*n+n-1, zero past T):
    dC = Q^T V, dm = Q^T 1, dX = K^T (A V), dr = K^T (A 1), A[j, s] = k_j.q_s for j <= s.
    Shapes: q [B, H, T, dk], k [B, H / group, T, dk], v [B, H / group, T, dv];
    dC, dX [B, H, NC, dk, dv], dm, dr [B, H, NC, dk]."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)

    @T.prim_func(s_tir=True)
    def hla2_chunk_summary(q_h: T.handle, k_h: T.handle, v_h: T.handle, dC_h: T.handle,
                           dm_h: T.handle, dX_h: T.handle, dr_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H // group, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        dC = T.match_buffer(dC_h, (B, H, NC, dk, dv), acc)
        dm = T.match_buffer(dm_h, (B, H, NC, dk), acc)
        dX = T.match_buffer(dX_h, (B, H, NC, dk, dv), acc)
        dr = T.match_buffer(dr_h, (B, H, NC, dk), acc)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        QT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        A0 = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        A = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        AV = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        A1 = T.sblock_alloc_buffer((B, H, NC, n), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _transpose(QT, Qc, b, hh, c, n, dk, "QT")
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc", group)
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            _matmul(dC, QT, Vc, b, hh, c, dk, dv, n, False, "dC")
            for i, t in T.grid(dk, n):
                with T.sblock("dm"):
                    vb, vh, vc, vi, vt = T.axis.remap("SSSSR", [b, hh, c, i, t])
                    with T.init():
                        dm[vb, vh, vc, vi] = _c(0)
                    dm[vb, vh, vc, vi] = dm[vb, vh, vc, vi] + Qc[vb, vh, vc, vt, vi]
            _matmul(A0, Kc, QT, b, hh, c, n, n, dk, False, "A0")
            for j, s in T.grid(n, n):
                with T.sblock("A"):
                    vb, vh, vc, vj, vs = T.axis.remap("SSSSS", [b, hh, c, j, s])
                    A[vb, vh, vc, vj, vs] = T.Select(vj <= vs, A0[vb, vh, vc, vj, vs], _c(0))
            _matmul(AV, A, Vc, b, hh, c, n, dv, n, False, "AV")
            for j, s in T.grid(n, n):
                with T.sblock("A1"):
                    vb, vh, vc, vj, vs = T.axis.remap("SSSSR", [b, hh, c, j, s])
                    with T.init():
                        A1[vb, vh, vc, vj] = _c(0)
                    A1[vb, vh, vc, vj] = A1[vb, vh, vc, vj] + A[vb, vh, vc, vj, vs]
            _matmul(dX, Kc, AV, b, hh, c, dk, dv, n, True, "dX")
            _matvec(dr, Kc, A1, b, hh, c, dk, n, True, "dr")

    return hla2_chunk_summary


def chunk_carry(dk: int, dv: int, *, masked=True, ridge=0.0, dtype="float32", group=1):
    """Sequential scan over chunks, state (C, m, G, h) [B, H, ...] updated in place, from the
    records Sc [B, H / group, NC, dk, dk] of S before each chunk and the advanced S.

    Before chunk c it records the chunk's readout:
        masked:   Xc[c] = (Sc + lI) C - G,  rc[c] = (Sc + lI) m - h
        unmasked: Xc[c] = C,                rc[c] = m
    then X += Sc dC + dX, r += Sc dm + dr, C += dC, m += dm, with X = S C - G, r = S m - h
    (X, r start from the state's G, h with S = Sc[0] and give them back at the end with the
    advanced S)."""
    acc = accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)
    lam = float(ridge)
    msk = 1.0 if masked else 0.0

    @T.prim_func(s_tir=True)
    def hla2_chunk_carry(dC_h: T.handle, dm_h: T.handle, dX_h: T.handle, dr_h: T.handle,
                         Sc_h: T.handle, S_h: T.handle, C_h: T.handle, m_h: T.handle,
                         G_h: T.handle, h_h: T.handle, Xc_h: T.handle, rc_h: T.handle):
        B = T.int64()
        H = T.int64()
        NC = T.int64()
        dC = T.match_buffer(dC_h, (B, H, NC, dk, dv), acc)
        dm = T.match_buffer(dm_h, (B, H, NC, dk), acc)
        dX = T.match_buffer(dX_h, (B, H, NC, dk, dv), acc)
        dr = T.match_buffer(dr_h, (B, H, NC, dk), acc)
        Sc = T.match_buffer(Sc_h, (B, H // group, NC, dk, dk), acc)
        S = T.match_buffer(S_h, (B, H // group, dk, dk), acc)
        C = T.match_buffer(C_h, (B, H, dk, dv), acc)
        m = T.match_buffer(m_h, (B, H, dk), acc)
        G = T.match_buffer(G_h, (B, H, dk, dv), acc)
        h_ = T.match_buffer(h_h, (B, H, dk), acc)
        Xc = T.match_buffer(Xc_h, (B, H, NC, dk, dv), acc)
        rc = T.match_buffer(rc_h, (B, H, NC, dk), acc)
        for b, h in T.grid(B, H):
            X = T.alloc_buffer((dk, dv), acc)
            r = T.alloc_buffer((dk,), acc)
            for i, j, l in T.grid(dk, dv, dk):
                with T.sblock("X0"):    # X = S C - G
                    vb, vh, vi, vj, vl = T.axis.remap("SSSSR", [b, h, i, j, l])
                    with T.init():
                        X[vi, vj] = _c(0) - G[vb, vh, vi, vj]
                    X[vi, vj] = X[vi, vj] + Sc[vb, vh // group, 0, vi, vl] * C[vb, vh, vl, vj]
            for i, l in T.grid(dk, dk):
                with T.sblock("r0"):    # r = S m - h
                    vb, vh, vi, vl = T.axis.remap("SSSR", [b, h, i, l])
                    with T.init():
                        r[vi] = _c(0) - h_[vb, vh, vi]
                    r[vi] = r[vi] + Sc[vb, vh // group, 0, vi, vl] * m[vb, vh, vl]
            for c in T.serial(NC):
                for i, j in T.grid(dk, dv):
                    with T.sblock("Xc"):
                        vb, vh, vc, vi, vj = T.axis.remap("SSSSS", [b, h, c, i, j])
                        Xc[vb, vh, vc, vi, vj] = _c(msk) * X[vi, vj] \
                            + _c(lam * msk + 1.0 - msk) * C[vb, vh, vi, vj]
                for i in T.serial(dk):
                    with T.sblock("rc"):
                        vb, vh, vc, vi = T.axis.remap("SSSS", [b, h, c, i])
                        rc[vb, vh, vc, vi] = _c(msk) * r[vi] \
                            + _c(lam * msk + 1.0 - msk) * m[vb, vh, vi]
                for i, j, l in T.grid(dk, dv, dk):
                    with T.sblock("X"):     # X += dX + Sc dC
                        vb, vh, vc, vi, vj, vl = T.axis.remap("SSSSSR", [b, h, c, i, j, l])
                        with T.init():
                            X[vi, vj] = X[vi, vj] + dX[vb, vh, vc, vi, vj]
                        X[vi, vj] = X[vi, vj] \
                            + Sc[vb, vh // group, vc, vi, vl] * dC[vb, vh, vc, vl, vj]
                for i, l in T.grid(dk, dk):
                    with T.sblock("r"):     # r += dr + Sc dm
                        vb, vh, vc, vi, vl = T.axis.remap("SSSSR", [b, h, c, i, l])
                        with T.init():
                            r[vi] = r[vi] + dr[vb, vh, vc, vi]
                        r[vi] = r[vi] + Sc[vb, vh // group, vc, vi, vl] * dm[vb, vh, vc, vl]
                for i, j in T.grid(dk, dv):
                    with T.sblock("C"):
                        vu = T.axis.reduce(1, 0)   # in place (see _tir)
                        vb, vh, vc, vi, vj = T.axis.remap("SSSSS", [b, h, c, i, j])
                        with T.init():
                            C[vb, vh, vi, vj] = C[vb, vh, vi, vj]
                        C[vb, vh, vi, vj] = C[vb, vh, vi, vj] + dC[vb, vh, vc, vi, vj]
                for i in T.serial(dk):
                    with T.sblock("m"):
                        vu = T.axis.reduce(1, 0)
                        vb, vh, vc, vi = T.axis.remap("SSSS", [b, h, c, i])
                        with T.init():
                            m[vb, vh, vi] = m[vb, vh, vi]
                        m[vb, vh, vi] = m[vb, vh, vi] + dm[vb, vh, vc, vi]
            for i, j, l in T.grid(dk, dv, dk):
                with T.sblock("G"):     # G = S C - X
                    vb, vh, vi, vj, vl = T.axis.remap("SSSSR", [b, h, i, j, l])
                    with T.init():
                        G[vb, vh, vi, vj] = _c(0) - X[vi, vj]
                    G[vb, vh, vi, vj] = G[vb, vh, vi, vj] \
                        + S[vb, vh // group, vi, vl] * C[vb, vh, vl, vj]
            for i, l in T.grid(dk, dk):
                with T.sblock("h"):     # h = S m - r
                    vb, vh, vi, vl = T.axis.remap("SSSR", [b, h, i, l])
                    with T.init():
                        h_[vb, vh, vi] = _c(0) - r[vi]
                    h_[vb, vh, vi] = h_[vb, vh, vi] + S[vb, vh // group, vi, vl] * m[vb, vh, vl]

    return hla2_chunk_carry


def chunk_output(dk: int, dv: int, n: int, *, masked=True, normalize=False, eps=1e-6, ridge=0.0,
                 dtype="float32", group=1):
    """Outputs of every chunk from its recorded readout (Sc, Xc, rc of `chunk_carry`):
        masked:   Z = Q (Sc + lI),          M = ((Z Q^T) + (W W^T)) * L,  num = Q Xc + M V
        unmasked: Z = Q (Sc + lI) + W K,    M = (Z Q^T) * L,             num = Z Xc + M V
    W = L * (Q K^T) chunk-local; o = num, or num / (Q rc + M 1 + eps) (Z rc when unmasked).
    Products over the chunk's tokens select s <= t (never 0 * a later token, which is NaN for
    an inf or NaN token), so row t depends on tokens <= t only.
    Shapes: q [B, H, T, dk], k [B, H / group, T, dk], v [B, H / group, T, dv],
    Sc [B, H / group, NC, dk, dk], Xc [B, H, NC, dk, dv], rc [B, H, NC, dk], o [B, H, T, dv]."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)
    lam = float(ridge)

    @T.prim_func(s_tir=True)
    def hla2_chunk_output(q_h: T.handle, k_h: T.handle, v_h: T.handle, Sc_h: T.handle,
                          Xc_h: T.handle, rc_h: T.handle, o_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H // group, L, dk), io)
        v = T.match_buffer(v_h, (B, H // group, L, dv), io)
        Sc = T.match_buffer(Sc_h, (B, H // group, NC, dk, dk), acc)
        Xc = T.match_buffer(Xc_h, (B, H, NC, dk, dv), acc)
        rc = T.match_buffer(rc_h, (B, H, NC, dk), acc)
        o = T.match_buffer(o_h, (B, H, L, dv), io)
        Qc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        QT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Kc = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        KT = T.sblock_alloc_buffer((B, H, NC, dk, n), acc)
        Vc = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        W0 = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        W = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        WT = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        Z = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        ZW = T.sblock_alloc_buffer((B, H, NC, n, dk), acc)
        ZQ = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        ZQW = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        M = T.sblock_alloc_buffer((B, H, NC, n, n), acc)
        numA = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        num = T.sblock_alloc_buffer((B, H, NC, n, dv), acc)
        denA = T.sblock_alloc_buffer((B, H, NC, n), acc)
        den = T.sblock_alloc_buffer((B, H, NC, n), acc)
        for b, hh, c in T.grid(B, H, NC):
            _stage(Qc, q, b, hh, c, n, dk, L, "Qc")
            _transpose(QT, Qc, b, hh, c, n, dk, "QT")
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc", group)
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc", group)
            _matmul(W0, Qc, KT, b, hh, c, n, n, dk, False, "W0")
            for t, s in T.grid(n, n):
                with T.sblock("W"):
                    vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                    W[vb, vh, vc, vt, vs] = T.Select(vs <= vt, W0[vb, vh, vc, vt, vs], _c(0))
            for t, i, l in T.grid(n, dk, dk):
                with T.sblock("Z"):
                    vb, vh, vc, vt, vi, vl = T.axis.remap("SSSSSR", [b, hh, c, t, i, l])
                    with T.init():
                        Z[vb, vh, vc, vt, vi] = _c(lam) * Qc[vb, vh, vc, vt, vi]
                    Z[vb, vh, vc, vt, vi] = Z[vb, vh, vc, vt, vi] \
                        + Qc[vb, vh, vc, vt, vl] * Sc[vb, vh // group, vc, vl, vi]
            if not masked:
                for t, i, j in T.grid(n, dk, n):
                    with T.sblock("ZW"):
                        vb, vh, vc, vt, vi, vj = T.axis.remap("SSSSSR", [b, hh, c, t, i, j])
                        with T.init():
                            ZW[vb, vh, vc, vt, vi] = Z[vb, vh, vc, vt, vi]
                        ZW[vb, vh, vc, vt, vi] = ZW[vb, vh, vc, vt, vi] + T.Select(
                            vj <= vt, W[vb, vh, vc, vt, vj] * Kc[vb, vh, vc, vj, vi], _c(0))
                _matmul(ZQ, ZW, QT, b, hh, c, n, n, dk, False, "ZQ")
                for t, s in T.grid(n, n):
                    with T.sblock("M"):
                        vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                        M[vb, vh, vc, vt, vs] = T.Select(vs <= vt, ZQ[vb, vh, vc, vt, vs], _c(0))
            else:
                _matmul(ZQ, Z, QT, b, hh, c, n, n, dk, False, "ZQ")
                for j, s in T.grid(n, n):
                    with T.sblock("WT"):
                        vb, vh, vc, vj, vs = T.axis.remap("SSSSS", [b, hh, c, j, s])
                        WT[vb, vh, vc, vj, vs] = W[vb, vh, vc, vs, vj]
                for t, s, j in T.grid(n, n, n):
                    with T.sblock("WW"):
                        vb, vh, vc, vt, vs, vj = T.axis.remap("SSSSSR", [b, hh, c, t, s, j])
                        with T.init():
                            ZQW[vb, vh, vc, vt, vs] = ZQ[vb, vh, vc, vt, vs]
                        ZQW[vb, vh, vc, vt, vs] = ZQW[vb, vh, vc, vt, vs] \
                            + W[vb, vh, vc, vt, vj] * WT[vb, vh, vc, vj, vs]
                for t, s in T.grid(n, n):
                    with T.sblock("M"):
                        vb, vh, vc, vt, vs = T.axis.remap("SSSSS", [b, hh, c, t, s])
                        M[vb, vh, vc, vt, vs] = T.Select(vs <= vt, ZQW[vb, vh, vc, vt, vs], _c(0))
            for t, x, i in T.grid(n, dv, dk):
                with T.sblock("numA"):
                    vb, vh, vc, vt, vx, vi = T.axis.remap("SSSSSR", [b, hh, c, t, x, i])
                    with T.init():
                        numA[vb, vh, vc, vt, vx] = _c(0)
                    if masked:
                        numA[vb, vh, vc, vt, vx] = numA[vb, vh, vc, vt, vx] \
                            + Qc[vb, vh, vc, vt, vi] * Xc[vb, vh, vc, vi, vx]
                    else:
                        numA[vb, vh, vc, vt, vx] = numA[vb, vh, vc, vt, vx] \
                            + ZW[vb, vh, vc, vt, vi] * Xc[vb, vh, vc, vi, vx]
            for t, x, s in T.grid(n, dv, n):
                with T.sblock("num"):
                    vb, vh, vc, vt, vx, vs = T.axis.remap("SSSSSR", [b, hh, c, t, x, s])
                    with T.init():
                        num[vb, vh, vc, vt, vx] = numA[vb, vh, vc, vt, vx]
                    num[vb, vh, vc, vt, vx] = num[vb, vh, vc, vt, vx] + T.Select(
                        vs <= vt, M[vb, vh, vc, vt, vs] * Vc[vb, vh, vc, vs, vx], _c(0))
            if normalize:
                for t, i in T.grid(n, dk):
                    with T.sblock("denA"):
                        vb, vh, vc, vt, vi = T.axis.remap("SSSSR", [b, hh, c, t, i])
                        with T.init():
                            denA[vb, vh, vc, vt] = _c(eps)
                        if masked:
                            denA[vb, vh, vc, vt] = denA[vb, vh, vc, vt] \
                                + QT[vb, vh, vc, vi, vt] * rc[vb, vh, vc, vi]
                        else:
                            denA[vb, vh, vc, vt] = denA[vb, vh, vc, vt] \
                                + ZW[vb, vh, vc, vt, vi] * rc[vb, vh, vc, vi]
                for t, s in T.grid(n, n):
                    with T.sblock("den"):
                        vb, vh, vc, vt, vs = T.axis.remap("SSSSR", [b, hh, c, t, s])
                        with T.init():
                            den[vb, vh, vc, vt] = denA[vb, vh, vc, vt]
                        den[vb, vh, vc, vt] = den[vb, vh, vc, vt] + M[vb, vh, vc, vt, vs]
            for t, x in T.grid(n, dv):
                with T.sblock("o"):
                    vb, vh, vc, vt, vx = T.axis.remap("SSSSS", [b, hh, c, t, x])
                    T.where(c * n + t < L)
                    if normalize:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, num[vb, vh, vc, vt, vx] / den[vb, vh, vc, vt])
                    else:
                        o[vb, vh, vc * n + vt, vx] = T.Cast(io, num[vb, vh, vc, vt, vx])

    return hla2_chunk_output
