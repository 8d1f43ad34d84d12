"""Products of bfloat16 values in pairs, for CPUs with AVX512-BF16 (`bf16_products` kernels).

A product dst[i, j] = sum_r a[i, r] b[r, j] of values that are bfloat16 numbers (a bfloat16
kernel's staged inputs) is written over pairs of the reduction axis:

    P[r2, x] = bits(src[2 r2, x]) | bits(src[2 r2 + 1, x]) << 16     (uint32: two bfloat16)
    dst[i, j] = sum_r2 lo(A[r2, i]) lo(B[r2, j]) + hi(A[r2, i]) hi(B[r2, j])

with bits(x) the bfloat16 nearest x (round to nearest even; exact for a bfloat16 input),
lo(p) = the float32 of p's low half, hi(p) of its high half. Both operands are packed the same
way, [pairs of the reduction, free axis], so one 64-byte row of B holds the pairs of 16 columns:
the layout of VDPBF16PS (16 x 2 products, float32 accumulation, one instruction), which
`schedule.steps.cpu.bf16_dot` puts in for the 32 columns of a register tile. The sums are those
of the float32 product of the same bfloat16 numbers up to float32 rounding order."""
from __future__ import annotations

import functools

from tvm.script import tirx as T
from tvm.target import codegen

# the block attribute that marks a pair product (`schedule.steps.cpu.chunk_gemm` tensorizes it)
PAIR_PRODUCT = "hla_tvm.bf16_pairs"
FEATURE = "avx512bf16"   # the LLVM CPU feature of vdpbf16ps


def available(target):
    """True when `target` (a tvm Target) is an LLVM CPU target with AVX512-BF16."""
    if target is None or target.kind.name != "llvm":
        return False
    return _has_feature(target)


@functools.lru_cache(maxsize=64)
def _has_feature(target):
    """(LLVM's answer, 85 us a query: remembered per Target object)"""
    try:
        return bool(codegen.target_has_features(FEATURE, target))
    except Exception:  # noqa: BLE001 - a target LLVM cannot query
        return False


def bits(x):
    """The bfloat16 nearest float32 `x` (round to nearest, ties to even), as uint32 in 0..65535."""
    u = T.reinterpret("uint32", x)
    return T.shift_right(u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)),
                                                              T.uint32(1)), T.uint32(16))


def lo(p):
    """The float32 value of the low bfloat16 of pair `p`."""
    return T.reinterpret("float32", T.shift_left(p, T.uint32(16)))


def hi(p):
    """The float32 value of the high bfloat16 of pair `p`."""
    return T.reinterpret("float32", T.bitwise_and(p, T.uint32(0xFFFF0000)))


@T.macro
def pack(dst, src, b, hh, c, pairs, width, name):
    """dst[b, h, c, r2, x] = the bfloat16 pair (src[2 r2, x], src[2 r2 + 1, x]) of src[b, h, c]:
    pairs of rows (a chunk's tokens)."""
    for r2, x in T.grid(pairs, width):
        with T.sblock(name):
            vb, vh, vc, vr, vx = T.axis.remap("SSSSS", [b, hh, c, r2, x])
            dst[vb, vh, vc, vr, vx] = bits(src[vb, vh, vc, 2 * vr, vx]) | \
                T.shift_left(bits(src[vb, vh, vc, 2 * vr + 1, vx]), T.uint32(16))


@T.macro
def matmul(dst, a, bm, b, hh, c, rows, cols, pairs, name):
    """dst[b, h, c, i, j] = sum over r2 of the pairs a[.., r2, i] . bm[.., r2, j] (`pack`ed):
    the product over 2 pairs reduction elements. a and bm must be two buffers (the tensor
    intrinsic matches three), even where they hold the same pairs."""
    for i, j, r in T.grid(rows, cols, pairs):
        with T.sblock(name):
            vb, vh, vc, vi, vj, vr = T.axis.remap("SSSSSR", [b, hh, c, i, j, r])
            T.sblock_attr({PAIR_PRODUCT: 1})
            with T.init():
                dst[vb, vh, vc, vi, vj] = T.float32(0)
            dst[vb, vh, vc, vi, vj] = dst[vb, vh, vc, vi, vj] \
                + lo(a[vb, vh, vc, vr, vi]) * lo(bm[vb, vh, vc, vr, vj]) \
                + hi(a[vb, vh, vc, vr, vi]) * hi(bm[vb, vh, vc, vr, vj])
