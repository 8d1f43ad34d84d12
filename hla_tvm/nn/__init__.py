"""PyTorch building blocks: the `torch.ops.hla_tvm.hla` custom op and HLA layers."""
from .layers import HLAttention, RMSNorm, SwiGLU
from .ops import hla_op, state_names

__all__ = ["HLAttention", "RMSNorm", "SwiGLU", "hla_op", "state_names"]
