"""The operator's cases of `hla-tvm bench decode|prefill`: the compiled kernels beside the
strongest PyTorch forms, measured in one process, one table with ratios (and optionally JSON).
A whole model's: `bench.model`.

tvm runs the default schedules; tvm_tuned (where `hla-tvm tune` wrote records for this machine)
the tuned ones.
decode:  tvm (`decode_`, state in place), tvm_hla (`hla(..., return_state=True)`, which copies
         the state), torch (the operator's `fast.step_`, in place), torch_compile
         (torch.compile of it), torch_compile_functional (torch.compile of a step that returns
         a new state: no in-place op for the compiler to keep), state_copy (copying the
         state's bytes once: the floor of a memory-bound step)
prefill: tvm (`hla`), torch (`fast.chunked`: every chunk at once, with or without decay),
         torch_compile (of the fast form), torch_chunk_loop and torch_compile_chunk_loop (a
         loop over the chunks carrying the state, each chunk `fast.chunked`, eager or
         compiled), torch_sdpa (causal softmax attention, the quadratic baseline),
         onnxruntime (one exported hla_tvm::HLA node in ONNX Runtime, its function body; where
         onnxruntime is installed), sgemm (this machine's float32 matmul rate, GFLOP/s);
         where the CPU has bfloat16 units (AVX512-BF16, AMX) also tvm_bf16 (`hla` on bfloat16
         inputs), torch_bf16 and torch_compile_bf16 (the fast form under bfloat16 autocast)
         and the bfloat16 matmul rate

The table names the fastest PyTorch form (every torch* case but softmax attention) and tvm's
speed against it. The mixed rows time tvm, the strongest compiled PyTorch form and (decode) the
state copy in a process that runs PyTorch work between the calls, as a model does: each call
follows a 1024 x 1024 torch.mm (MIXED_SIZE), and the call alone is timed (at most MIXED_CALLS
calls a round: the matmuls take far longer than the decode steps between them).

Every timed run starts once the process's threads are idle (`timing.settle`): the
thread pools of PyTorch and ONNX Runtime spin on after their work and would take the cores
from the next case."""
from __future__ import annotations

import importlib.util
import json
import statistics

import torch

from .. import validate
from ..api import hla
from ..decode import decode_
from ..ops import OPERATORS, get
from ..runtime.paths import replacing
from ..runtime.pool import OtherLoad
from ..target import resolve
from .model import has_bf16_units
from .timing import SelfTimed, load_notes, machine, measure_rounds

OPS = {"hla2": dict(), "ahla": dict(asymmetric=True), "hla3": dict(order=3)}
MIXED_SIZE = 1024   # the PyTorch matmul before each call of a mixed case (n x n, float32)
MIXED_CALLS = 20    # calls of a mixed case a round (a decode round of the others has 200)
PEERS_EXCLUDED = ("torch_sdpa",)   # torch* cases that are no form of the operator


def _measure(fn, runs, number=1, probe=None):
    """(median, min) seconds per call over `runs` timed runs of `number` calls, after warm-up
    (two calls; the second through `probe(fn)` when given, as `peak_rss_growth` does)."""
    times = measure_rounds({"fn": fn}, runs, number,
                            None if probe is None else (lambda _, f: probe(f)))["fn"]
    return statistics.median(times), min(times)


def _inputs(batch, heads, seq, dk, dv, kv_heads=None, dtype=torch.float32):
    """q [B, H, T, dk], k [B, Hkv, T, dk], v [B, Hkv, T, dv] (Hkv = kv_heads or H)."""
    g = torch.Generator().manual_seed(0)
    hs = (heads, kv_heads or heads, kv_heads or heads)
    return (torch.randn(batch, h, seq, d, generator=g, dtype=dtype) / d ** 0.5
            for h, d in zip(hs, (dk, dk, dv)))


def _repeat_kv(x, heads):
    """x [B, Hkv, ...] with each key/value head repeated for its group of query heads (what a
    PyTorch form without grouped heads needs)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], 1)


def decode_cases(batch, heads, dk, dv, op, decay, kv_heads=None):
    """{name: fn} of one decode step each, from the state after 16 prompt tokens."""
    kw = OPS[op]
    q, k, v = _inputs(batch, heads, 17, dk, dv, kv_heads)
    _, st = hla(q[:, :, :16], k[:, :, :16], v[:, :, :16], decay=decay, return_state=True,
                **kw)
    q1, k1, v1 = (x[:, :, 16].contiguous() for x in (q, k, v))
    q4, k4, v4 = (x.unsqueeze(2) for x in (q1, k1, v1))
    kv_state = get(kw.get("order", 2), kw.get("asymmetric", False)).kv_state
    full = {n: (_repeat_kv(x, heads) if n in kv_state else x) for n, x in st.items()}
    states = {"tvm": {n: x.clone() for n, x in st.items()},
              "tvm_tuned": {n: x.clone() for n, x in st.items()},
              "torch": {n: x.clone() for n, x in full.items()},
              "torch_compile": {n: x.clone() for n, x in full.items()}}
    step = OPERATORS[op].fast.step_
    compiled = torch.compile(step, dynamic=False)
    dst = {n: torch.empty_like(x) for n, x in st.items()}

    def state_copy():
        for n, x in st.items():
            dst[n].copy_(x)

    def functional(q, k, v, st):
        """A step returning a new state (torch.compile then keeps no in-place update)."""
        new = {n: x.clone() for n, x in st.items()}
        return step(q, k, v, new, decay=decay), new

    compiled_functional = torch.compile(functional, dynamic=False)
    kr, vr = _repeat_kv(k1, heads), _repeat_kv(v1, heads)
    cases = {
        "tvm": lambda: decode_(q1, k1, v1, states["tvm"], decay=decay, schedules="default",
                               **kw),
        "tvm_hla": lambda: hla(q4, k4, v4, state=st, decay=decay, return_state=True, **kw),
        "torch": lambda: step(q1, _repeat_kv(k1, heads), _repeat_kv(v1, heads),
                              states["torch"], decay=decay),
        "torch_compile": lambda: compiled(q1, _repeat_kv(k1, heads), _repeat_kv(v1, heads),
                                          states["torch_compile"], decay=decay),
        "torch_compile_functional": lambda: compiled_functional(q1, kr, vr, full),
        "state_copy": state_copy,
    }
    with_mixed(cases, ("tvm", "torch_compile_functional", "state_copy"))
    if _tuned_records():
        cases["tvm_tuned"] = lambda: decode_(q1, k1, v1, states["tvm_tuned"], decay=decay,
                                             schedules="auto", **kw)
    return cases


def _tuned_records():
    """True when `hla-tvm tune` wrote records for this machine (schedules="auto" finds them)."""
    # TVM's compiler and ONNX Runtime are imported where used: `hla-tvm bench --help` imports this
    # module
    from ..schedule.tuning import records

    return records.find("auto", resolve(None))[0] is not None


def hla2_prefill_flops(B, H, T, dk, dv, n):
    """Multiply-adds x 2 of the chunked second-order prefill (summary, carry, output)."""
    nc = -(-T // n)
    summary = n * dk * dk + n * dk * dv + n * n * dk + n * n * dv + n * dk * dv
    output = n * n * dk + n * dk * dk + n * n * dk + n ** 3 + n * dk * dv + n * n * dv
    return 2 * B * H * nc * (summary + output + dk * dk * dv)


def prefill_cases(batch, heads, seq, dk, dv, op, decay, chunk_size, kv_heads=None):
    kw = OPS[op]
    q, k, v = _inputs(batch, heads, seq, dk, dv, kv_heads)
    cases = {"tvm": lambda: hla(q, k, v, decay=decay, chunk_size=chunk_size,
                                schedules="default", **kw)}
    if _tuned_records():
        cases["tvm_tuned"] = lambda: hla(q, k, v, decay=decay, chunk_size=chunk_size,
                                         schedules="auto", **kw)
    def fast(q, k, v):
        return OPERATORS[op].fast.chunked(q, _repeat_kv(k, heads), _repeat_kv(v, heads),
                                          chunk_size=chunk_size, decay=decay)[0]
    compiled = torch.compile(fast, dynamic=False)
    cases["torch"] = lambda: fast(q, k, v)
    cases["torch_compile"] = lambda: compiled(q, k, v)

    def one_chunk(q, k, v, st):
        return OPERATORS[op].fast.chunked(q, k, v, chunk_size=chunk_size, decay=decay, state=st)

    compiled_chunk = torch.compile(one_chunk, dynamic=False)
    kr, vr = _repeat_kv(k, heads), _repeat_kv(v, heads)

    def chunk_loop(step):
        def run():
            st, outs = None, []
            for s in range(0, seq, chunk_size):
                o, st = step(q[:, :, s:s + chunk_size], kr[:, :, s:s + chunk_size],
                             vr[:, :, s:s + chunk_size], st)
                outs.append(o)
            return torch.cat(outs, dim=2)
        return run

    cases["torch_chunk_loop"] = chunk_loop(one_chunk)
    cases["torch_compile_chunk_loop"] = chunk_loop(compiled_chunk)

    if has_bf16_units():   # bfloat16: our kernels on bfloat16 inputs, PyTorch's autocast
        qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
        cases["tvm_bf16"] = lambda: hla(qb, kb, vb, decay=decay, chunk_size=chunk_size,
                                        schedules="default", **kw)
        for name, fn in (("torch_bf16", fast), ("torch_compile_bf16", compiled)):
            def cast(f=fn):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return f(q, k, v)
            cases[name] = cast
    cases["torch_sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != heads)
    ort = _onnxruntime_case(q, k, v, op, decay)
    if ort is not None:
        cases["onnxruntime"] = ort
    with_mixed(cases, ("tvm", "torch_compile_chunk_loop"))
    return cases


def with_mixed(cases, names):
    """Add, for each of `names`, `<name>_mixed`: a MIXED_SIZE torch.mm, then the case, whose
    call alone is timed (`timing.SelfTimed`; a process running PyTorch work between the
    calls: its threads may still spin, its data has left the caches)."""
    a = torch.randn(MIXED_SIZE, MIXED_SIZE)
    b = torch.randn(MIXED_SIZE, MIXED_SIZE)
    for name in names:
        cases[f"{name}_mixed"] = SelfTimed(lambda: torch.mm(a, b), cases[name], MIXED_CALLS)


def summary(results):
    """{"fastest_torch": name, "fastest_tvm": name (tvm, tvm_tuned or tvm_bf16),
    "tvm_vs_fastest": the one's time over the other's, "mixed": {name: seconds of a call in
    the mixed process, "<name>_quiet_ratio": mixed over quiet}}."""
    forms = {n: r["median_s"] for n, r in results.items() if n.startswith("torch")
             and not n.endswith("_mixed") and n not in PEERS_EXCLUDED}
    ours = {n: results[n]["median_s"] for n in ("tvm", "tvm_tuned", "tvm_bf16") if n in results}
    out = {}
    if forms:
        best, mine = min(forms, key=forms.get), min(ours, key=ours.get)
        out.update(fastest_torch=best, fastest_tvm=mine, tvm_vs_fastest=forms[best] / ours[mine])
    mixed = {}
    for n, r in results.items():
        if n.endswith("_mixed"):
            base = n[:-len("_mixed")]
            mixed[base] = r["median_s"]
            mixed[f"{base}_quiet_ratio"] = mixed[base] / results[base]["median_s"]
    if mixed:
        out["mixed"] = mixed
    return out


def _onnxruntime_case(q, k, v, op, decay):
    """One exported `hla_tvm::HLA` node run by ONNX Runtime (its standard-ONNX function body,
    a Scan over chunks), or None where onnxruntime is not installed."""
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    from ..onnx.function import one_node_model
    from ..onnx.ort_session import session

    kw = {"order": 3} if op == "hla3" else {"asymmetric": True} if op == "ahla" else {}
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()}
    model = one_node_model({n: x.shape for n, x in feeds.items()},
                           decay=1.0 if decay is None else float(decay), **kw)
    sess = session(model, threads=torch.get_num_threads())
    return lambda: sess.run(["o"], feeds)


def _proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in /proc/self/status")


def peak_rss_growth(fn):
    """Bytes by which this process's peak resident memory grows over one call of fn (Linux,
    which resets the peak through /proc/self/clear_refs); None where that is unavailable.
    Memory the allocator kept from earlier calls and hands out again is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_bytes("VmRSS")
        fn()
        return max(0, _proc_status_bytes("VmHWM") - before)
    except OSError:
        return None


def sgemm_rate(size=2048, runs=3, dtype=torch.float32):
    """This machine's matmul rate (GFLOP/s) through torch in `dtype` (float32: sgemm;
    bfloat16: oneDNN's, on AMX where present), best of `runs`."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    _, best = _measure(lambda: a @ b, runs)
    return 2 * size ** 3 / best / 1e9


def run(mode="decode", batch=1, heads=8, seq=8192, dk=64, dv=None, op="hla2", decay=None,
        chunk_size=64, repeat=5, json_path=None, kv_heads=None, out=print):
    dv = dv or dk
    kv_heads = kv_heads or heads
    if json_path:
        json_path = validate.output_path("json_path", json_path)
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    shape = dict(batch=batch, heads=heads, kv_heads=kv_heads, dk=dk, dv=dv, op=op, decay=decay,
                 threads=torch.get_num_threads())
    if mode == "decode":
        cases = decode_cases(batch, heads, dk, dv, op, decay, kv_heads)
        number = 200
    else:
        shape.update(seq=seq, chunk_size=chunk_size)
        cases = prefill_cases(batch, heads, seq, dk, dv, op, decay, chunk_size, kv_heads)
        number = 1
    peaks = {}   # prefill: the second warm-up call measures the memory too

    def probe(name, fn):
        peaks[name] = peak_rss_growth(fn)

    busy = {}

    with OtherLoad() as load:
        times = measure_rounds(cases, repeat, number, probe if mode == "prefill" else None,
                                busy)
    results = {}
    for name, ts in times.items():
        results[name] = {"median_s": statistics.median(ts), "min_s": min(ts), "runs": repeat,
                         "busy_runs": busy.get(name, 0)}
        if name in peaks:
            results[name]["peak_bytes"] = peaks[name]
    extra = {}
    if mode == "prefill":
        extra["sgemm_gflops"] = sgemm_rate()
        if "tvm_bf16" in cases:
            extra["bf16_gemm_gflops"] = sgemm_rate(dtype=torch.bfloat16)
        if op == "hla2" and decay is None and kv_heads == heads:
            flops = hla2_prefill_flops(batch, heads, seq, dk, dv, chunk_size)
            extra["tvm_gflops"] = flops / results["tvm"]["median_s"] / 1e9
    info = machine()
    report = {"mode": mode, "shape": shape, "machine": info, "results": results,
              "other_load_cores": load.cores, **summary(results), **extra}
    _table(report, out)
    if json_path:
        with replacing(json_path, "w") as f:
            json.dump(report, f, indent=1)
        out(f"wrote {json_path}")
    return report


def _fmt(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _table(report, out):
    s, m, res = report["shape"], report["machine"], report["results"]
    what = s["op"] if s["decay"] is None else f"{s['op']} decay {s['decay']}"
    size = f"B={s['batch']} H={s['heads']}" + \
        (f" Hkv={s['kv_heads']}" if s.get("kv_heads", s["heads"]) != s["heads"] else "") + \
        f" Dk={s['dk']} Dv={s['dv']}" + \
        (f" T={s['seq']} chunk {s['chunk_size']}" if report["mode"] == "prefill" else "")
    out(f"hla-tvm bench {report['mode']}: {what}, {size}; {m['cpu']} ({m['cores']} cores, "
        f"{m['isa']}), median of {next(iter(res.values()))['runs']} rounds")
    ref = res["tvm"]["median_s"]
    peak = report["mode"] == "prefill"
    width = max(16, 2 + max(len(name) for name in res))
    out(f"{'case':<{width}}{'median':>12}{'min':>12}{'vs tvm':>10}"
        + (f"{'peak mem':>12}" if peak else ""))
    for name, r in res.items():
        mem = r.get("peak_bytes")
        out(f"{name:<{width}}{_fmt(r['median_s']):>12}{_fmt(r['min_s']):>12}"
            f"{r['median_s'] / ref:>9.2f}x" +
            ((f"{mem / 2 ** 20:>9.1f} MB" if mem is not None else f"{'n/a':>12}") if peak else ""))
    if "fastest_torch" in report:
        ratio = report["tvm_vs_fastest"]
        out(f"fastest PyTorch form: {report['fastest_torch']}; {report['fastest_tvm']} is "
            + (f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"))
    mixed = report.get("mixed") or {}
    if mixed:
        out(f"in a mixed process (a {MIXED_SIZE}x{MIXED_SIZE} torch.mm before each call, "
            "the call alone timed): " + ", ".join(
                f"{n} {_fmt(t)} ({mixed[n + '_quiet_ratio']:.2f}x quiet)"
                for n, t in mixed.items() if not n.endswith("_quiet_ratio")))
    if "sgemm_gflops" in report:
        line = f"sgemm {report['sgemm_gflops']:.0f} GFLOP/s"
        if "tvm_gflops" in report:
            line += (f"; tvm kernels {report['tvm_gflops']:.0f} GFLOP/s "
                     f"({report['tvm_gflops'] / report['sgemm_gflops']:.0%} of sgemm)")
        if "bf16_gemm_gflops" in report:
            line += f"; bfloat16 matmul {report['bf16_gemm_gflops']:.0f} GFLOP/s"
        out(line)
    busy = {name: f"{r['busy_runs']} of {r['runs']}" for name, r in res.items()
            if r.get("busy_runs")}
    for note in load_notes(report.get("other_load_cores"), busy):
        out(note)
    out("(vs tvm: a case's time over tvm's; above 1 means tvm is faster" +
        ("; peak mem: growth of the resident set over one call)" if peak else ")"))
