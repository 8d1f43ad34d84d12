"""hla_tvm: Higher-order Linear Attention as compiled TVM operators.

Attributes load lazily, so that `hla_tvm.runtime` (and `hla-tvm run`) work with the TVM runtime
alone, without importing torch or TVM's compiler."""
from .version import __version__

__all__ = ["hla", "decode_", "init_state", "compile", "__version__"]


def __getattr__(name):
    if name == "hla":
        from .api import hla

        return hla
    if name in ("decode_", "init_state"):
        from . import decode

        return getattr(decode, name)
    if name == "compile":
        from .compiler import compile as compile_model

        return compile_model
    raise AttributeError(f"module 'hla_tvm' has no attribute {name!r}")
