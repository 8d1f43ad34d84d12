"""The custom ONNX operator `hla_tvm::HLA` (domain hla_tvm, version 1)."""
from .function import DOMAIN, OP_TYPE, make_function, overload_name

__all__ = ["DOMAIN", "OP_TYPE", "make_function", "overload_name"]
