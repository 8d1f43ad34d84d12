"""Compiling kernel modules, with an in-process and an on-disk cache.

A module is keyed by what is baked into its code: kernel kind, head sizes, chunk size, options
and target, plus the package and TVM versions. Batch, heads and length are symbolic, so one
compiled module serves every B, H and T."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings

from .runtime import cache, libfile
from .runtime.cache import root as cache_dir  # noqa: F401  (where the cache is: `cache`)
from .runtime.pool import size_once
from .schedule import TUNED, schedule_module  # noqa: F401  (TUNED: what marks a tuned kernel)
from .version import __version__

_MEMORY: dict = {}
_LOCK = threading.Lock()


_CODE_DIGEST = []


def sources_digest(*folders) -> str:
    """sha256 (hex) over the .py files, names and contents, of the package's `folders` (none:
    the whole package)."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for sub in folders or ("",):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, sub))):
            dirnames.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def code_digest() -> str:
    """sha256 over the source of the kernels and schedules (what decides the generated code),
    so that an edited kernel or schedule rule never finds a stale cache entry."""
    if not _CODE_DIGEST:
        _CODE_DIGEST.append(sources_digest("ops", "schedule")[:16])
    return _CODE_DIGEST[0]


def _key_blob(spec: dict, target) -> str:
    # TVM is imported where kernels are compiled: backend imports this module, which runs with the
    # TVM runtime alone
    import tvm

    # "sealed": entries carry the libfile trailer; older unsealed entries are simply not found
    return json.dumps({"spec": spec, "target": str(target), "hla_tvm": __version__,
                       "code": code_digest(), "tvm": tvm.__version__, "cache": "sealed"},
                      sort_keys=True)


def compile_kernels(funcs, target):
    """`tvm.compile` of the kernels {name: PrimFunc} (functions named so), each scheduled by
    its tuned record or the target's default rules (`schedule_module`)."""
    import tvm

    irmod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.compile(schedule_module(irmod, target), target=target)


def load_or_build(spec: dict, make_funcs, target, names=()):
    """The compiled runtime module for `spec`: from memory, else from disk, else built.

    make_funcs() returns {name: PrimFunc}. The built library is sealed with the digest of its
    spec and target (`libfile`) and written to the cache folder (`cache.folder`: private)
    atomically; a cached file that is truncated, corrupt, or sealed for another spec is
    refused before it is loaded, and one that lacks a function of `names` after, and rebuilt
    with a warning."""
    fast = (tuple(sorted(spec.items())), str(target))
    mod = _MEMORY.get(fast)  # the per-call path: no hashing, no lock
    if mod is not None:
        return mod
    blob = _key_blob(spec, target)
    tag = libfile.tag_of(blob)
    with _LOCK:
        if fast in _MEMORY:
            return _MEMORY[fast]
        try:   # (private, or ValueError: its libraries are loaded here)
            where = cache.folder()
        except OSError as err:   # read-only home, full disk: run from memory
            warnings.warn(f"hla_tvm: cannot create the kernel cache {cache.root()}: {err}")
            where = None
        path = None if where is None else \
            os.path.join(where, f"{spec['kind']}-{tag.hex()[:24]}.so")
        mod = None
        if path is not None and os.path.exists(path):
            try:   # (its seal and its spec digest are checked before it is loaded)
                mod = libfile.load(path, tag, what="cached kernel module")
                lacks = sorted(n for n in names if not mod.implements_function(n))
                if lacks:
                    mod = None
                    raise ValueError(f"it has no function {', '.join(lacks)}")
            except Exception as err:  # a truncated, corrupt or foreign file: rebuild it
                warnings.warn(f"hla_tvm: rebuilding unreadable cached kernel {path}: {err}")
        size_once()
        if mod is None:
            exe = compile_kernels(make_funcs(), target)
            mod = exe if path is None else _save(exe, path, tag)
        _MEMORY[fast] = mod
        return mod


def _save(exe, path, tag):
    try:
        libfile.export(exe, path, tag)
        return libfile.load(path, tag, what="cached kernel module")
    except OSError as err:  # read-only home, full disk: run from memory
        warnings.warn(f"hla_tvm: cannot write kernel cache {path}: {err}")
        return exe


def clear_memory_cache():
    with _LOCK:
        _MEMORY.clear()
