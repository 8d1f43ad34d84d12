"""A prefill's product on Intel AMX tiles: x [M, K] float32 @ W [K, N] stored in bfloat16 pairs,
float32 out, with bfloat16 products accumulated in float32 (TDPBF16PS):

    out[m, n] = sum_k bf16(x[m, k]) * W[k, n]          bf16(): round to nearest even

W is the bf16 scheme's stored weight (`scheme`), in row pairs in panels (`panels.pairs`,
`panels.to_panels`): q[n // P, r, n % P] holds W[2r, n] in its low half and W[2r + 1, n] in its
high half, which is the layout of AMX's B tile (a tile row: 16 columns of one row pair), so the
tiles load straight from the stored weight (a pair row every 4 P bytes).

The function (`matmul_func`, symbolic M):
    xb[M', K] = bf16(x), M' = M rounded up to 32 rows (the rest zero)      (parallel rows)
    for each 32-column block (parallel): for each 32-row block:
        out[rows, cols] = xb[rows] @ W[:, cols]   (`KERNEL`: 2 x 2 tiles of 16 x 16, K in steps
                                                    of 32; the last rows through a scratch block)

The column block's K x 32 slice of the weight stays in cache while the rows stream by. Passes
over K in blocks (the sums kept in `out` between them) were slower: K 3072, N 768, 512 rows,
3.8 ms whole against 4.5-5.4 ms in blocks of 1,024-256 (one core busy with another process).
Measured on the Xeon VM (2 cores, AMX, 2026-12-07): a 32 x 32 x 768 block 1.5 TFLOP/s a core
with its data in L1, a 512 x 768 x 2304 product 1.9 TFLOP/s on both cores (PyTorch's oneDNN
2.0-2.4 in the same run).

`KERNEL` is LLVM IR linked into the module (`pragma_import_llvm`), on LLVM's AMX intrinsics
(TVM 0.27 has no AMX intrinsic of its own); LLVM configures the tiles (ldtilecfg) in the
function. Linux hands AMX's tile state to a process that asks for it once (arch_prctl
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): `INIT` does, on the first call of a process; where
the OS refuses, the function stops with an error before its first tile instruction."""
from __future__ import annotations

from . import bf16_blocks

ROWS = COLS = 32          # the output block of one kernel call: 2 x 2 tiles of 16 x 16 float32
STEP = 32                 # K per TDPBF16PS (16 rows of bf16 pairs)
FEATURES = ("amx-tile", "amx-bf16")
PREFIX = "amx_bf16"       # the module's functions: PREFIX_matmul_K_N
KERNEL_NAME, INIT_NAME = "hla_tvm_amx_bf16_32x32", "hla_tvm_amx_init"

# arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18) through syscall(158, ...),
# once a process (the answer kept: 1 granted, -1 refused)
INIT = f"""
@hla_tvm_amx_ready = internal global i32 0
declare i64 @syscall(i64, ...)
define i32 @{INIT_NAME}() {{
entry:
  %r = load atomic i32, ptr @hla_tvm_amx_ready monotonic, align 4
  %known = icmp ne i32 %r, 0
  br i1 %known, label %done, label %ask
ask:
  %s = call i64 (i64, ...) @syscall(i64 158, i64 4131, i64 18)
  %granted = icmp eq i64 %s, 0
  %v = select i1 %granted, i32 1, i32 -1
  store atomic i32 %v, ptr @hla_tvm_amx_ready monotonic, align 4
  br label %done
done:
  %out = phi i32 [ %r, %entry ], [ %v, %ask ]
  ret i32 %out
}}
"""

# c[32, 32] (row stride ldc floats) = a[32, 32 steps] bf16 (row stride lda elements)
#   x b (`steps` x 16 pair rows, row stride ldb bytes; 32 columns: two tiles 64 bytes apart)
KERNEL = f"""
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
declare x86_amx @llvm.x86.tilezero.internal(i16, i16)
define i32 @{KERNEL_NAME}(ptr %c, i64 %ldc, ptr %a, i64 %lda, ptr %b, i64 %ldb,
                                   i64 %steps) #0 {{
entry:
  %sa = mul i64 %lda, 2
  %sc = mul i64 %ldc, 4
  %bstep = mul i64 %ldb, 16
  %a1 = mul i64 %sa, 16
  %pc1 = getelementptr i8, ptr %c, i64 64
  %c16 = mul i64 %sc, 16
  %pc2 = getelementptr i8, ptr %c, i64 %c16
  %pc3 = getelementptr i8, ptr %pc2, i64 64
  %z00 = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  %z01 = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  %z10 = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  %z11 = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %d00 = phi x86_amx [%z00, %entry], [%e00, %loop]
  %d01 = phi x86_amx [%z01, %entry], [%e01, %loop]
  %d10 = phi x86_amx [%z10, %entry], [%e10, %loop]
  %d11 = phi x86_amx [%z11, %entry], [%e11, %loop]
  %aoff = mul i64 %i, 64
  %pa0 = getelementptr i8, ptr %a, i64 %aoff
  %pa1 = getelementptr i8, ptr %pa0, i64 %a1
  %boff = mul i64 %i, %bstep
  %pb0 = getelementptr i8, ptr %b, i64 %boff
  %pb1 = getelementptr i8, ptr %pb0, i64 64
  %ta0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa0, i64 %sa)
  %ta1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pa1, i64 %sa)
  %tb0 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb0, i64 %ldb)
  %tb1 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %pb1, i64 %ldb)
  %e00 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %d00,
                                                   x86_amx %ta0, x86_amx %tb0)
  %e01 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %d01,
                                                   x86_amx %ta0, x86_amx %tb1)
  %e10 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %d10,
                                                   x86_amx %ta1, x86_amx %tb0)
  %e11 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %d11,
                                                   x86_amx %ta1, x86_amx %tb1)
  %next = add i64 %i, 1
  %more = icmp slt i64 %next, %steps
  br i1 %more, label %loop, label %exit
exit:
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c, i64 %sc, x86_amx %e00)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %pc1, i64 %sc, x86_amx %e01)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %pc2, i64 %sc, x86_amx %e10)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %pc3, i64 %sc, x86_amx %e11)
  ret i32 0
}}
attributes #0 = {{ "target-features"="+amx-tile,+amx-bf16" }}
"""


def available(target):
    """Whether code for the llvm `target` may use AMX's bfloat16 tiles (`FEATURES`)."""
    return bf16_blocks.has_features(target, FEATURES)


def fits(k, n, panel):
    """Whether a weight [K = `k`, N = `n`] stored in panels of `panel` columns takes the
    kernel: K in whole steps, N and the panel in whole column blocks."""
    return bf16_blocks.fits(k, n, panel, step=STEP, cols=COLS)


def matmul_func(k, n, panel, name="amx_bf16_matmul", sch=None):
    """The PrimFunc (x [M, K] float32, q [N / P, K / 2, P] uint32, out [M, N] float32, xb
    scratch), M symbolic, that computes out = bf16(x) @ W on AMX tiles (`bf16_blocks`, asking
    the OS for the tiles first); scheduled already. With `sch` (int8, int4) q is its integers
    in quads and their scale follows (`bf16_blocks.matmul_func`)."""
    return bf16_blocks.matmul_func(
        k, n, panel, name, rows=ROWS, cols=COLS, step=STEP, llvm_ir=INIT + KERNEL,
        kernel=KERNEL_NAME, init=INIT_NAME,
        init_error="AMX tiles refused by the OS (arch_prctl XTILEDATA)", sch=sch)
