"""Models built from HLA layers."""
from .hlalm import HLALM

__all__ = ["HLALM"]
