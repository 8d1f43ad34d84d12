"""TVM's CPU worker pool: its size (`set_threads`), and the worker count of each kind of call
chosen by measurement (`Adaptive`). Torch-free (the runtime-only path uses it).

TVM runs a kernel's parallel loop on a fork-join pool of one worker per core, the calling thread
being one of them, and waits for the slowest. When another process keeps a core busy, the
worker that shares its core gets the CPU in scheduler time slices (milliseconds), and a decode
step of 50 small kernels, 230 us on a quiet 2-core machine, took 50 ms (19 tokens/s, measured);
on the calling thread alone it took 0.7 ms. Which count is fastest depends on the load of the
moment and on the call (a small model's decode is fastest on one thread even on a quiet
machine; a large prefill is not), so `Adaptive` times the calls and picks."""
from __future__ import annotations

import os
import sys
import threading
import time


def physical_cores():
    """Physical cores this process may run on (SMT siblings count once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(c))
    return max(1, len(cores))


def import_tvm_runtime():
    """TVM, runtime-only unless it is already imported or torch is (a process that works with
    torch goes on to compile: a runtime-only TVM there would break `hla()` and `compile`)."""
    if "tvm" in sys.modules:
        return sys.modules["tvm"]
    if "torch" in sys.modules:
        # TVM's runtime is imported where first needed: `import hla_tvm.runtime` loads no TVM
        # library
        import tvm

        return tvm
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("hla_tvm.runtime keeps torch out of the runtime path")
            return None

    blocker = _NoTorch()
    sys.meta_path.insert(0, blocker)
    try:
        import tvm
    finally:
        sys.meta_path.remove(blocker)
    return tvm


# names the $TVM_NUM_THREADS value `set_threads` wrote (for TVM's pool): in the environment, so
# that child processes, which inherit both, do not take it for the user's
WROTE_ENV = "HLA_TVM_WROTE_TVM_NUM_THREADS"


def env_threads():
    """$TVM_NUM_THREADS as a positive int set by the user, or 0 when unset, not a number, or
    the value `set_threads` wrote itself (here or in a parent process)."""
    env = os.environ.get("TVM_NUM_THREADS", "")
    if env and env == os.environ.get(WROTE_ENV):
        return 0
    return int(env) if env.isdigit() else 0


def set_threads(threads=None):
    """Size TVM's CPU thread pool (of the calling thread): `threads` workers, or with None
    $TVM_NUM_THREADS when set, else one per physical core. (TVM's own default on x86 is half
    the logical CPUs, which leaves half the cores idle on machines without SMT.) TVM sizes a
    pool once, from $TVM_NUM_THREADS, when the thread first runs a parallel kernel; later
    calls can lower the count below that size, not raise it. Returns the count asked for."""
    tvm = import_tvm_runtime()
    env = env_threads()
    if threads is None:
        threads = env or physical_cores()
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    elif threads > (os.cpu_count() or threads):   # (more workers than CPUs only contend)
        raise ValueError(f"threads={threads} exceeds this machine's {os.cpu_count()} CPUs")
    raw = os.environ.get("TVM_NUM_THREADS", "")
    env = int(raw) if raw.isdigit() else 0   # (the pool's size: the user's value or ours)
    if env < threads:
        os.environ["TVM_NUM_THREADS"] = os.environ[WROTE_ENV] = str(threads)  # (read when
        # the pool is created)
    _configure(tvm, threads)
    _LOCAL.threads = _LOCAL.requested = threads
    return threads


_SIZED = []
_LOCAL = threading.local()
_SHARE_ALL_CORES = -3   # TVM's ThreadGroup::kSpecifyThreadShareAllCore


def _configure(tvm, n):
    """This thread's TVM pool runs kernels on `n` workers, every one of them (the calling
    thread included) free to run on any of the CPUs the calling thread may use now (its
    affinity, read at each call: whatever the user or a launcher set is kept). TVM's default
    mode pins each worker to one core, the calling thread to the first: a thread of the
    user's (a server's, a test worker's) was left on CPU 0 alone, with every thread it started
    later."""
    config = tvm.get_global_func("runtime.config_threadpool")
    if hasattr(os, "sched_getaffinity"):
        config(_SHARE_ALL_CORES, n, [str(c) for c in sorted(os.sched_getaffinity(0))])
    else:   # (no affinity on this platform: nothing is pinned)
        config(1, n)


def use_threads(n):
    """Run this thread's next kernels on `n` TVM workers (the pool is reconfigured only when
    the count changes: that costs 10-20 us)."""
    if getattr(_LOCAL, "threads", None) != n:
        _configure(import_tvm_runtime(), n)
        _LOCAL.threads = n


def default_threads():
    """The worker count kernels run with unless a call chooses (`Adaptive`): what
    `set_threads` set on this thread, else $TVM_NUM_THREADS when set, else one per physical
    core (counted once)."""
    requested = getattr(_LOCAL, "requested", None)
    if requested:
        return requested
    if not _CORES:
        _CORES.append(physical_cores())
    return env_threads() or _CORES[0]


_CORES = []


def size_once():
    """Once per process, before the first kernel of `hla()` or `decode_()` runs (or a kernel is
    timed for tuning): one TVM worker per physical core ($TVM_NUM_THREADS wins), as
    `hla_tvm.runtime.load` does. TVM's own default (half the logical CPUs) left the operator
    1.7x slower on a 2-core machine."""
    if not _SIZED:
        set_threads(None)
        _SIZED.append(True)


class Adaptive:
    """The worker count of one kind of call (an entry at one shape) on one thread, chosen by
    timing. A probe first runs PROBE_CALLS calls on the calling thread alone; a call whose
    median there is under PARALLEL_FROM_S stays there (its kernels are too small for a pool to
    gain much, and beside a busy process one pooled call of the demo's decode, 0.14 ms alone,
    stalled 75 ms: measured). Otherwise the other candidate counts run PROBE_CALLS calls each
    in turn (a count whose fastest call is SLOW times another's median is dropped at once),
    and the count with the least median time is kept (a median: beside a busy process a pool's
    calls are fast or very slow as the scheduler happens to place them, and one lucky call
    must not decide). Calls of LONG_S or more (every call of the probe so far, two of them or
    one of 10 LONG_S) are timed once a count: the scheduler's slices average out over them,
    and five single-thread calls of a long prefill (1.35 s each for the 120 M model's 512
    tokens, 0.68 s on 2 cores; the demo model's 1,024: 41 against 25 ms) would cost seconds.
    The candidates are probed again after `reprobe_s` seconds (doubled, up to MAX_REPROBE_S,
    while probes keep choosing the same count; long calls after MAX_REPROBE_S), or as soon as
    SLOW_RUN calls in a row take SLOW times the chosen count's median (the load changed).
    Results do not depend on the count (each parallel loop splits independent rows), only the
    time does.

        n = chooser.before()      # the count to run this call with (the pool is set to it)
        ... the call ...
        chooser.after(seconds)
    """

    PROBE_CALLS = 5
    LONG_S = 10e-3
    PARALLEL_FROM_S = 2e-3   # (the demo's prefill: 3.6 ms alone, 2.4 ms on 2 cores; decode
    # 0.14 ms alone, slower pooled)
    REPROBE_S, MAX_REPROBE_S = 1.0, 30.0
    SLOW, SLOW_RUN = 2.0, 3

    def __init__(self, most, configure):
        self.candidates = sorted({1, max(1, most // 2), most}) if most > 1 else [1]
        self.configure = configure   # configure(n): the calling thread's pool runs n workers
        self.current = None          # the count the pool is set to
        self.chosen = None           # the count picked by the last probe
        self.times = {}              # count -> seconds of its calls in this probe
        self.order = []              # counts still to run in this probe
        self.since = 0.0             # when the chosen count was picked
        self.reprobe_s = self.REPROBE_S
        self.typical = None          # the chosen count's median time
        self.slow = 0                # calls in a row slower than SLOW * typical

    def before(self):
        # (long calls: a timed probe runs one of them on a single thread; seldom then)
        wait = self.reprobe_s if self.chosen is None or self.typical < self.LONG_S else \
            self.MAX_REPROBE_S
        if not self.order and (self.chosen is None or len(self.candidates) > 1 and
                               time.perf_counter() - self.since > wait):
            self._probe()
        n = self.order[0] if self.order else self.chosen
        if n != self.current:
            self.configure(n)
            self.current = n
        return n

    def after(self, seconds):
        if self.order:
            n = self.order.pop(0)
            self.times.setdefault(n, []).append(seconds)
            calls = sum(len(t) for t in self.times.values())
            if all(min(t) >= self.LONG_S for t in self.times.values()) and \
                    (calls > 1 or seconds >= 10 * self.LONG_S):
                # long calls, all of them (two, or one of 10 LONG_S: a short call's stall is
                # rarely both): one call a count tells them apart
                self.order = list(dict.fromkeys(m for m in self.order if m not in self.times))
            # a count whose fastest call is SLOW times the (upper) median of a count with two
            # calls or more is far behind: not worth more calls
            settled = [sorted(t)[len(t) // 2] for t in self.times.values() if len(t) > 1]
            far = {m for m, t in self.times.items()
                   if settled and min(t) > self.SLOW * min(settled)}
            self.order = [m for m in self.order if m not in far]
            if n == 1 and self.order and self.order[0] != 1 and \
                    sorted(self.times[1])[len(self.times[1]) // 2] < self.PARALLEL_FROM_S:
                self.order = []   # small calls stay on the calling thread
            if not self.order:
                medians = {m: sorted(t)[len(t) // 2] for m, t in self.times.items()
                           if m not in far}
                chosen = min(medians, key=medians.get)
                self.reprobe_s = min(2 * self.reprobe_s, self.MAX_REPROBE_S) \
                    if chosen == self.chosen else self.REPROBE_S
                self.chosen, self.typical = chosen, medians[chosen]
                self.since, self.slow = time.perf_counter(), 0
        elif len(self.candidates) > 1:
            self.slow = self.slow + 1 if seconds > self.SLOW * self.typical else 0
            if self.slow >= self.SLOW_RUN:
                self.reprobe_s = self.REPROBE_S
                self._probe()

    def run(self, fn, *args):
        """fn(*args) on the count `before` picks, set again first (another call on this thread
        may have changed the pool; `configure` must cost nothing when the count is the same,
        as `use_threads` does), its time passed to `after`. Returns fn's result."""
        self.configure(self.before())
        t0 = time.perf_counter()
        out = fn(*args)
        self.after(time.perf_counter() - t0)
        return out

    def _probe(self):
        self.times = {}
        others = [n for n in self.candidates if n != 1]
        self.order = [1] * self.PROBE_CALLS + [n for _ in range(self.PROBE_CALLS)
                                               for n in others]


def _all_busy_seconds():
    """CPU seconds every process of the machine has run since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """A context that measures how many cores other processes kept busy while it ran:
    `cores` (None where /proc/stat is missing), the machine's CPU time less this process's
    over the wall time.

        with OtherLoad() as load:
            ... timed work ...
        if load.busy: print(f"{load.cores:.1f} cores were busy with other work")
    """

    BUSY = 0.25   # cores of other work from which timings are called taken on a busy machine

    def __enter__(self):
        self.cores = None
        self._start = (time.perf_counter(), _all_busy_seconds(), sum(os.times()[:2]))
        return self

    def __exit__(self, *exc):
        wall0, all0, own0 = self._start
        wall, all1, own1 = time.perf_counter() - wall0, _all_busy_seconds(), sum(os.times()[:2])
        if all0 is not None and all1 is not None and wall > 0:
            self.cores = max(0.0, ((all1 - all0) - (own1 - own0)) / wall)
        return False

    @property
    def busy(self):
        return self.cores is not None and self.cores >= self.BUSY

    def note(self, what="the timings"):
        """A sentence for people when the machine was busy, else ""."""
        if not self.busy:
            return ""
        return (f"note: other processes kept {self.cores:.1f} of this machine's "
                f"{os.cpu_count()} CPUs busy during {what}; on a quiet machine the times are "
                "lower")
