"""Second-order HLA as TensorIR.

Each builder returns an s_tir PrimFunc; batch B, heads H, length T and the chunk count NC are
symbolic, head sizes and the chunk size are fixed at build time. The functions mirror
`hla_tvm.reference.hla2` and are composed by `hla_tvm.ops`:

    decode             one token, state (S, C, m, G, h) updated in place        == reference.step
    chunk_summary      per chunk c:  dS = K^T K, dC = Q^T V, dm = Q^T 1,
                       dX = K^T (((K Q^T) * U) V), dr = K^T (((K Q^T) * U) 1)    (U: j <= s)
    chunk_carry        sequential over chunks, in place on the state: records the readout
                       matrices of each chunk, then X += S dC + dX, r += S dm + dr,
                       S += dS, C += dC, m += dm;  X = S C - G, r = S m - h
    chunk_output       per chunk, from the recorded readout (see `chunk_output`)

X = S C - G obeys X_t = X_{t-1} + S_t q_t v_t^T, so the carry needs one d x d x dv product a
chunk; G and h are recovered at the end as S C - X and S m - r.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from ._tir import PRESCHEDULED, accum_dtype, load_token as _load_token, const, matmul as _matmul, matvec as _matvec, stage as _stage, \
    transpose as _transpose


def decode(dk: int, dv: int, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, dtype="float32"):
    """o = q^T((S'+lI) C' - G') [/ (q^T((S'+lI) m' - h') + eps)], with the state updated in place:
    G += k (k^T C), h += k (k^T m), S += k k^T, C += q v^T, m += q   (C, m read before the update).
    Shapes: q, k [B, H, 1, dk], v [B, H, 1, dv], o [B, H, 1, dv].

    In-place updates do not satisfy s_tir's dataflow checks, so the CPU schedule (parallel over
    batch*heads, vectorized rows) is written into the loops here."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)
    msk = 1.0 if masked else 0.0

    @T.prim_func(s_tir=True)
    def hla2_decode(q_h: T.handle, k_h: T.handle, v_h: T.handle, S_h: T.handle, C_h: T.handle,
                    m_h: T.handle, G_h: T.handle, h_h: T.handle, o_h: T.handle):
        B = T.int64()
        H = T.int64()
        q = T.match_buffer(q_h, (B, H, 1, dk), io)
        k = T.match_buffer(k_h, (B, H, 1, dk), io)
        v = T.match_buffer(v_h, (B, H, 1, dv), io)
        S = T.match_buffer(S_h, (B, H, dk, dk), acc)
        C = T.match_buffer(C_h, (B, H, dk, dv), acc)
        m = T.match_buffer(m_h, (B, H, dk), acc)
        G = T.match_buffer(G_h, (B, H, dk, dv), acc)
        h = T.match_buffer(h_h, (B, H, dk), acc)
        o = T.match_buffer(o_h, (B, H, 1, dv), io)
        for bh in T.parallel(B * H):
            kC = T.alloc_buffer((dv,), acc)
            u = T.alloc_buffer((dk,), acc)
            num = T.alloc_buffer((dv,), acc)
            km = T.alloc_buffer((1,), acc)
            den = T.alloc_buffer((1,), acc)
            qa = T.alloc_buffer((dk,), acc)
            ka = T.alloc_buffer((dk,), acc)
            va = T.alloc_buffer((dv,), acc)
            _load_token(qa, ka, va, q, k, v, bh, B, H, dk, dv)
            with T.sblock("scalars0"):
                km[0] = _c(0)
                den[0] = _c(eps)
            for j in T.vectorized(dv):
                with T.sblock("zero_dv"):
                    vj = T.axis.spatial(dv, j)
                    kC[vj] = _c(0)
                    num[vj] = _c(0)
            for i in T.serial(dk):
                for j in T.vectorized(dv):
                    with T.sblock("kC"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vj = T.axis.remap("RS", [i, j])
                        kC[vj] = kC[vj] + ka[vi] * C[vb, vh, vi, vj]
            for i in T.serial(dk):
                with T.sblock("km"):
                    vb = T.axis.spatial(B, bh // H)
                    vh = T.axis.spatial(H, bh % H)
                    vi = T.axis.reduce(dk, i)
                    km[0] = km[0] + ka[vi] * m[vb, vh, vi]
            for i in T.serial(dk):
                for j in T.vectorized(dv):
                    with T.sblock("upd_CG"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vj = T.axis.remap("SS", [i, j])
                        G[vb, vh, vi, vj] = G[vb, vh, vi, vj] + ka[vi] * kC[vj]
                        C[vb, vh, vi, vj] = C[vb, vh, vi, vj] + qa[vi] * va[vj]
                for j in T.vectorized(dk):
                    with T.sblock("upd_S"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vj = T.axis.remap("SS", [i, j])
                        S[vb, vh, vi, vj] = S[vb, vh, vi, vj] + ka[vi] * ka[vj]
            for i in T.vectorized(dk):
                with T.sblock("upd_mh"):
                    vb = T.axis.spatial(B, bh // H)
                    vh = T.axis.spatial(H, bh % H)
                    vi = T.axis.spatial(dk, i)
                    h[vb, vh, vi] = h[vb, vh, vi] + ka[vi] * km[0]
                    m[vb, vh, vi] = m[vb, vh, vi] + qa[vi]
                    u[vi] = _c(ridge) * qa[vi]
            for l in T.serial(dk):
                for i in T.vectorized(dk):
                    with T.sblock("u"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vl, vi = T.axis.remap("RS", [l, i])
                        u[vi] = u[vi] + S[vb, vh, vl, vi] * qa[vl]
            for i in T.serial(dk):
                for j in T.vectorized(dv):
                    with T.sblock("num"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vj = T.axis.remap("RS", [i, j])
                        num[vj] = num[vj] + u[vi] * C[vb, vh, vi, vj] \
                            - _c(msk) * qa[vi] * G[vb, vh, vi, vj]
            if normalize:
                for i in T.serial(dk):
                    with T.sblock("den"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi = T.axis.reduce(dk, i)
                        den[0] = den[0] + u[vi] * m[vb, vh, vi] - _c(msk) * qa[vi] * h[vb, vh, vi]
            for j in T.vectorized(dv):
                with T.sblock("o"):
                    vb = T.axis.spatial(B, bh // H)
                    vh = T.axis.spatial(H, bh % H)
                    vj = T.axis.spatial(dv, j)
                    if normalize:
                        o[vb, vh, 0, vj] = T.Cast(io, num[vj] / den[0])
                    else:
                        o[vb, vh, 0, vj] = T.Cast(io, num[vj])

    return hla2_decode.with_attr(PRESCHEDULED, True)


def chunk_summary(dk: int, dv: int, n: int, *, dtype="float32"):
    """Per chunk c (rows c*n .. c*n+n-1, zero past T):
    dS = K^T K, dC = Q^T V, dm = Q^T 1, dX = K^T (A V), dr = K^T (A 1), A[j, s] = k_j.q_s for j <= s.
    Shapes: q, k [B, H, T, dk], v [B, H, T, dv]; dS [B, H, NC, dk, dk], dC, dX [B, H, NC, dk, dv],
    dm, dr [B, H, NC, dk]."""
    io, acc = dtype, accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)

    @T.prim_func(s_tir=True)
    def hla2_chunk_summary(q_h: T.handle, k_h: T.handle, v_h: T.handle, dS_h: T.handle,
                           dC_h: T.handle, dm_h: T.handle, dX_h: T.handle, dr_h: T.handle):
        B = T.int64()
        H = T.int64()
        L = T.int64()
        NC = T.int64()
        q = T.match_buffer(q_h, (B, H, L, dk), io)
        k = T.match_buffer(k_h, (B, H, L, dk), io)
        v = T.match_buffer(v_h, (B, H, L, dv), io)
        dS = T.match_buffer(dS_h, (B, H, NC, dk, dk), acc)
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
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc")
            _matmul(dS, Kc, Kc, b, hh, c, dk, dk, n, True, "dS")
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


def chunk_carry(dk: int, dv: int, *, masked=True, ridge=0.0, dtype="float32"):
    """Sequential scan over chunks, state (S, C, m, G, h) [B, H, ...] updated in place.

    Before chunk c it records the chunk's readout: Sc[c] = S and
        masked:   Xc[c] = (S + lI) C - G,  rc[c] = (S + lI) m - h
        unmasked: Xc[c] = C,               rc[c] = m
    then X += S dC + dX, r += S dm + dr, S += dS, C += dC, m += dm, with X = S C - G, r = S m - h.
    The schedule (parallel over batch*heads, vectorized rows) is written into the loops."""
    acc = accum_dtype(dtype)
    _c = functools.partial(const, dtype=acc)
    lam = float(ridge)
    msk = 1.0 if masked else 0.0

    @T.prim_func(s_tir=True)
    def hla2_chunk_carry(dS_h: T.handle, dC_h: T.handle, dm_h: T.handle, dX_h: T.handle,
                         dr_h: T.handle, S_h: T.handle, C_h: T.handle, m_h: T.handle,
                         G_h: T.handle, h_h: T.handle, Sc_h: T.handle, Xc_h: T.handle,
                         rc_h: T.handle):
        B = T.int64()
        H = T.int64()
        NC = T.int64()
        dS = T.match_buffer(dS_h, (B, H, NC, dk, dk), acc)
        dC = T.match_buffer(dC_h, (B, H, NC, dk, dv), acc)
        dm = T.match_buffer(dm_h, (B, H, NC, dk), acc)
        dX = T.match_buffer(dX_h, (B, H, NC, dk, dv), acc)
        dr = T.match_buffer(dr_h, (B, H, NC, dk), acc)
        S = T.match_buffer(S_h, (B, H, dk, dk), acc)
        C = T.match_buffer(C_h, (B, H, dk, dv), acc)
        m = T.match_buffer(m_h, (B, H, dk), acc)
        G = T.match_buffer(G_h, (B, H, dk, dv), acc)
        h = T.match_buffer(h_h, (B, H, dk), acc)
        Sc = T.match_buffer(Sc_h, (B, H, NC, dk, dk), acc)
        Xc = T.match_buffer(Xc_h, (B, H, NC, dk, dv), acc)
        rc = T.match_buffer(rc_h, (B, H, NC, dk), acc)
        for bh in T.parallel(B * H):
            X = T.alloc_buffer((dk, dv), acc)
            r = T.alloc_buffer((dk,), acc)
            # X = S C - G, r = S m - h
            for i in T.serial(dk):
                for j in T.vectorized(dv):
                    with T.sblock("X0_init"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vj = T.axis.remap("SS", [i, j])
                        X[vi, vj] = _c(0) - G[vb, vh, vi, vj]
                with T.sblock("r0_init"):
                    vb = T.axis.spatial(B, bh // H)
                    vh = T.axis.spatial(H, bh % H)
                    vi = T.axis.spatial(dk, i)
                    r[vi] = _c(0) - h[vb, vh, vi]
                for l in T.serial(dk):
                    for j in T.vectorized(dv):
                        with T.sblock("X0"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vi, vl, vj = T.axis.remap("SRS", [i, l, j])
                            X[vi, vj] = X[vi, vj] + S[vb, vh, vi, vl] * C[vb, vh, vl, vj]
                    with T.sblock("r0"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vl = T.axis.remap("SR", [i, l])
                        r[vi] = r[vi] + S[vb, vh, vi, vl] * m[vb, vh, vl]
            for c in T.serial(NC):
                # record the chunk's readout
                for i in T.serial(dk):
                    for j in T.vectorized(dk):
                        with T.sblock("Sc"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vc, vi, vj = T.axis.remap("SSS", [c, i, j])
                            Sc[vb, vh, vc, vi, vj] = S[vb, vh, vi, vj]
                    for j in T.vectorized(dv):
                        with T.sblock("Xc"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vc, vi, vj = T.axis.remap("SSS", [c, i, j])
                            Xc[vb, vh, vc, vi, vj] = _c(msk) * X[vi, vj] \
                                + _c(lam * msk + 1.0 - msk) * C[vb, vh, vi, vj]
                    with T.sblock("rc"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vc, vi = T.axis.remap("SS", [c, i])
                        rc[vb, vh, vc, vi] = _c(msk) * r[vi] \
                            + _c(lam * msk + 1.0 - msk) * m[vb, vh, vi]
                # X += S dC + dX, r += S dm + dr
                for i in T.serial(dk):
                    for j in T.vectorized(dv):
                        with T.sblock("X_dX"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vc, vi, vj = T.axis.remap("SSS", [c, i, j])
                            X[vi, vj] = X[vi, vj] + dX[vb, vh, vc, vi, vj]
                    with T.sblock("r_dr"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vc, vi = T.axis.remap("SS", [c, i])
                        r[vi] = r[vi] + dr[vb, vh, vc, vi]
                    for l in T.serial(dk):
                        for j in T.vectorized(dv):
                            with T.sblock("X"):
                                vb = T.axis.spatial(B, bh // H)
                                vh = T.axis.spatial(H, bh % H)
                                vc, vi, vl, vj = T.axis.remap("SSRS", [c, i, l, j])
                                X[vi, vj] = X[vi, vj] + S[vb, vh, vi, vl] * dC[vb, vh, vc, vl, vj]
                        with T.sblock("r"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vc, vi, vl = T.axis.remap("SSR", [c, i, l])
                            r[vi] = r[vi] + S[vb, vh, vi, vl] * dm[vb, vh, vc, vl]
                # S += dS, C += dC, m += dm
                for i in T.serial(dk):
                    for j in T.vectorized(dk):
                        with T.sblock("S"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vc, vi, vj = T.axis.remap("SSS", [c, i, j])
                            S[vb, vh, vi, vj] = S[vb, vh, vi, vj] + dS[vb, vh, vc, vi, vj]
                    for j in T.vectorized(dv):
                        with T.sblock("C"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vc, vi, vj = T.axis.remap("SSS", [c, i, j])
                            C[vb, vh, vi, vj] = C[vb, vh, vi, vj] + dC[vb, vh, vc, vi, vj]
                    with T.sblock("m"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vc, vi = T.axis.remap("SS", [c, i])
                        m[vb, vh, vi] = m[vb, vh, vi] + dm[vb, vh, vc, vi]
            # G = S C - X, h = S m - r
            for i in T.serial(dk):
                for j in T.vectorized(dv):
                    with T.sblock("G_init"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vj = T.axis.remap("SS", [i, j])
                        G[vb, vh, vi, vj] = _c(0) - X[vi, vj]
                with T.sblock("h_init"):
                    vb = T.axis.spatial(B, bh // H)
                    vh = T.axis.spatial(H, bh % H)
                    vi = T.axis.spatial(dk, i)
                    h[vb, vh, vi] = _c(0) - r[vi]
                for l in T.serial(dk):
                    for j in T.vectorized(dv):
                        with T.sblock("G"):
                            vb = T.axis.spatial(B, bh // H)
                            vh = T.axis.spatial(H, bh % H)
                            vi, vl, vj = T.axis.remap("SRS", [i, l, j])
                            G[vb, vh, vi, vj] = G[vb, vh, vi, vj] + S[vb, vh, vi, vl] * C[vb, vh, vl, vj]
                    with T.sblock("h"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vi, vl = T.axis.remap("SR", [i, l])
                        h[vb, vh, vi] = h[vb, vh, vi] + S[vb, vh, vi, vl] * m[vb, vh, vl]

    return hla2_chunk_carry.with_attr(PRESCHEDULED, True)


def chunk_output(dk: int, dv: int, n: int, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, dtype="float32"):
    """Outputs of every chunk from its recorded readout (Sc, Xc, rc of `chunk_carry`):
        masked:   Z = Q (Sc + lI),          M = ((Z Q^T) + (W W^T)) * L,  num = Q Xc + M V
        unmasked: Z = Q (Sc + lI) + W K,    M = (Z Q^T) * L,             num = Z Xc + M V
    W = L * (Q K^T) chunk-local; o = num, or num / (Q rc + M 1 + eps) (Z rc when unmasked).
    Products over the chunk's tokens select s <= t (never 0 * a later token, which is NaN for
    an inf or NaN token), so row t depends on tokens <= t only.
    Shapes: q, k [B, H, T, dk], v [B, H, T, dv], Sc [B, H, NC, dk, dk], Xc [B, H, NC, dk, dv],
    rc [B, H, NC, dk], o [B, H, T, dv]."""
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
        k = T.match_buffer(k_h, (B, H, L, dk), io)
        v = T.match_buffer(v_h, (B, H, L, dv), io)
        Sc = T.match_buffer(Sc_h, (B, H, NC, dk, dk), acc)
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
            _stage(Kc, k, b, hh, c, n, dk, L, "Kc")
            _transpose(KT, Kc, b, hh, c, n, dk, "KT")
            _stage(Vc, v, b, hh, c, n, dv, L, "Vc")
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
                        + Qc[vb, vh, vc, vt, vl] * Sc[vb, vh, vc, vl, vi]
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
