"""TensorIR definitions, one module per operator family.

KERNELS maps a kernel family to its module: hla2 (second order, undecayed: one-product chunk
carry), hla2d (second order with Algorithm 1's decay), ahla, hla3; the last three share the
prefill structure summary -> scans -> cross -> scans -> output. STATE_NAMES gives each family's
state entries in the order its kernels take them."""
from ..reference import ahla as _ahla_ref, hla2 as _hla2_ref, hla3 as _hla3_ref
from . import ahla, hla2, hla2_decay, hla3

KERNELS = {"hla2": hla2, "hla2d": hla2_decay, "ahla": ahla, "hla3": hla3}
REFERENCES = {"hla2": _hla2_ref, "hla2d": _hla2_ref, "ahla": _ahla_ref, "hla3": _hla3_ref}
STATE_NAMES = {fam: ref.STATE_NAMES for fam, ref in REFERENCES.items()}

__all__ = ["KERNELS", "REFERENCES", "STATE_NAMES", "ahla", "hla2", "hla2_decay", "hla3"]
