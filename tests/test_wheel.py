"""The wheel carries the shipped tuned records: built from this checkout and installed into a
folder of its own, the package finds them there (`records.package_root`), identical to the
checkout's `schedules/`."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source(tmp_path):
    """A copy of the files a build reads (the checkout's sources, records and apps)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("hla_tvm", "schedules", "export"):
        shutil.copytree(os.path.join(ROOT, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


def _shipped():
    """The records files of the checkout's schedules/, relative to it."""
    shipped = sorted(os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "schedules"))
                     for d, _, files in os.walk(os.path.join(ROOT, "schedules"))
                     for f in files if f.endswith((".json", ".json.xz")))
    assert shipped, "no tuned records in schedules/"
    return shipped


def test_source_distribution_carries_the_records_and_apps(tmp_path):
    """MANIFEST.in names every kind of file the wheel then copies (a wheel built from the
    sdist, as pip does from PyPI, holds only what the sdist holds)."""
    import tarfile

    pytest.importorskip("setuptools", reason="building an sdist needs setuptools")
    src = _source(tmp_path)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                   cwd=src, check=True, capture_output=True)
    sdist = next((tmp_path / "dist").glob("hla_tvm-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for f in [f"schedules/{f}" for f in _shipped()] + [
            "hla_tvm/data/stdlib-hla2.pt", "export/cpp/main.cc", "export/cpp/CMakeLists.txt",
            "export/python/generate.py"]:
        assert f in names, f


def test_installed_wheel_finds_the_shipped_records(tmp_path):
    pytest.importorskip("setuptools", reason="building a wheel needs setuptools")
    src = _source(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("hla_tvm-*.whl"))
    shipped = _shipped()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert all(f"hla_tvm/_schedules/{f}" in names for f in shipped)
    # the demo model, and the app sources `hla-tvm bundle` copies
    for f in ("hla_tvm/data/stdlib-hla2.pt", "hla_tvm/_export/cpp/main.cc",
              "hla_tvm/_export/cpp/CMakeLists.txt", "hla_tvm/_export/python/generate.py"):
        assert f in names, f

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    code = ("import os, sys, tvm; from hla_tvm.schedule.tuning import records as r; "
            "root = r.package_root(); print(root); "
            "print(all(os.path.isfile(os.path.join(root, f)) for f in sys.argv[1:])); "
            "t = tvm.target.Target({'kind': 'llvm', 'mcpu': 'znver3', 'num-cores': 2}); "
            "print(r.resolve('auto', t))")
    env = {**os.environ, "PYTHONPATH": str(site), "HLA_TVM_CACHE_DIR": str(tmp_path / "c")}
    out = subprocess.run([sys.executable, "-c", code, *shipped], cwd=tmp_path, env=env,
                         check=True, capture_output=True, text=True).stdout.split("\n")
    assert out[0] == str(site / "hla_tvm" / "_schedules")
    assert out[1] == "True"
    if "llvm-znver3-2c/database_workload.json.xz" in shipped:
        assert out[2] == str(site / "hla_tvm" / "_schedules" / "llvm-znver3-2c")
