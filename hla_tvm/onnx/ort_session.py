"""Running an hla_tvm ONNX model in ONNX Runtime (no plugin: the HLA nodes run their function
bodies)."""
from __future__ import annotations

import onnxruntime as ort

from .function import check_functions
from .importer import load_model


def session(model, *, threads=None):
    """An onnxruntime.InferenceSession for `model` (path or ModelProto), after checking that
    every hla_tvm::HLA node has its function body (ValueError naming the node otherwise)."""
    proto = check_functions(load_model(model))
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = int(threads)
    return ort.InferenceSession(proto.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
