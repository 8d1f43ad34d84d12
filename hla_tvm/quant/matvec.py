"""One stream's decode-step product with float32 or bf16 stored weights, x [1, K] float32 @ W
[K, N] -> out [1, N] float32, reading the weights in panels (`panels`) with software prefetch:

    out[n] = sum_k x[k] W[k, n]          (bf16: x rounded to bfloat16, `kernels.round_bf16`;
                                          W from row pairs, `panels.pairs`)

Loops (`matvec_func`): for each panel of P columns (parallel): K in steps of 4 weight rows
(bf16: 4 row pairs), P / lanes vector sums in registers, each step asking the cache for the
weights PREFETCH bytes ahead (not on AMD Zen: `prefetch_bytes`); the sums run over k in order.
Several rows keep the scheduled TE product (`schedule.rules.cpu.matmul_tiles`, which shares a
weight's conversion between rows); a decode step of one stream (`compiler.with_decode_one`:
static shapes) takes this one.

Measured on the Xeon VM (2 cores, 2026-12-07), 768 x 6144 (the 120 M preset's gate and up
projection), weights cold as in a decode step (100 MB of copies in turn), fastest of 5: bf16
543-555 us scheduled, 425 us here without the prefetch, 350 us with it (equal outputs);
float32 812 -> 709 us."""
from __future__ import annotations

from tvm.script import tirx as T

from ..ops.common.pairs import bits

PREFETCH = 8192   # bytes of weights ahead of the step being summed that it asks the cache for
STEP = 4          # weight rows (bf16: row pairs) a step


def prefetch_bytes(target):
    """The bytes ahead that a decode step's products (these and `vnni`'s) ask the cache for on
    `target`: PREFETCH, or 0 (no prefetch instructions) on AMD Zen, whose own prefetchers
    stream the panels faster alone. Measured on the Zen 4 VM (2 cores, 2026-12-07), 768 x 6144
    with the weights cold, fastest of 7 rounds: float32 807 us with the prefetch, 703 without;
    bf16 401 / 361; int8 (`vnni`) 240 / 181. On the Xeon VM the prefetch made int8 1.5x
    faster (module docstring, `vnni`)."""
    mcpu = str(target.attrs.get("mcpu", "") or "")
    return 0 if mcpu.startswith("znver") else PREFETCH


def prefetch(flat, index, last):
    """The TIR call asking the cache for element `index` of the flat buffer `flat` (clamped to
    its last element `last`: a prefetch past a weight's end reads nothing of use)."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0",
                              T.address_of(flat[T.min(index, last)]),
                              T.uint32(0), T.uint32(3), T.uint32(1))   # read, keep, data


def fits(sch, k, n, panel, lanes):
    """Whether the float32 (`sch` None) or bf16 weight [K = `k`, N = `n`] in panels of `panel`
    columns takes the kernel: K in whole steps, the panel in whole vectors of `lanes`."""
    if panel is None or n % panel or panel % lanes:
        return False
    if sch is None:
        return k % STEP == 0
    return sch.name == "bf16" and k % (2 * STEP) == 0


def matvec_func(sch, k, n, panel, lanes, name="matvec", ahead=PREFETCH):
    """The PrimFunc (x [1, K] float32, q (float32 [N / P, K, P], or bf16 pairs uint32
    [N / P, K / 2, P]), out [1, N] float32) computing out as the module docstring says, asking
    the cache for the weights `ahead` bytes on (none where 0, `prefetch_bytes`); scheduled
    already."""
    assert fits(sch, k, n, panel, lanes), (sch, k, n, panel, lanes)
    bf16 = sch is not None
    p, lw = panel, lanes
    rows = k // 2 if bf16 else k   # rows of q a panel
    total = n // p * rows * p
    fvec = f"float32x{lw}"
    lines = STEP * p * 4 // 64 if ahead else 0   # cache lines of a step asked for
    ahead = ahead // 4   # elements of q
    dtype = "uint32" if bf16 else "float32"

    def weight(q, jb, row, col, high):
        """W's lanes of one weight row (bf16: the row pair's low or high half, as float32)."""
        if not bf16:
            return q[jb, row, T.ramp(col, 1, lw)]
        word = q[jb, row, T.ramp(col, 1, lw)]
        half = T.bitwise_and(word, T.broadcast(T.uint32(0xFFFF0000), lw)) if high else \
            T.shift_left(word, T.broadcast(T.uint32(16), lw))
        return T.reinterpret(fvec, half)

    @T.prim_func
    def func(x: T.Buffer((1, k), "float32"), q: T.Buffer((n // p, rows, p), dtype),
             out: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True})
        qf = T.decl_buffer((total,), dtype, data=q.data)
        xb = T.decl_buffer((k,), "float32")   # x as the products take it
        for i in range(k):
            if bf16:
                xb[i] = T.reinterpret("float32", bits(x[0, i]) << T.uint32(16))
            else:
                xb[i] = x[0, i]
        for jb in T.parallel(n // p):
            sums = T.decl_buffer((p,), "float32")
            for c in T.vectorized(p):
                sums[c] = T.float32(0)
            for ko in range(rows // STEP):
                if lines > 0:   # (a Python bool: no loop at all without the prefetch)
                    for line in T.unroll(lines):
                        T.evaluate(prefetch(qf, (jb * rows + ko * STEP) * p + ahead +
                                            line * 16, total - 1))
                for ki in T.unroll(STEP):
                    for v in T.unroll(p // lw):
                        if bf16:
                            sums[T.ramp(v * lw, 1, lw)] = sums[T.ramp(v * lw, 1, lw)] + \
                                T.broadcast(xb[(ko * STEP + ki) * 2], lw) * \
                                weight(q, jb, ko * STEP + ki, v * lw, False) + \
                                T.broadcast(xb[(ko * STEP + ki) * 2 + 1], lw) * \
                                weight(q, jb, ko * STEP + ki, v * lw, True)
                        else:
                            sums[T.ramp(v * lw, 1, lw)] = sums[T.ramp(v * lw, 1, lw)] + \
                                T.broadcast(xb[ko * STEP + ki], lw) * \
                                weight(q, jb, ko * STEP + ki, v * lw, False)
            for c in T.vectorized(p):
                out[0, jb * p + c] = sums[c]

    return func.with_attr({"global_symbol": name, "tirx.is_scheduled": True})
