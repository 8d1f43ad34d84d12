"""A prefill's bf16 product by output blocks: x [M, K] float32 @ W [K, N] stored in bfloat16
pairs, float32 out, bfloat16 products accumulated in float32:

    out[m, n] = sum_k bf16(x[m, k]) * W[k, n]          bf16(): round to nearest even

W is the bf16 scheme's stored weight in row pairs in panels (`panels.pairs`, `panels.to_panels`):
q[n // P, r, n % P] holds W[2r, n] in its low half and W[2r + 1, n] in its high half, so a pair
row of a block of columns is contiguous (a pair row every 4 P bytes).

`matmul_func` (symbolic M) is the part every such kernel shares:
    xb[M', K] = bf16(x), M' = M rounded up to `rows` (the rest zero)       (parallel rows)
    for each block of `cols` columns (parallel): for each block of `rows` rows:
        out[rows, cols] = xb[rows] @ W[:, cols]      (the microkernel; the last rows through a
                                                      scratch block)
The column block's slice of the weight stays in cache while the rows stream by. The microkernel
is LLVM IR linked into the module (`pragma_import_llvm`), called as
    kernel(c, ldc floats, a, lda elements, b, ldb bytes, steps)
with c the block's first output, a its first bf16 row, b its first pair row, and `steps` its K
steps: `quant.amx` (AMX tiles, 32 x 32) and `quant.dpbf16` (VDPBF16PS, AVX512-BF16).

int8 and int4 weights (in quads, `panels.quads`) take the same kernels: each column block first
writes its K x `cols` slice as bfloat16 pairs of W = (u - o) s into a scratch of its own
(`dequantized_pairs`, a few hundred KB that stay in L2 while the rows stream by), then runs the
microkernel on it, so the activations and the scaled weights round to bfloat16 as the bf16
scheme's do. On the Zen 4 VM (2 cores, 2026-12-07, another process busy), 512 x 768 x 6144:
int8 34-40 ms against 28-38 ms for the bf16 scheme's stored pairs in the same runs; its 6 rows
alone (the slice's conversion, most of it) 1.3 ms."""
from __future__ import annotations

from tvm.script import tirx as T
from tvm.target import codegen

from ..ops.common.pairs import bits
from .kernels import dequantized

LANES = 16   # the rows' conversion to bfloat16: vectors of 16 inputs


def has_features(target, features):
    """Whether code for the llvm `target` may use every one of `features` (LLVM's names)."""
    if target.kind.name != "llvm":
        return False
    try:
        return all(codegen.target_has_features(f, target) for f in features)
    except Exception:  # noqa: BLE001 - a target LLVM cannot query
        return False


def fits(k, n, panel, *, step, cols):
    """Whether a weight [K = `k`, N = `n`] stored in panels of `panel` columns takes a kernel
    of K `step` and `cols` columns: K in whole steps and conversion vectors (LANES), N and the
    panel in whole column blocks."""
    return panel is not None and k % step == 0 and k % LANES == 0 and n % cols == 0 and \
        panel % cols == 0


def matmul_func(k, n, panel, name, *, rows, cols, step, llvm_ir, kernel, init=None,
                init_error="", sch=None):
    """The PrimFunc (x [M, K] float32, q [N / P, K / 2, P] uint32, out [M, N] float32, xb [M',
    K] uint16 scratch), M symbolic, that computes out = bf16(x) @ W through the microkernel
    `kernel` of `llvm_ir` (the module docstring); scheduled already (TVM's rules leave it as it
    is). `init`: a function of `llvm_ir` called first, which must return 1 (else the function
    stops with `init_error`), as AMX asks the OS for its tiles. With `sch` (int8 or int4) q is
    that scheme's integers in quads (`panels.quads`, [N / P, K / 4 or K / 8, P]) and a scale
    [K / g, N] float32 follows it: each block of columns first writes its K x `cols` slice of
    W as bfloat16 pairs into a scratch of its own (`dequantized_pairs`)."""
    assert fits(k, n, panel, step=step, cols=cols), (k, n, panel)
    blocks, p, lanes = n // cols, panel, LANES
    ROWS, COLS = rows, cols
    g = None if sch is None else sch.group(k)
    pair = None if sch is None else dequantized_pairs(sch)

    @T.macro
    def to_bf16(x, xb, m):
        """xb = bf16(x), the rows past M zero (parallel over blocks of rows)."""
        if init is not None:   # (decided as the function is parsed)
            ready = T.decl_buffer((1,), "int32")
            ready[0] = T.call_extern("int32", init)
            assert ready[0] == 1, init_error
        for io in T.parallel((m + ROWS - 1) // ROWS):
            for ii in range(ROWS):
                if io * ROWS + ii < m:
                    for ko in range(k // lanes):
                        for ki in T.vectorized(lanes):
                            # (an expression, no let: a let's value in a vectorized loop
                            # came out as one lane's)
                            xb[io * ROWS + ii, ko * lanes + ki] = T.Cast(
                                "uint16", bits(x[io * ROWS + ii, ko * lanes + ki]))
                else:
                    for kk in T.vectorized(k):
                        xb[io * ROWS + ii, kk] = T.uint16(0)

    @T.macro
    def column_block(out, xb, m, jb, w, ldb):
        """out[:, block jb] = xb @ the block's pairs at address `w` (a pair row every `ldb`
        bytes)."""
        c = T.decl_buffer((ROWS, COLS), "float32", align=64)   # the last rows' block
        for ib in range((m + ROWS - 1) // ROWS):
            if ib * ROWS + ROWS <= m:   # a whole block: its sums straight into `out`
                T.evaluate(T.call_extern(
                    "int32", kernel, T.address_of(out[ib * ROWS, jb * COLS]), T.int64(n),
                    T.address_of(xb[ib * ROWS, 0]), T.int64(k), w, T.int64(ldb),
                    T.int64(k // step)))
            else:
                T.evaluate(T.call_extern(
                    "int32", kernel, c.data, T.int64(COLS), T.address_of(xb[ib * ROWS, 0]),
                    T.int64(k), w, T.int64(ldb), T.int64(k // step)))
        for r in range(m % ROWS):
            for j in T.vectorized(COLS):
                out[m - m % ROWS + r, jb * COLS + j] = c[r, j]

    @T.macro
    def product(var_x, var_out, var_xb, q, scale):
        """out = bf16(x) @ W, W the stored pairs `q` or (`scale` given) the integers in quads
        `q`, each column block's slice dequantized into a scratch of its own first."""
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), "float32")
        out = T.match_buffer(var_out, (m, n), "float32")
        xb = T.match_buffer(var_xb, ((m + ROWS - 1) // ROWS * ROWS, k), "uint16")
        T.attr(0, "pragma_import_llvm", llvm_ir)
        to_bf16(x, xb, m)
        for jb in T.parallel(blocks):
            if scale is None:   # (decided as the function is parsed)
                column_block(out, xb, m, jb,
                             T.address_of(q[jb * COLS // p, 0, jb * COLS % p]), 4 * p)
            else:
                wb = T.decl_buffer((k // 2, COLS), "uint32", align=64)
                for r in range(k // 2):
                    for j in T.vectorized(COLS):
                        wb[r, j] = pair(q, scale, jb * COLS + j, r, g, p)
                column_block(out, xb, m, jb, wb.data, 4 * COLS)

    if sch is None:
        @T.prim_func
        def func(var_x: T.handle, q: T.Buffer((n // p, k // 2, p), "uint32"),
                 var_out: T.handle, var_xb: T.handle):
            T.func_attr({"tirx.noalias": True})
            product(var_x, var_out, var_xb, q, None)
    else:
        words = k // (8 if sch.name == "int4" else 4)

        @T.prim_func
        def func(var_x: T.handle, q: T.Buffer((n // p, words, p), "uint32"),
                 scale: T.Buffer((k // g, n), "float32"), var_out: T.handle,
                 var_xb: T.handle):
            T.func_attr({"tirx.noalias": True})
            product(var_x, var_out, var_xb, q, scale)

    return func.with_attr({"global_symbol": name, "tirx.is_scheduled": True})


def dequantized_pairs(sch):
    """The TIR expression of the bfloat16 pair (W[2r, n], W[2r + 1, n]) of the int8 / int4
    integers `q` in quads and panels of `p` columns (`panels.quads`), W = (u - o) s
    (`kernels.dequantized`) rounded to bfloat16, as a function of (q, scale, n, r, g, p). The
    integers are exact in bfloat16; the scale's product rounds (2^-9 of W at most, under the
    schemes' own rounding of 1/254 and 1/14 of a group's largest |W|)."""
    def pair(q, scale, nn, r, g, p):
        return bits(dequantized(sch, q, scale, 2 * r, nn, g, p)) | T.shift_left(
            bits(dequantized(sch, q, scale, 2 * r + 1, nn, g, p)), T.uint32(16))

    return pair
