"""Models built from HLA layers; SHIPPED, the demo's trained checkpoint (`hla-tvm train`)."""
import os

from .hlalm import HLALM

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "stdlib-hla2.pt")

__all__ = ["HLALM", "SHIPPED"]
