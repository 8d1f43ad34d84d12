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
