"""Every HLA kernel checked on an NVIDIA GPU against the float64 reference, and decode and
prefill timed there beside PyTorch, from a bundle made on a machine with TVM's compiler.

    python benchmarks/gpu_check.py prepare [--bundle gpu_bundle] [--arch sm_90]
        (here: TVM's compiler and nvcc) compiles the CUDA kernel modules the check runs (and
        the timed prefills' schedule variants), builds their device code with nvcc, and
        gathers the runtime: libtvm_runtime.so,
        libtvm_runtime_cuda.so and a cp312 apache-tvm-ffi wheel (pip downloads it once).
    python benchmarks/gpu_check.py emulate [--only 'hla2_decay,float32,8;ahla'] [--arch sm_90]
        (here, no GPU) the same checks with every CUDA kernel emulated on the CPU thread by
        thread (`hla_tvm.tools.cuda_emulator`), threads in forward and in reverse order.
    python benchmarks/gpu_check.py run [--bundle gpu_bundle] [--out DIR]
        (on the GPU machine: PyTorch with CUDA and apache-tvm-ffi; no TVM) runs the checks, each
        group of kernels in its own process (a kernel that faults or hangs fails its group
        alone), then the timings; prints Markdown tables and writes DIR/gpu_check.json and .md.
    python benchmarks/gpu_check.py models [--out DIR]
        (on the GPU machine: TVM's runtime alone) the bundle's compiled models (a tiny HLALM and
        the shipped demo model, `hla-tvm compile --target cuda`) through
        `hla_tvm.runtime.load(device="cuda")` against their checkpoints in PyTorch; then each
        model's `hla-tvm bundle`, made there, through its generate.py and the C++ app (built by
        `prepare`), their greedy tokens against PyTorch's.
    python benchmarks/gpu_check.py api [--out DIR] [--device cuda]
        (on a GPU machine with TVM's compiler) `hla()` and `decode_()` on CUDA tensors against
        the float64 reference: the user's path, kernels compiled there on first use.

On a lent GPU machine (the `device` tool; the bundle is git-ignored, so carry it), one call:

    carry ["gpu_bundle"]; command:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site gpu_bundle/wheels/*.whl &&
    tar -xJf gpu_bundle/runtime/tvm-python.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site &&
    python3 benchmarks/gpu_check.py run --out $OUT && python3 benchmarks/gpu_check.py models --out $OUT

(`api` needs TVM's compiler there: its 100 MB wheel does not fit one call; split in two parts
carried by two calls while the machine stays warm, it did.)

The kernels run through `hla_tvm.backend.run_chain` with the chains of `hla_tvm.ops.chains`
(neither needs TVM's compiler); the references are `hla_tvm.reference` in float64 on the GPU.
Timed: decode at B64 H32 D128 (float32 state) against `hla_tvm.fast.step` eager and under
torch.compile, as a share of the measured copy bandwidth; prefill at B1 H32 T32768 D128 bfloat16
against `hla_tvm.fast.chunk` (float32 work, as `hla(backend="torch")`) eager and under
torch.compile, and SDPA causal softmax (flash) on the same inputs, each family's chain also
with the schedule variants of `VARIANTS` (the schedule the H200 timed among them), so a
schedule change is judged beside its predecessor in one run.

TVM 0.27 keeps a module's CUDA code as source and builds it when the module is loaded, through
the `tvm_callback_cuda_compile` hook. `run` registers a hook serving the device code `prepare`
built (looked up by the source's sha256; nvcc there builds any source not found)."""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

FFI_WHEEL = "apache-tvm-ffi==0.1.14.post0"   # pyproject's pin
OPTS = {"hla2": dict(masked=True, ridge=0.0), "hla2_decay": dict(masked=True, ridge=0.0),
        "ahla": {}, "hla3": {}}
OPERATOR = {"hla2": "hla2", "hla2_decay": "hla2", "ahla": "ahla", "hla3": "hla3"}
# (family, dtype, head size, group, normalize): one module of its prefill chain and one of its
# decode chain (second order decodes with hla2_decay's kernel)
CHECKS = [(fam, dtype, d, 1, False) for fam in ("hla2", "hla2_decay", "ahla", "hla3")
          for dtype in ("float32", "bfloat16") for d in (64, 128)] + [
    ("hla2", "float32", 64, 1, True), ("hla2_decay", "float32", 64, 2, False),
    ("ahla", "bfloat16", 64, 2, True), ("hla3", "float32", 64, 2, False),
    # head size 8 with chunks of 16: the tiny model whose compiled CUDA prefill was wrong past
    # one chunk on the H200 (docs/cuda.md)
    ("hla2", "float32", 8, 1, False), ("hla2_decay", "float32", 8, 1, False)]
DECODE_TIMED = ("hla2_decay", "ahla", "hla3")   # B64 H32 D128 float32
# prefill chains (B1 H32 T D128 bfloat16) built with other schedules too (`cuda.schedule`'s
# variant arguments; "chunk": another chunk size) and timed beside the default in the same
# run: the schedule the H200 timed on 2026-12-04 (scans one block per (batch, head), one output
# per thread, 128 threads), the register tiles on 128 threads, and chunks of 32 (less shared memory per
# block: AHLA's and third order's kernels take up to 197 kB at 64, one block per
# multiprocessor)
PREFILL_VARIANTS = ("hla2_decay", "ahla", "hla3")
VARIANTS = {"h200-timed": dict(lanes=False, tiles=(), chunk_threads=128),
            "tiles-128-threads": dict(chunk_threads=128),
            "chunk-32": dict(chunk=32)}


def entry_id(fam, phase, dtype, d, group=1, normalize=False):
    return f"{fam}-{phase}-{dtype}-d{d}" + (f"-g{group}" if group > 1 else "") + \
        ("-norm" if normalize else "")


# ----------------------------------------------------------------------------- prepare (here)

def entries(target, checks=CHECKS, timed=True):
    """[(entry id, chain, head size, group, chunk, kernel options)] of the modules `checks`
    run (a prefill and a decode each) and, with `timed`, the timed decodes; chunk: what the
    prefill runs with on `target` (`limits.gpu_chunk`), None for decode."""
    from hla_tvm.ops import chains
    from hla_tvm.schedule.rules.cuda import limits

    wanted = []
    for fam, dtype, d, group, normalize in checks:
        opts = dict(OPTS[fam], normalize=normalize, eps=1e-6, dtype=dtype)
        wanted.append((entry_id(fam, "prefill", dtype, d, group, normalize),
                       chains.prefill(fam), d, group, opts))
        dfam = "hla2_decay" if fam == "hla2" else fam
        dchain = chains.decode(dfam)
        wanted.append((entry_id(dfam, "decode", dtype, d, group, normalize), dchain, d, group,
                       dict(OPTS[dfam], normalize=normalize, eps=1e-6, dtype=dtype,
                            **chains.gpu_options(dchain))))
    for fam in DECODE_TIMED if timed else ():   # no decay (gamma = 1), plain options
        dchain = chains.decode(fam)
        plain = dict(OPTS[fam], normalize=False, eps=1e-6, dtype="float32")
        wanted.append((entry_id(fam, "decode", "float32", 128), dchain, 128, 1,
                       dict(plain, **chains.gpu_options(dchain))))
        if chains.gpu_options(dchain):   # timed beside the kernel the CPU runs
            wanted.append((entry_id(fam, "decode", "float32", 128) + "@cpu-kernel", dchain, 128,
                           1, plain))
    out, seen = [], set()
    for eid, chain, d, group, opts in wanted:
        if eid not in seen:
            seen.add(eid)
            chunk = None if chain.calls[0].kernel == "decode" else limits.gpu_chunk(
                chain, d, d, target, chunk=64 if d >= 32 else 16, group=group, **opts)
            out.append((eid, chain, d, group, chunk, opts))
    return out


def prepare(args):
    """Compile the check's modules for the GPU, build their device code, gather the runtime."""
    import tvm

    from hla_tvm.build import compile_kernels
    from hla_tvm.runtime.device_code import cuda_source, store
    from hla_tvm.schedule import TUNED
    from hla_tvm.schedule.rules import cuda
    from hla_tvm.schedule.tuning import records
    from hla_tvm.target import resolve

    target = resolve({"kind": "cuda", "arch": args.arch})
    bundle = os.path.abspath(args.bundle)
    for sub in ("modules", "device", "models"):   # built again: never an earlier schedule's
        shutil.rmtree(os.path.join(bundle, sub), ignore_errors=True)
    for sub in ("modules", "device", "runtime", "wheels"):
        os.makedirs(os.path.join(bundle, sub), exist_ok=True)
    manifest = {"arch": args.arch, "tvm": tvm.__version__, "entries": {}}
    wanted = entries(target)
    timed_variants = {entry_id(fam, "prefill", "bfloat16", 128) for fam in PREFILL_VARIANTS}
    for n, (eid, chain, d, group, chunk, opts) in enumerate(wanted):
        decode = chain.calls[0].kernel == "decode"
        t0 = time.time()
        variants = {None: None}
        if not decode and eid in timed_variants:
            variants.update(VARIANTS)
        for variant, how in variants.items():
            how = dict(how or {})
            vchunk = how.pop("chunk", chunk)
            if variant is not None and (vchunk, how) == (chunk, {}):
                continue   # the default itself
            vid = eid if variant is None else f"{eid}@{variant}"
            path = os.path.join(bundle, "modules", vid + ".so")
            if not os.path.exists(path):   # (another entry's module may be this one)
                kernels = records.tuning_kernels(chain, d, d, chunk=vchunk, group=group, **opts)
                funcs = {name: f if variant is None else
                         cuda.schedule(f.with_attr("global_symbol", name), **how).with_attr(
                             TUNED, True) for name, (f, _) in kernels.items()}
                exe = compile_kernels(funcs, target)
                store(os.path.join(bundle, "device"), cuda_source(exe), [args.arch])
                exe.export_library(path + ".tmp.so")
                os.replace(path + ".tmp.so", path)
            manifest["entries"][vid] = {
                "family": chain.family, "phase": "decode" if decode else "prefill",
                "dtype": opts["dtype"], "d": d, "group": group, "chunk": vchunk,
                "options": {k: v for k, v in opts.items() if k != "dtype"},
                "module": f"modules/{vid}.so", "variant": variant}
        print(f"[{n + 1}/{len(wanted)}] {eid}: chunk {chunk}, {time.time() - t0:.1f} s", flush=True)
    lib = os.path.join(os.path.dirname(tvm.__file__), "lib")
    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        shutil.copy2(os.path.join(lib, name), os.path.join(bundle, "runtime", name))
    if not glob.glob(os.path.join(bundle, "wheels", "apache_tvm_ffi-*cp312*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp",
                        "--platform", "manylinux_2_28_x86_64", "-d",
                        os.path.join(bundle, "wheels"), FFI_WHEEL], check=True)
    pack_tvm_runtime(os.path.dirname(tvm.__file__), os.path.join(bundle, "runtime",
                                                                 "tvm-python.tar.xz"))
    prepare_models(bundle, args.arch)
    prepare_app(bundle)
    with open(os.path.join(bundle, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(bundle, "**"), recursive=True)
               if os.path.isfile(p))
    print(f"bundle {bundle}: {len(manifest['entries'])} modules, {size / 2**20:.1f} MiB")
    tracked = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True)
    tree = sum(os.path.getsize(os.path.join(ROOT, p)) for p in
               tracked.stdout.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p)))
    if (size + tree) / 2**20 > 60:   # what one device call carries: 64 MiB in all
        print(f"warning: bundle and checkout together are {(size + tree) / 2**20:.1f} MiB, near "
              "the 64 MiB one device call carries", flush=True)


# ----------------------------------------------------------------------------- on the GPU

def load_runtime(bundle):
    """Load TVM's runtime and its CUDA part from the bundle and register the device-code hook."""
    import ctypes

    import torch
    import tvm_ffi  # first: loads libtvm_ffi.so, which TVM's runtime links to

    torch.cuda.init()
    rt = os.path.join(bundle, "runtime")
    ctypes.CDLL(os.path.join(rt, "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    from hla_tvm.runtime.device_code import load_cuda_runtime, serve

    load_cuda_runtime(rt)
    arch = json.load(open(os.path.join(bundle, "manifest.json")))["arch"]
    serve(os.path.join(bundle, "device"), arch)   # nvcc there builds any source not found
    return tvm_ffi


class Kernels:
    """A bundle's modules, loaded on first use: functions(entry id) -> (entry, chain, [fn])."""

    def __init__(self, bundle):
        self.bundle = bundle
        self.ffi = load_runtime(bundle)
        self.manifest = json.load(open(os.path.join(bundle, "manifest.json")))
        self._mods = {}

    def functions(self, eid):
        from hla_tvm.ops import chains

        e = self.manifest["entries"][eid]
        chain = (chains.decode if e["phase"] == "decode" else chains.prefill)(e["family"])
        if eid not in self._mods:
            self._mods[eid] = self.ffi.load_module(os.path.join(self.bundle, e["module"]))
        mod = self._mods[eid]
        return e, chain, [mod[chains.kernel_name(chain, c, e["d"], e["d"], e["group"])]
                          for c in chain.calls]

    def synchronize(self):
        import torch

        torch.cuda.synchronize()

    def run(self, eid, env, out):
        """Run entry eid's chain on torch CUDA tensors (env as `backend.run_chain` takes it)."""
        from hla_tvm import backend

        e, chain, fns = self.functions(eid)
        with self.ffi.use_torch_stream():
            backend.run_chain(chain, fns, env, out, e["chunk"] or 1)
        return out


def rel_err(x, ref):
    """max |x - ref| / max |ref| (0 when both vanish)."""
    x, ref = x.double(), ref.double()
    scale = ref.abs().max().item()
    return (x - ref).abs().max().item() / (scale or 1.0)


def _inputs(B, H, Hkv, T, d, dtype, seed, device="cuda"):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: (torch.randn(B, h, T, d, device=device, generator=g) * 0.5).to(dtype)  # noqa: E731
    return mk(H), mk(Hkv), mk(Hkv)


def check_entry(kern, fam, dtype_name, d, group, normalize, seed=0, device="cuda"):
    """Rows comparing the prefill (from a nonzero state) and three decode steps of one
    configuration with the float64 reference on the GPU."""
    import torch

    from hla_tvm.ops import OPERATORS
    from hla_tvm.ops.chains import operator_of

    dtype = getattr(torch, dtype_name)
    ref = operator_of(fam).ref
    op = OPERATORS[OPERATOR[fam]]
    B, H, T, T0 = 2, 4, 150, 37
    Hkv = H // group
    opts = dict(OPTS[fam], normalize=normalize, eps=1e-6)
    decay = None if fam == "hla2" else torch.linspace(0.85, 0.99, Hkv, device=device,
                                                        dtype=torch.float64).repeat_interleave(group)
    q, k, v = _inputs(B, H, Hkv, T0 + T + 3, d, dtype, seed, device)
    kf, vf = (x.double().repeat_interleave(group, 1) for x in (k, v))
    qf = q.double()
    # the reference: a first segment gives a nonzero state, then the checked tokens
    _, st0 = ref.serial(qf[:, :, :T0], kf[:, :, :T0], vf[:, :, :T0], decay=decay, **opts)
    o_ref, st1 = ref.serial(qf[:, :, T0:T0 + T], kf[:, :, T0:T0 + T], vf[:, :, T0:T0 + T],
                            decay=decay, state={n: x.clone() for n, x in st0.items()}, **opts)
    rows = []
    pid = entry_id(fam, "prefill", dtype_name, d, group, normalize)
    gamma = (torch.ones(H, device=device) if decay is None else decay.float()).contiguous()
    state = {n: (x[:, ::group] if n in op.kv_state else x).float().contiguous()
             for n, x in st0.items()}
    env = {"q": q[:, :, T0:T0 + T].contiguous(), "k": k[:, :, T0:T0 + T].contiguous(),
           "v": v[:, :, T0:T0 + T].contiguous(), "gamma": gamma, **state}
    # scratch and output start as NaN: a kernel reading an element no kernel wrote shows up
    # (fresh GPU memory is zeros, which can hide it)
    from hla_tvm import backend

    backend._SCRATCH.buf = torch.full((1 << 24,), float("nan"), device=device)
    out = torch.full((B, H, T, d), float("nan"), dtype=dtype, device=device)
    kern.run(pid, env, out)
    kern.synchronize()
    errs = {"o": rel_err(out, o_ref)}
    for n, x in state.items():
        errs[n] = rel_err(x, st1[n][:, ::group] if n in op.kv_state else st1[n])
    rows.append({"entry": pid, "errors": errs, "floor": rel_err(o_ref.to(dtype), o_ref)})
    # decode: three tokens from the reference's state (every entry with the query heads; k, v
    # with the key/value heads)
    did = entry_id("hla2_decay" if fam == "hla2" else fam, "decode", dtype_name, d, group, normalize)
    st = {n: x.float().contiguous() for n, x in st1.items()}
    rst = {n: x.clone() for n, x in st1.items()}
    errs, floor = {}, 0.0
    for t in range(T0 + T, T0 + T + 3):
        o = torch.empty(B, H, 1, d, dtype=dtype, device=device)
        kern.run(did, {"q": q[:, :, t:t + 1].contiguous(), "k": k[:, :, t:t + 1].contiguous(),
                       "v": v[:, :, t:t + 1].contiguous(), "gamma": gamma, **st}, o)
        o_r, rst = ref.step(qf[:, :, t], kf[:, :, t], vf[:, :, t], rst, decay=decay, **opts)
        kern.synchronize()
        errs["o"] = max(errs.get("o", 0.0), rel_err(o[:, :, 0], o_r))
        floor = max(floor, rel_err(o_r.to(dtype), o_r))
    for n in st:
        errs[n] = rel_err(st[n], rst[n])
    rows.append({"entry": did, "errors": errs, "floor": floor})
    return rows


def tolerance(dtype_name):
    """The issue's bound: 1e-4 for float32, 1e-3 for bfloat16, above the error of rounding the
    exact output to the output dtype (`floor`; output elements are rounded, the bound is on
    max |error| / max |reference|)."""
    return 1e-4 if dtype_name == "float32" else 1e-3


def judged(kern, fam, dtype, d, group, normalize, device="cuda"):
    """`check_entry`'s rows with "worst" and "pass" (within `tolerance`), or one failed row
    with the error that stopped it."""
    t0 = time.time()
    try:
        rows = check_entry(kern, fam, dtype, d, group, normalize, device=device)
        for r in rows:
            r["worst"] = max(r["errors"].values())
            r["pass"] = r["worst"] <= tolerance(dtype) + r["floor"]
    except Exception as err:   # a failed configuration is reported; the rest still run
        rows = [{"entry": entry_id(fam, "prefill", dtype, d, group, normalize),
                 "error": f"{type(err).__name__}: {err}"[:600], "pass": False}]
    for r in rows:
        r["seconds"] = round(time.time() - t0, 2)
    return rows


def worker_checks(args):
    kern = Kernels(args.bundle)
    results = []
    for spec in args.checks.split(";"):
        fam, dtype, d, group, normalize = spec.split(",")
        rows = judged(kern, fam, dtype, int(d), int(group), normalize == "1")
        for r in rows:
            print(json.dumps(r), flush=True)
        results += rows
    with open(args.result, "w") as f:
        json.dump(results, f)


class EmulatedKernels:
    """The check's kernel chains under the default CUDA schedules for `target`, emulated on
    the CPU thread by thread (`hla_tvm.tools.cuda_emulator`; threads and blocks in the
    order `self.mode` names, which may change between runs: the kernels are built once):
    `run` and `synchronize` as `Kernels` has them, on CPU tensors."""

    def __init__(self, target, checks, mode):
        self.target, self.mode = target, mode
        self.entries = {e[0]: e[1:] for e in entries(target, checks, timed=False)}
        self._fns = {}

    def synchronize(self):
        pass

    def run(self, eid, env, out):
        import functools

        from hla_tvm import backend
        from hla_tvm.tools import cuda_emulator as emulator

        chain, d, group, chunk, opts = self.entries[eid]
        if eid not in self._fns:
            self._fns[eid] = emulator.chain_functions(chain, d, d, self.target, chunk=chunk,
                                                      group=group, **opts)
        fns = [functools.partial(fn, mode=self.mode) for fn in self._fns[eid]]
        return backend.run_chain(chain, fns, env, out, chunk or 1)


def emulate(args):
    """(here, no GPU) `run`'s checks with every CUDA kernel emulated on the CPU, once with the
    threads and blocks of each kernel in forward order and once in reverse (a result that
    depends on the order is a race); a table of the rows, exit status 1 when one fails."""
    from hla_tvm.target import resolve
    from hla_tvm.tools import cuda_emulator as emulator

    target = resolve({"kind": "cuda", "arch": args.arch})
    checks = [c for c in CHECKS if args.only is None or
              any(f"{c[0]},{c[1]},{c[2]}".startswith(x) for x in args.only.split(";"))]
    rows = []
    kern = EmulatedKernels(target, checks, emulator.FORWARD)
    for mode in (emulator.FORWARD, emulator.REVERSE):
        kern.mode = mode
        for fam, dtype, d, group, normalize in checks:
            for r in judged(kern, fam, dtype, d, group, normalize, device="cpu"):
                r["entry"] += " (reverse order)" if mode == emulator.REVERSE else ""
                print(json.dumps(r), flush=True)
                rows.append(r)
    print(markdown({"gpu": f"none: emulated on the CPU ({len(checks)} checks, forward and "
                           "reverse thread order)", "torch": "", "arch": args.arch,
                    "tvm": "", "checks": rows, "timing": []}))
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


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
    q, k, v = (x * 0.2 for x in _inputs(B, H, H, T, d, dtype, 1))
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


def api(args):
    """`hla_tvm.hla` and `decode_` on CUDA tensors, compiled on this machine (needs TVM's
    compiler here, unlike `run`), against the float64 reference: every operator, with and
    without decay, float32 and bfloat16, grouped heads, a prefill then a decode step."""
    import torch

    import hla_tvm
    from hla_tvm import ops

    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.init()   # loads libcudart, which TVM's CUDA runtime links to
    rows = []
    cases = [(2, False, None, torch.float32, 1), (2, False, 0.95, torch.bfloat16, 2),
             (2, True, None, torch.float32, 2), (3, False, 0.95, torch.float32, 1)]
    for order, asym, decay, dtype, group in cases:
        op = ops.get(order, asym)
        name = f"{op.name} decay={decay} {str(dtype)[6:]} group={group}"
        t0 = time.time()
        try:
            g = torch.Generator(device=dev).manual_seed(len(rows))
            B, H, T, d = 2, 4, 100, 64
            mk = lambda h, t: (torch.randn(B, h, t, d, device=dev, generator=g) * 0.5).to(dtype)  # noqa: E731
            q, k, v = mk(H, T + 1), mk(H // group, T + 1), mk(H // group, T + 1)
            o, st = hla_tvm.hla(q[:, :, :T], k[:, :, :T], v[:, :, :T], order=order,
                                asymmetric=asym, decay=decay, return_state=True)
            o1 = hla_tvm.decode_(q[:, :, T], k[:, :, T], v[:, :, T], st, order=order,
                                 asymmetric=asym, decay=decay)
            kf, vf = (x.double().repeat_interleave(group, 1) for x in (k, v))
            ref, rst = op.ref.serial(q.double(), kf, vf, decay=decay)
            err = max(rel_err(o, ref[:, :, :T]), rel_err(o1, ref[:, :, T]))
            floor = rel_err(ref.to(dtype), ref)
            for n, x in st.items():
                want = rst[n][:, ::group] if n in op.kv_state else rst[n]
                err = max(err, rel_err(x, want))
            rows.append({"case": name, "error": err, "floor": floor, "device": str(o.device),
                         "pass": err <= tolerance(str(dtype)[6:]) + floor,
                         "seconds": round(time.time() - t0, 1)})
        except Exception as err:
            rows.append({"case": name, "fail": f"{type(err).__name__}: {err}"[:500],
                         "pass": False})
        print(json.dumps(rows[-1]), flush=True)
    ok = sum(r["pass"] for r in rows)
    print(f"hla()/decode_() on {dev} tensors: {ok} of {len(rows)} cases pass", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "api.json"), "w") as f:
        json.dump(rows, f, indent=1)


def pack_tvm_runtime(package, out):
    """TVM's Python package without its compiler library (about 3 MB as .tar.xz): what
    `hla_tvm.runtime` needs (`models`), unpacked on the GPU machine beside the tvm-ffi wheel."""
    import tarfile

    if os.path.exists(out):
        return
    skip = ("/3rdparty", "/__pycache__", "libtvm_compiler.so", "libtvm_runtime_extra.so")
    with tarfile.open(out + ".tmp", "w:xz") as tar:
        tar.add(package, arcname="tvm",
                filter=lambda info: None if any(x in info.name for x in skip) else info)
    os.replace(out + ".tmp", out)


MODELS = {"tiny": None, "demo": os.path.join(ROOT, "hla_tvm", "data", "stdlib-hla2.pt")}


def prepare_models(bundle, arch):
    """Compile the check's models for the GPU: a tiny decayed HLALM (its checkpoint written
    beside) and the shipped demo model."""
    import torch

    from hla_tvm import compile as compile_model
    from hla_tvm.models import HLALM

    os.makedirs(os.path.join(bundle, "models"), exist_ok=True)
    for name, checkpoint in MODELS.items():
        if checkpoint is None:
            torch.manual_seed(0)
            checkpoint = os.path.join(bundle, "models", f"{name}.pt")
            tiny = HLALM(40, 32, 2, 4, chunk_size=16, decay=[0.9, 0.95, 0.97, 0.99])
            with torch.no_grad():   # larger weights: greedy tokens that depend on the context
                for p in tiny.parameters():   # (at init the tiny model repeats one token)
                    p.mul_(4)
            tiny.save(checkpoint)
        else:
            shutil.copy2(checkpoint, os.path.join(bundle, "models", f"{name}.pt"))
        t0 = time.time()
        compile_model(HLALM.load(checkpoint), target={"kind": "cuda", "arch": arch},
                      out=os.path.join(bundle, "models", f"{name}.so"))
        print(f"model {name}: {time.time() - t0:.1f} s", flush=True)


def prepare_app(bundle):
    """export/cpp's app, built here against the installed wheel's runtime (the GPU machine may
    have no CMake), for `models` to run on the bundles it makes there."""
    import tempfile

    if shutil.which("cmake") is None or shutil.which("c++") is None:
        print("no cmake or C++ compiler here: `models` will not run the C++ app", flush=True)
        return
    with tempfile.TemporaryDirectory() as build:
        for cmd in (["cmake", "-S", os.path.join(ROOT, "export", "cpp"), "-B", build,
                     "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                    ["cmake", "--build", build]):
            subprocess.run(cmd, check=True, capture_output=True)
        os.makedirs(os.path.join(bundle, "app"), exist_ok=True)
        app = os.path.join(bundle, "app", "hla_tvm_app")
        shutil.copy2(os.path.join(build, "hla_tvm_app"), app)
        subprocess.run(["strip", app], check=False)


BUNDLE_PROMPT = [5, 9, 2, 33, 7, 1, 0, 12]   # token ids below every model's vocabulary


def _torch_greedy(model, prompt, steps):
    """`steps` greedy token ids after `prompt` from `model` in float64 on the CPU."""
    import torch

    with torch.no_grad():
        m = model.double().cpu()
        logits, state = m(torch.tensor([prompt]), None)
        out = []
        for _ in range(steps):
            out.append(int(logits[0, -1].argmax()))
            logits, state = m(torch.tensor([[out[-1]]]), state)
    return out


def bundle_check(bundle_dir, name, model, steps=12):
    """`hla-tvm bundle` of the compiled model `name`, made here on the GPU machine, and its two
    programs run here: generate.py (numpy, tvm-ffi and the bundle's runtime) and the C++ app
    `prepare` built (the bundle's runtime on LD_LIBRARY_PATH), their greedy tokens against
    PyTorch's (float64). A dict for the report."""
    import tempfile

    from hla_tvm.bundle import bundle

    row = {"bundle": name}
    want = _torch_greedy(model, BUNDLE_PROMPT, steps)
    with tempfile.TemporaryDirectory() as tmp:
        dest = os.path.join(tmp, name)
        try:
            info = bundle(os.path.join(bundle_dir, "models", f"{name}.so"), dest)
            row["cudart_in_bundle"] = info.get("cudart")
        except Exception as err:   # (reported, not raised: the other checks go on)
            row["error"] = f"bundle: {type(err).__name__}: {err}"[-1500:]
            return row
        args = [os.path.join(dest, "model.so"), "--prompt", ",".join(map(str, BUNDLE_PROMPT)),
                "--steps", str(steps)]
        lib_path = os.pathsep.join(os.path.join(dest, "runtime", p, "lib")
                                   for p in ("tvm", "tvm_ffi"))
        app = os.path.join(bundle_dir, "app", "hla_tvm_app")
        runs = {"script": [sys.executable, os.path.join(dest, "generate.py"), *args]}
        if os.path.isfile(app):
            runs["app"] = [app, *args]
        else:
            row["app"] = f"not run: no {app} (`prepare` builds it where cmake is installed)"
        env = dict(os.environ, LD_LIBRARY_PATH=lib_path + os.pathsep +
                   os.environ.get("LD_LIBRARY_PATH", ""))
        for what, cmd in runs.items():
            try:
                run_ = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                                      cwd=dest)
            except subprocess.TimeoutExpired:
                row[what] = {"tokens_equal": False, "error": "timed out after 300 s"}
                continue
            got = run_.stdout.split()
            row[what] = {"tokens_equal": got == [str(t) for t in want], "rc": run_.returncode,
                         "tokens": " ".join(got), "stderr": run_.stderr.strip()[-800:]}
    row["want"] = " ".join(map(str, want))
    return row


def model_worker(args):
    """(no torch in this process: TVM's runtime alone) prefill, decode steps and decode speed
    of a compiled model on the GPU; arrays to args.result (.npz)."""
    import numpy as np

    from hla_tvm.runtime import load

    assert "torch" not in sys.modules
    m = load(args.module, device=args.device)
    tokens = np.load(args.tokens)
    t0 = args.prompt
    st = m.init_state(tokens.shape[0])
    prefill, st = m.prefill(tokens[:, :t0], st)
    steps = []
    for t in range(t0, tokens.shape[1]):
        logits, st = m.decode(tokens[:, t], st)
        steps.append(logits)
    one = m.init_state(1)
    for i in range(10):
        _, one = m.decode(np.array([i % 7]), one)
    n, start = 300, time.perf_counter()
    for i in range(n):
        _, one = m.decode(np.array([i % 7]), one)
    tokps = n / (time.perf_counter() - start)
    np.savez(args.result, prefill=prefill, decode=np.stack(steps, 1), tokps=tokps)


def _eager_decode(model):
    """Tokens per second of `model` (float32, PyTorch eager on the GPU) decoding one sequence."""
    import torch

    model = model.float().cuda()
    with torch.no_grad():
        st = [{n: x.cuda() for n, x in layer.items()} for layer in model.init_state(1)]
        tok = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
        for _ in range(10):
            _, st = model(tok, st)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(300):
            _, st = model(tok.fill_(i % 7), st)
        torch.cuda.synchronize()
    return 300 / (time.perf_counter() - start)


def models(args):
    """Each compiled model of the bundle, run by `hla_tvm.runtime.load(device="cuda")` in a
    process without torch, against its checkpoint in PyTorch (float64, CPU); decode speed beside
    PyTorch eager on the same GPU; on a GPU, each model's bundle too (`bundle_check`)."""
    import numpy as np
    import torch

    from hla_tvm.models import HLALM

    rows = []
    for name in MODELS:
        so = os.path.join(args.bundle, "models", f"{name}.so")
        model = HLALM.load(os.path.join(args.bundle, "models", f"{name}.pt")).eval()
        vocab = model.config["vocab_size"]
        tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 40))
        tok_path = os.path.join(args.out, f"{name}-tokens.npy")
        result = os.path.join(args.out, f"{name}-gpu.npz")
        os.makedirs(args.out, exist_ok=True)
        np.save(tok_path, tokens)
        run_ = subprocess.run([sys.executable, __file__, "model-worker", "--module", so,
                               "--tokens", tok_path, "--prompt", "30", "--result", result,
                               "--device", args.device],
                              capture_output=True, text=True, timeout=300)
        if run_.returncode:
            rows.append({"model": name, "pass": False, "error": run_.stderr.strip()[-1500:]})
            print(json.dumps(rows[-1]), flush=True)
            if args.device == "cuda":
                rows.append(bundle_check(args.bundle, name, model))
                print(json.dumps(rows[-1]), flush=True)
            continue
        got = np.load(result)
        with torch.no_grad():
            ref = model.double()(torch.from_numpy(tokens), None)[0].numpy()
        eager = None
        if args.device == "cuda":
            eager = _eager_decode(model)
        scale = np.abs(ref).max()
        err = max(np.abs(got["prefill"] - ref[:, :30]).max(), np.abs(got["decode"] -
                                                                    ref[:, 30:]).max()) / scale
        rows.append({"model": name, "rel_err": float(err), "pass": bool(err < 1e-3),
                     "decode_tok_s": float(got["tokps"]), "eager_gpu_tok_s": eager})
        print(json.dumps(rows[-1]), flush=True)
        if args.device == "cuda":
            rows.append(bundle_check(args.bundle, name, model))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "models.json"), "w") as f:
        json.dump(rows, f, indent=1)


def run(args):
    """Checks in parallel processes, then the timings in one; tables and JSON to --out."""
    manifest = json.load(open(os.path.join(args.bundle, "manifest.json")))
    os.makedirs(args.out, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0)
    print(f"# gpu_check on {gpu}, torch {torch.__version__}, kernels for {manifest['arch']} "
          f"(TVM {manifest['tvm']})", flush=True)
    groups = {}
    for fam, dtype, d, group, normalize in [] if args.skip_checks else CHECKS:
        groups.setdefault(fam, []).append(f"{fam},{dtype},{d},{group},{int(normalize)}")
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    procs = {}
    t0 = time.time()
    for fam, specs in groups.items():
        result = os.path.join(args.out, f"checks-{fam}.json")
        cmd = [sys.executable, __file__, "worker-checks", "--bundle", args.bundle,
               "--checks", ";".join(specs), "--result", result]
        procs[fam] = (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True), result)
    checks = []
    for fam, (p, result) in procs.items():
        try:
            log, _ = p.communicate(timeout=max(10, args.check_seconds - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
            log += "\n(timed out)"
        if os.path.exists(result):
            checks += json.load(open(result))
        else:
            checks.append({"entry": fam, "pass": False, "error": log.strip()[-1500:]})
        if p.returncode:
            print(f"## {fam} worker exit {p.returncode}\n{log.strip()[-3000:]}", flush=True)
    print(f"checks: {time.time() - t0:.0f} s", flush=True)
    result = os.path.join(args.out, "timing.json")
    cmd = [sys.executable, __file__, "worker-timing", "--bundle", args.bundle, "--result", result,
           "--deadline", str(time.time() + args.timing_seconds - 60),
           "--prefill-tokens", str(args.prefill_tokens),
           "--prefill-families", args.prefill_families] + \
        (["--compile-all"] if args.compile_all else [])
    p = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=args.timing_seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        log, _ = p.communicate()
        log += "\n(timed out)"
    timing = json.load(open(result)) if os.path.exists(result) else []
    if p.returncode:
        print(f"## timing worker exit {p.returncode}\n{log.strip()[-3000:]}", flush=True)
    report = {"gpu": gpu, "torch": torch.__version__, "arch": manifest["arch"],
              "tvm": manifest["tvm"], "checks": checks, "timing": timing}
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(md)
    print(md, flush=True)


def markdown(report):
    lines = [f"GPU: {report['gpu']}; torch {report['torch']}; kernels built for "
             f"{report['arch']} by TVM {report['tvm']}.", "",
             "| kernel chain | worst error (max abs / max ref) | bf16 rounding floor | result |",
             "| --- | --- | --- | --- |"]
    for r in report["checks"]:
        if "error" in r:
            lines.append(f"| {r['entry']} | {r['error'][:200]} | | FAIL |")
        else:
            worst = max(r["errors"], key=r["errors"].get)
            lines.append(f"| {r['entry']} | {r['worst']:.2e} ({worst}) | {r['floor']:.1e} | "
                         f"{'pass' if r['pass'] else 'FAIL'} |")
    lines += ["", "| timing | TVM | PyTorch eager | torch.compile | other |",
              "| --- | --- | --- | --- | --- |"]
    for r in report["timing"]:
        if r["bench"] == "copy":
            lines.append(f"| device copy | | | | {r['GB/s']:.0f} GB/s |")
        elif r["bench"] == "decode":
            lines.append(f"| decode {r['family']} {r['shape']} | {r['tvm_ms']:.3f} ms "
                         f"({r['tvm_GB/s']:.0f} GB/s, {100 * r['share_of_copy_bw']:.0f}% of copy)"
                         f" | {r['eager_ms']:.3f} ms | "
                         f"{r.get('compiled_ms', float('nan')):.3f} ms | "
                         + (f"the CPU's kernel form: {r['cpu_kernel_ms']:.3f} ms "
                            f"({100 * r['cpu_kernel_share_of_copy_bw']:.0f}%)"
                            if "cpu_kernel_ms" in r else "") + " |")
        elif "tvm_ms" not in r:
            lines.append(f"| prefill {r['family']} | {r.get('error', '?')[:300]} | | | |")
        else:
            lines.append(f"| prefill {r['family']} {r['shape']} (chunk {r['chunk']}) | "
                         f"{r['tvm_ms']:.1f} ms | {r.get('torch_fp32_ms', float('nan')):.1f} ms "
                         f"(bf16 work {r.get('torch_bf16_ms', float('nan')):.1f}) | "
                         f"{r.get('torch_compiled_fp32_ms', float('nan')):.1f} ms | SDPA flash "
                         f"{r.get('sdpa_flash_ms', float('nan')):.1f} ms; TVM error "
                         f"{r.get('tvm_rel_err_vs_float64', float('nan')):.1e} |")
            lines.append(f"| (prefill kernels, ms) | {r['tvm_kernels_ms']} | | | |")
            for name, v in r.get("variants", {}).items():
                lines.append(f"| (schedule variant {name}) | "
                             + (f"{v['tvm_ms']:.1f} ms (output differs from the default's by "
                                f"{v.get('rel_diff_vs_default', float('nan')):.1e}) "
                                if "tvm_ms" in v else "") + v.get("error", "")[:200] + " | | | |")
            if "error" in r:
                lines.append(f"| (then failed) | {r['error'][:300]} | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="compile the bundle (needs TVM's compiler and nvcc)")
    p.add_argument("--bundle", default=os.path.join(ROOT, "gpu_bundle"))
    p.add_argument("--arch", default="sm_90", help="CUDA architecture of the GPU (sm_90: H100, "
                   "H200; sm_80: A100)")
    p = sub.add_parser("emulate", help="(no GPU) the checks with the CUDA kernels emulated on "
                       "the CPU, threads in forward and reverse order")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--only", help="semicolon-separated prefixes of 'family,dtype,head size' "
                   "(e.g. 'hla2_decay,float32,8;ahla')")
    p = sub.add_parser("run", help="run the checks and timings on the GPU")
    p.add_argument("--bundle", default=os.path.join(ROOT, "gpu_bundle"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--check-seconds", type=float, default=180)
    p.add_argument("--timing-seconds", type=float, default=300)
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--prefill-families", default="hla2_decay,ahla,hla3,hla2_decay:0.99",
                   help="comma-separated kernel families whose prefill is timed (hla2_decay: second "
                   "order as hla() runs it on a GPU; hla2: its serial carry; ahla, hla3; no "
                   "decay), each beside its schedule variants (VARIANTS); FAMILY:G times it "
                   "with decay G beside the PyTorch forms with decay G (no variants)")
    p.add_argument("--skip-checks", action="store_true", help="timings only")
    p.add_argument("--compile-all", action="store_true",
                   help="torch.compile every decode step (default: second order's)")
    p = sub.add_parser("api", help="hla()/decode_() on CUDA tensors (needs TVM's compiler on "
                       "the GPU machine)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--device", default="cuda", help="torch device (cpu: the same checks of the "
                   "CPU kernels)")
    p = sub.add_parser("models", help="compiled models on the GPU with the TVM runtime alone, "
                       "against PyTorch")
    p.add_argument("--bundle", default=os.path.join(ROOT, "gpu_bundle"))
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("model-worker")
    p.add_argument("--device", default="cuda")
    p.add_argument("--module", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--prompt", type=int, required=True)
    p.add_argument("--result", required=True)
    p = sub.add_parser("worker-checks")
    p.add_argument("--bundle", required=True)
    p.add_argument("--checks", required=True)
    p.add_argument("--result", required=True)
    p = sub.add_parser("worker-timing")
    p.add_argument("--bundle", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--deadline", type=float, required=True)
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--prefill-families", default="hla2_decay,ahla,hla3,hla2_decay:0.99")
    p.add_argument("--compile-all", action="store_true")
    args = ap.parse_args(argv)
    if hasattr(args, "bundle"):
        args.bundle = os.path.abspath(args.bundle)
    {"prepare": prepare, "emulate": emulate, "run": run, "api": api, "models": models,
     "model-worker": model_worker, "worker-checks": worker_checks,
     "worker-timing": worker_timing}[args.cmd](args)


if __name__ == "__main__":
    main()
