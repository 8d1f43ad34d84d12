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
steps: `quant.amx` (AMX tiles, 32 x 32) and `quant.dpbf16` (VDPBF16PS, AVX512-BF16)."""
from __future__ import annotations


LANES = 16   # the rows' conversion to bfloat16: vectors of 16 inputs


def has_features(target, features):
    """Whether code for the llvm `target` may use every one of `features` (LLVM's names)."""
    from tvm.target import codegen

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
                init_error=""):
    """The PrimFunc (x [M, K] float32, q [N / P, K / 2, P] uint32, out [M, N] float32, xb [M',
    K] uint16 scratch), M symbolic, that computes out = bf16(x) @ W through the microkernel
    `kernel` of `llvm_ir` (the module docstring); scheduled already (TVM's rules leave it as it
    is). `init`: a function of `llvm_ir` called first, which must return 1 (else the function
    stops with `init_error`), as AMX asks the OS for its tiles."""
    from tvm.script import tirx as T

    from ..ops.common.pairs import bits

    assert fits(k, n, panel, step=step, cols=cols), (k, n, panel)
    blocks, p, lanes = n // cols, panel, LANES
    ROWS, COLS = rows, cols

    @T.prim_func
    def func(var_x: T.handle, q: T.Buffer((n // p, k // 2, p), "uint32"), var_out: T.handle,
             var_xb: T.handle):
        T.func_attr({"tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), "float32")
        out = T.match_buffer(var_out, (m, n), "float32")
        xb = T.match_buffer(var_xb, ((m + ROWS - 1) // ROWS * ROWS, k), "uint16")
        T.attr(0, "pragma_import_llvm", llvm_ir)
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
        for jb in T.parallel(blocks):
            c = T.decl_buffer((ROWS, COLS), "float32", align=64)   # the last rows' block
            for ib in range((m + ROWS - 1) // ROWS):
                if ib * ROWS + ROWS <= m:   # a whole block: its sums straight into `out`
                    T.evaluate(T.call_extern(
                        "int32", kernel, T.address_of(out[ib * ROWS, jb * COLS]),
                        T.int64(n), T.address_of(xb[ib * ROWS, 0]), T.int64(k),
                        T.address_of(q[jb * COLS // p, 0, jb * COLS % p]), T.int64(4 * p),
                        T.int64(k // step)))
                else:
                    T.evaluate(T.call_extern(
                        "int32", kernel, c.data, T.int64(COLS),
                        T.address_of(xb[ib * ROWS, 0]), T.int64(k),
                        T.address_of(q[jb * COLS // p, 0, jb * COLS % p]), T.int64(4 * p),
                        T.int64(k // step)))
            for r in range(m % ROWS):
                for j in T.vectorized(COLS):
                    out[m - m % ROWS + r, jb * COLS + j] = c[r, j]

    return func.with_attr({"global_symbol": name, "tirx.is_scheduled": True})
