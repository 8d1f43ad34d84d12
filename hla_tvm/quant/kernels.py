"""TensorIR (TE) kernels that read a model's stored weights (packed under a `scheme`, or float32)
in the layout they are stored in (`panels`) and dequantize them where they are used: no float32
copy of a weight exists at run time.

    matmul(x [.., K], q, scale) -> [.., N]      out[.., n] = sum_k x[.., k] * W[k, n]
    take(q, scale, ids [..])   -> [.., K]       out[.., k] = W[k, clip(id, 0, N - 1)]

W[k, n] is `dequantized(k, n)`: a stage of its own ("dequantize") that the schedule inlines
into the product (`schedule.rules.cpu.matmul_tiles` inlines element-wise producers), so each
stored value is read and decoded in the product's inner loop. `panel`: the stored values'
panel width (`frontend.pack_weights.panel_width`), None for the [R, N] layout."""
from __future__ import annotations


def dequantized(sch, q, scale, k, n, group, panel=None):
    """W[k, n] as a TIR expression of the stored values `q` and scales `scale` (te tensors)
    under the scheme `sch` (None: `q` is W in float32), `group` input elements per scale."""
    from tvm import tirx

    from .panels import at

    if sch is None:
        return at(q, k, n, panel)
    if sch.name == "bf16":
        return tirx.reinterpret("float32", at(q, k, n, panel).astype("uint32")
                                << tirx.const(16, "uint32"))
    if sch.name == "int8":
        value = at(q, k, n, panel).astype("float32")
    else:   # int4: row k in the low (even k) or high (odd k) nibble of byte row k // 2
        byte = at(q, k // 2, n, panel).astype("int32")
        # the nibble picked by the row's parity: constant shifts keep the lanes int32 (a shift
        # by an index expression would be widened with the int64 indices)
        nibble = tirx.Select(k % 2 == 0, byte & 15, byte >> 4)
        value = nibble.astype("float32") - tirx.const(8.0, "float32")
    return value * scale[k // group, n]


def matmul(x, q, scale, *, sch, k, n, group, panel=None):
    """x [.., K] @ W [K, N] with W dequantized in the product (see the module docstring)."""
    from tvm import te

    w = te.compute((k, n), lambda i, j: dequantized(sch, q, scale, i, j, group, panel),
                   name="dequantize")
    r = te.reduce_axis((0, k), name="k")
    return te.compute((*x.shape[:-1], n),
                      lambda *i: te.sum(x[(*i[:-1], r)] * w[r, i[-1]], axis=r), name="matmul")


def take(q, scale, ids, *, sch, k, n, group, panel=None):
    """Rows of the table W^T [N, K] (an embedding table stored as the head's [K, N] weight) at
    `ids`, clamped to 0..N-1 as `frontend.safe_take` clamps a plain lookup."""
    from tvm import te, tirx

    def row(*i):
        idx = tirx.max(tirx.min(ids[i[:-1]].astype("int64"), tirx.const(n - 1, "int64")),
                       tirx.const(0, "int64"))
        return dequantized(sch, q, scale, i[-1], idx, group, panel)

    return te.compute((*ids.shape, k), row, name="take")
