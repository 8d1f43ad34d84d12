"""What a user holds is safe to share between threads: one loaded model serving several
sequences at once (4 threads x 2,000 decode steps), and the operator function itself; every
thread's results equal a serial run's, token for token and bit for bit."""
import threading

import numpy as np
import pytest
import torch
from conftest import make_qkv, rel_err

from hla_tvm import hla
from hla_tvm.ops.hla2 import reference as hla2
from hla_tvm.runtime import load

VOCAB, THREADS, STEPS = 40, 4, 2000


# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_the_worker_count_follows_the_measured_times",
    "test_other_load_counts_the_cores_other_processes_keep_busy",
    "test_results_do_not_depend_on_the_worker_count",
    "test_decode_steps_run_on_the_calling_thread_and_prefill_on_every_worker",
    "test_the_pool_leaves_the_calling_threads_cpus_as_they_were",
    "test_a_count_set_with_set_threads_holds_for_hla",
}

@pytest.fixture(scope="module")
def model_path(compiled_lm):
    return compiled_lm("hla2")[1]


def _generate(m, seed, steps):
    """Greedy tokens and every step's logits of one sequence from its own prompt."""
    prompt = np.random.default_rng(seed).integers(0, VOCAB, (1, 5 + seed))
    logits, state = m.prefill(prompt, m.init_state(1))
    tokens, all_logits = [int(logits[0, -1].argmax())], [logits[0, -1]]
    for _ in range(steps):
        logits, state = m.decode(np.array(tokens[-1:]), state)
        tokens.append(int(logits[0].argmax()))
        all_logits.append(logits[0])
    return tokens, np.stack(all_logits)


def _in_threads(fn, n):
    results, errors = [None] * n, []

    def work(i):
        try:
            results[i] = fn(i)
        except BaseException as err:   # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_one_loaded_model_serves_four_threads(model_path):
    m = load(model_path)
    serial = [_generate(m, i, STEPS) for i in range(THREADS)]
    parallel = _in_threads(lambda i: _generate(m, i, STEPS), THREADS)
    for (tok_s, log_s), (tok_p, log_p) in zip(serial, parallel):
        assert tok_p == tok_s
        assert np.array_equal(log_p, log_s)


def test_threads_batched_and_unbatched_on_one_model(model_path):
    """Threads with different batch sizes and prefill lengths interleave on one module."""
    m = load(model_path)

    def run(i):
        tokens = np.random.default_rng(10 + i).integers(0, VOCAB, (1 + i % 3, 7 + 5 * i))
        out = []
        for _ in range(20):
            logits, state = m.prefill(tokens, m.init_state(tokens.shape[0]))
            logits2, _ = m.decode(tokens[:, 0], state)
            out.append((logits, logits2))
        return out

    serial = [run(i) for i in range(THREADS)]
    parallel = _in_threads(run, THREADS)
    for s, p in zip(serial, parallel):
        for (a, b), (c, d) in zip(s, p):
            assert np.array_equal(a, c) and np.array_equal(b, d)


def test_the_operator_from_threads():
    """hla() from several threads at once (kernels compiled on first use by one of them)."""
    inputs = [make_qkv(1, 2, 45 + 7 * i, 8, 4, seed=20 + i, dtype=torch.float32)
              for i in range(THREADS)]

    def run(i):
        q, k, v = inputs[i]
        out, state = hla(q, k, v, chunk_size=16, return_state=True)
        steps = [hla(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], state=state) for _ in range(50)]
        return out, torch.cat(steps, 2)

    parallel = _in_threads(run, THREADS)
    for i, (out, steps) in enumerate(parallel):
        q, k, v = (x.double() for x in inputs[i])
        assert rel_err(out, hla2.quadratic(q, k, v)) <= 1e-4
        serial_out, serial_steps = run(i)
        assert torch.equal(out, serial_out) and torch.equal(steps, serial_steps)


def test_results_do_not_depend_on_the_worker_count(model_path):
    """A compiled module gives bit-identical logits on 1 worker, on every core, and with the
    count chosen per call by timing (the default): only the time depends on it."""
    runs = []
    for threads in (1, None, 2):
        m = load(model_path, threads=threads)
        prompt = np.random.default_rng(1).integers(0, VOCAB, (2, 300))
        logits, state = m.prefill(prompt, m.init_state(2))
        steps = [logits]
        for t in range(40):   # (past the adaptive chooser's first probes)
            out, state = m.decode(prompt[:, t], state)
            steps.append(out)
        runs.append(steps)
    for other in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], other))


def test_the_worker_count_follows_the_measured_times():
    """pool.Adaptive probes every candidate count, keeps the fastest by its median (not by one
    lucky call), drops a count far behind after one call, probes again when the chosen count
    turns slow (the load changed), and keeps small calls on the calling thread."""
    from hla_tvm.runtime.pool import Adaptive

    set_to = []
    chooser = Adaptive(4, set_to.append)
    assert chooser.candidates == [1, 2, 4]
    cost = {1: 3e-3, 2: 1e-3, 4: 50e-3}   # a busy machine: every core is slow

    def call():
        n = chooser.before()
        chooser.after(cost[n])
        return n

    probe = [call() for _ in range(2 * Adaptive.PROBE_CALLS + 1)]
    assert probe.count(4) == 1 and sorted(set(probe)) == [1, 2, 4]   # 4 dropped at once
    assert [call() for _ in range(20)] == [2] * 20 and chooser.chosen == 2
    cost[2] = 10e-3   # 2 turns slow: after SLOW_RUN slow calls the counts are probed again
    seen = [call() for _ in range(Adaptive.SLOW_RUN + 8)]
    assert seen[:Adaptive.SLOW_RUN] == [2] * Adaptive.SLOW_RUN and 1 in seen
    assert chooser.chosen == 1 and [call() for _ in range(5)] == [1] * 5
    assert set_to[-1] == 1 and all(a != b for a, b in zip(set_to, set_to[1:]))
    # a count with one lucky fast call among slow ones is not chosen over a steady one
    chooser = Adaptive(2, set_to.append)
    lucky = iter([0.5e-3] + [20e-3] * 10)
    steady = 2e-3
    for _ in range(2 * Adaptive.PROBE_CALLS):
        n = chooser.before()
        chooser.after(steady if n == 1 else next(lucky))
    assert chooser.chosen == 1
    # calls too small for a pool to gain stay on the calling thread, the others never tried
    chooser = Adaptive(2, set_to.append)
    tried = []
    for _ in range(Adaptive.PROBE_CALLS + 3):
        tried.append(chooser.before())
        chooser.after(0.1e-3)
    assert tried == [1] * (Adaptive.PROBE_CALLS + 3) and chooser.chosen == 1
    assert Adaptive(1, set_to.append).candidates == [1]


def test_long_calls_are_timed_once_a_count_and_probed_again_only_when_slow():
    """Calls of Adaptive.LONG_S or more (a long prefill) run one call on each count, not
    PROBE_CALLS single-thread calls first; they are probed again after MAX_REPROBE_S, not
    REPROBE_S, or after a run of slow calls; one long call among short ones (a stall) does not
    cut a probe short."""
    from hla_tvm.runtime.pool import Adaptive

    chooser = Adaptive(2, [].append)
    cost = {1: 20 * Adaptive.LONG_S, 2: 10 * Adaptive.LONG_S}

    def call():
        n = chooser.before()
        chooser.after(cost[n])
        return n

    assert [call() for _ in range(4)] == [1, 2, 2, 2] and chooser.chosen == 2
    chooser.since -= 2 * Adaptive.REPROBE_S   # past a short call's timed probe: not a long's
    assert [call() for _ in range(3)] == [2, 2, 2]
    chooser.since -= Adaptive.MAX_REPROBE_S   # past a long call's
    assert [call() for _ in range(3)] == [1, 2, 2] and chooser.chosen == 2
    cost[2] = 30 * Adaptive.LONG_S   # the load changed: after SLOW_RUN slow calls, a probe
    seen = [call() for _ in range(Adaptive.SLOW_RUN + 2)]
    assert seen == [2] * Adaptive.SLOW_RUN + [1, 2] and chooser.chosen == 1
    # short calls with one stall among them keep their PROBE_CALLS a count
    chooser = Adaptive(2, [].append)
    times = iter([Adaptive.LONG_S * 3] + [Adaptive.PARALLEL_FROM_S * 2] * 20)
    tried = []
    for _ in range(2 * Adaptive.PROBE_CALLS):
        tried.append(chooser.before())
        chooser.after(next(times))
    assert tried == [1] * Adaptive.PROBE_CALLS + [2] * Adaptive.PROBE_CALLS


def test_other_load_counts_the_cores_other_processes_keep_busy():
    """What demo and bench report as a busy machine: another process spinning for the whole
    block counts as most of a core (this process's own time does not count)."""
    import subprocess
    import sys
    import time

    from hla_tvm.runtime.pool import OtherLoad

    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\n"
                             "while time.time() < end: pass"])
    try:
        time.sleep(0.3)   # (started)
        with OtherLoad() as load:
            end = time.perf_counter() + 1.0
            while time.perf_counter() < end:   # this process busy too: not counted
                pass
    finally:
        spin.kill()
    assert load.cores is not None and load.cores >= 0.5 and load.busy, load.cores
    assert load.note("the timing").startswith("note: other processes kept")


def test_decode_steps_run_on_the_calling_thread_and_prefill_on_every_worker(monkeypatch):
    """`decode_` runs a step this small on the calling thread alone (`pool.Adaptive`: beside
    PyTorch's spinning OpenMP workers a pooled step took 80x its quiet time), and a later
    `hla()` on the same thread gets every worker back; both give the float64 recurrence's
    outputs."""
    from hla_tvm import decode_
    from hla_tvm.runtime import pool

    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.setattr(pool, "_CORES", [2])
    monkeypatch.setattr(pool, "_LOCAL", threading.local())   # (no count set on this thread)
    monkeypatch.setattr(pool, "_SIZED", [True])
    q, k, v = make_qkv(1, 2, 12, 8, 8)
    want = hla2.serial(q, k, v)[0]
    _, st = hla(q[:, :, :4].float(), k[:, :, :4].float(), v[:, :, :4].float(),
                return_state=True)
    outs = [decode_(q[:, :, t].float(), k[:, :, t].float(), v[:, :, t].float(), st)
            for t in range(4, 12)]
    assert pool._LOCAL.threads == 1
    assert rel_err(torch.stack(outs, 2), want[:, :, 4:]) < 1e-5
    assert rel_err(hla(q.float(), k.float(), v.float()), want) < 1e-5
    assert pool._LOCAL.threads == 2


_AFFINITY_CHILD = r"""
import os, sys, threading
import numpy as np, torch
from hla_tvm import decode_, hla
from hla_tvm.runtime import load, pool, set_threads
before = os.sched_getaffinity(0)
seen = []
set_threads(1); seen.append(os.sched_getaffinity(0))
set_threads(None); seen.append(os.sched_getaffinity(0))
q = torch.randn(1, 2, 8, 8)
_, st = hla(q, q, q, return_state=True); seen.append(os.sched_getaffinity(0))
for _ in range(12):
    decode_(q[:, :, 0], q[:, :, 0], q[:, :, 0], st)
seen.append(os.sched_getaffinity(0))
m = load(sys.argv[1])
s = m.init_state(1)
for _ in range(12):
    _, s = m.decode(np.array([1]), s)
seen.append(os.sched_getaffinity(0))
later = []
t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
t.start(); t.join()
print(sorted(before), [sorted(x) for x in seen + later])
assert all(x == before for x in seen + later)
# a thread the user pins later stays pinned (the pool takes the thread's CPUs as they are now)
last = {max(before)}
os.sched_setaffinity(0, last)
set_threads(1)
decode_(q[:, :, 0], q[:, :, 0], q[:, :, 0], st)
assert os.sched_getaffinity(0) == last, os.sched_getaffinity(0)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity") or
                    len(__import__("os").sched_getaffinity(0)) < 2, reason="one CPU")
def test_the_pool_leaves_the_calling_threads_cpus_as_they_were(model_path):
    """Sizing TVM's pool, `hla()`, `decode_` (on one worker or all) and a compiled module's
    calls leave the calling thread free to run on every CPU it had, and threads it starts
    later too: TVM's default mode pinned it to CPU 0 (two test workers shared one core). A
    thread pinned by the user afterwards stays as pinned."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _AFFINITY_CHILD, str(model_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


def test_a_count_set_with_set_threads_holds_for_hla(monkeypatch):
    """`set_threads(1)` on a thread: `hla()` there runs on one worker (it resets the pool to
    the thread's own count, not to every core), with the float64 recurrence's outputs."""
    from hla_tvm.runtime import pool, set_threads

    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    q, k, v = make_qkv(1, 2, 12, 8, 8)
    want = hla2.serial(q, k, v)[0]

    def run(_):
        set_threads(1)
        out = hla(q.float(), k.float(), v.float())
        return pool._LOCAL.threads, rel_err(out, want)

    threads, err = _in_threads(run, 1)[0]
    assert threads == 1 and err < 1e-5
