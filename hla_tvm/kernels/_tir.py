"""TensorIR pieces shared by the operator kernels: dtypes, constants, chunk staging, products.

Every chunked kernel works on chunks of n rows: buffers indexed [b, h, c, row, col], nested
under one (batch, head, chunk) loop so that the default schedule can run it in parallel."""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

# attribute of functions whose loops already carry their CPU schedule (in-place state updates)
PRESCHEDULED = "hla_tvm.prescheduled"

IO_DTYPES = ("float16", "bfloat16", "float32", "float64")


def accum_dtype(dtype):
    """State and accumulation dtype for inputs of `dtype`: float64 stays, the rest use float32."""
    if dtype not in IO_DTYPES:
        raise ValueError(f"kernel dtype must be one of {IO_DTYPES}, got {dtype!r}")
    return "float64" if dtype == "float64" else "float32"


def const(value, dtype):
    return tvm.tirx.const(value, dtype)


def load_row(src, vb, vh, vc, vt, vi, n, L, dtype):
    """src[b, h, c*n + t, i] as `dtype`, zero past the end of the sequence (short last chunk)."""
    return T.if_then_else(vc * n + vt < L, T.Cast(dtype, src[vb, vh, vc * n + vt, vi]),
                          const(0, dtype))


@T.macro
def stage(dst, src, b, hh, c, n, width, L, name):
    """dst[b, h, c, t, i] = src[b, h, c*n + t, i] for the chunk's rows (zero past T)."""
    for t, i in T.grid(n, width):
        with T.sblock(name):
            vb, vh, vc, vt, vi = T.axis.remap("SSSSS", [b, hh, c, t, i])
            dst[vb, vh, vc, vt, vi] = load_row(src, vb, vh, vc, vt, vi, n, L, dst.dtype)


@T.macro
def transpose(dst, src, b, hh, c, rows, cols, name):
    """dst[b, h, c, i, t] = src[b, h, c, t, i] (rows x cols -> cols x rows)."""
    for i, t in T.grid(cols, rows):
        with T.sblock(name):
            vb, vh, vc, vi, vt = T.axis.remap("SSSSS", [b, hh, c, i, t])
            dst[vb, vh, vc, vi, vt] = src[vb, vh, vc, vt, vi]


@T.macro
def matmul(dst, a, bm, b, hh, c, rows, cols, red, a_transposed, name):
    """dst[i, j] = sum_r a[i, r] bm[r, j] for one chunk (a[r, i] when a_transposed)."""
    for i, j, r in T.grid(rows, cols, red):
        with T.sblock(name):
            vb, vh, vc, vi, vj, vr = T.axis.remap("SSSSSR", [b, hh, c, i, j, r])
            with T.init():
                dst[vb, vh, vc, vi, vj] = const(0, dst.dtype)
            if a_transposed:
                dst[vb, vh, vc, vi, vj] = dst[vb, vh, vc, vi, vj] \
                    + a[vb, vh, vc, vr, vi] * bm[vb, vh, vc, vr, vj]
            else:
                dst[vb, vh, vc, vi, vj] = dst[vb, vh, vc, vi, vj] \
                    + a[vb, vh, vc, vi, vr] * bm[vb, vh, vc, vr, vj]


def gpow(lg, x, dtype):
    """gamma^x as exp(x log gamma) (exactly 1 for gamma = 1)."""
    return T.exp(lg * T.Cast(dtype, x))


def chunk_len(c, n, L):
    """Rows of chunk c: n, or fewer for the last chunk."""
    return T.min(T.int64(n), L - c * n)


def chunk_scan(width: int, dtype="float32"):
    """Sequential scan over chunks of an element-wise linear recurrence, state X [B, H, width]
    updated in place:  Xc[c] = X;  X = gl[c] X + dX[c]   (gl: the chunk's decay gamma^len).

    Every HLA state that is not a plain prefix sum advances this way once its cross-term
    increments dX are known, so the sequential work of a prefill is element-wise only."""
    acc = accum_dtype(dtype)

    @T.prim_func(s_tir=True)
    def scan(X_h: T.handle, dX_h: T.handle, gl_h: T.handle, Xc_h: T.handle):
        B = T.int64()
        H = T.int64()
        NC = T.int64()
        X = T.match_buffer(X_h, (B, H, width), acc)
        dX = T.match_buffer(dX_h, (B, H, NC, width), acc)
        gl = T.match_buffer(gl_h, (B, H, NC), acc)
        Xc = T.match_buffer(Xc_h, (B, H, NC, width), acc)
        for bh in T.parallel(B * H):
            for c in T.serial(NC):
                for i in T.vectorized(width):
                    with T.sblock("scan"):
                        vb = T.axis.spatial(B, bh // H)
                        vh = T.axis.spatial(H, bh % H)
                        vc, vi = T.axis.remap("SS", [c, i])
                        Xc[vb, vh, vc, vi] = X[vb, vh, vi]
                        X[vb, vh, vi] = gl[vb, vh, vc] * X[vb, vh, vi] + dX[vb, vh, vc, vi]

    return scan.with_attr(PRESCHEDULED, True)
