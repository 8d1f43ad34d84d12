"""TensorIR (TE) kernels that read packed weights (`scheme`) and dequantize them where they
are used: no float32 copy of a weight exists at run time.

    matmul(x [.., K], q, scale) -> [.., N]      out[.., n] = sum_k x[.., k] * W[k, n]
    take(q, scale, ids [..])   -> [.., K]       out[.., k] = W[k, clip(id, 0, N - 1)]

W[k, n] is `dequantized(k, n)`: a stage of its own ("dequantize") that the schedule inlines
into the product (`schedule.rules.cpu.matmul_tiles` inlines element-wise producers), so each
packed value is read and decoded in the product's inner loop."""
from __future__ import annotations


def dequantized(sch, q, scale, k, n, group):
    """W[k, n] as a TIR expression of the packed values `q` and scales `scale` (te tensors)
    under the scheme `sch`, `group` input elements per scale."""
    from tvm import tirx

    if sch.name == "bf16":
        return tirx.reinterpret("float32", q[k, n].astype("uint32") << tirx.const(16, "uint32"))
    if sch.name == "int8":
        value = q[k, n].astype("float32")
    else:   # int4: row k in the low (even k) or high (odd k) nibble of byte row k // 2
        byte = q[k // 2, n].astype("int32")
        # the nibble picked by the row's parity: constant shifts keep the lanes int32 (a shift
        # by an index expression would be widened with the int64 indices)
        nibble = tirx.Select(k % 2 == 0, byte & 15, byte >> 4)
        value = nibble.astype("float32") - tirx.const(8.0, "float32")
    return value * scale[k // group, n]


def matmul(x, q, scale, *, sch, k, n, group):
    """x [.., K] @ W [K, N] with W dequantized in the product (see the module docstring)."""
    from tvm import te

    w = te.compute((k, n), lambda i, j: dequantized(sch, q, scale, i, j, group),
                   name="dequantize")
    r = te.reduce_axis((0, k), name="k")
    return te.compute((*x.shape[:-1], n),
                      lambda *i: te.sum(x[(*i[:-1], r)] * w[r, i[-1]], axis=r), name="matmul")


def take(q, scale, ids, *, sch, k, n, group):
    """Rows of the table W^T [N, K] (an embedding table stored as the head's [K, N] weight) at
    `ids`, clamped to 0..N-1 as `frontend.safe_take` clamps a plain lookup."""
    from tvm import te, tirx

    def row(*i):
        idx = tirx.max(tirx.min(ids[i[:-1]].astype("int64"), tirx.const(n - 1, "int64")),
                       tirx.const(0, "int64"))
        return dequantized(sch, q, scale, i[-1], idx, group)

    return te.compute((*ids.shape, k), row, name="take")
