"""The dtypes of the kernels' inputs and of their state and accumulation (no TVM, no torch)."""
from __future__ import annotations

IO_DTYPES = ("float16", "bfloat16", "float32", "float64")


def accum_dtype(dtype):
    """State and accumulation dtype for inputs of `dtype`: float64 stays, the rest use float32."""
    if dtype not in IO_DTYPES:
        raise ValueError(f"kernel dtype must be one of {IO_DTYPES}, got {dtype!r}")
    return "float64" if dtype == "float64" else "float32"
