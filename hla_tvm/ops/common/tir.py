"""TensorIR pieces shared by the operator kernels: dtypes, constants, chunk staging, products.

Every chunked kernel works on chunks of n rows: buffers indexed [b, h, c, row, col], nested
under one (batch, head, chunk) loop so that the default schedule can run it in parallel."""
from __future__ import annotations

import tvm
from tvm import te
from tvm.script import tirx as T

from .dtypes import IO_DTYPES, accum_dtype  # noqa: F401  (the kernel modules take them here)
from .script_frames import skip_module_scans

skip_module_scans()   # (the kernels' TVMScript parses in a fraction of the time)

# In-place state updates X = f(X) are written as reductions over a unit axis whose init leaves X
# as it is: s_tir then sees a reduction block (the only writer of X, reading its own output),
# so the schedule primitives (parallel, vectorize, tiling) and auto-tuning apply to the
# recurrent kernels as to any other; the init `X = X` compiles to nothing.


def const(value, dtype):
    return tvm.tirx.const(value, dtype)


def load_row(src, vb, vh, vc, vt, vi, n, L, dtype):
    """src[b, h, c*n + t, i] as `dtype`, zero past the end of the sequence (short last chunk)."""
    return T.if_then_else(vc * n + vt < L, T.Cast(dtype, src[vb, vh, vc * n + vt, vi]),
                          const(0, dtype))


@T.macro
def stage(dst, src, b, hh, c, n, width, L, name, group=1):
    """dst[b, h, c, t, i] = src[b, h // group, c*n + t, i] for the chunk's rows (zero past T);
    group > 1 reads key/value head h // group of grouped k, v (`kv_group`)."""
    for t, i in T.grid(n, width):
        with T.sblock(name):
            vb, vh, vc, vt, vi = T.axis.remap("SSSSS", [b, hh, c, t, i])
            dst[vb, vh, vc, vt, vi] = load_row(src, vb, vh // group, vc, vt, vi, n, L,
                                               dst.dtype)


@T.macro
def scale_rows(dst, w, src, b, hh, c, rows, cols, name):
    """dst[b, h, c, s, x] = w[b, h, c, s] src[b, h, c, s, x]: a chunk's rows weighted (decay)."""
    for s, x in T.grid(rows, cols):
        with T.sblock(name):
            vb, vh, vc, vs, vx = T.axis.remap("SSSSS", [b, hh, c, s, x])
            dst[vb, vh, vc, vs, vx] = w[vb, vh, vc, vs] * src[vb, vh, vc, vs, vx]


@T.macro
def transpose(dst, src, b, hh, c, rows, cols, name):
    """dst[b, h, c, i, t] = src[b, h, c, t, i] (rows x cols -> cols x rows)."""
    for i, t in T.grid(cols, rows):
        with T.sblock(name):
            vb, vh, vc, vi, vt = T.axis.remap("SSSSS", [b, hh, c, i, t])
            dst[vb, vh, vc, vi, vt] = src[vb, vh, vc, vt, vi]


@T.macro
def matmul(dst, a, bm, b, hh, c, rows, cols, red, a_transposed, name, causal=False, agroup=1,
           bgroup=1):
    """dst[i, j] = sum_r a[i, r] bm[r, j] for one chunk (a[r, i] when a_transposed); a and bm
    of head h // agroup and h // bgroup (key/value-head buffers of grouped heads).

    causal=True sums over r <= i only, by selection: for a product whose row i is an output
    token and r a token of the same chunk, the later tokens r > i must not reach row i even
    when a[i, r] is zero and bm[r] is inf or NaN (0 * inf is NaN)."""
    for i, j, r in T.grid(rows, cols, red):
        with T.sblock(name):
            vb, vh, vc, vi, vj, vr = T.axis.remap("SSSSSR", [b, hh, c, i, j, r])
            with T.init():
                dst[vb, vh, vc, vi, vj] = const(0, dst.dtype)
            if causal:
                if a_transposed:
                    dst[vb, vh, vc, vi, vj] = dst[vb, vh, vc, vi, vj] + T.Select(
                        vr <= vi, a[vb, vh // agroup, vc, vr, vi] * bm[vb, vh // bgroup, vc, vr, vj],
                        const(0, dst.dtype))
                else:
                    dst[vb, vh, vc, vi, vj] = dst[vb, vh, vc, vi, vj] + T.Select(
                        vr <= vi, a[vb, vh // agroup, vc, vi, vr] * bm[vb, vh // bgroup, vc, vr, vj],
                        const(0, dst.dtype))
            else:
                if a_transposed:
                    dst[vb, vh, vc, vi, vj] = dst[vb, vh, vc, vi, vj] \
                        + a[vb, vh // agroup, vc, vr, vi] * bm[vb, vh // bgroup, vc, vr, vj]
                else:
                    dst[vb, vh, vc, vi, vj] = dst[vb, vh, vc, vi, vj] \
                        + a[vb, vh // agroup, vc, vi, vr] * bm[vb, vh // bgroup, vc, vr, vj]


def gpow(lg, x, dtype):
    """gamma^x as exp(x log gamma) (exactly 1 for gamma = 1)."""
    return T.exp(lg * T.Cast(dtype, x))


@T.macro
def powers(pw, g, b, hh, c, count):
    """pw[b, h, c, d] = g[h]^d for d < count: the chunk's decay powers, computed once so that
    element-wise stages index them instead of calling exp per element."""
    for d in T.serial(count):
        with T.sblock("pw"):
            vb, vh, vc, vd = T.axis.remap("SSSS", [b, hh, c, d])
            pw[vb, vh, vc, vd] = gpow(T.log(g[vh]), vd, pw.dtype)


def chunk_len(c, n, L):
    """Rows of chunk c: n, or fewer for the last chunk."""
    return T.min(T.int64(n), L - c * n)


def chunk_scan(width: int, dtype="float32", *, group=1, decayed=True):
    """Sequential scan over chunks of an element-wise linear recurrence, state X [B, H, width]
    updated in place:  Xc[c] = X;  X = gl[c] X + dX[c]   (gl: the chunk's decay gamma^len, of
    head h // group: the key/value head's, shared by its group; decayed=False: gl = 1, no gl).

    Every HLA state that is not a plain prefix sum advances this way once its cross-term
    increments dX are known, so the sequential work of a prefill is element-wise only."""
    acc = accum_dtype(dtype)

    @T.macro
    def steps(X, dX, gl, Xc, b, h, NC, group, decayed):
        """Chunk by chunk: Xc[c] = X, then X = gl[c] X + dX[c] (X + dX[c] without decay)."""
        for c in T.serial(NC):
            for i in T.serial(width):
                with T.sblock("record"):
                    vb, vh, vc, vi = T.axis.remap("SSSS", [b, h, c, i])
                    Xc[vb, vh, vc, vi] = X[vb, vh, vi]
            for i in T.serial(width):
                with T.sblock("advance"):   # a fold over the chunks, in place on X
                    vb, vh, vi, vc = T.axis.remap("SSSR", [b, h, i, c])
                    with T.init():
                        X[vb, vh, vi] = X[vb, vh, vi]
                    if decayed:
                        X[vb, vh, vi] = gl[vb, vh // group, vc] * X[vb, vh, vi] \
                            + dX[vb, vh, vc, vi]
                    else:
                        X[vb, vh, vi] = X[vb, vh, vi] + dX[vb, vh, vc, vi]

    @T.prim_func(s_tir=True)
    def scan(X_h: T.handle, dX_h: T.handle, gl_h: T.handle, Xc_h: T.handle):
        B = T.int64()
        H = T.int64()
        NC = T.int64()
        X = T.match_buffer(X_h, (B, H, width), acc)
        dX = T.match_buffer(dX_h, (B, H, NC, width), acc)
        gl = T.match_buffer(gl_h, (B, H // group, NC), acc)
        Xc = T.match_buffer(Xc_h, (B, H, NC, width), acc)
        for b, h in T.grid(B, H):
            steps(X, dX, gl, Xc, b, h, NC, group, True)

    @T.prim_func(s_tir=True)
    def prefix_sum(X_h: T.handle, dX_h: T.handle, Xc_h: T.handle):
        B = T.int64()
        H = T.int64()
        NC = T.int64()
        X = T.match_buffer(X_h, (B, H, width), acc)
        dX = T.match_buffer(dX_h, (B, H, NC, width), acc)
        Xc = T.match_buffer(Xc_h, (B, H, NC, width), acc)
        for b, h in T.grid(B, H):
            steps(X, dX, None, Xc, b, h, NC, 1, False)

    return scan if decayed else prefix_sum


@T.macro
def decay_weights(tail, gl, g, b, hh, c, n, L):
    """tail[s] = g^(len-1-s) for the chunk's rows s < len (0 past it), gl = g^len."""
    for s in T.serial(n):
        with T.sblock("tail"):
            vb, vh, vc, vs = T.axis.remap("SSSS", [b, hh, c, s])
            tail[vb, vh, vc, vs] = T.Select(
                T.Cast("int64", vs) < chunk_len(vc, n, L),
                gpow(T.log(g[vh]), chunk_len(vc, n, L) - 1 - T.Cast("int64", vs), tail.dtype),
                const(0, tail.dtype))
    with T.sblock("gl"):
        vb, vh, vc = T.axis.remap("SSS", [b, hh, c])
        gl[vb, vh, vc] = gpow(T.log(g[vh]), chunk_len(vc, n, L), gl.dtype)


@T.macro
def load_token(qa, ka, va, q, k, v, b, h, dk, dv, group):
    """qa, ka, va = the (b, h) token of q [B, H, 1, .] and of k, v [B, H / group, 1, .] (key/value
    head h // group) in the accumulation dtype."""
    for i in T.serial(dk):
        with T.sblock("qk"):
            vb, vh, vi = T.axis.remap("SSS", [b, h, i])
            qa[vi] = T.Cast(qa.dtype, q[vb, vh, 0, vi])
            ka[vi] = T.Cast(ka.dtype, k[vb, vh // group, 0, vi])
    for j in T.serial(dv):
        with T.sblock("va"):
            vb, vh, vj = T.axis.remap("SSS", [b, h, j])
            va[vj] = T.Cast(va.dtype, v[vb, vh // group, 0, vj])


@T.macro
def update_row(X, g, a, bv, b, h, i, cols, name):
    """Row i of X[b, h] = g[h] X[b, h] + a bv^T, in place."""
    for j in T.serial(cols):
        with T.sblock(name):
            vu = T.axis.reduce(1, 0)   # in place (see the note at the top)
            vb, vh, vi, vj = T.axis.remap("SSSS", [b, h, i, j])
            with T.init():
                X[vb, vh, vi, vj] = X[vb, vh, vi, vj]
            X[vb, vh, vi, vj] = g[vh] * X[vb, vh, vi, vj] + a[vi] * bv[vj]


@T.macro
def update_outer(X, g, a, bv, b, h, rows, cols, name):
    """X[b, h] = g[h] X[b, h] + a bv^T, in place."""
    for i in T.serial(rows):
        update_row(X, g, a, bv, b, h, i, cols, name)


@T.macro
def update_axpy(X, g, a, scale, b, h, rows, name):
    """X[b, h] = g[h] X[b, h] + scale a, in place."""
    for i in T.serial(rows):
        with T.sblock(name):
            vu = T.axis.reduce(1, 0)   # in place (see the note at the top)
            vb, vh, vi = T.axis.remap("SSS", [b, h, i])
            with T.init():
                X[vb, vh, vi] = X[vb, vh, vi]
            X[vb, vh, vi] = g[vh] * X[vb, vh, vi] + scale * a[vi]


@T.macro
def vecmat_row(y, x, X, b, h, i, cols, name):
    """Row i's share of y[j] = sum_i x[i] X[b, h, i, j] (y = 0 before row 0)."""
    for j in T.serial(cols):
        with T.sblock(name):
            vb, vh, vi, vj = T.axis.remap("SSRS", [b, h, i, j])
            with T.init():
                y[vj] = const(0, y.dtype)
            y[vj] = y[vj] + x[vi] * X[vb, vh, vi, vj]


@T.macro
def vecmat(y, x, X, b, h, rows, cols, name):
    """y[j] = sum_i x[i] X[b, h, i, j]."""
    for i in T.serial(rows):
        vecmat_row(y, x, X, b, h, i, cols, name)


@T.macro
def vecdot(y, x, X, b, h, rows, name):
    """y[0] = sum_i x[i] X[b, h, i] (a plain sum, so that a GPU sums it across threads)."""
    for i in T.serial(rows):
        with T.sblock(name):
            vb, vh, vi = T.axis.remap("SSR", [b, h, i])
            with T.init():
                y[0] = const(0, y.dtype)
            y[0] = y[0] + x[vi] * X[vb, vh, vi]


@T.macro
def write_token(o, num, den, b, h, dv, normalize, eps):
    """o[b, h, 0] = num (/ (den[0] + eps) when normalize) in o's dtype."""
    for j in T.serial(dv):
        with T.sblock("o"):
            vb, vh, vj = T.axis.remap("SSS", [b, h, j])
            if normalize:
                o[vb, vh, 0, vj] = T.Cast(o.dtype, num[vj] / (den[0] + const(eps, den.dtype)))
            else:
                o[vb, vh, 0, vj] = T.Cast(o.dtype, num[vj])


@T.macro
def cross_step(P, m, E, n, g, qa, ka, va, x, o, b, h, dk, dv, eps, normalize):
    """One token of the recurrence AHLA and third order share, state updated in place:
    P = gP + k v^T, m = gm + k, E = gE + x (q^T P), n = gn + (q.m) x (P, m after the token);
    o = q^T E [/ (q.n + eps)]. AHLA: x = k; third order: x = S q (E = F, n = eta)."""
    qP = T.alloc_buffer((dv,), P.dtype)
    num = T.alloc_buffer((dv,), P.dtype)
    qm = T.alloc_buffer((1,), P.dtype)
    den = T.alloc_buffer((1,), P.dtype)
    update_outer(P, g, ka, va, b, h, dk, dv, "P")
    vecmat(qP, qa, P, b, h, dk, dv, "qP")
    update_axpy(m, g, ka, const(1, P.dtype), b, h, dk, "m")
    vecdot(qm, qa, m, b, h, dk, "qm")
    update_outer(E, g, x, qP, b, h, dk, dv, "E")
    vecmat(num, qa, E, b, h, dk, dv, "num")
    update_axpy(n, g, x, qm[0], b, h, dk, "n")
    vecdot(den, qa, n, b, h, dk, "den")
    write_token(o, num, den, b, h, dv, normalize, eps)


@T.macro
def matvec(dst, a, x, b, hh, c, rows, red, a_transposed, name, agroup=1, xgroup=1):
    """dst[i] = sum_r a[i, r] x[r] for one chunk (a[r, i] when a_transposed); a and x of head
    h // agroup and h // xgroup."""
    for i, r in T.grid(rows, red):
        with T.sblock(name):
            vb, vh, vc, vi, vr = T.axis.remap("SSSSR", [b, hh, c, i, r])
            with T.init():
                dst[vb, vh, vc, vi] = const(0, dst.dtype)
            if a_transposed:
                dst[vb, vh, vc, vi] = dst[vb, vh, vc, vi] \
                    + a[vb, vh // agroup, vc, vr, vi] * x[vb, vh // xgroup, vc, vr]
            else:
                dst[vb, vh, vc, vi] = dst[vb, vh, vc, vi] \
                    + a[vb, vh // agroup, vc, vi, vr] * x[vb, vh // xgroup, vc, vr]


@T.macro
def cross_sums(ddX, ddx, K, Y, y, Z, z, X, x, Yout, yout, w, b, hh, c, n, dk, dv):
    """One chunk's cross-term increments summed with its n tokens inside, the products Y [n, dv]
    and y [n] (scratch) kept in Yout, yout for the output kernel:
        ddX = K^T (w Y + Z),  ddx = K^T (w y + z)   (w = w[b, h, c], X, x scratch)."""
    for t, j in T.grid(n, dv):
        with T.sblock("keep_Y"):
            vb, vh, vc, vt, vj = T.axis.remap("SSSSS", [b, hh, c, t, j])
            Yout[vb, vh, vc, vt, vj] = Y[vb, vh, vc, vt, vj]
    for t in T.serial(n):
        with T.sblock("keep_y"):
            vb, vh, vc, vt = T.axis.remap("SSSS", [b, hh, c, t])
            yout[vb, vh, vc, vt] = y[vb, vh, vc, vt]
    for t, j in T.grid(n, dv):
        with T.sblock("X"):
            vb, vh, vc, vt, vj = T.axis.remap("SSSSS", [b, hh, c, t, j])
            X[vb, vh, vc, vt, vj] = w[vb, vh, vc] * Y[vb, vh, vc, vt, vj] \
                + Z[vb, vh, vc, vt, vj]
    for t in T.serial(n):
        with T.sblock("x"):
            vb, vh, vc, vt = T.axis.remap("SSSS", [b, hh, c, t])
            x[vb, vh, vc, vt] = w[vb, vh, vc] * y[vb, vh, vc, vt] + z[vb, vh, vc, vt]
    matmul(ddX, K, X, b, hh, c, dk, dv, n, True, "ddX")
    matvec(ddx, K, x, b, hh, c, dk, n, True, "ddx")


def zero_state(tails, dtype="float32"):
    """PrimFunc (q [B, H, T, D], *out): out[i] [B, H, *tails[i]] = 0. It takes q so that
    constant folding cannot turn the zeros into module constants (the kernels update state in
    place, and an in-place update of a constant would leak into the next call)."""
    q = te.placeholder([te.var(n, "int64") for n in ("B", "H", "L", "D")], dtype, name="q")
    # batch and heads of each output are its own (key/value-only entries have fewer heads)
    outs = [te.compute((te.var(f"B{j}", "int64"), te.var(f"H{j}", "int64"),
                        *[tvm.tirx.IntImm("int64", d) for d in tail]),
                       lambda *i: tvm.tirx.const(0, dtype), name=f"zero{j}")
            for j, tail in enumerate(tails)]
    return te.create_prim_func([q, *outs])
