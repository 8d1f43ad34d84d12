"""Tuning kernels with meta_schedule: `tune(kernels, target, trials, out)`.

The design space of a kernel is its default CPU schedule with the register tile of every
GEMM-shaped block a sampled decision (`cpu.apply(..., tunable=True)`; the first point is the
default schedule). meta_schedule's evolutionary search, XGBoost cost model and local (or RPC)
runner search it for the tuning shape (`records.TUNE_SHAPE`); its own database under
`<out>/work/` keeps every trial, so a second run with the same `out` resumes. Then each kernel's
best trial and its default schedule are timed side by side in this process, and `<out>` gets a
records database (`records`) with the faster of the two: tuning never picks a schedule slower
than the default."""
from __future__ import annotations

import logging
import os
import sys
import time


def _build(mod, target, _params):
    """meta_schedule's build step without its import of every tensor intrinsic (which costs
    40 s at each start of the builder's worker pool)."""
    from tvm.driver import build

    return build(mod, target=target)


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


def tune(kernels, target, trials, out, *, runner=None, progress=True, log=print):
    """Tune `kernels` {name: (PrimFunc, argument shapes at the tuning shape)} for `target` with
    `trials` measured candidates in all (meta_schedule shares them out), then write to `out`
    the records of the faster of tuned and default per kernel. runner: a meta_schedule runner
    (default: local). Returns {name: {"default_s", "tuned_s", "kept"}}. Ctrl-C stops the search
    and keeps what it found."""
    import tvm
    from tqdm import tqdm
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    from . import cpu, records

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
                        builder=ms.builder.LocalBuilder(f_build=_build, timeout_sec=300),
                        runner=runner or ms.runner.LocalRunner(timeout_sec=120),
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
        default_trace, default_s = sch.trace, _time(sch.mod["main"], shapes, target)
        rec = db.query_tuning_record(wl, target, "main")
        tuned_s, trace = None, default_trace
        if rec is not None:
            tsch = s_tir.Schedule(wl)
            rec.trace.apply_to_schedule(tsch, remove_postproc=False)
            tuned_s = _time(tsch.mod["main"], shapes, target)
            if tuned_s < default_s:
                trace = rec.trace
        kept = "tuned" if trace is not default_trace else "default"
        final.commit_tuning_record(ms.database.TuningRecord(
            trace, final.commit_workload(wl), [min(default_s, tuned_s or default_s)], target,
            ms.arg_info.ArgInfo.from_prim_func(wl["main"])))
        report[name] = {"default_s": default_s, "tuned_s": tuned_s, "kept": kept}
    return report
