"""hla_tvm: Higher-order Linear Attention as compiled TVM operators."""
__version__ = "0.1.0"

from .api import hla  # noqa: E402

__all__ = ["hla", "__version__"]
