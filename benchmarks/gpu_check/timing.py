"""The timings on the GPU (the worker process `run` starts after the checks): device copy
bandwidth, decode steps and prefill chains (with their schedule variants) beside PyTorch."""
import json
import time

from .checks import Kernels, random_qkv, rel_err
from .entries import DECODE_TIMED, OPTS, entry_id


def cuda_time(fn, *, warmup=2, min_seconds=1.0, max_iters=200):
    """Mean seconds per call of fn() on the GPU (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    n = max(1, min(max_iters, int(min_seconds / max(once, 1e-6))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def copy_bandwidth(nbytes=2 << 30):
    """Bytes per second (read + written) of a device-to-device copy of nbytes."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_time(lambda: dst.copy_(src))


def worker_timing(args):
    import torch

    from hla_tvm.ops.chains import operator_of

    kern = Kernels(args.bundle)
    rows = []

    def emit(row):   # a later row of the same bench and family supersedes the earlier one
        print(json.dumps(row), flush=True)
        rows[:] = [r for r in rows if (r["bench"], r.get("family")) !=
                   (row["bench"], row.get("family"))] + [row]
        with open(args.result, "w") as f:
            json.dump(rows, f)

    copy_bw = copy_bandwidth()
    emit({"bench": "copy", "GB/s": copy_bw / 1e9})
    # decode B64 H32 D128, float32 state, no decay
    B, H, d = 64, 32, 128
    steps = {fam: operator_of(fam).fast.step_ for fam in ("hla2_decay", "ahla", "hla3")}
    for fam in DECODE_TIMED:
        if time.time() > args.deadline:
            break
        eid = entry_id(fam, "decode", "float32", d)
        e, chain, (fn,) = kern.functions(eid)
        ref = operator_of(fam).ref
        st = ref.zero_state(B, H, d, d, torch.float32, "cuda")
        q, k, v = (torch.randn(B, H, 1, d, device="cuda") * 0.1 for _ in range(3))
        o = torch.empty(B, H, 1, d, device="cuda")
        gamma = torch.ones(H, device="cuda")
        args_ = (q, k, v, gamma, *[st[n] for n in chain.state_names], o)
        nbytes = 2 * sum(x.numel() * 4 for x in st.values()) + 4 * (q.numel() * 4)
        with kern.ffi.use_torch_stream():
            t_tvm = cuda_time(lambda: fn(*args_))
        opts = dict(OPTS[fam])
        q3, k3, v3 = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        step = steps[fam]
        t_eager = cuda_time(lambda: step(q3, k3, v3, st, **opts))
        row = {"bench": "decode", "family": fam, "shape": "B64 H32 D128 float32",
               "tvm_ms": t_tvm * 1e3, "eager_ms": t_eager * 1e3,
               "tvm_GB/s": nbytes / t_tvm / 1e9, "state_MB": nbytes / 2 / 1e6,
               "share_of_copy_bw": nbytes / t_tvm / copy_bw}
        if eid + "@cpu-kernel" in kern.manifest["entries"]:   # the CPU's form of the kernel
            _, _, (fn_cpu,) = kern.functions(eid + "@cpu-kernel")
            with kern.ffi.use_torch_stream():
                t_cpu_form = cuda_time(lambda: fn_cpu(*args_))
            row["cpu_kernel_ms"] = t_cpu_form * 1e3
            row["cpu_kernel_share_of_copy_bw"] = nbytes / t_cpu_form / copy_bw
        if fam == "hla2_decay" or args.compile_all:
            try:
                t0 = time.time()
                compiled = torch.compile(step)
                compiled(q3, k3, v3, st, **opts)
                row["compile_s"] = time.time() - t0
                row["compiled_ms"] = cuda_time(lambda: compiled(q3, k3, v3, st, **opts)) * 1e3
            except Exception as err:
                row["compiled_error"] = f"{type(err).__name__}: {err}"[:300]
        emit(row)
    # prefill B1 H32 T D128 bfloat16, no decay (gamma = 1 for the decayed chains); an entry
    # "fam:g" runs that chain with decay g beside the PyTorch forms with decay g
    for item in args.prefill_families.split(","):
        if time.time() > args.deadline:
            break
        fam, _, g = item.partition(":")
        try:
            time_prefill(kern, fam, args.prefill_tokens, args.deadline, emit,
                         decay=float(g) if g else None)
        except Exception as err:   # kept with what was measured before it
            label = fam if not g else f"{fam} decay {float(g)}"
            done = [r for r in rows if (r["bench"], r.get("family")) == ("prefill", label)]
            emit({**(done[-1] if done else {"bench": "prefill", "family": label}),
                  "error": f"{type(err).__name__}: {err}"[:600]})
        torch.cuda.empty_cache()


def time_prefill(kern, fam, T, deadline, emit, decay=None):
    """Time one family's prefill chain at B1 H32 T D128 bfloat16 (and each kernel of it) beside
    the PyTorch chunk form (eager, torch.compile) and SDPA causal softmax; its error against
    the chunk form in float64. With `decay` (every head's) the chain and the PyTorch forms
    decay; the schedule variants are then not timed."""
    import torch
    import torch.nn.functional as F

    from hla_tvm import backend
    from hla_tvm.ops.chains import operator_of

    B, H, d, dtype = 1, 32, 128, torch.bfloat16
    eid = entry_id(fam, "prefill", "bfloat16", d)
    e, chain, fns = kern.functions(eid)
    q, k, v = (x * 0.2 for x in random_qkv(B, H, H, T, d, dtype, 1))
    out = torch.empty(B, H, T, d, dtype=dtype, device="cuda")
    zero = operator_of(fam).ref.zero_state(B, H, d, d, torch.float32, "cuda")
    gamma = torch.full((H,), 1.0 if decay is None else decay, device="cuda")

    def tvm_prefill(eid=eid):
        kern.run(eid, {"q": q, "k": k, "v": v, "gamma": gamma,
                       **{n: x.zero_() for n, x in zero.items()}}, out)
        return out

    row = {"bench": "prefill", "family": fam if decay is None else f"{fam} decay {decay}",
           "shape": f"B1 H32 T{T} D128 bfloat16", "chunk": e["chunk"]}
    row["tvm_ms"] = cuda_time(tvm_prefill, warmup=1, min_seconds=2, max_iters=10) * 1e3
    o_tvm = tvm_prefill().clone()
    # each kernel of the chain, on the buffers of one full run (timing repeats in-place
    # kernels, so their outputs are not looked at afterwards)
    env = {"q": q, "k": k, "v": v, "gamma": gamma, **{n: x.zero_() for n, x in zero.items()}}
    nc = -(-T // e["chunk"])
    per = {}
    with kern.ffi.use_torch_stream():
        backend.run_chain(chain, fns, env, out, e["chunk"])
        for i, (call, fn) in enumerate(zip(chain.calls, fns)):
            argv = backend.call_arguments(call, env, nc, gamma)   # (one group: gamma_kv)
            per[f"{i}:{call.kernel}"] = round(cuda_time(lambda: fn(*argv), warmup=1,
                                                        min_seconds=0.3, max_iters=20) * 1e3, 3)
    row["tvm_kernels_ms"] = per
    emit(dict(row))
    for vid in [x for x, v in kern.manifest["entries"].items()
                if x.startswith(eid + "@") and v.get("variant") and decay is None]:
        if time.time() > deadline:
            break
        vrow = row.setdefault("variants", {})[vid.split("@", 1)[1]] = {}
        try:
            vrow["tvm_ms"] = cuda_time(lambda: tvm_prefill(vid), warmup=1, min_seconds=2,
                                       max_iters=10) * 1e3
            vrow["rel_diff_vs_default"] = rel_err(tvm_prefill(vid), o_tvm)
        except Exception as err:
            vrow["error"] = f"{type(err).__name__}: {err}"[:300]
        emit(dict(row))
    form = operator_of(fam).fast.chunked
    o64 = form(q.double(), k.double(), v.double(), chunk_size=64, decay=decay)[0]
    row["tvm_rel_err_vs_float64"] = rel_err(o_tvm, o64)
    row["bf16_rounding_floor"] = rel_err(o64.to(dtype), o64)
    del o64
    qw, kw, vw = (x.float() for x in (q, k, v))

    def torch_form():
        return form(qw, kw, vw, chunk_size=64, decay=decay)[0].to(dtype)

    row["torch_fp32_ms"] = cuda_time(torch_form, warmup=1, min_seconds=2, max_iters=10) * 1e3
    row["torch_bf16_ms"] = cuda_time(lambda: form(q, k, v, chunk_size=64, decay=decay),
                                     warmup=1, min_seconds=2, max_iters=10) * 1e3
    row["sdpa_flash_ms"] = cuda_time(lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True), warmup=2, min_seconds=2, max_iters=20) * 1e3
    emit(dict(row))
    if time.time() < deadline:
        try:
            t0 = time.time()
            compiled = torch.compile(torch_form)
            compiled()
            row["compile_s"] = time.time() - t0
            row["torch_compiled_fp32_ms"] = cuda_time(compiled, warmup=1, min_seconds=2,
                                                      max_iters=10) * 1e3
        except Exception as err:
            row["compiled_error"] = f"{type(err).__name__}: {err}"[:300]
        emit(row)
