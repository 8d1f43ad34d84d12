"""Tuning over TVM RPC: a tracker and a server on 127.0.0.1 (as on a device), `tune` measuring
its trials and its default-vs-tuned comparison through them; the records then give kernels that
equal the float64 recurrence. Unreachable trackers and missing servers give clear errors."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import free_port, make_qkv, rel_err

from hla_tvm import hla
from hla_tvm.cli import main
from hla_tvm.ops.hla2 import reference as hla2
from hla_tvm.schedule.tuning import records, tune
from hla_tvm.target import resolve

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)

KEY = "hla-test"


def _start(*args):
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture(scope="module")
def tracker():
    from tvm import rpc

    port = free_port()
    procs = [_start("tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                    "--port-end", str(port + 1))]
    try:
        deadline = time.time() + 60
        while True:   # the tracker, then a server registered with it
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "the RPC tracker did not start"
                time.sleep(0.5)
        sport = free_port()
        procs.append(_start("tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}", "--key",
                            KEY, "--host", "127.0.0.1", "--port", str(sport), "--port-end",
                            str(sport + 1)))
        while KEY not in (rpc.connect_tracker("127.0.0.1", port).summary()
                          .get("queue_info") or {}):
            assert time.time() < deadline, "the RPC server did not register"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def test_tune_over_rpc_gives_records_that_match_float64(tracker, tmp_path):
    from hla_tvm import ops

    op = ops.get(2, False)
    kernels = tune.operator_kernels(op, decayed=False, dk=8, dv=8, chunk=16,
                                       dtype=torch.float32,
                                       **op.options(masked=True, normalize=False, eps=1e-6,
                                                    ridge=0.0))
    picked = {n: kernels[n] for n in ("hla2_chunk_ksummary", "hla2_chunk_summary")}
    report = tune.tune(picked, resolve(None), 3, str(tmp_path),
                       runner=tune.rpc_runner(tracker, KEY), progress=False)
    assert set(report) == set(picked)
    for r in report.values():   # both schedules were measured on the server
        assert 0 < r["default_s"] < 1 and r["kept"] in ("tuned", "default")
    db = records.load(str(tmp_path))
    for name, (func, shapes) in picked.items():
        assert records.tuned(func, shapes, db, resolve(None)) is not None, name
    q, k, v = make_qkv(2, 3, 37, 8, 8, seed=5)
    want, _ = hla2.serial(q, k, v)
    with pytest.warns(UserWarning, match="without a tuned record"):   # the other kernels
        out = hla(q.float(), k.float(), v.float(), chunk_size=16, schedules=str(tmp_path))
    assert rel_err(out, want) < 1e-4


def test_rpc_errors_are_clear(tracker, capsys):
    with pytest.raises(ValueError, match="cannot reach the RPC tracker"):
        tune.rpc_runner(f"127.0.0.1:{free_port()}", KEY)
    with pytest.raises(ValueError, match="no RPC server is registered with key 'nokey'"):
        tune.rpc_runner(tracker, "nokey")
    with pytest.raises(ValueError, match="HOST:PORT"):
        tune.rpc_runner("localhost", KEY)
    assert main(["tune", "--dk", "8", "--trials", "1", "--rpc-tracker", tracker]) == 2
    assert "--rpc-key" in capsys.readouterr().err
