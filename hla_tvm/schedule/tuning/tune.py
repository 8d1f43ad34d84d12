"""Tuning kernels with meta_schedule: `tune(kernels, target, trials, out)`.

The design space of a kernel is its default CPU schedule with the register tile of every
GEMM-shaped block a sampled decision (`rules.cpu.schedule(..., tunable=True)`; the first point
is the default schedule). meta_schedule's evolutionary search, XGBoost cost model and local (or
RPC) runner search it for the tuning shape (`records.TUNE_SHAPE`), measuring `trials` candidates
in all; its own database and log under `<out>/work/` keep every trial, so a second run with the
same `out` resumes. The local runner times a candidate as `_time` does: the fastest of `CALLS`
calls, on inputs filled alike. Then each kernel's best trial and its default schedule are timed
side by side (called in turn) in this process, or on the RPC device, and `<out>` gets a records
database (`records`) with the faster of the two (the tuned one only when it is `MARGIN` faster:
timing noise alone never replaces a default)."""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import socket
import sys
import time

import cloudpickle
import torch
import tvm
from tqdm import tqdm
from tvm import rpc, s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ...ops import chains
from ...runtime.pool import size_once
from ...target import cross_compiler
from ...validate import chunk_size
from ..rules import cpu
from . import records
from .records import tuning_kernels

MARGIN = 0.03   # a tuned schedule is kept only when this much faster than the default (noise)
CALLS = 21      # a kernel's time: the fastest of this many calls (the search's and the final)
_MS_LOGGER = "tvm.s_tir.meta_schedule"   # the parent of all of meta_schedule's loggers


def _build(mod, target, _params):
    """meta_schedule's build step without its import of every tensor intrinsic (which costs
    40 s at each start of the builder's worker pool)."""
    # _build, _export, _size_worker_threads, _alloc_args and _fastest_call run in meta_schedule's
    # worker processes, which get this module pickled by value (`_pickle_build_by_value`): they
    # import there what they use
    from tvm.driver import build

    return build(mod, target=target)


def _import_tensor_intrinsics():
    """Import `tvm.s_tir.tensor_intrin` (meta_schedule's TuneContext does, once a process) in
    seconds rather than 25 s: its hundreds of TVMScript functions each look at the stack, which
    holds importlib's frozen frames during the import (`ops.common.script_frames`); and
    register the project's own (`schedule.register_intrinsics`: the search database of a
    folder tuned before holds traces that name them)."""
    from ...ops.common.script_frames import skip_module_scans
    from .. import register_intrinsics

    skip_module_scans()
    import tvm.s_tir.tensor_intrin  # noqa: F401
    register_intrinsics()


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


def _size_worker_threads():
    """In the local runner's worker process: one TVM thread per physical core, as the kernels
    run in use (TVM's default there is half the logical CPUs: trials ran on one core of two,
    2x slower than the default schedule timed in the tuning process)."""
    from hla_tvm.runtime import set_threads

    set_threads(None)


def _alloc_args(device, args_info, alloc_repeat):
    """meta_schedule's argument allocator, in the local runner's worker: the arguments of a
    candidate, floating-point ones filled as `_time` fills them (uniform in [0.9, 1)), others
    with meta_schedule's fill. (meta_schedule fills uniform in [1, 10), on which a kernel with
    an exp ran 2x slower: a sigmoid projection, the fastest of 21 calls, 792 us there, 402 us
    on these and 407 us in `_time`; the search ranked schedules on inputs never compared.)"""
    import numpy as np
    import tvm

    try:
        import ml_dtypes  # noqa: F401  (numpy's spelling of bfloat16)
    except ImportError:
        pass
    fill = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure", allow_missing=True)
    rng = np.random.default_rng(0)
    repeated = []
    for _ in range(alloc_repeat):
        args = []
        for kind, dtype, shape in args_info:
            if kind != "TENSOR":
                raise NotImplementedError(f"meta_schedule argument {kind} {dtype} {shape}")
            arg = tvm.runtime.empty(shape, dtype, device)
            try:
                if not str(dtype).startswith(("float", "bfloat")):
                    raise TypeError(dtype)
                arg.copyfrom((rng.random(tuple(shape)) * 0.1 + 0.9).astype(dtype))
            except TypeError:
                fill(arg)
            args.append(arg)
        repeated.append(args)
    return repeated


def _fastest_call(rt_mod, device, config, repeated_args):
    """meta_schedule's run evaluator, in the local runner's worker: [the fastest of the
    `config.repeat` timings] in seconds, each of one call with `evaluator_config()`, as `_time`
    takes the fastest of its calls. (meta_schedule's default, the mean of the calls of 100 ms,
    counts each time slice another process takes from one of the kernel's threads: on a busy
    2-core machine it read 88 us and 1.7 ms for kernels whose fastest call took 27 us and
    0.53 ms.)"""
    from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common

    return [min(run_evaluator_common(rt_mod, device, config, repeated_args))]


def evaluator_config():
    """The local runner's timing: `CALLS` timings of one call each (with `_fastest_call`)."""
    return ms.runner.EvaluatorConfig(number=1, repeat=CALLS, min_repeat_ms=0)


def local_runner():
    """meta_schedule's local runner as `tune` measures with it: a worker process with one TVM
    thread per physical core, arguments filled as `_time` fills them, and a candidate's time the
    fastest of `CALLS` calls (`_alloc_args`, `_fastest_call`)."""
    _pickle_build_by_value()
    return ms.runner.LocalRunner(timeout_sec=120, evaluator_config=evaluator_config(),
                                 f_alloc_argument=_alloc_args, f_run_evaluator=_fastest_call,
                                 initializer=_size_worker_threads)


def _pickle_build_by_value():
    """Pickle this module's functions by value into meta_schedule's worker processes."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def space(target):
    """The design space: the default rules with sampled register tiles, searched by mutating
    one tile decision at a time (`mutator`)."""
    return ms.space_generator.ScheduleFn(
        lambda sch: cpu.schedule(sch, "main", target, tunable=True),
        sch_rules=[], postprocs=[], mutator_probs={mutator(): 1.0})


def _strategy(trials):
    """meta_schedule's evolutionary search with its population sized to the trials (its
    default, 512 schedules sampled and evolved through this space's Python rules per round,
    took over a minute per kernel on 2 cores, whatever the trial count)."""
    population = min(256, max(16, 4 * trials))
    return ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=max(8, population // 8))


def _trials_per_iter(trials, tasks):
    """meta_schedule's `num_trials_per_iter` (the candidates a task is asked for at a time):
    the trials shared out over the tasks (between 1 and 16), so that its first round, one batch
    per task, spreads the budget over the kernels rather than spending it on the first."""
    return min(16, max(1, math.ceil(trials / max(1, tasks))))


def _capped(strategy, budget):
    """`strategy` (a meta_schedule search strategy) whose batches of candidates stop at the
    trials left in `budget` (a one-item list that every task's clone shares): meta_schedule's
    task scheduler compares the trials sent with `max_trials_global` only before it asks a task
    for a batch, so its last batch (up to `num_trials_per_iter`) went past it (8 trials asked,
    14 measured). Where the budget is spent the strategy has no more candidates."""
    @derived_object
    class Capped(ms.search_strategy.PySearchStrategy):
        def __init__(self):
            self.inner = strategy

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None,
                       cost_model=None):
            self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database,
                                  cost_model)

        def post_tuning(self):
            self.inner.post_tuning()

        def generate_measure_candidates(self):
            if budget[0] <= 0:
                return None
            candidates = self.inner.generate_measure_candidates()
            if candidates is None:
                return None
            candidates = list(candidates)[:budget[0]]
            budget[0] -= len(candidates)
            return candidates

        def notify_runner_results(self, measure_candidates, results):
            self.inner.notify_runner_results(measure_candidates, results)

        def clone(self):
            return _capped(self.inner.clone(), budget)

    return Capped()


def mutator(seed=0):
    """A meta_schedule mutator that moves one categorical decision of a trace (a register
    tile's rows or columns) to another of its candidates. (meta_schedule's own mutators change
    tile splits, unrolling and parallelism only, none of which this space samples.)"""
    @derived_object
    class MutateCategorical(ms.mutator.PyMutator):
        def __init__(self):
            self.rng = random.Random(seed)

        def _initialize_with_tune_context(self, context):
            pass

        def apply(self, trace, _rand_state):
            insts = [i for i in trace.insts if i.kind.name == "SampleCategorical"
                     and trace.get_decision(i) is not None and len(i.attrs[0]) > 1]
            if not insts:
                return None
            inst = self.rng.choice(insts)
            now = int(trace.get_decision(inst))
            new = self.rng.choice([d for d in range(len(inst.attrs[0])) if d != now])
            return trace.with_decision(inst, new, remove_postproc=True)

        def clone(self):
            return mutator(self.rng.randrange(1 << 30))

    return MutateCategorical()


def default_schedule(wl, target):
    """The Schedule of workload `wl` at the first point of its design space: the default rules
    with their default tiles, as the kernel runs untuned (a projection's tile chosen for any
    prompt length, not for the tuning length)."""
    sch = s_tir.Schedule(wl)
    cpu.schedule(sch, "main", target, tunable=True)
    return sch


def _seed_defaults(db, workloads, target, runner_secs):
    """Commit to the search database `db` each kernel's default schedule (`default_schedule`)
    with its run times as the runner measures them, where the database holds no trial of that
    kernel yet: the evolutionary search then starts from the default schedule and mutates it."""
    todo = []
    for wl in workloads:
        if not (db.has_workload(wl) and db.get_top_k(db.commit_workload(wl), 1)):
            todo.append((wl, default_schedule(wl, target)))
    for (wl, sch), secs in zip(todo, runner_secs([sch.mod["main"] for _, sch in todo])):
        if secs:
            db.commit_tuning_record(ms.database.TuningRecord(
                sch.trace, db.commit_workload(wl), secs, target,
                ms.arg_info.ArgInfo.from_prim_func(wl["main"])))


def _ms(secs):
    """`secs` seconds in milliseconds, three significant digits."""
    return f"{secs * 1e3:.3g} ms"


def _progress_callback(bar, names, best, counts):
    """A meta_schedule measure callback that advances `bar` by each measured trial, counts the
    trials of each kernel in `counts` and shows in `best` and on the bar each kernel's fastest
    trial so far as meta_schedule's runner measured it (the least of its run times, in its
    worker process or on the RPC device: the final comparison times the kernels anew)."""
    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                  runner_results):
            name = names[int(task_id)]
            for res in runner_results:
                secs = [float(s) for s in (res.run_secs or [])]
                if secs and res.error_msg is None:
                    best[name] = min(best.get(name, float("inf")), min(secs))
            counts[name] = counts.get(name, 0) + len(runner_results)
            bar.update(len(runner_results))
            bar.set_postfix_str("runner's fastest: " + ", ".join(
                f"{n} {_ms(t)}" for n, t in best.items()))

    return Progress()


@contextlib.contextmanager
def _meta_schedule_logging():
    """Run the body with meta_schedule's loggers as its `tune_tir` expects them, then put back
    what was there. Its `create_loggers` (tvm/s_tir/meta_schedule/logging.py) formats the name
    of every handler already on its logger "tvm.s_tir.meta_schedule", so one without a name
    (another library's, a log capture's) failed the tune with AttributeError: 'NoneType' object
    has no attribute 'format'; it levels its console handler (on stdout) at that logger's level,
    which its own dictConfig leaves at DEBUG, so a second tune in a process printed every table
    of the search; and that dictConfig resets the level, handlers and propagation of the
    loggers below it. Here its logger starts with no handlers, at WARNING (the console shows
    warnings, the files under work/logs the full log); afterwards the handlers meta_schedule
    added (its console, its log files) are closed and each logger under it gets back its
    handlers, level, propagation and disabled flag."""
    top = logging.getLogger(_MS_LOGGER)

    def loggers():
        return {name: lg for name, lg in list(logging.Logger.manager.loggerDict.items())
                if isinstance(lg, logging.Logger)
                and (name == _MS_LOGGER or name.startswith(_MS_LOGGER + "."))}

    saved = {name: (lg.handlers[:], lg.level, lg.propagate, lg.disabled)
             for name, lg in loggers().items()}
    keep = {h for handlers, *_ in saved.values() for h in handlers}
    for handler in top.handlers[:]:
        top.removeHandler(handler)
    top.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, lg in loggers().items():
            handlers, level, propagate, disabled = saved.get(
                name, ([], logging.NOTSET, True, False))
            for handler in lg.handlers[:]:
                lg.removeHandler(handler)
                if handler not in keep:
                    handler.close()
            for handler in handlers:
                lg.addHandler(handler)
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled


def _time(funcs, shapes, target, repeat=CALLS):
    """[seconds] of each scheduled PrimFunc in `funcs` (variants of one kernel) on inputs of
    `shapes`: the fastest of `repeat` calls each, the variants called in turn so that a busy
    spell on a shared machine slows them alike (and the minimum, as noise only ever adds)."""
    size_once()
    fns = [tvm.compile(tvm.IRModule({"main": f}), target=target)["main"] for f in funcs]
    dtypes = {"float32": torch.float32, "float64": torch.float64,
              "float16": torch.float16, "bfloat16": torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    args = [torch.rand(shape, generator=gen, dtype=torch.float32).to(dtypes[dt]) * 0.1 + 0.9
            for shape, dt in shapes]
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn(*args)
    for _ in range(repeat):
        for n, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn(*args)
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


def _runner_secs(funcs, target, builder, runner, args_info=None):
    """[run seconds as meta_schedule's `runner` measures them, or None where the build or the
    run failed] of each scheduled PrimFunc in `funcs`, built by `builder`, called on arguments
    made from `args_info` (meta_schedule ArgInfos; None: each function's own static shapes)."""
    if not funcs:
        return []
    built = builder.build([ms.builder.BuilderInput(tvm.IRModule({"main": f}), target)
                           for f in funcs])
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    inputs = [ms.runner.RunnerInput(b.artifact_path, device,
                                    args_info or ms.arg_info.ArgInfo.from_prim_func(f))
              for b, f in zip(built, funcs) if b.error_msg is None]
    results = iter(fut.result() for fut in runner.run(inputs))
    out = []
    for b in built:
        r = None if b.error_msg else next(results)
        ok = r is not None and r.error_msg is None and r.run_secs
        out.append([float(x) for x in r.run_secs] if ok else None)
    return out


def tune(kernels, target, trials, out, *, runner=None, progress=True, log=print):
    """Tune `kernels` {name: (PrimFunc, argument shapes at the tuning shape)} for `target` with
    `trials` measured candidates in all (meta_schedule shares them out; fewer where the design
    spaces hold no more new ones, which `log` then says), then write to `out` a record per
    kernel: its best trial where that is `MARGIN` faster than its default schedule, else the
    default. runner: an RPC runner (`rpc_runner`) to measure on the devices of a tracker
    (candidates are built here, by the target's cross compiler where needed); None: on this
    machine (`local_runner`). The progress bar counts the trials against `trials` and shows each
    kernel's fastest trial as the runner measured it; meta_schedule's own log goes to
    `<out>/work/logs`, not to the console. Returns {name: {"default_s", "tuned_s", "kept",
    "trials"}} (kept: "tuned", "default", or "failed" where the default schedule could not be
    measured, which gets no record; trials: the candidates the search measured for it; default_s
    and tuned_s as the final comparison timed them, which `log` says). Ctrl-C stops the search
    and keeps what it found."""
    _import_tensor_intrinsics()
    builder = ms.builder.LocalBuilder(
        f_build=_build, f_export=functools.partial(_export, cross_compiler(target)),
        timeout_sec=300)
    remote = runner is not None
    runner = runner or local_runner()
    _pickle_build_by_value()
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    records.unpack(out)   # a compressed folder's records kept (and a damaged one refused now)
    if all(records.stored(out, f) for f in records.FILES):
        records.load(out)   # (checked apart before meta_schedule's JSONDatabase reads them here)
    names = sorted(kernels)

    def runner_secs(funcs, args_info=None):
        return _runner_secs(funcs, target, builder, runner, args_info)

    def measure(funcs, shapes, wl):   # the final comparison: on the device, or here in turn
        """[seconds] of each function in `funcs` (None: inf), inputs of `shapes`."""
        ok = [f for f in funcs if f is not None]
        if remote:
            secs = [min(x) if x else float("inf") for x in runner_secs(
                ok, ms.arg_info.ArgInfo.from_prim_func(wl["main"]))]
        else:
            secs = _time(ok, shapes, target)
        it = iter(secs)
        return [float("inf") if f is None else next(it) for f in funcs]

    workloads = {n: records.workload(*kernels[n]) for n in names}
    _seed_defaults(ms.database.JSONDatabase(work_dir=work), workloads.values(), target,
                   runner_secs)
    mod = tvm.IRModule({n: workloads[n]["main"] for n in names})
    best, counts, stopped = {}, {}, False
    with tqdm(total=trials, desc="tuning", unit="trial", disable=not progress) as bar, \
            _meta_schedule_logging():
        callbacks = list(ms.measure_callback.MeasureCallback.create("default")) + \
            [_progress_callback(bar, names, best, counts)]
        try:
            ms.tune_tir(mod, target, work, max_trials_global=trials,
                        num_trials_per_iter=_trials_per_iter(trials, len(names)),
                        builder=builder, runner=runner,
                        space=space(target), measure_callbacks=callbacks,
                        strategy=_capped(_strategy(trials), [trials]),
                        num_tuning_cores=os.cpu_count() or 1)
        except KeyboardInterrupt:
            stopped = True
            log(f"stopped: keeping the trials so far; run the same command with -o {out} "
                "to resume")
        except RuntimeError as err:
            # seen: the trials of a run killed mid-write, which the database cannot replay
            if "old_outputs.size() == new_outputs.size()" not in str(err):
                raise
            raise ValueError(f"meta_schedule cannot replay the trials in {work} (a record "
                             "does not fit its kernel); if an earlier tune was killed while "
                             f"writing there, delete {work} and tune again") from None
    measured = sum(counts.values())
    if measured != trials and not stopped:
        log(f"the search measured {measured} of the {trials} trials asked" + (
            " (it found no more new candidates in these kernels' design spaces)"
            if measured < trials else ""))
    db = ms.database.JSONDatabase(work_dir=work)
    final = ms.database.JSONDatabase(*(os.path.join(out, f) for f in records.FILES))
    report = {}
    for name in names:
        (func, shapes), wl = kernels[name], workloads[name]
        default_trace = default_schedule(wl, target).trace
        traces = [default_trace]
        rec = db.query_tuning_record(wl, target, "main")
        if rec is not None and len(rec.trace.decisions) and \
                list(rec.trace.as_python()) != list(default_trace.as_python()):
            # (a one-point space, or a best trial that is the default itself: nothing to time)
            traces.append(rec.trace)
        # each trace on the symbolic kernel, as its record runs (`records.replay`): the search
        # timed the kernel specialized to the tuning shape, and a trial 10% faster there took
        # 3x the default's time on the symbolic kernel (second order's key summary, Zen 5 VM)
        candidates = []
        for trace in traces:
            try:
                candidates.append(records.replay(func, trace))
            except Exception:  # noqa: BLE001 - a trial that does not replay: not kept
                candidates.append(None)
        secs = measure(candidates, shapes, wl)
        default_s, tuned_s = secs[0], (secs[1] if len(secs) > 1 else None)
        if default_s == float("inf"):
            log(f"{name}: its default schedule could not be measured (see {work}/logs); no "
                "record for it")
            report[name] = {"default_s": default_s, "tuned_s": tuned_s, "kept": "failed"}
            continue
        if tuned_s == float("inf"):
            tuned_s = None
        keep = tuned_s is not None and tuned_s < default_s * (1 - MARGIN)
        trace = rec.trace if keep else default_trace
        final.commit_tuning_record(ms.database.TuningRecord(
            trace, final.commit_workload(wl), [tuned_s if keep else default_s], target,
            ms.arg_info.ArgInfo.from_prim_func(wl["main"])))
        report[name] = {"default_s": default_s, "tuned_s": tuned_s,
                        "kept": "tuned" if keep else "default"}
    for name in names:
        report[name]["trials"] = counts.get(name, 0)
    log("default and tuned times: " + (
        "measured on the RPC device by meta_schedule's runner, the fastest of its repeats"
        if remote else f"the fastest of {CALLS} calls, the two schedules called in turn in "
        "this process") + (" (the bar showed the fastest trial as the search's runner timed it)"
                           if progress else ""))
    return report


def operator_kernels(op, *, decayed, dk, dv, chunk, group=1, dtype, target=None, **opts):
    """`tuning_kernels` of operator `op`'s prefill and decode chains (an `ops.Operator`;
    opts: its `options`, dtype a torch dtype) as they run on `target` (a tvm Target; None: the
    kernels without target options, `chains.target_options`)."""
    chunk = chunk_size(chunk, name="chunk", instead="a larger chunk's records could serve no "
                       "call")
    kw = chains.kernel_options(dtype, **opts)
    out = {}
    for decode in (False, True):
        fam = chains.family(op.name, decayed=decayed, decode=decode)
        chain = chains.decode(fam) if decode else chains.prefill(fam)
        on = {} if target is None else chains.target_options(chain, target, kw["dtype"])
        out.update(tuning_kernels(chain, dk, dv, chunk=None if decode else chunk, group=group,
                                  **kw, **on))
    return out
