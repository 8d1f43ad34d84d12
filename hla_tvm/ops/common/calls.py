"""The calls a kernel chain is made of (`hla_tvm.ops.chains` runs them; each operator's
`chain.py` lists its own). No TVM, no torch.

Reads name the inputs q, k, v, gamma ([H] decay, ones for none), the state entries (the
reference's names) and earlier writes; a kernel takes its reads in order, then its writes.
Kinds of written buffers: per (batch, head, chunk) "kk" [Dk, Dk], "kv" [Dk, Dv], "k" [Dk],
"1" (one value), "nn" [n, n], "nv" [n, Dv], "n" [n] (n the chunk size), in the accumulation
dtype; "o" is the output [B, H, T, Dv] in the input dtype."""
from __future__ import annotations

from dataclasses import dataclass

KIND_SHAPES = {"kk": lambda dk, dv, n: (dk, dk), "kv": lambda dk, dv, n: (dk, dv),
               "k": lambda dk, dv, n: (dk,), "1": lambda dk, dv, n: (),
               "nn": lambda dk, dv, n: (n, n), "nv": lambda dk, dv, n: (n, dv),
               "n": lambda dk, dv, n: (n,)}


@dataclass(frozen=True)
class Call:
    kernel: str         # ksummary | summary | carry | cross | output | scan | decode
    reads: tuple        # argument names, in the kernel's order
    writes: tuple       # (name, kind) of the new buffers, passed after the reads
    inplace: tuple = ()  # the state entries among `reads` that the kernel advances in place
    kv: bool = False    # runs on the key/value heads (`hla_tvm.ops.chains`)


def scan(x, dx, kind, kv=False, decayed=True):
    """Advance state entry x in place by the per-chunk increments dx (times the chunk's decay
    gl first where decayed); xc records x per chunk."""
    return Call("scan", (x, dx) + (("gl",) if decayed else ()), ((x + "c", kind),),
                inplace=(x,), kv=kv)
