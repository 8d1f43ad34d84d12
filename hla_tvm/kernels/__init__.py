"""TensorIR definitions, one module per operator family."""
from . import hla2

__all__ = ["hla2"]
