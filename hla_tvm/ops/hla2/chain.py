"""Second order's prefill chains (`hla_tvm.ops.chains` explains the notation).

    hla2        undecayed: ksummary -> scan of S -> summary -> carry (in place on the state,
                one product) -> output
    hla2_decay  with Algorithm 1's decay (and on GPUs without: gamma = 1): ksummary, summary ->
                scans of S, C, m -> cross (the cross-term increments, the chunk's own terms
                inside) -> scans of G, h -> output"""
from __future__ import annotations

from ..common.calls import Call, scan

PREFILL = (
    Call("ksummary", ("k",), (("dS", "kk"),), kv=True),
    scan("S", "dS", "kk", kv=True, decayed=False),
    Call("summary", ("q", "k", "v"),
         (("dC", "kv"), ("dm", "k"), ("dX", "kv"), ("dr", "k"))),
    Call("carry", ("dC", "dm", "dX", "dr", "Sc", "S", "C", "m", "G", "h"),
         (("Xc", "kv"), ("rc", "k")), inplace=("C", "m", "G", "h")),
    Call("output", ("q", "k", "v", "Sc", "Xc", "rc"), (("o", "o"),)),
)

PREFILL_DECAY = (
    Call("ksummary", ("k", "gamma"), (("dS", "kk"), ("gl", "1")), kv=True),
    Call("summary", ("q", "v", "gamma"), (("dC", "kv"), ("dm", "k"))),
    scan("S", "dS", "kk", kv=True), scan("C", "dC", "kv"), scan("m", "dm", "k"),
    Call("cross", ("q", "k", "v", "gamma", "Cc", "mc"),
         (("ddG", "kv"), ("ddh", "k"), ("KC", "nv"), ("Km", "n"))),
    scan("G", "ddG", "kv"), scan("h", "ddh", "k"),
    Call("output", ("q", "k", "v", "gamma", "Sc", "Cc", "mc", "Gc", "hc", "KC", "Km"),
         (("o", "o"),)),
)
