"""Stage lines for long work on standard error, where a person watches it:

    stages = Stages("compile")           # shown where stderr is a terminal
    stages("exporting (torch.export)")   # "compile: exporting (torch.export) ..."
    stages("scheduling kernels")         # "  2.1 s" ends the line before, a new one starts
    stages.done()                        # "compile: done in 14.2 s"

$HLA_TVM_PROGRESS=1 shows them anywhere, 0 nowhere; `show` overrides both."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time


class Stages:
    def __init__(self, what, show=None):
        if show is None:
            env = os.environ.get("HLA_TVM_PROGRESS")
            show = env == "1" if env in ("0", "1") else _is_terminal(sys.stderr)
        self.what, self.show = what, bool(show)
        self.start = self.at = time.monotonic()
        self.open = False

    def __call__(self, name):
        """End the current stage and start `name`."""
        if not self.show:
            return
        self._end()
        print(f"{self.what}: {name} ...", end="", file=sys.stderr, flush=True)
        self.open, self.at = True, time.monotonic()

    def done(self):
        if not self.show:
            return
        self._end()
        print(f"{self.what}: done in {time.monotonic() - self.start:.1f} s", file=sys.stderr,
              flush=True)

    def _end(self):
        if self.open:
            print(f" {time.monotonic() - self.at:.1f} s", file=sys.stderr, flush=True)
            self.open = False


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def progress_line(message, stream=None):
    """Show `message` with the seconds elapsed, refreshed each second on a terminal (once
    elsewhere), until the block ends; then the time it took."""
    stream = stream or sys.stderr
    done = threading.Event()
    t0 = time.perf_counter()
    tty = stream.isatty()

    def tick():
        while not done.wait(1.0):
            stream.write(f"\r{message} {time.perf_counter() - t0:.0f} s")
            stream.flush()

    stream.write(message + ("" if tty else "\n"))
    stream.flush()
    thread = threading.Thread(target=tick, daemon=True) if tty else None
    if thread:
        thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        if thread:
            thread.join()
        took = f"{'done' if ok else 'failed'} after {time.perf_counter() - t0:.0f} s"
        stream.write(f"\r{message} {took}\n" if tty else f"  {took}\n")
        stream.flush()
