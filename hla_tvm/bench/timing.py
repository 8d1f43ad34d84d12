"""Timing helpers the benchmarks share: cases timed in interleaved rounds, each run started once
the process's thread pools are idle, and a description of the machine."""
from __future__ import annotations

import platform
import time

from ..runtime import physical_cores
from ..runtime.pool import OtherLoad


def settle(most=1.0, window=0.005):
    """Wait, up to `most` seconds, until this process's threads are idle (under a tenth of a
    core over `window` seconds): thread pools (PyTorch's OpenMP workers, ONNX Runtime's) keep
    spinning for a while after their work, taking the cores from whatever runs next. Returns
    whether they went idle in time."""
    end = time.perf_counter() + most
    while time.perf_counter() < end:
        c0 = time.process_time()
        time.sleep(window)
        if time.process_time() - c0 < window / 10:
            return True
    return False


class SelfTimed:
    """A case whose calls run `before()` untimed, then `fn()` timed: called, it returns the
    seconds `fn` took (`measure_rounds` counts those alone, over at most `max_calls` calls a
    round: a long `before` would otherwise multiply a round of many short calls)."""

    def __init__(self, before, fn, max_calls=None):
        self.before, self.fn, self.max_calls = before, fn, max_calls

    def __call__(self):
        self.before()
        t0 = time.perf_counter()
        self.fn()
        return time.perf_counter() - t0


def measure_rounds(cases, runs, number=1, probe=None, busy=None):
    """{name: [seconds per call of each run]} of every case in `cases` {name: fn}, timed in
    rounds (each round times `number` calls of every case in turn), after each case's warm-up
    (two calls; the second through `probe(name, fn)` when given): a slow or fast spell of a
    noisy machine falls on every case alike, not on whichever ran then. A `SelfTimed` case
    counts the time its calls report. `busy` (a dict), when given, gets {name: runs that
    started before the process went idle (`settle` gave up)}."""
    for name, fn in cases.items():
        fn()
        if probe is None:
            fn()
        else:
            probe(name, fn)
    times = {name: [] for name in cases}
    for _ in range(runs):
        for name, fn in cases.items():
            if not settle() and busy is not None:
                busy[name] = busy.get(name, 0) + 1
            if isinstance(fn, SelfTimed):
                calls = min(number, fn.max_calls or number)
                times[name].append(sum(fn() for _ in range(calls)) / calls)
                continue
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times[name].append((time.perf_counter() - t0) / number)
    return times


def load_notes(others, busy):
    """The table's notes on a busy machine: `others` (cores other processes kept busy while it
    was timed, `pool.OtherLoad.cores`), `busy` ({case: "k" or "k of n" runs that started before
    this process's threads went idle, `measure_rounds`})."""
    out = []
    if others is not None and others >= OtherLoad.BUSY:
        out.append(f"note: other processes kept {others:.1f} of this machine's CPUs busy while "
                   "it was timed: every case ran slower than on a quiet machine, the ratios may "
                   "differ")
    if busy:
        out.append("note: " + ", ".join(f"{n} {k}" for n, k in busy.items()) +
                   " timed runs started with this process's threads still working after "
                   "waiting 1 s: those times may be high")
    return out


def machine():
    """{cpu, cores, isa} of this machine."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.machine()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = next((x for x in ("avx512f", "avx2", "sve", "asimd", "neon") if x in flags),
               platform.machine())
    # the units that multiply in bfloat16 or int8, which some cases use
    extra = [x for x in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if x in flags]
    return {"cpu": cpu, "cores": physical_cores(), "isa": " ".join([isa, *extra])}
