"""Checking scheduled kernels against a GPU's limits (threads per block, shared memory), on the
code TVM really generates: the function right before it is split into host and device parts,
its symbolic sizes fixed to a concrete call's."""
from __future__ import annotations

import math

import tvm
from tvm import s_tir

from .common import walk
from .rules.cuda import scheduled
from .shapes import specialize, tuning_kernels


def split_host_device(func, target):
    """(executable, functions before, functions after SplitHostDevice) of `func` compiled by
    `tvm.compile` for `target`: before, the one function with barriers inserted and shared
    memory merged; after, its host function (attribute "tirx.is_entry_func", launching the
    kernels) and the device kernels. (The functions are taken as the pass sees them: later
    passes may rewrite the module that held them.)"""
    seen = {}

    @tvm.instrument.pass_instrument
    class _Grab:
        def run_before_pass(self, mod, info):
            if info.name.endswith("SplitHostDevice"):
                seen.setdefault("before", list(mod.functions.values()))

        def run_after_pass(self, mod, info):
            if info.name.endswith("SplitHostDevice"):
                seen.setdefault("after", list(mod.functions.values()))

    with tvm.transform.PassContext(instruments=[_Grab()]):
        exe = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                          target=target)
    return exe, seen["before"], seen["after"]


def shared_bytes(func):
    """Bytes of shared memory the lowered `func` allocates (static and dynamic)."""
    total = []

    def visit(node):
        buf = getattr(node, "buffer", None)
        if type(node).__name__ == "AllocBuffer" and buf is not None and \
                buf.scope().startswith("shared"):
            n = math.prod(int(x) for x in buf.shape)
            total.append(n * tvm_bytes(buf.dtype))

    walk(func.body, visit)
    return sum(total)


def tvm_bytes(dtype):
    t = tvm.DataType(str(dtype))
    return t.bits * t.lanes // 8


def check(func, shapes, target, name="kernel"):
    """Lower the scheduled `func` specialized to `shapes` (one (shape, dtype) per argument) for
    `target` and verify it within the target's limits (`tvm.s_tir.analysis.verify_gpu_code`).
    Returns the shared memory bytes it uses; ValueError naming the kernel and the limits when it
    does not fit."""
    _, before, _ = split_host_device(specialize(func, shapes), target)
    lowered = before[0]
    limits = {"max_shared_memory_per_block": int(target.attrs["max_shared_memory_per_block"]),
              "max_threads_per_block": int(target.attrs["max_threads_per_block"]),
              "max_vthread": 8, "max_vector_bytes": 16}
    used = shared_bytes(lowered)
    if not s_tir.analysis.verify_gpu_code(lowered, limits):
        raise ValueError(f"{name}: the CUDA schedule exceeds {target.attrs['arch']}'s limits "
                         f"({used} bytes of shared memory; limits {limits})")
    return used


def fitting_chunk(fits, chunk):
    """The largest chunk size among `chunk`, chunk / 2, ... (down to 16) for which `fits(n)` is
    true: a chunk kernel holds a few n x n and n x D tiles in shared memory, and the chunked
    form gives the same outputs for any chunk size. ValueError when none fits."""
    n = chunk
    while True:
        if fits(n):
            return n
        if n <= 16 or n % 2:
            raise ValueError(f"no chunk size from {chunk} down to {n} fits the GPU's shared "
                             "memory for these head sizes")
        n //= 2


_FITS: dict = {}


def gpu_chunk(chain, dk, dv, target, *, chunk, group=1, **opts):
    """The chunk size `chain`'s kernels run with on a CUDA `target`: `chunk`, or the largest
    half of it whose kernels fit the architecture's shared memory (`check`;
    the chunked form's outputs do not depend on the chunk size). Remembered per process."""
    key = (chain.family, dk, dv, str(target), chunk, group, tuple(sorted(opts.items())))
    if key not in _FITS:
        def fits(n):
            try:
                for name, (func, shapes) in tuning_kernels(chain, dk, dv, chunk=n, group=group,
                                                           **opts).items():
                    check(scheduled(func.with_attr("global_symbol", name)), shapes, target,
                          name)
            except ValueError:
                return False
            return True

        _FITS[key] = fitting_chunk(fits, chunk)
    return _FITS[key]
