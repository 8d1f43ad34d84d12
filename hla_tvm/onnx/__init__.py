"""The custom ONNX operator `hla_tvm::HLA` (domain hla_tvm, version 1): its schema, its function
bodies in standard ONNX, export of `hla_tvm.nn` models, and compiling such ONNX models with TVM.

    hla_tvm.onnx.export(model, "model.onnx", example_tokens, decode=False)
    hla_tvm.onnx.session("model.onnx")                                  # ONNX Runtime
    hla_tvm.onnx.compile("model.onnx", target="llvm", out="model.so")   # hla_tvm.runtime.load
"""
from . import schema
from .function import (
    DOMAIN,
    OP_TYPE,
    add_functions,
    check,
    check_functions,
    make_function,
    node,
    node_variant,
    overload_name,
)

schema.register()

__all__ = ["DOMAIN", "OP_TYPE", "add_functions", "check", "check_functions", "make_function",
           "node", "node_variant", "overload_name", "export", "compile", "to_relax", "session"]


def __getattr__(name):
    if name == "export":
        # loaded on first use: the exporter imports torch, the importer TVM
        from .exporter import export
        return export
    if name == "session":
        from .ort_session import session
        return session
    if name in ("compile", "to_relax"):
        from . import importer
        return getattr(importer, name)
    raise AttributeError(name)
