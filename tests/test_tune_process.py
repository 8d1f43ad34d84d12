"""`tune.tune` run several times in one process (a child process, so that its logging state is
the tuner's own): each tune measures the trials asked with a bar that counts to them, prints none
of meta_schedule's log (its tables) to stdout, and works whatever logging state was left before
it, by an earlier tune or by another library (a handler without a name on meta_schedule's
logger made meta_schedule's own logging setup fail). Small kernels, few trials: about a minute."""
import json
import re
import subprocess
import sys

import pytest

# one worker runs this file, so the child process below runs once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tune_process")]

CHILD = r"""
import json, logging, sys, traceback

import torch

from hla_tvm import ops
from hla_tvm.schedule.tuning import tune
from hla_tvm.target import resolve

out = sys.argv[1]
op = ops.get(2, False)
kernels = tune.operator_kernels(op, decayed=False, dk=8, dv=8, chunk=16, dtype=torch.float32,
                                   **op.options(masked=True, normalize=False, eps=1e-6,
                                                ridge=0.0))
result = {}


def step(name, picked, trials, progress=False):
    for stream in (sys.stdout, sys.stderr):
        print(f"=== {name}", file=stream, flush=True)
    try:
        report = tune.tune({n: kernels[n] for n in picked}, resolve(None), trials,
                           f"{out}/{name}", progress=progress,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
        result[name] = {"report": report}
    except Exception:
        result[name] = {"error": traceback.format_exc()}
    for stream in (sys.stdout, sys.stderr):
        print(f"=== end {name}", file=stream, flush=True)


# a 1-point design space and a 4-point one: with 3 trials, meta_schedule's first batches
# (its trials per iteration: 3) measured 1 + 3
step("first", ["chunk_psum_w64", "hla2_chunk_summary"], 3, progress=True)
step("second", ["chunk_psum_w64"], 1)
# another library's handler (no name) on meta_schedule's logger, which it set to DEBUG
logger = logging.getLogger("tvm.s_tir.meta_schedule")
foreign = logging.StreamHandler(sys.stderr)
logger.addHandler(foreign)
logger.setLevel(logging.DEBUG)
step("foreign", ["chunk_psum_w64"], 1)
result["foreign"]["handler_kept"] = foreign in logger.handlers
result["foreign"]["handlers"] = len(logger.handlers)
result["foreign"]["level"] = logger.level
with open(f"{out}/result.json", "w") as f:
    json.dump(result, f)
"""

TABLE = ("Total trials", "TaskScheduler picks", "Weighted Latency", "[INFO]", "[DEBUG]")


def _segment(text, name):
    return text.split(f"=== {name}\n", 1)[1].split(f"=== end {name}\n", 1)[0]


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """(result, stdout, stderr, folder) of one child process that tunes three times (`CHILD`):
    its result.json, its output streams, and the folder of its tunes."""
    out = tmp_path_factory.mktemp("tune_process")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    return result, proc.stdout, proc.stderr, out


def test_a_tune_measures_the_trials_asked_and_its_bar_counts_to_them(child):
    result, _, stderr, out = child
    assert "error" not in result["first"], result["first"].get("error")
    # meta_schedule's database: the two seeded default schedules and the 3 trials (it held 1 + 4)
    lines = (out / "first" / "work" / "database_tuning_record.json").read_text().splitlines()
    assert len(lines) == 2 + 3
    bar = _segment(stderr, "first")
    counts = re.findall(r"(\d+)/(\d+) \[", bar)
    assert counts and counts[-1] == ("3", "3")
    assert {total for _, total in counts} == {"3"}   # the total never changed
    assert "runner's fastest: " in bar and "default and tuned times: the fastest of 21" in bar
    report = result["first"]["report"]
    assert set(report) == {"chunk_psum_w64", "hla2_chunk_summary"}
    assert sum(r["trials"] for r in report.values()) == 3
    assert all(r["trials"] >= 1 for r in report.values())   # shared out over both kernels


def test_a_second_tune_in_a_process_prints_no_meta_schedule_tables(child):
    result, stdout, _, out = child
    assert "error" not in result["second"], result["second"].get("error")
    assert result["second"]["report"]["chunk_psum_w64"]["kept"] == "default"
    for name in ("first", "second"):
        printed = _segment(stdout, name)
        assert not any(mark in printed for mark in TABLE), printed[:2000]
    # the full log went to the work folder
    logs = out / "second" / "work" / "logs"
    assert "Total trials" in "".join(p.read_text() for p in logs.iterdir())


def test_a_tune_after_another_library_set_up_meta_schedules_logger(child):
    """A handler without a name and the level DEBUG on meta_schedule's logger (left there by
    another library): the tune works, prints no tables, and leaves them as they were."""
    result, stdout, _, _ = child
    assert "error" not in result["foreign"], result["foreign"].get("error")
    assert result["foreign"]["report"]["chunk_psum_w64"]["default_s"] > 0
    assert not any(mark in _segment(stdout, "foreign") for mark in TABLE)
    assert result["foreign"]["handler_kept"] and result["foreign"]["handlers"] == 1
    assert result["foreign"]["level"] == 10   # logging.DEBUG
