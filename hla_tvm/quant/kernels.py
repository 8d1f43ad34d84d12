"""TensorIR (TE) kernels that read a model's stored weights (packed under a `scheme`, or float32)
in the layout they are stored in (`panels`) and dequantize them where they are used: no float32
copy of a weight exists at run time.

    matmul(x [.., K], q, scale) -> [.., N]      out[.., n] = sum_k x[.., k] * W[k, n]
                                                (bf16: x rounded to bfloat16, `round_bf16`)
    take(q, scale, ids [..])   -> [.., K]       out[.., k] = W[k, clip(id (+ N if < 0), 0, N - 1)]

W[k, n] is `dequantized(k, n)`: a stage of its own (DEQUANTIZE) that the schedule inlines
into a decode step's product, so each stored value is read and decoded in its inner loop; a
prefill's product (several rows) computes it once per column tile, which every row tile then
reads (`schedule.rules.cpu.matmul_tiles`). `panel`: the stored values'
panel width (`compiler.passes.pack_weights.panel_width`), None for the [R, N] layout."""
from __future__ import annotations

from tvm import te, tirx

from ..ops.common.pairs import bits
from .panels import at


def dequantized(sch, q, scale, k, n, group, panel=None):
    """W[k, n] as a TIR expression of the stored values `q` and scales `scale` (te tensors)
    under the scheme `sch` (None: `q` is W in float32), `group` input elements per scale."""
    if sch is None:
        return at(q, k, n, panel)
    if sch.name == "bf16":   # row pairs (`panels.pairs`): the low half for even k
        pair = at(q, k // 2, n, panel)
        return tirx.reinterpret("float32", tirx.Select(
            k % 2 == 0, pair << tirx.const(16, "uint32"), pair & tirx.const(0xFFFF0000, "uint32")))
    value = stored_integer(sch, q, k, n, panel)
    if sch.name == "int4":
        value = value - tirx.const(8.0, "float32")
    return value * scale[k // group, n]


def _nibble(q, k, n, panel):
    """The int4 value u in 0..15 of row k (int32): the low (even k) or high (odd k) nibble of
    byte row k // 2."""
    byte = at(q, k // 2, n, panel).astype("int32")
    # the nibble picked by the row's parity: constant shifts keep the lanes int32 (a shift by
    # an index expression would be widened with the int64 indices)
    return tirx.Select(k % 2 == 0, byte & 15, byte >> 4)


def _in_quad(q, k, n, panel, int4):
    """The unsigned value of row k in the quads `q` (`panels.quads`, uint32 words), int32:
    int8 u = q + 128 in byte k % 4 of word k // 4; int4 u in byte k % 4 of word k // 8, the
    high nibble where k % 8 >= 4."""
    word = at(q, k // 8 if int4 else k // 4, n, panel)
    shift = tirx.Cast("uint32", k % 4) * tirx.const(8, "uint32")
    if int4:
        shift = shift + tirx.Cast("uint32", (k // 4) % 2) * tirx.const(4, "uint32")
    mask = tirx.const(15 if int4 else 255, "uint32")
    return ((word >> shift) & mask).astype("int32")


def stored_integer(sch, q, k, n, panel=None):
    """The stored integer of W[k, n] as float32: the int8 value q (W = q s), or the int4 value
    u in 0..15 (W = (u - 8) s); from either layout (int8 / uint8 rows, or uint32 quads)."""
    if str(q.dtype) == "uint32":   # quads (`panels.quads`)
        u = _in_quad(q, k, n, panel, sch.name == "int4")
        return (u - 128 if sch.name == "int8" else u).astype("float32")
    if sch.name == "int8":
        return at(q, k, n, panel).astype("float32")
    return _nibble(q, k, n, panel).astype("float32")


DEQUANTIZE = "dequantize"   # the weight's stage in `matmul` (schedule.rules.cpu.matmul_tiles)
# block names of `group_matvec`, by which `schedule.rules.cpu.group_matvec` knows it
GROUP_SUM, GROUP_PARTIAL, GROUP_SCALED = "group_sum", "group_partial", "group_scaled"


def group_matvec(x, q, scale, *, sch, k, n, group, panel=None):
    """x [.., 1, K] @ W [K, N] for int8 and int4 weights (one row a batch entry: a decode step)
    with each group's scale, and int4's offset, out of its sum:

        partial[.., g, n] = sum_{k in group g} x[.., k] * v[k, n]       (GROUP_PARTIAL)
        out[.., n]        = sum_g scale[g, n] * (partial[.., g, n] - o * xsum[.., g])
                                                                         (GROUP_SCALED)

    v the stored integers (`stored_integer`); int8: o = 0; int4: o = 8 and xsum[.., g] the sum
    of x over group g (GROUP_SUM). One multiply by a scale a group and column, where `matmul`
    has one a weight; equal to it up to float32 rounding (the sums are grouped)."""
    groups = k // group
    lead = tuple(x.shape[:-1])
    r = te.reduce_axis((0, group), name="k")
    offset = None
    if sch.name == "int4":
        rs = te.reduce_axis((0, group), name="k")
        xsum = te.compute((*lead, groups), lambda *i: te.sum(x[(*i[:-1], i[-1] * group + rs)],
                                                             axis=rs), name=GROUP_SUM)
        offset = tirx.const(8.0, "float32")
    partial = te.compute(
        (*lead, groups, n),
        lambda *i: te.sum(x[(*i[:-2], i[-2] * group + r)] *
                          stored_integer(sch, q, i[-2] * group + r, i[-1], panel), axis=r),
        name=GROUP_PARTIAL)
    g = te.reduce_axis((0, groups), name="g")

    def scaled(*i):
        value = partial[(*i[:-1], g, i[-1])]
        if offset is not None:
            value = value - offset * xsum[(*i[:-1], g)]
        return te.sum(scale[g, i[-1]] * value, axis=g)

    return te.compute((*lead, n), scaled, name=GROUP_SCALED)


def matmul(x, q, scale, *, sch, k, n, group, panel=None, grouped=False):
    """x [.., K] @ W [K, N] with W dequantized in the product (see the module docstring);
    `grouped` (CPUs): `group_matvec` where x has one row a batch entry and W is int8 or int4."""
    rows = x.shape[-2] if len(x.shape) >= 2 else None
    if grouped and panel is not None and sch is not None and sch.name in ("int8", "int4") and \
            isinstance(rows, tirx.IntImm) and int(rows) == 1:
        return group_matvec(x, q, scale, sch=sch, k=k, n=n, group=group, panel=panel)

    w = te.compute((k, n), lambda i, j: dequantized(sch, q, scale, i, j, group, panel),
                   name=DEQUANTIZE)
    if sch is not None and sch.name == "bf16":   # bf16 products take bf16 activations
        x = te.compute(x.shape, lambda *i: round_bf16(x(*i)), name="round_bf16")
    r = te.reduce_axis((0, k), name="k")
    return te.compute((*x.shape[:-1], n),
                      lambda *i: te.sum(x[(*i[:-1], r)] * w[r, i[-1]], axis=r), name="matmul")


def round_bf16(value):
    """The float32 TIR expression `value` rounded to bfloat16 (nearest even), as float32
    (`scheme.activations`): the bits `ops.common.pairs.bits` gives, in the upper half."""
    return tirx.reinterpret("float32", bits(value) << tirx.const(16, "uint32"))


def take(q, scale, ids, *, sch, k, n, group, panel=None):
    """Rows of the table W^T [N, K] (an embedding table stored as the head's [K, N] weight) at
    `ids`: a negative id counts from the end (id + N, as PyTorch indexes a tensor), then ids
    are clamped to 0..N-1 as `compiler.passes.safe_take` clamps a plain lookup."""
    def row(*i):
        idx = ids[i[:-1]].astype("int64")
        idx = tirx.Select(idx < 0, idx + tirx.const(n, "int64"), idx)
        idx = tirx.max(tirx.min(idx, tirx.const(n - 1, "int64")), tirx.const(0, "int64"))
        return dequantized(sch, q, scale, i[-1], idx, group, panel)

    return te.compute((*ids.shape, k), row, name="take")
