"""Asymmetric HLA (AHLA): ((A A) * L) V with A = L * (Q K^T) (paper Section 4), in four files.

    reference.py   the float64 specification: quadratic form, serial recurrence, chunk form,
                   with normalize and decay
    fast.py        fast PyTorch forms: every chunk at once (`chunked`), a step in place
    kernels.py     TensorIR kernels (family ahla), with or without decay
    chain.py       the prefill chain"""
from ..operator import Family, Operator
from . import chain, fast, reference

OPERATOR = Operator(
    "ahla", order=2, asymmetric=True, ref=reference, fast=fast, kv_state=("P", "m"),
    has_mask_ridge=False, families={"prefill": "ahla", "decode": "ahla"})

FAMILIES = (Family("ahla", "ahla", chain.PREFILL, f"{__name__}.kernels"),)
