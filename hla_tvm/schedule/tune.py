"""Tuning kernels with meta_schedule: `tune(kernels, target, trials, out)`.

The design space of a kernel is its default CPU schedule with the register tile of every
GEMM-shaped block a sampled decision (`cpu.apply(..., tunable=True)`; the first point is the
default schedule). meta_schedule's evolutionary search, XGBoost cost model and local (or RPC)
runner search it for the tuning shape (`records.TUNE_SHAPE`); its own database under
`<out>/work/` keeps every trial, so a second run with the same `out` resumes. Then each kernel's
best trial and its default schedule are timed side by side in this process, and `<out>` gets a
records database (`records`) with the faster of the two (the tuned one only when it is
`MARGIN` faster: timing noise alone never replaces a default)."""
from __future__ import annotations

import logging
import os
import sys
import time


MARGIN = 0.03   # a tuned schedule is kept only when this much faster than the default (noise)


def _build(mod, target, _params):
    """meta_schedule's build step without its import of every tensor intrinsic (which costs
    40 s at each start of the builder's worker pool)."""
    from tvm.driver import build

    return build(mod, target=target)


def _export(compiler, mod):
    """meta_schedule's export step: the candidate as a shared library, linked by `compiler`
    (a cross compiler's command; None: this machine's)."""
    import tempfile

    from tvm.support import cc

    path = os.path.join(tempfile.mkdtemp(prefix="hla-tvm-trial-"), "kernel.so")
    if compiler:
        mod.export_library(path, fcompile=cc.cross_compiler(compiler))
    else:
        mod.export_library(path)
    return path


def rpc_runner(tracker, key, timeout=60):
    """meta_schedule's RPC runner measuring on the servers registered with the TVM tracker at
    `tracker` ("HOST:PORT") under `key`, checked first: ValueError when the tracker cannot be
    reached or no server holds that key."""
    import socket

    from tvm import rpc
    from tvm.s_tir import meta_schedule as ms

    host, sep, port = str(tracker).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"rpc tracker must be HOST:PORT, got {tracker!r}")
    try:   # (TVM's own connect retries for a minute before it gives up)
        socket.create_connection((host, int(port)), timeout=5).close()
        summary = rpc.connect_tracker(host, int(port)).summary()
    except Exception as err:   # refused, unreachable, not a tracker
        raise ValueError(f"cannot reach the RPC tracker at {tracker} ({err}); start one with "
                         "python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port 9190") from None
    queue = (summary.get("queue_info") or {}).get(key, {})
    servers = {s.get("key") for s in summary.get("server_info") or []}
    if not (queue.get("free", 0) or queue.get("pending", 0) or f"server:{key}" in servers):
        have = ", ".join(sorted(summary.get("queue_info") or {})) or "none"
        raise ValueError(f"no RPC server is registered with key {key!r} at {tracker} (keys "
                         f"there: {have}); on the device run python -m tvm.exec.rpc_server "
                         f"--tracker {tracker} --key {key}")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=key,
                                 session_timeout_sec=timeout)
    evaluator = ms.runner.EvaluatorConfig(number=3, repeat=5, min_repeat_ms=20)
    return ms.runner.RPCRunner(config, evaluator, max_workers=1)


def _pickle_build_by_value():
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def space(target):
    """The design space: the default rules with sampled register tiles."""
    from tvm.s_tir import meta_schedule as ms

    from . import cpu

    return ms.space_generator.ScheduleFn(
        lambda sch: cpu.apply(sch, "main", target, tunable=True),
        sch_rules=[], postprocs=[], mutator_probs={})


def _progress_callback(bar, names, best):
    """A meta_schedule measure callback that advances `bar` by each measured trial and shows
    the best time per kernel so far."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.ir.utils import derived_object

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                  runner_results):
            name = names[int(task_id)]
            for res in runner_results:
                secs = [float(s) for s in (res.run_secs or [])]
                if secs and res.error_msg is None:
                    best[name] = min(best.get(name, float("inf")), sum(secs) / len(secs))
            bar.total = max(bar.total, bar.n + len(runner_results))  # (the search may overshoot)
            bar.update(len(runner_results))
            bar.set_postfix_str(", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in best.items()))

    return Progress()


def _time(func, shapes, target, repeat=15):
    """Fastest of `repeat` timed calls (seconds) of scheduled `func` on inputs of `shapes` (the
    minimum: on a shared machine the noise only ever adds)."""
    import torch
    import tvm

    from ..build import _size_thread_pool

    _size_thread_pool()
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
    fn = lib["main"]
    dtypes = {"float32": torch.float32, "float64": torch.float64,
              "float16": torch.float16, "bfloat16": torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    args = [torch.rand(shape, generator=gen, dtype=torch.float32).to(dtypes[dt]) * 0.1 + 0.9
            for shape, dt in shapes]
    fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def _time_by_runner(funcs, target, builder, runner):
    """[seconds] of each scheduled PrimFunc in `funcs`, built by `builder` and measured by
    meta_schedule's `runner` (the fastest repeat; inf where it failed)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    built = builder.build([ms.builder.BuilderInput(tvm.IRModule({"main": f}), target)
                           for f in funcs])
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    inputs = [ms.runner.RunnerInput(b.artifact_path, device,
                                    ms.arg_info.ArgInfo.from_prim_func(f))
              for b, f in zip(built, funcs) if b.error_msg is None]
    results = iter(fut.result() for fut in runner.run(inputs))
    out = []
    for b in built:
        r = None if b.error_msg else next(results)
        ok = r is not None and r.error_msg is None and r.run_secs
        out.append(min(float(x) for x in r.run_secs) if ok else float("inf"))
    return out


def tune(kernels, target, trials, out, *, rpc=None, progress=True, log=print):
    """Tune `kernels` {name: (PrimFunc, argument shapes at the tuning shape)} for `target` with
    `trials` measured candidates in all (meta_schedule shares them out), then write to `out`
    the records of the faster of tuned and default per kernel. rpc: (tracker "HOST:PORT", key)
    to measure on the devices registered there (`rpc_runner`; candidates are built here, by
    the target's cross compiler where needed); None: on this machine. Returns {name:
    {"default_s", "tuned_s", "kept"}}. Ctrl-C stops the search and keeps what it found."""
    import functools

    import tvm
    from tqdm import tqdm
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    from ..target import cross_compiler
    from . import cpu, records

    builder = ms.builder.LocalBuilder(
        f_build=_build, f_export=functools.partial(_export, cross_compiler(target)),
        timeout_sec=300)
    runner = rpc_runner(*rpc) if rpc else ms.runner.LocalRunner(timeout_sec=120)
    _pickle_build_by_value()
    quiet = logging.getLogger("tvm.s_tir.meta_schedule")
    if quiet.level == logging.NOTSET:   # its console log at warnings; the full log in work/logs
        quiet.setLevel(logging.WARNING)
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    names = sorted(kernels)
    mod = tvm.IRModule({n: records.workload(*kernels[n])["main"] for n in names})
    best = {}
    with tqdm(total=trials, desc="tuning", unit="trial", disable=not progress) as bar:
        callbacks = list(ms.measure_callback.MeasureCallback.create("default")) + \
            [_progress_callback(bar, names, best)]
        try:
            ms.tune_tir(mod, target, work, max_trials_global=trials,
                        num_trials_per_iter=min(16, max(1, trials)),
                        builder=builder, runner=runner,
                        space=space(target), measure_callbacks=callbacks,
                        num_tuning_cores=os.cpu_count() or 1)
        except KeyboardInterrupt:
            log(f"stopped: keeping the trials so far; run the same command with -o {out} "
                "to resume")
    db = ms.database.JSONDatabase(work_dir=work)
    final = ms.database.JSONDatabase(*(os.path.join(out, f) for f in records.FILES))
    report = {}
    for name in names:
        func, shapes = kernels[name]
        wl = records.workload(func, shapes)
        sch = s_tir.Schedule(wl)
        cpu.apply(sch, "main", target)
        default_trace, candidates = sch.trace, [sch.mod["main"]]
        rec = db.query_tuning_record(wl, target, "main")
        if rec is not None and len(rec.trace.decisions):   # (none: the space is one point)
            tsch = s_tir.Schedule(wl)
            rec.trace.apply_to_schedule(tsch, remove_postproc=False)
            candidates.append(tsch.mod["main"])
        if rpc:
            secs = _time_by_runner(candidates, target, builder, runner)
        else:
            secs = [_time(f, shapes, target) for f in candidates]
        default_s, tuned_s = secs[0], (secs[1] if len(secs) > 1 else None)
        keep = tuned_s is not None and tuned_s < default_s * (1 - MARGIN)
        trace = rec.trace if keep else default_trace
        final.commit_tuning_record(ms.database.TuningRecord(
            trace, final.commit_workload(wl), [tuned_s if keep else default_s], target,
            ms.arg_info.ArgInfo.from_prim_func(wl["main"])))
        report[name] = {"default_s": default_s, "tuned_s": tuned_s,
                        "kept": "tuned" if keep else "default"}
    return report
