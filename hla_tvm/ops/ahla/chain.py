"""AHLA's prefill chain (`hla_tvm.ops.chains` explains the notation): ksummary -> scans of P, m
-> cross (the cross-term increments, the chunk's own terms inside) -> scans of E, n -> output."""
from __future__ import annotations

from ..common.calls import Call, scan

PREFILL = (
    Call("ksummary", ("k", "v", "gamma"), (("dP", "kv"), ("dm", "k"), ("gl", "1")),
         kv=True),
    scan("P", "dP", "kv", kv=True), scan("m", "dm", "k", kv=True),
    Call("cross", ("q", "k", "v", "gamma", "Pc", "mc"),
         (("ddE", "kv"), ("ddn", "k"), ("QP", "nv"), ("Qm", "n"))),
    scan("E", "ddE", "kv"), scan("n", "ddn", "k"),
    Call("output", ("q", "k", "v", "gamma", "Ec", "QP", "nc", "Qm"), (("o", "o"),)),
)
