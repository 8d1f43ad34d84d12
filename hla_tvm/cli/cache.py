"""`hla-tvm cache`: the cache folder by kind, and clearing the package's own files
(`runtime.cache`)."""
from __future__ import annotations

import os

DESCRIPTION = ("List the cache folder ($HLA_TVM_CACHE_DIR, else "
               "~/.cache/hla_tvm) by kind, or --clear it. --clear removes only "
               "the files the package put there (compiled kernels and models, "
               "device code, downloaded runtimes), never another file in the "
               "folder, and keeps the tuned records of `hla-tvm tune` (minutes to "
               "hours of work) unless --records is given too.")


def add_arguments(p):
    """The command's options."""
    p.add_argument("--clear", action="store_true",
                   help="delete the cached compiled files (not the tuned records)")
    p.add_argument("--records", action="store_true",
                   help="with --clear: delete the tuned records under schedules/ too")


_CACHE_KINDS = {"kernels": "compiled kernel modules",
                "models": "compiled models (of demo and bench model)",
                "device": "CUDA device code", "emulator": "emulated CUDA kernels",
                "runtime": "TVM runtimes of other architectures",
                "checked": "records files read once apart (no fault)",
                "records": "tuned records (hla-tvm tune)"}


def _model_line(path):
    """What a cached compiled model is (its model's shape, weight scheme and target, from the
    metadata its library holds: nothing is loaded), or why that cannot be read."""
    # the library is imported once the arguments are parsed: `hla-tvm cache --help` (and `hla-tvm
    # --help`) import this module
    from ..runtime.model import read_meta, scheme_name

    try:
        meta = read_meta(path)
    except (OSError, ValueError) as err:
        return f"(unreadable: {str(err).split(': ', 1)[-1]})"
    cfg = meta.get("config") or {}
    shape = ", ".join(f"{k} {cfg[k]}" for k in ("d_model", "n_layers", "n_heads", "vocab_size")
                      if k in cfg)
    target = (meta.get("schedules") or {}).get("target") or meta.get("device") or "?"
    return f"{shape or 'a model'}; {scheme_name(meta)}; for {target}"


def main(args):
    from ..runtime import cache

    path = cache.root()
    if args.records and not args.clear:
        raise ValueError("--records goes with --clear (the listing shows the records)")
    if args.clear:
        removed = cache.clear(records=args.records)
        kinds = {}
        for p, kind in removed:
            kinds[kind] = kinds.get(kind, 0) + 1
        what = ", ".join(f"{n} {_CACHE_KINDS[k]}" for k, n in kinds.items()) or "nothing"
        print(f"removed from {path}: {what}")
        kept = [p for p, kind in cache.entries(records=True) if kind == "records"]
        if kept:
            print(f"kept the tuned records in {os.path.join(path, cache.RECORDS)} "
                  f"({', '.join(os.path.basename(p) for p in kept)}): --clear --records "
                  "removes them too")
        left = cache.others()
        if left:
            print(f"left {len(left)} file(s) that are not the cache's alone, e.g. {left[0]}")
        return 0
    found = cache.entries(records=True)
    if not found:
        print(f"{path}: empty (kernels are compiled and cached on first use)")
        return 0
    print(path)
    for kind, label in _CACHE_KINDS.items():
        mine = [p for p, k in found if k == kind]
        if mine:
            print(f"  {label}: {len(mine)}, {sum(cache.size(p) for p in mine) / 1e6:.1f} MB")
            for p in mine[:20]:
                about = f"  {_model_line(p)}" if kind == "models" else ""
                print(f"    {os.path.relpath(p, path)}{'/' if os.path.isdir(p) else ''}  "
                      f"{cache.size(p) / 1e3:.0f} kB{about}")
            if len(mine) > 20:
                print(f"    ... {len(mine) - 20} more")
    left = cache.others()
    if left:
        print(f"  not the cache's ({len(left)}; --clear leaves them): "
              + ", ".join(os.path.relpath(p, path) for p in left[:5])
              + (" ..." if len(left) > 5 else ""))
    return 0
