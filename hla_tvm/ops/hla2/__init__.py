"""Second-order HLA: o_t = q_t^T (S_t C_t - G_t) (paper Section 3), in four files.

    reference.py       the float64 specification: quadratic form ((W W^T) * L) V, serial
                       recurrence, chunk form, with masked=False, ridge, normalize and decay
    fast.py            fast PyTorch forms: every chunk at once (`chunked`), a step in place
    kernels.py         TensorIR kernels of the undecayed prefill (family hla2: one-product carry)
    kernels_decay.py   TensorIR kernels with Algorithm 1's decay (family hla2_decay), whose
                       decode also serves the undecayed operator (gamma = 1)
    chain.py           the two prefill chains

Families: a prefill without decay runs hla2 on a CPU and hla2_decay on a GPU (gamma = 1: hla2's
carry runs one thread block per head, the scan chain one per chunk; B1 H32 T32768 D128 bfloat16
on an H200, 2026-12-04: 939 ms against 161 ms); with decay, and every decode, hla2_decay."""
from ..operator import Family, Operator
from . import chain, fast, reference

OPERATOR = Operator(
    "hla2", order=2, asymmetric=False, ref=reference, fast=fast, kv_state=("S",),
    has_mask_ridge=True,
    families={"prefill": "hla2", "prefill_decay": "hla2_decay", "prefill_gpu": "hla2_decay",
              "decode": "hla2_decay"})

FAMILIES = (
    # on CPUs with AVX512-BF16, bfloat16 inputs' products run on vdpbf16ps (`bf16_products`)
    Family("hla2", "hla2", chain.PREFILL, f"{__name__}.kernels", bf16_products=True),
    # its decode reads each state element once: row by row on CPUs, a column a thread on GPUs
    # (`kernels_decay.decode(columns=True)`)
    Family("hla2_decay", "hla2", chain.PREFILL_DECAY, f"{__name__}.kernels_decay",
           gpu_options={"columns": True}),
)
