"""A decode step's int8 / int4 product on the CPU's integer dot products (VPDPBUSD, AVX512-VNNI
or AVX-VNNI): x [M, K] float32 @ W [K, N] -> out [M, N] float32, with W the scheme's stored
integers (`scheme`) and scales,

    W[k, n] = (u[k, n] - o) s[k // g, n]      u unsigned (int8: q + 128, o = 128; int4: o = 8)

The activations are not rounded to 8 bits: each row's block of BLOCK inputs is written as D
signed 8-bit digits in base R = RADIX of x / t, t = max |x| / 127 over the block,

    x / t = d0 + d1 / R + ... + d_{D-1} / R^(D-1) + e,   d_i = round(remainder),
    |e| <= 1 / (2 R^(D-1))

with D = DIGITS[scheme]: int8 three (the sum is the float32 product up to 6e-8 of the block's
largest |x| a row), int4 one (up to 3.9e-3 of it, 1 / 254: the activations rounded to 8 bits a
block, as ONNX Runtime's accuracy level 4 and llama.cpp do; int4's own rounding of the weights
is 1 / 14 of a group's largest |W|). int4 took two digits (1.6e-5) before: at one row a step
reads at the memory's rate either way, at 8 rows the products run once a digit and a row, and
one digit took the 120 M preset's int4 step at batch 2 / 8 from 6.28 / 13.59 to 5.18 / 9.42 ms
(3.43 / 3.53 at batch 1; Zen 4 VM, 2026-12-08, both modules in turn, fastest of 5 rounds of 20
steps). Per block and column:

    c_i = sum_{k in block} u[k, n] d_i[k] - o sum_k d_i[k]            (int32, VPDPBUSD: u8 x s8)
    out[m, n] += (c0 + c1 / R + ... + c_{D-1} / R^(D-1)) t s[block's group, n]

The stored integers are in quads (`panels.quads`): 32-bit words of four bytes, the layout of
VPDPBUSD's unsigned operand (int8: one row each; int4: two nibbles each, rows 8r + j low and
8r + 4 + j high). Loops (`matvec_func`, symbolic M): the rows' digits first (serial), then for
each panel of P columns (parallel), the rows in pairs (an odd last row alone): the blocks of
K, each in parts of at most 4 vectors of columns (2 x D x 4 int32 sums and the P float32
sums of each row in registers; a weight vector loaded and unpacked once for both rows), each
block asking the cache for the weights `matvec.PREFETCH` bytes ahead (not on AMD Zen:
`matvec.prefetch_bytes`). A row holding a NaN or an infinity gives NaN. int4's int32 sums
are bound values (TIR `Bind`, in the order step, vector, row, digit), int8's a buffer: LLVM
keeps int8's buffer in registers but stored int4's to memory after every VPDPBUSD, and the
bound form spilled int8's 24 sums of two rows. On the Zen 4 VM (2 cores, 2026-12-07), 768 x
6144, both forms in turn, fastest of 9: int4 in cache 39.5 / 66.8 / 134.8 us at 1 / 2 / 3 rows
bound against 77.7 / 122.4 / 190.8 in the buffer; with 200 MB of copies read in turn, one
row, 79 us against 111; int8 one row 43.4 us bound, 43.8 in the buffer, two rows 127 / 87.

Measured on the Xeon VM (2 cores, 2026-12-07, `TVM_NUM_THREADS=2`), 768 x 6144 (the 120 M
preset's gate and up projection), 100 MB of weight copies read in turn as a decode step reads
them, fastest of 7: int8 84-91 us with three digits (55 GB/s), 84 with two; int4 62.6 us with
three, 44.4 with two (53 GB/s), 43.4 with one: int4's unpacking and products bound it with three
digits (43 GB/s with its weights in cache), int8 reads at the cache's rate with three.
Without the prefetch int8 took 96-104 us, int4 (two digits) 61 us (docs/cpu_schedules.md).
Rows in pairs against one at a time (the same weights, both kernels in turn, fastest of 7):
int8 at 2 / 3 / 8 rows 170 / 177 / 407 us against 196 / 219 / 507, one row alike (104 us);
int4 alike at every count (its products, not the unpacking, bound it there)."""
from __future__ import annotations

import itertools

BLOCK = 32        # inputs per activation scale t (divides every group size, `scheme.GROUP_SIZES`)
DIGITS = {"int8": 3, "int4": 1}   # activation digits a block, per scheme
RADIX = 254
OFFSET = {"int8": 128, "int4": 8}
FEATURES = {16: "avx512vnni", 8: "avxvnni"}   # int32 lanes -> the feature giving VPDPBUSD
INTRINSIC = {16: "llvm.x86.avx512.vpdpbusd.512", 8: "llvm.x86.avx512.vpdpbusd.256"}


def precision(digits):
    """The most that `digits` digits a block leave an input off by, as a fraction of its
    block's largest |x|: 1 / (2 127 RADIX^(digits - 1))."""
    return 1 / (2 * 127 * RADIX ** (digits - 1))


def lanes(target):
    """int32 lanes of the target's VPDPBUSD (16: AVX512-VNNI with AVX-512 BW, 8: AVX-VNNI or
    AVX512-VNNI with VL), or None where it has none (then the float path: `kernels`)."""
    from tvm.target import codegen

    if target.kind.name != "llvm":
        return None

    def has(feature):
        try:
            return bool(codegen.target_has_features(feature, target))
        except Exception:  # noqa: BLE001 - a target LLVM cannot query
            return False

    if has("avx512vnni") and has("avx512bw"):
        return 16
    if has("avxvnni") or (has("avx512vnni") and has("avx512vl")):
        return 8
    return None


def fits(sch, k, n, panel, width):
    """Whether the weight [K = `k`, N = `n`] under the scheme `sch`, in panels of `panel`
    columns, takes the kernel of `width` lanes (None: no VNNI): int8 or int4, K in whole
    blocks, the panel in whole vectors."""
    return width is not None and sch is not None and sch.name in OFFSET and \
        panel is not None and k % BLOCK == 0 and panel % width == 0 and n % panel == 0


def _part(vectors):
    """Vectors of columns summed at once: 4 (12 int32 sums in registers) or all where fewer."""
    return 4 if vectors % 4 == 0 else vectors


def matvec_func(sch, k, n, panel, width, name="vnni_matvec", ahead=None):
    """The PrimFunc (x [M, K] float32, q [N / P, K / 4 (int4: / 8), P] uint32, scale [K / g, N],
    out [M, N] float32), M symbolic, computing out as the module docstring says (the rows'
    digits in a workspace of its own), asking the cache for the weights `ahead` bytes on
    (`matvec.PREFETCH` where None, none where 0: `matvec.prefetch_bytes`), with the scheme's
    activation digits a block (DIGITS); scheduled already."""
    from tvm.script import tirx as T

    from .matvec import PREFETCH, prefetch

    assert fits(sch, k, n, panel, width), (sch, k, n, panel, width)
    int4 = sch.name == "int4"
    g, p, lw = sch.group(k), panel, width
    o = OFFSET[sch.name]
    blocks, words = k // BLOCK, k // 8 if int4 else k // 4
    part = _part(p // lw)
    parts, span = p // lw // part, part * lw   # parts of a panel, columns of a part
    ivec, bvec, fvec = f"int32x{lw}", f"int8x{4 * lw}", f"float32x{lw}"
    intrin = INTRINSIC[lw]
    steps = BLOCK // 4   # VPDPBUSD steps of 4 inputs a block
    block_words = steps // 2 if int4 else steps   # rows of q a block
    ahead = PREFETCH if ahead is None else ahead
    digits = DIGITS[sch.name]
    bound = int4   # the int32 sums as bound values, int8's in a buffer (module docstring)
    lines = block_words * p // 16 if ahead else 0   # cache lines of a block asked for
    ahead = max(1, ahead // (4 * p * block_words))   # blocks

    def operand(q, jb, b, s, col):
        """The weights of inputs 4s..4s+3 of block b for the lanes from column `col` of panel
        jb, as VPDPBUSD's unsigned bytes."""
        if not int4:
            return T.reinterpret(bvec, q[jb, b * steps + s, T.ramp(col, 1, lw)])
        word = q[jb, b * (steps // 2) + s // 2, T.ramp(col, 1, lw)]
        nib = T.if_then_else(s % 2 == 0, word, T.shift_right(word, T.broadcast(T.uint32(4), lw)))
        return T.reinterpret(bvec, T.bitwise_and(nib, T.broadcast(T.uint32(0x0F0F0F0F), lw)))

    def slot(rr, d, v):
        """The int32 sums of row rr, digit d, vector v of a part: their lanes in `acc`."""
        return T.ramp((rr * digits + d) * span + v * lw, 1, lw)

    def combine(value, rr, v):
        """c0 + c1 / R + ... of row rr's int32 sums for vector v (`value(rr, d, v)`), in
        float32."""
        total = T.Cast(fvec, value(rr, 0, v))
        for d in range(1, digits):
            total = total + T.Cast(fvec, value(rr, d, v)) * \
                T.broadcast(T.float32(1.0 / RADIX ** d), lw)
        return total

    def add_block(sums, scale, t, jb, b, r0, rr, col, total):
        """Row rr's float32 sums of the lanes from column `col` of panel jb plus block b's
        `total` times its scales."""
        at = T.ramp(rr * p + col, 1, lw)
        return T.buffer_store(sums, sums[at] + total * T.broadcast(t[r0 + rr, b], lw) *
                              scale[b * BLOCK // g, T.ramp(jb * p + col, 1, lw)], [at])

    def bound_block(q, scale, dw, off, t, sums, jb, b, r0, R):
        """Block b's products added to the R rows' sums of panel jb with the int32 sums as
        bound values (no buffer), in the order step, vector, row, digit: each weight vector
        loaded and unpacked once for the R rows' D digits."""
        for h in range(parts):
            acc = {}
            for rr, d in itertools.product(range(R), range(digits)):
                start = T.bind(T.broadcast(off[r0 + rr, d, b], lw))
                for v in range(part):
                    acc[rr, d, v] = start
            for s in range(steps):
                for v in range(part):
                    w = T.bind(operand(q, jb, b, s, h * span + v * lw))
                    for rr, d in itertools.product(range(R), range(digits)):
                        acc[rr, d, v] = T.bind(T.call_llvm_pure_intrin(
                            ivec, intrin, acc[rr, d, v], w, T.reinterpret(bvec, T.broadcast(
                                dw[r0 + rr, d, b * steps + s], lw))))
            for rr, v in itertools.product(range(R), range(part)):
                add_block(sums, scale, t, jb, b, r0, rr, h * span + v * lw,
                          combine(lambda *key: acc[key], rr, v))

    @T.macro
    def rows(q, scale, out, dw, off, t, qf, jb, r0, R):
        """out[r0 : r0 + R, panel jb] for R (1 or 2) rows: each weight vector loaded and
        unpacked once for the R rows' products."""
        sums = T.decl_buffer((R * p,), "float32")
        for c in T.vectorized(R * p):
            sums[c] = T.float32(0)
        for b in range(blocks):
            if lines > 0:   # (a Python bool: no loop at all without the prefetch)
                for line in T.unroll(lines):
                    T.evaluate(prefetch(
                        qf, (jb * words + (b + ahead) * block_words) * p + line * 16,
                        n // p * words * p - 1))
            if bound:   # (a Python bool)
                bound_block(q, scale, dw, off, t, sums, jb, b, r0, R)
            else:
                acc = T.decl_buffer((R * digits * span,), "int32")
                for h in T.unroll(parts):
                    for rr, d, v in T.grid(R, digits, part):
                        acc[slot(rr, d, v)] = T.broadcast(off[r0 + rr, d, b], lw)
                    for s in T.unroll(steps):
                        for v in T.unroll(part):
                            for rr in T.unroll(R):
                                for d in T.unroll(digits):
                                    acc[slot(rr, d, v)] = T.call_llvm_pure_intrin(
                                        ivec, intrin, acc[slot(rr, d, v)],
                                        operand(q, jb, b, s, h * span + v * lw),
                                        T.reinterpret(bvec, T.broadcast(
                                            dw[r0 + rr, d, b * steps + s], lw)))
                    for rr in T.unroll(R):
                        for v in T.unroll(part):
                            add_block(sums, scale, t, jb, b, r0, rr, h * span + v * lw,
                                      combine(lambda *key: acc[slot(*key)], rr, v))
        for rr in range(R):
            for c in T.vectorized(p):
                out[r0 + rr, jb * p + c] = sums[rr * p + c]

    @T.prim_func
    def func(var_x: T.handle, q: T.Buffer((n // p, words, p), "uint32"),
             scale: T.Buffer((k // g, n), "float32"), var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(var_x, (m, k), "float32")
        out = T.match_buffer(var_out, (m, n), "float32")
        dig = T.decl_buffer((m, digits, k), "int8", align=64)
        t = T.decl_buffer((m, blocks), "float32")
        off = T.decl_buffer((m, digits, blocks), "int32")
        dw = T.decl_buffer((m, digits, k // 4), "int32", data=dig.data)   # 4 digits a word
        qf = T.decl_buffer((n // p * words * p,), "uint32", data=q.data)
        # each row's digits, block by block
        for r, b in T.grid(m, blocks):
            top = T.decl_buffer((1,), "float32")
            bad = T.decl_buffer((1,), "int32")   # 1 where the block holds a NaN or infinity
            top[0] = T.float32(0)
            bad[0] = 0
            for i in range(BLOCK):
                top[0] = T.max(top[0], T.fabs(x[r, b * BLOCK + i]))
                # (tested on the bits: LLVM's fast-math flags fold a float test away)
                bad[0] = T.max(bad[0], T.Cast("int32", T.bitwise_and(T.reinterpret(
                    "uint32", x[r, b * BLOCK + i]), T.uint32(0x7F800000)) == T.uint32(
                    0x7F800000)))
            scale_t = T.decl_buffer((1,), "float32")
            scale_t[0] = T.Select(top[0] > T.float32(0), top[0] / T.float32(127), T.float32(1))
            t[r, b] = T.Select(bad[0] == 0, scale_t[0], T.reinterpret("float32",
                                                                        T.uint32(0x7FC00000)))
            total = T.decl_buffer((digits,), "int32")
            for d in range(digits):
                total[d] = 0
            for i in range(BLOCK):
                rest = T.decl_buffer((1,), "float32")
                rest[0] = T.float32(0)
                if bad[0] == 0:
                    rest[0] = x[r, b * BLOCK + i] / scale_t[0]
                for d in range(digits):
                    digit = T.decl_buffer((1,), "float32")
                    digit[0] = T.round(rest[0])
                    dig[r, d, b * BLOCK + i] = T.Cast("int8", digit[0])
                    total[d] = total[d] + T.Cast("int32", digit[0])
                    rest[0] = (rest[0] - digit[0]) * T.float32(RADIX)
            for d in range(digits):
                off[r, d, b] = total[d] * (-o)
        for jb in T.parallel(n // p):
            for rp in range(m // 2):
                rows(q, scale, out, dw, off, t, qf, jb, rp * 2, 2)
            if m % 2 == 1:
                rows(q, scale, out, dw, off, t, qf, jb, m - 1, 1)

    return func.with_attr({"global_symbol": name, "tirx.is_scheduled": True})
