"""Readable float64-exact PyTorch math for every HLA operator: the specification."""
from . import hla2

__all__ = ["hla2"]
