"""Running HLA operators through the compiled TensorIR kernels (torch tensors in and out).

Each operator's kernels and the order they run in are its chain (`ops.chains`); this module
compiles a chain's kernels for a target (cached, `build`) and runs the chain on torch tensors.
The state is the reference's dict in the accumulation dtype (float32 for float16, bfloat16 and
float32 inputs, float64 for float64), advanced in place; outputs come in the input dtype."""
from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import build
from .ops import chains, state_dtype
from .runtime.pool import default_threads, use_threads
from .validate import ALIGN, aligned


def private_copy(x, dtype, device=None):
    """A new contiguous tensor of `dtype` (float32 or float64) on `device` (None: x's) holding
    x's values, copied once; on the CPU on the calling thread alone. PyTorch copies large tensors
    with its OpenMP threads, whose workers keep spinning on the cores after the copy; a TVM kernel
    launched right after then
    waits for a scheduler time slice (measured: 3.5 ms stalls on a 2-core machine, a 0.3 ms
    functional decode at B=8 taking 4 ms)."""
    device = x.device if device is None else torch.device(device)
    if x.numel() <= SERIAL_COPY or x.dtype not in (torch.float16, torch.float32, torch.float64) \
            or x.device.type != "cpu" or device.type != "cpu":
        # (PyTorch copies these on the calling thread too)
        return x.to(device, dtype, memory_format=torch.contiguous_format, copy=True)
    out = torch.empty(x.shape, dtype=dtype)
    np.copyto(out.numpy(), x.detach().numpy(), casting="unsafe")
    return out


SERIAL_COPY = 32768   # PyTorch's grain size: smaller copies do not use its threads


def module(chain, dk, dv, target, *, chunk=None, group=1, schedules="auto", **opts):
    """The compiled module holding every kernel of `chain` (functions named by
    `chains.kernel_name`), for k, v with H / group heads; opts from `kernel_options`.
    schedules: "auto", "default" or a records folder (`schedule.tuning.records`); kernels with a
    record use its schedule, the others the default one."""
    # TVM's compiler (schedule.tuning, schedule.gpu_limits) and tvm_ffi are imported where used:
    # this module imports with the TVM runtime alone (benchmarks/gpu_check run)
    from .schedule.tuning import records

    opts = {**opts, **chains.target_options(chain, target, opts.get("dtype"))}
    phase = "decode" if chain.calls[0].kernel == "decode" else "prefill"
    spec = {"kind": f"{chain.family}_{phase}", "dk": dk, "dv": dv, **opts}
    if chunk is not None:
        spec["chunk"] = chunk
    if group > 1:
        spec["group"] = group
    path, digest = records.find(schedules, target)
    if path is not None:
        spec["records"] = digest

    def make():
        kernels = records.tuning_kernels(chain, dk, dv, chunk=chunk, group=group, **opts)
        return records.pick(kernels, None if path is None else records.load(path), target,
                            path=path)

    names = {chains.kernel_name(chain, call, dk, dv, group) for call in chain.calls}
    return build.load_or_build(spec, make, target, names=names)


def functions(chain, mod, dk, dv, group=1):
    """The compiled function of each call of `chain`, in order."""
    return [mod[chains.kernel_name(chain, call, dk, dv, group)] for call in chain.calls]


# Scratch (per-chunk summaries and records) a prefill call may hold: larger inputs run in parts
# (`_segmented`: `head_blocks`, segments of T), each advancing its slice of the state in place,
# so memory does not grow with T.
SCRATCH_BYTES = 128 << 20


def scratch_per_chunk(chain, dk, dv, n):
    """Accumulation values per chunk (of n tokens) and head that `chain`'s per-chunk buffers
    hold."""
    return sum(math.prod(chains.KIND_SHAPES[kind](dk, dv, n))
               for kind in chain.kinds().values() if kind != "o")


def _chunk_bytes(chain, dk, dv, n, acc):
    """Bytes of `chain`'s per-chunk buffers for one chunk (of n tokens) and head, in the
    accumulation dtype `acc`."""
    return scratch_per_chunk(chain, dk, dv, n) * (torch.finfo(acc).bits // 8)


def segment_tokens(chain, B, H, dk, dv, chunk_size, acc, budget=None):
    """Tokens per segment: whole chunks whose scratch fits in `budget` bytes (None:
    SCRATCH_BYTES); at least one."""
    per_chunk = B * H * _chunk_bytes(chain, dk, dv, chunk_size, acc)
    return chunk_size * max(1, (budget or SCRATCH_BYTES) // per_chunk)


def gpu_scratch_budget(device):
    """Scratch bytes a prefill on CUDA `device` may hold: an eighth of the GPU's memory, at most
    half of what is free now, at least SCRATCH_BYTES. A GPU runs long inputs in segments of T
    (`_segmented`), each a round of kernel launches over fewer chunks; 128 MB made 103 segments
    of second order at B1 H32 T32768 D128 (the whole chain's scratch: 12.9 GB)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(SCRATCH_BYTES, min(total // 8, free // 2))


def head_blocks(chain, B, H, Hkv, T, dk, dv, chunk_size, acc, budget=None):
    """The (batch, head) blocks a CPU prefill runs, as (b0, b1, h0, h1): the whole input where
    its scratch fits `budget` bytes (None: SCRATCH_BYTES), else rows of whole batch entries,
    else blocks of whole head groups (H / Hkv heads) of one entry: the fewest blocks that fit,
    their sizes differing by one at most. Each block's q, k, v, output and state are
    contiguous slices of the caller's tensors, copied only where a slice does not start
    64-byte aligned (a state slice then written back); a block whose scratch still exceeds
    the budget (a single group over a very long T) runs in segments of T (`segment_tokens`)."""
    group = H // Hkv
    per_head = math.ceil(T / chunk_size) * _chunk_bytes(chain, dk, dv, chunk_size, acc)
    fit = (budget or SCRATCH_BYTES) // per_head   # heads whose whole-T scratch fits
    if fit >= B * H:
        return [(0, B, 0, H)]
    if fit >= H:   # rows of whole batch entries
        return [(b0, b1, 0, H) for b0, b1 in _even_parts(B, fit // H)]
    return [(b, b + 1, group * g0, group * g1) for b in range(B)
            for g0, g1 in _even_parts(H // group, max(1, fit // group))]


def _even_parts(count, most):
    """[(start, end)] splitting range(count) into the fewest parts of at most `most` items,
    their sizes differing by one at most."""
    parts = -(-count // most)
    size, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds, bounds[1:]))


def _segmented(chain, q, k, v, gamma, state, chunk_size, run):
    """o [B, H, T, dv]: run(env, o) (env: q, k, v, gamma and `state`'s entries, as
    `run_chain` reads them) on the whole input, or on its parts: on a CPU the (batch, head)
    blocks of `head_blocks`, slices of the caller's tensors, one after another, or, where
    those blocks hold fewer heads than the workers, blocks within an equal share of
    SCRATCH_BYTES each, run at once by as many threads of one worker each (`_block_workers`:
    the scans and the carry, sequential over chunks, then keep every core busy); on a GPU,
    where a block of fewer heads would leave the scans' lanes idle, consecutive segments of T
    within `gpu_scratch_budget` (copies), each continuing the state the one before left."""
    B, H, T, dk = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    acc = state_dtype(q.dtype)
    out = torch.empty(B, H, T, dv, dtype=q.dtype, device=q.device)
    blocks = head_blocks(chain, B, H, Hkv, T, dk, dv, chunk_size, acc) \
        if q.device.type == "cpu" else [(0, B, 0, H)]
    group = H // Hkv

    def block(bounds, budget=None):
        b0, b1, h0, h1 = bounds
        kv = slice(h0 // group, h1 // group)
        # (validate.state: key/value-head entries have Hkv heads, query-head ones H)
        part = {name: x[b0:b1, h0:h1] if x.shape[1] == H else x[b0:b1, kv]
                for name, x in state.items()}
        assert all(x.is_contiguous() for x in part.values())   # whole rows or one row
        env = {name: aligned(x) for name, x in part.items()}   # an unaligned slice: a copy
        env["gamma"] = None if gamma is None else aligned(gamma[h0:h1])
        _run_segments(chain, q[b0:b1, h0:h1], k[b0:b1, kv], v[b0:b1, kv], env,
                      out[b0:b1, h0:h1], chunk_size, acc, run, budget)
        for name, x in part.items():
            if env[name] is not x:
                x.copy_(env[name])

    workers = default_threads() if q.device.type == "cpu" else 1
    if workers > 1 and len(blocks) > 1 and \
            min((b1 - b0) * (h1 - h0) for b0, b1, h0, h1 in blocks) < workers:
        # blocks of fewer heads than workers: sequential over chunks, a block's scans and
        # carry would keep one core busy; the blocks run at once instead, one worker each,
        # within the same scratch in all
        share = SCRATCH_BYTES // workers
        blocks = head_blocks(chain, B, H, Hkv, T, dk, dv, chunk_size, acc, share)
        list(_block_workers(workers).map(lambda bounds: block(bounds, share), blocks))
    else:
        for bounds in blocks:
            block(bounds)
    return out


_BLOCKS = {}   # worker count -> the executor running a CPU prefill's blocks at once
_BLOCKS_LOCK = threading.Lock()
_WORKER = threading.local()   # a block worker's scratch holder (its kernels run on 1 worker)
_WORKER_SCRATCH = []


def _block_workers(n):
    """The executor of `n` threads that runs a CPU prefill's (batch, head) blocks at once
    (`_segmented`), each thread's kernels on one TVM worker, each with its own scratch."""
    with _BLOCKS_LOCK:
        if n not in _BLOCKS:
            def start():
                _WORKER.scratch = _Buffer()
                with _BLOCKS_LOCK:
                    _WORKER_SCRATCH.append(_WORKER.scratch)

            _BLOCKS[n] = ThreadPoolExecutor(n, thread_name_prefix="hla_tvm-blocks",
                                            initializer=start)
        return _BLOCKS[n]


def _run_segments(chain, q, k, v, env, out, chunk_size, acc, run, budget=None):
    """run(env with q, k, v, out) over the whole of T, or over consecutive segments of
    `segment_tokens` within `budget` (copies of the inputs' slices where they are not
    contiguous; on a GPU within `gpu_scratch_budget`), the state in env (accumulation dtype
    `acc`) carried between them."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    seg = segment_tokens(chain, B, H, dk, dv, chunk_size, acc, budget)
    if seg < T and q.device.type != "cpu":
        seg = segment_tokens(chain, B, H, dk, dv, chunk_size, acc, gpu_scratch_budget(q.device))
    for start in range(0, T, seg):
        end = min(T, start + seg)
        qs, ks, vs, os_ = (x[:, :, start:end] for x in (q, k, v, out))
        dst = os_ if os_.is_contiguous() and os_.data_ptr() % ALIGN == 0 else \
            torch.empty(os_.shape, dtype=out.dtype, device=out.device)
        run(dict(env, q=aligned(qs.contiguous()), k=aligned(ks.contiguous()),
                 v=aligned(vs.contiguous())), dst)
        if dst is not os_:
            os_.copy_(dst)


class _Buffer:
    """One flat scratch buffer, kept between calls: a prefill's per-chunk buffers are views of
    it, so repeated calls touch memory that is already mapped (fresh allocations of this size
    come from mmap and fault in every page on first write)."""
    buf = None

    def take(self, numel, dtype):
        if self.buf is None or self.buf.numel() < numel or self.buf.dtype != dtype:
            self.buf = None
            self.buf = torch.empty(numel, dtype=dtype)
        return self.buf


class _Scratch(_Buffer, threading.local):
    """A `_Buffer` per thread."""


_SCRATCH = _Scratch()


def release_scratch():
    """Free this thread's kept prefill scratch (at most about SCRATCH_BYTES) and the block
    workers' (`_segmented`; together at most about SCRATCH_BYTES); call it while no prefill
    runs."""
    _SCRATCH.buf = None
    with _BLOCKS_LOCK:
        for holder in _WORKER_SCRATCH:
            holder.buf = None


def run_chain(chain, fns, env, out, chunk_size):
    """Call `chain`'s compiled functions `fns` in order, on the device of env["q"] (the
    functions compiled for it): env maps the reads (q, k, v, gamma and
    the state entries, which are advanced in place; the chain's key/value-head entries with the
    key/value heads of k) to tensors; the per-chunk buffers the calls write are views of this
    thread's scratch; the output goes to `out` [B, H, T, Dv]."""
    B, H, T, dk = env["q"].shape
    Hkv = env["k"].shape[1]
    dv = out.shape[-1]
    nc = math.ceil(T / chunk_size)
    shapes = chains.buffer_shapes(chain, B, H, Hkv, nc, dk, dv, chunk_size)
    # each buffer starts 64-byte aligned, as TVM's own allocations do
    sizes = {name: -(-math.prod(shape) // 16) * 16 for name, shape in shapes.items()}
    numel, acc, device = sum(sizes.values()) + 16, state_dtype(env["q"].dtype), env["q"].device
    # on a GPU a fresh buffer per call: PyTorch's caching allocator ties it to the stream, where
    # one kept per thread could be overwritten by a call on another stream still reading it
    if device.type == "cpu":   # (a block worker of `_segmented` has a buffer of its own)
        flat = getattr(_WORKER, "scratch", _SCRATCH).take(numel, acc)
    else:
        flat = torch.empty(numel, dtype=acc, device=device)
    at = -(flat.data_ptr() // flat.element_size()) % 16
    for name, shape in shapes.items():
        env[name] = flat[at:at + math.prod(shape)].view(shape)
        at += sizes[name]
    env["o"] = out
    gamma_kv = None
    if env.get("gamma") is not None:   # the kv calls' decay: each group's first query head
        gamma_kv = env["gamma"] if Hkv == H else env["gamma"][::H // Hkv].contiguous()
    if device.type == "cpu":   # (every worker: `decode_` may have left this thread on one; a
        # block worker of `_segmented` runs on its own)
        use_threads(1 if hasattr(_WORKER, "scratch") else default_threads())
    for call, fn in zip(chain.calls, fns):
        fn(*call_arguments(call, env, nc, gamma_kv))
    return out


def call_arguments(call, env, nc, gamma_kv=None):
    """The arguments of one chain call, its reads then its writes, from `env` (as `run_chain`
    fills it; nc chunks; gamma_kv: the decay the kv calls read): a scan's state, increments and
    record flattened to [B, heads, (nc,) width]."""
    args = [gamma_kv if call.kv and x == "gamma" else env[x] for x in call.reads]
    writes = [env[x] for x, _ in call.writes]
    if call.kernel == "scan":   # element-wise
        B, heads = args[0].shape[:2]
        args[:2] = [args[0].view(B, heads, -1), args[1].view(B, heads, nc, -1)]
        writes = [writes[0].view(B, heads, nc, -1)]
    return args + writes


def on_stream(device):
    """The context the kernels run in for tensors on torch `device`: on a CUDA device, that
    device (the current one restored after) and PyTorch's current stream on it (kernels and
    PyTorch's work stay ordered); nothing on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    import tvm_ffi

    return tvm_ffi.use_torch_stream(torch.cuda.device(device))


def prefill(fam, q, k, v, gamma, state, *, chunk_size, target, schedules="auto", **opts):
    """Outputs [B, H, T, dv] of kernel family `fam` for contiguous q [B, H, T, dk] and k, v with
    H or H / group heads (grouped key/value heads; one floating dtype);
    gamma [H] in the accumulation dtype (None where the chain takes none); `state` (the
    reference's names, accumulation dtype, contiguous, owned by the caller; the operator's
    key/value-only entries with the key/value heads) is advanced in place past the T tokens.
    opts from `kernel_options`; schedules as for `module`. On a CUDA target the chunk is the
    largest up to chunk_size whose tiles fit the GPU (`schedule.gpu_limits.gpu_chunk`;
    outputs do not depend on it)."""
    dk, dv = q.shape[-1], v.shape[-1]
    q, k, v = aligned(q), aligned(k), aligned(v)
    chain = chains.prefill(fam)
    group = q.shape[1] // k.shape[1]
    if target.kind.name == "cuda":
        from .schedule import gpu_limits as limits

        chunk_size = limits.gpu_chunk(chain, dk, dv, target, chunk=chunk_size, group=group,
                                      **opts)
    mod = module(chain, dk, dv, target, chunk=chunk_size, group=group, schedules=schedules,
                 **opts)
    fns = functions(chain, mod, dk, dv, group)
    with on_stream(q.device):
        return _segmented(chain, q, k, v, gamma, state, chunk_size,
                          lambda env, out: run_chain(chain, fns, env, out, chunk_size))
