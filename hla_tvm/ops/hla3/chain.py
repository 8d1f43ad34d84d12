"""Third order's prefill chain (`hla_tvm.ops.chains` explains the notation): ksummary -> scans
of S, P, m -> cross (the cross-term increments, the chunk's own terms inside) -> scans of F,
eta -> output."""
from __future__ import annotations

from ..common.calls import Call, scan

PREFILL = (
    Call("ksummary", ("gamma", "k", "v"),
         (("dS", "kk"), ("dP", "kv"), ("dm", "k"), ("gl", "1")), kv=True),
    scan("S", "dS", "kk", kv=True), scan("P", "dP", "kv", kv=True),
    scan("m", "dm", "k", kv=True),
    Call("cross", ("q", "k", "v", "gamma", "Sc", "Pc", "mc"),
         (("ddF", "kv"), ("ddeta", "k"), ("M", "nn"), ("Y", "nv"), ("y", "n"))),
    scan("F", "ddF", "kv"), scan("eta", "ddeta", "k"),
    Call("output", ("q", "gamma", "Fc", "etac", "M", "Y", "y"), (("o", "o"),)),
)
