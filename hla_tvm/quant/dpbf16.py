"""A prefill's bf16 product on VDPBF16PS (AVX512-BF16: Zen 4/5, Cooper Lake and later Xeons)
where the CPU has no AMX: x [M, K] float32 @ W [K, N] stored in bfloat16 pairs, float32 out,

    out[m, n] = sum_k bf16(x[m, k]) * W[k, n]          bf16(): round to nearest even

each VDPBF16PS adding two bfloat16 products (an input pair) to each of 16 float32 lanes.

Blocks of ROWS x COLS outputs (`bf16_blocks`): the microkernel `KERNEL` keeps them in 24 zmm
registers (6 rows x 4 vectors of 16 columns) over K, one input pair a step: the 64 columns of
the pair row (four 64-byte loads from the stored weight) and each row's pair broadcast from its
bf16 copy, 24 VDPBF16PS a step. The stored pair layout is the instruction's operand layout, so
the weight is read as it is stored."""
from __future__ import annotations

from . import bf16_blocks

ROWS, VECTORS = 6, 4
COLS = 16 * VECTORS       # 64 columns: four vectors of 16 float32
STEP = 2                  # K per step: one input pair
FEATURES = ("avx512bf16", "avx512f")
PREFIX = "dpbf16"         # the module's functions: PREFIX_matmul_K_N
KERNEL_NAME = "hla_tvm_dpbf16_6x64"


def _kernel():
    """The LLVM IR of the microkernel (module docstring): c[6, 64] (row stride ldc floats) =
    a[6, 2 steps] bf16 (row stride lda elements) x b (`steps` pair rows of 64 columns, row
    stride ldb bytes)."""
    regs = [(r, v) for r in range(ROWS) for v in range(VECTORS)]
    lines = [
        "declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>,"
        " <32 x bfloat>)",
        f"define i32 @{KERNEL_NAME}(ptr %c, i64 %ldc, ptr %a, i64 %lda, ptr %b, i64 %ldb,"
        " i64 %steps) #0 {",
        "entry:",
        "  %sa = mul i64 %lda, 2",
        "  %sc = mul i64 %ldc, 4",
        "  br label %loop",
        "loop:",
        "  %i = phi i64 [0, %entry], [%next, %loop]",
    ]
    lines += [f"  %d{r}_{v} = phi <16 x float> [zeroinitializer, %entry], [%e{r}_{v}, %loop]"
              for r, v in regs]
    lines += ["  %boff = mul i64 %i, %ldb", "  %pb = getelementptr i8, ptr %b, i64 %boff",
              "  %aoff = mul i64 %i, 4"]
    for v in range(VECTORS):
        lines += [f"  %pb{v} = getelementptr i8, ptr %pb, i64 {64 * v}",
                  f"  %w{v} = load <16 x i32>, ptr %pb{v}, align 4",
                  f"  %bw{v} = bitcast <16 x i32> %w{v} to <32 x bfloat>"]
    for r in range(ROWS):
        lines += [f"  %ra{r} = mul i64 %sa, {r}",
                  f"  %pa{r}0 = getelementptr i8, ptr %a, i64 %ra{r}",
                  f"  %pa{r} = getelementptr i8, ptr %pa{r}0, i64 %aoff",
                  f"  %x{r} = load i32, ptr %pa{r}, align 4",
                  f"  %xv{r}0 = insertelement <16 x i32> poison, i32 %x{r}, i64 0",
                  f"  %xv{r} = shufflevector <16 x i32> %xv{r}0, <16 x i32> poison, "
                  "<16 x i32> zeroinitializer",
                  f"  %xb{r} = bitcast <16 x i32> %xv{r} to <32 x bfloat>"]
        for v in range(VECTORS):
            lines.append(f"  %e{r}_{v} = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512("
                         f"<16 x float> %d{r}_{v}, <32 x bfloat> %xb{r}, <32 x bfloat> %bw{v})")
    lines += ["  %next = add i64 %i, 1", "  %more = icmp slt i64 %next, %steps",
              "  br i1 %more, label %loop, label %exit", "exit:"]
    for r in range(ROWS):
        lines += [f"  %rc{r} = mul i64 %sc, {r}",
                  f"  %pc{r} = getelementptr i8, ptr %c, i64 %rc{r}"]
        for v in range(VECTORS):
            lines += [f"  %pc{r}_{v} = getelementptr i8, ptr %pc{r}, i64 {64 * v}",
                      f"  store <16 x float> %e{r}_{v}, ptr %pc{r}_{v}, align 4"]
    lines += ["  ret i32 0", "}",
              'attributes #0 = { "target-features"="+avx512f,+avx512bf16" }']
    return "\n".join(lines) + "\n"


KERNEL = _kernel()


def available(target):
    """Whether code for the llvm `target` may use VDPBF16PS (`FEATURES`)."""
    return bf16_blocks.has_features(target, FEATURES)


def fits(k, n, panel):
    """Whether a weight [K = `k`, N = `n`] stored in panels of `panel` columns takes the
    kernel: K in whole vectors of 16, N and the panel in whole 64-column blocks."""
    return bf16_blocks.fits(k, n, panel, step=STEP, cols=COLS)


def matmul_func(k, n, panel, name="dpbf16_matmul", sch=None):
    """The PrimFunc (x [M, K] float32, q [N / P, K / 2, P] uint32, out [M, N] float32, xb
    scratch [M rounded up to ROWS, K] uint16), M symbolic, that computes out = bf16(x) @ W on
    VDPBF16PS (`bf16_blocks`); scheduled already. With `sch` (int8, int4) q is its integers
    in quads and their scale follows (`bf16_blocks.matmul_func`)."""
    return bf16_blocks.matmul_func(k, n, panel, name, rows=ROWS, cols=COLS, step=STEP,
                                   llvm_ir=KERNEL, kernel=KERNEL_NAME, sch=sch)
