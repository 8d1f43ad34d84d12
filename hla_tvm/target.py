"""Resolving the `target=` argument to a tvm.target.Target."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def host_target():
    """The machine we run on: LLVM for the host CPU model with all its cores."""
    import tvm

    return tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1,
                              "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def resolve(target):
    """None -> the host CPU; "llvm" -> the host CPU; a dict or Target -> as given.

    TVM 0.27 takes targets as dicts ({"kind": "llvm", "mcpu": "znver4"}); strings with flags
    ("llvm -mcpu=...") are rejected by TVM, so we reject them here with the dict spelling."""
    import tvm

    if target is None or target == "llvm":
        return host_target()
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if isinstance(target, str):
        raise ValueError(
            f"target={target!r}: give a dict such as {{'kind': 'llvm', 'mcpu': 'znver4'}} "
            "or a tvm.target.Target; only the bare kind 'llvm' is accepted as a string")
    raise TypeError(f"target must be None, 'llvm', a dict or a tvm.target.Target, "
                    f"got {type(target).__name__}")
