"""PyTorch building blocks: the `torch.ops.hla_tvm.hla` custom op, HLA layers and the softmax
attention layer of hybrid models."""
from .layers import HLAttention, RMSNorm, SwiGLU
from .ops import hla_op, state_names
from .softmax import SoftmaxAttention

__all__ = ["HLAttention", "RMSNorm", "SoftmaxAttention", "SwiGLU", "hla_op", "state_names"]
