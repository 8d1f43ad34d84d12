"""TensorIR definitions, one module per operator family.

KERNELS maps a kernel family to its module: hla2 (second order, undecayed: one-product chunk
carry), hla2d (second order with Algorithm 1's decay), ahla, hla3; the last three share the
prefill structure summaries of the prefix sums -> their scans -> cross (the cross-term
increments) -> their scans -> output. STATE_NAMES gives each family's
state entries in the order its kernels take them. The TensorIR modules (and KERNELS) load on first
use: the chains need no TVM compiler."""
from ..reference import ahla as _ahla_ref, hla2 as _hla2_ref, hla3 as _hla3_ref

IO_DTYPES = ("float16", "bfloat16", "float32", "float64")


def accum_dtype(dtype):
    """State and accumulation dtype for inputs of `dtype`: float64 stays, the rest use float32."""
    if dtype not in IO_DTYPES:
        raise ValueError(f"kernel dtype must be one of {IO_DTYPES}, got {dtype!r}")
    return "float64" if dtype == "float64" else "float32"


REFERENCES = {"hla2": _hla2_ref, "hla2d": _hla2_ref, "ahla": _ahla_ref, "hla3": _hla3_ref}
STATE_NAMES = {fam: ref.STATE_NAMES for fam, ref in REFERENCES.items()}

__all__ = ["KERNELS", "REFERENCES", "STATE_NAMES", "ahla", "hla2", "hla2_decay", "hla3"]


def __getattr__(name):
    # the TensorIR modules import TVM's compiler: loaded on first use, so that the chains
    # (`kernels.chains`) serve a machine with the TVM runtime alone
    if name == "KERNELS":
        from . import ahla, hla2, hla2_decay, hla3

        return {"hla2": hla2, "hla2d": hla2_decay, "ahla": ahla, "hla3": hla3}
    if name in ("ahla", "hla2", "hla2_decay", "hla3", "_tir"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
