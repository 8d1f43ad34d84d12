"""Third-order HLA: ((W W^T * L) W) V (paper Section 5; `docs/hla3_masked_form.md` has the
masked form the kernels compute), in four files.

    reference.py   the float64 specification: quadratic form, serial recurrence, chunk form,
                   with normalize and decay
    fast.py        fast PyTorch forms: every chunk at once (`chunked`), a step in place
    kernels.py     TensorIR kernels (family hla3), with or without decay
    chain.py       the prefill chain"""
from ..operator import Family, Operator
from . import chain, fast, reference

OPERATOR = Operator(
    "hla3", order=3, asymmetric=False, ref=reference, fast=fast, kv_state=("S", "P", "m"),
    has_mask_ridge=False, families={"prefill": "hla3", "decode": "hla3"})

FAMILIES = (Family("hla3", "hla3", chain.PREFILL, f"{__name__}.kernels"),)
