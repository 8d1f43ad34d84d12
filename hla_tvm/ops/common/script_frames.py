"""TVMScript parsing without `inspect`'s module scans.

TVMScript looks at the Python stack as it parses: `T.prim_func` calls `inspect.stack()`, every
`T.macro` call `inspect.getouterframes`. For each frame, `inspect.getmodule` looks the frame's
file up in its cache (`inspect.modulesbyfile`) and, on a miss, scans all of `sys.modules`
(about 2,000 modules once torch is imported): about 0.5 ms each time. Some files always miss,
as no module has them as its `__file__`: "<ast>" (the expressions TVMScript's evaluator
compiles), "<string>" (code made by `exec`) and "<frozen NAME>" (importlib's frames, on the
stack during every import). A miss ends in None for a frame (no module has such a name as its
`__file__`; one that did would no longer be found for them). `skip_module_scans` files those
names in the cache under a name no module has, so that `sys.modules.get` gives the same None at
once. Measured with and without it (2-core Zen 4 VM, 2026-12-06): importing
`tvm.s_tir.tensor_intrin` (which meta_schedule does) 4.5 against 24.6 s; three chunk kernels
parsed 40 frames deep 0.45 against 0.89 s; the test of `hla-tvm bench decode` and `prefill` 28
against 52 s. A first `hla()` call from a shallow script takes 8 s either way: LLVM's compile
is most of it."""
from __future__ import annotations

import inspect
import sys

NO_MODULE = "<no module: hla_tvm.ops.common.script_frames>"   # (never a module's name)


def skip_module_scans():
    """File the stack's module-less file names in `inspect.modulesbyfile` (see the module's
    docstring); what `inspect` answers for them stays the same."""
    names = ["<ast>", "<string>"] + [
        f"<frozen {name}>" for name, module in list(sys.modules.items())
        if getattr(getattr(module, "__spec__", None), "origin", None) == "frozen"]
    for name in names:
        inspect.modulesbyfile.setdefault(name, NO_MODULE)
