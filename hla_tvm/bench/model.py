"""`hla-tvm bench model`: a whole language model compiled and in the runtimes users would pick,
timed in one process, in interleaved rounds (each case once per round):

    tvm <scheme>       the compiled module (`hla_tvm.compile`, float32 and each --quantize
                       scheme), decode in place through its `decode` entry
    torch              PyTorch eager: the model's forward with its state (its HLA layers run
                       the operator's PyTorch form)
    torch.compile      torch.compile of that forward (default mode; the decode step compiled
                       for the batch, the prefill for the prompt length)
    onnxruntime        ONNX Runtime on the exported graph (`hla_tvm.onnx.export`: decode=True
                       for decode; the HLA nodes run as their function bodies)
    onnxruntime int4   the same graph, its constants folded by ONNX Runtime's basic
                       optimizations, after ONNX Runtime's own MatMulNBitsQuantizer (4-bit
                       MatMulNBits, symmetric, block 32): the peer's best at 4 bits
    floor              reading the weights' bytes once (a PyTorch sum over as many bytes), per
                       scheme: the time no decode step can beat at batch 1

Decode: tokens/s of batch-B steps; prefill: tokens/s of a T-token prompt from a fresh state,
logits of every position for every case. Every peer runs with its best thread count as the
modules do (`pool.Adaptive`): each PyTorch case and ONNX Runtime's decode session is tried with
one thread and with all, and keeps the faster (`_fastest_threads`; the table's notes say
which). Module sizes and the weights' bytes per scheme are listed under the table."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from ..compiler import flatten_state, resolve_model_target
from ..demo import compiled_module
from ..models import HLALM, SHIPPED
from ..quant.scheme import SCHEMES as QUANT_SCHEMES
from ..runtime import load
from ..runtime import cpu_features
from ..runtime.paths import replacing
from ..runtime.pool import OtherLoad
from .timing import load_notes, machine, measure_rounds

PRESETS = {   # random weights (speed does not depend on them)
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, decay=0.98),
    "demo": None,   # the shipped model
    "120m": dict(vocab_size=8192, d_model=768, n_layers=12, n_heads=12, decay=0.98),
}
SCHEMES = ("float32",) + QUANT_SCHEMES


def load_model(checkpoint=None, preset="demo"):
    """(HLALM, name): the checkpoint's model, or a preset's (random weights, seed 0)."""
    if checkpoint is not None:
        return HLALM.load(checkpoint).eval(), os.path.basename(str(checkpoint))
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if PRESETS[preset] is None:
        return HLALM.load(SHIPPED).eval(), "demo (shipped)"
    torch.manual_seed(0)
    model = HLALM(**PRESETS[preset])   # (initialised as training expects)
    return model.eval(), f"{preset} (random weights)"


def weight_bytes(model):
    """Bytes of the model's float32 weights (`parameters()` yields a tied table once)."""
    return 4 * sum(p.numel() for p in model.parameters())


def _floor(nbytes):
    """A step that reads `nbytes` bytes once (a float32 PyTorch sum over as many)."""
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    return lambda: float(data.sum())


def _module_cases(model, name, schemes, target, batch, prompt):
    """{name: (decode step, prefill)} and {name: (module bytes, stored weight bytes)} of the
    compiled module per scheme (from the cache where an earlier run compiled it)."""
    cases, sizes = {}, {}
    for sch in schemes:
        quantize = None if sch == "float32" else sch
        path, _ = compiled_module(model, target, checkpoint=name, quantize=quantize)
        mod = load(path)
        quant = mod.meta.get("quantize") or {}
        stored = weight_bytes(model) - quant.get("float_bytes", 0) + quant.get("bytes", 0)
        sizes[f"tvm {sch}"] = (os.path.getsize(path), stored)
        state = mod.init_state(batch)
        tok = np.zeros(batch, dtype=np.int64)
        ids = np.zeros((batch, prompt), dtype=np.int64)
        cases[f"tvm {sch}"] = (lambda m=mod, s=state, t=tok: m.decode(t, s),
                               lambda m=mod, i=ids: m.prefill(i, m.init_state(batch)))
    return cases, sizes


def units(schemes, target):
    """Notes naming the units the cases multiply on where they are not the float32 vectors:
    the compiled prefill on AMX tiles or VDPBF16PS, int8 / int4 decode on integer dot products,
    PyTorch's bfloat16 autocast on oneDNN's."""
    from ..compiler.passes.pack_weights import prefill_blocks
    from ..quant import amx, vnni
    from ..quant.scheme import scheme

    out = []
    for sch in ("bf16", "int8", "int4"):
        kind = prefill_blocks(scheme(sch), target) if sch in schemes else None
        if kind is not None:
            unit = "AMX tiles" if kind is amx else "VDPBF16PS"
            out.append(f"tvm {sch}: prefill products on {unit} (bfloat16 inputs"
                       f"{'' if sch == 'bf16' else ' and weights'}, float32 sums)")
    lanes = vnni.lanes(target)
    for sch in ("int8", "int4"):
        if sch in schemes and lanes:
            digits = vnni.DIGITS[sch]
            out.append(f"tvm {sch}: decode products on VPDPBUSD ({32 * lanes}-bit; activations "
                       f"as {digits} 8-bit digit{'s' if digits > 1 else ''} a block, within "
                       f"{vnni.precision(digits):.0e} of the block's largest |x|)")
    if has_bf16_units():
        out.append("torch bf16: oneDNN's bfloat16 kernels (AMX or AVX512-BF16 where present)")
    return out


def has_bf16_units():
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16), where
    PyTorch's bfloat16 autocast is a peer to beat."""
    return bool({"avx512bf16", "amx-bf16"} & (cpu_features.host_features() or set()))


def _fastest_threads(forms, calls=3):
    """(fn, label): of `forms` {threads: fn} the fn whose best of `calls` calls (after one
    warm-up) is fastest, and "N thread(s)". On a busy machine PyTorch's default of every core
    lost 7x to one thread on an eager decode step (46.7 against 6.2 ms)."""
    best = None
    for threads, fn in forms.items():
        fn()
        t = min(_timed(fn) for _ in range(calls))
        if best is None or t < best[0]:
            best = (t, threads, fn)
    return best[2], f"{best[1]} thread{'s' if best[1] > 1 else ''}"


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _with_torch_threads(fn, threads):
    """`fn` run with PyTorch's pool at `threads` (set back after)."""
    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)
    return run


def _torch_cases(model, batch, prompt, compiled):
    """{name: (decode step, prefill)} of PyTorch eager and torch.compile, each also under
    bfloat16 autocast where the CPU has bfloat16 units (`has_bf16_units`)."""
    tok = torch.zeros(batch, 1, dtype=torch.int64)
    ids = torch.zeros(batch, prompt, dtype=torch.int64)
    out = {}
    forms = [("torch", model)]
    if compiled:
        forms.append(("torch.compile", torch.compile(model)))
    autocasts = [("", contextlib.nullcontext)]
    if has_bf16_units():
        autocasts.append((" bf16", lambda: torch.autocast("cpu", dtype=torch.bfloat16)))
    for name, fn in forms:
        for label, cast in autocasts:
            state = {"s": model.init_state(batch)}

            def step(f=fn, st=state, c=cast):
                with torch.no_grad(), c():
                    _, st["s"] = f(tok, st["s"])

            def prefill(f=fn, c=cast):
                with torch.no_grad(), c():
                    f(ids, None)

            out[name + label] = (step, prefill)
    return out


def _threads_chosen(cases, threads):
    """`cases` {name: (decode, prefill)} of PyTorch with each fn at its fastest of 1 and
    `threads` threads (`_fastest_threads`), and notes naming the choices."""
    out, notes = {}, []
    for name, fns in cases.items():
        chosen = [_fastest_threads({n: _with_torch_threads(fn, n) for n in sorted({1, threads})})
                  for fn in fns]
        out[name] = tuple(fn for fn, _ in chosen)
        notes.append(f"{name}: decode {chosen[0][1]}, prefill {chosen[1][1]}")
    return out, notes


def _onnx_cases(model, batch, prompt, folder, notes):
    """{name: (decode step, prefill)} of ONNX Runtime on the exported graphs, float32 and after
    MatMulNBitsQuantizer (4 bits, block 32); {} without onnxruntime. A quantizer failure is
    returned under "onnxruntime int4" as its message. The decode step runs the faster of a
    one-thread session and a default one (`_fastest_threads`), named in `notes`."""
    try:
        # ONNX Runtime (optional: no ONNX cases without it), onnx and TVM's compiler (quant
        # kernels, compiler.passes) are imported where used: `hla-tvm bench --help` imports this
        # module
        import onnxruntime as ort
    except ImportError:
        return {}
    import onnx

    from ..onnx import export

    dec, pre = os.path.join(folder, "decode.onnx"), os.path.join(folder, "prefill.onnx")
    export(model, dec, decode=True)
    export(model, pre)
    graphs = {"onnxruntime": (dec, pre)}
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(
            logging.WARNING)

        quantized = []
        for path in (dec, pre):
            # ONNX Runtime's basic optimizations first: they fold the weights' transposes
            # into constants, the form MatMulNBitsQuantizer takes (a MatMul of a constant)
            folded = path.replace(".onnx", "-folded.onnx")
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            so.optimized_model_filepath = folded
            so.log_severity_level = 3
            ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            q = MatMulNBitsQuantizer(onnx.load(folded), block_size=32, is_symmetric=True)
            q.process()
            out = path.replace(".onnx", "-int4.onnx")
            q.model.save_model_to_file(out, use_external_data_format=False)
            quantized.append(out)
        graphs["onnxruntime int4"] = tuple(quantized)
    except Exception as err:  # noqa: BLE001 - reported in the table's notes
        graphs["onnxruntime int4"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    def session(path, threads=0):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = threads   # 0: ONNX Runtime's default (every core)
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    cases = {}
    for name, paths in graphs.items():
        if isinstance(paths, str):
            cases[name] = paths
            continue
        sd, sp = session(paths[0]), session(paths[1])
        one = session(paths[0], 1)
        names = [i.name for i in sd.get_inputs()]
        state = [x.numpy() for x in flatten_state(model.init_state(batch))]
        feed = {"s": dict(zip(names, [np.zeros(batch, dtype=np.int64), *state]))}

        def step(sess, f=feed, n=names):
            outs = sess.run(None, f["s"])
            f["s"] = dict(zip(n, [f["s"][n[0]], *outs[1:]]))

        chosen, label = _fastest_threads({os.cpu_count() or 1: lambda: step(sd),
                                          1: lambda: step(one)})
        notes.append(f"{name}: decode {label}")
        ids = {sp.get_inputs()[0].name: np.zeros((batch, prompt), dtype=np.int64)}
        cases[name] = (chosen, lambda sess=sp, i=ids: sess.run(None, i))
    return cases


def run(checkpoint=None, preset="demo", schemes=SCHEMES, batch=1, prompt=1024, rounds=3,
        steps=50, peers=True, target=None, json_path=None, out=print):
    """Time every case (module docstring); print one table and return the report."""
    tgt = resolve_model_target(target)
    model, name = load_model(checkpoint, preset)
    params = weight_bytes(model) // 4
    out(f"{name}: {params / 1e6:.2f} M parameters, batch {batch}, prompt {prompt} tokens; "
        "compiling what the cache lacks ...")
    cases, sizes = _module_cases(model, name, schemes, tgt, batch, prompt)
    notes = []
    with tempfile.TemporaryDirectory() as folder:
        threads = []   # the thread counts the peers' cases run with
        if peers:
            chosen, threads = _threads_chosen(_torch_cases(model, batch, prompt, compiled=True),
                                              torch.get_num_threads())
            cases.update(chosen)
            for k, v in _onnx_cases(model, batch, prompt, folder, threads).items():
                if isinstance(v, str):
                    notes.append(f"{k}: not run ({v})")
                else:
                    cases[k] = v
        floors = {f"floor {s.split()[1]}": _floor(stored) for s, (_, stored) in sizes.items()}
        decode = {k: (lambda f=v[0]: [f() for _ in range(steps)]) for k, v in cases.items()}
        decode.update({k: (lambda f=f: [f() for _ in range(steps)]) for k, f in floors.items()})
        prefill = {k: v[1] for k, v in cases.items()}
        busy = {}
        with OtherLoad() as load:
            t_dec = measure_rounds(decode, rounds, busy=busy)
            t_pre = measure_rounds(prefill, rounds, busy=busy)
    rows = {}
    for k in decode:
        sec = min(t_dec[k]) / steps
        rows[k] = {"decode_step_s": sec, "decode_tokens_s": batch / sec,
                   "decode_median_s": statistics.median(t_dec[k]) / steps}
        if k in prefill:
            rows[k]["prefill_s"] = min(t_pre[k])
            rows[k]["prefill_tokens_s"] = batch * prompt / min(t_pre[k])
    report = {"model": name, "parameters": params, "batch": batch, "prompt": prompt,
              "machine": machine(), "target": str(tgt), "rounds": rounds,
              "sizes": {k: {"module_bytes": a, "weight_bytes": b} for k, (a, b) in sizes.items()},
              "results": rows, "notes": notes, "units": units(schemes, tgt) if peers else [],
              "threads": threads, "other_load_cores": load.cores,
              "busy_runs": busy,
              "date": time.strftime("%Y-%m-%d")}
    _table(report, out)
    if json_path:
        with replacing(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def _table(report, out):
    rows, base = report["results"], report["results"].get("tvm float32")
    out(f"{'case':<18} {'decode tok/s':>13} {'step':>10} {'vs tvm f32':>11} "
        f"{'prefill tok/s':>14} {'vs tvm f32':>11}")
    for k, r in rows.items():
        dec = f"{r['decode_tokens_s']:>13,.0f} {r['decode_step_s'] * 1e6:>8.1f}us"
        ratio = f"{base['decode_step_s'] / r['decode_step_s']:>10.2f}x" if base else ""
        pre = f"{r['prefill_tokens_s']:>14,.0f} " + (
            f"{base['prefill_s'] / r['prefill_s']:>10.2f}x" if base else "") \
            if "prefill_s" in r else ""
        out(f"{k:<18} {dec} {ratio} {pre}")
    for k, s in report["sizes"].items():
        out(f"{k}: module {s['module_bytes'] / 1e6:.2f} MB, weights {s['weight_bytes'] / 1e6:.2f}"
            " MB")
    for note in report["units"] + report["notes"]:
        out("note: " + note)
    if report.get("threads"):
        out("note: peers' fastest thread counts: " + "; ".join(report["threads"]))
    for note in load_notes(report.get("other_load_cores"), report.get("busy_runs")):
        out(note)
    m = report["machine"]
    out(f"({m['cpu']}, {m['cores']} cores, {m['isa']}; {report['date']}; fastest of "
        f"{report['rounds']} rounds; 'vs tvm f32': tvm float32's time over this case's, above 1 "
        "where the case is faster; 'floor <scheme>': reading that scheme's weight bytes once, "
        "the least a decode step of batch 1 can take)")
