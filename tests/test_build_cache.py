"""The compiled-kernel cache: reused from disk by a new process, rebuilt when a file is corrupt."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)


def _run_in_new_process(code, cache):
    env = dict(os.environ, HLA_TVM_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


CODE = """
import torch, hla_tvm
q = torch.ones(1, 1, 5, 4) / 2
print(float(hla_tvm.hla(q, q, q[..., :3]).sum()))
"""


def _kernel_files(cache):
    """The cache folder's entries but `checked/` (the verdict on the shipped records of this
    CPU, where the project ships some: `records.load`)."""
    return sorted(f for f in os.listdir(cache) if f != "checked")


def test_second_process_loads_from_disk(tmp_path):
    first = _run_in_new_process(CODE, tmp_path)
    assert first.returncode == 0, first.stderr
    files = _kernel_files(tmp_path)
    assert len(files) == 1 and files[0].startswith("hla2_prefill-")
    mtime = os.path.getmtime(tmp_path / files[0])
    second = _run_in_new_process(CODE, tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert os.path.getmtime(tmp_path / files[0]) == mtime  # loaded, not rebuilt


def test_corrupt_cache_file_is_rebuilt(tmp_path):
    """The issue's case: a cache file cut to 4 kB used to crash every later process (SIGBUS)."""
    first = _run_in_new_process(CODE, tmp_path)
    assert first.returncode == 0, first.stderr
    (name,) = _kernel_files(tmp_path)
    path = tmp_path / name
    good = path.read_bytes()
    for damaged in (good[:4096],):
        path.write_bytes(damaged)
        second = _run_in_new_process(CODE, tmp_path)
        assert second.returncode == 0, second.stderr
        assert "rebuilding unreadable cached kernel" in second.stderr
        assert second.stdout == first.stdout
        assert path.stat().st_size > 1000
        third = _run_in_new_process(CODE, tmp_path)
        assert "unreadable" not in third.stderr and third.stdout == first.stdout
