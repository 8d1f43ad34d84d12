"""CUDA device code of compiled modules: the source TVM generates and its build with nvcc.

TVM 0.27 keeps a CUDA module as CUDA C++ source and compiles it when the module is first loaded
on a GPU (through the `tvm_callback_cuda_compile` hook, which `tvm.support.nvcc` provides).
Building the same source here with nvcc proves the device code compiles for each architecture
before any GPU sees it, and gives the binaries a runtime-only machine can load: `store` keeps
them in a folder by the source's sha256, and `serve` registers the hook that returns them."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

HOOK = "tvm_callback_cuda_compile"


def cuda_source(executable):
    """The CUDA C++ source of the device kernels in a `tvm.compile` result (or a loaded
    module); ValueError when it holds no CUDA module."""
    todo = [getattr(executable, "mod", executable)]
    while todo:   # (a compiled model's kernels sit one import further down)
        for imp in todo.pop().imports:
            if imp.kind == "cuda":
                return imp.inspect_source()
            todo.append(imp)
    raise ValueError("the module holds no CUDA device code")


def nvcc():
    """The nvcc command, or None when it is not installed ($CUDA_HOME/bin or PATH)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def compile_cuda(source, archs, fmt="fatbin"):
    """Device code for `archs` (e.g. ["sm_80", "sm_90"]) built from CUDA `source` with nvcc -O3:
    fmt "fatbin" (one binary per architecture plus PTX of the newest, for later GPUs) or
    "cubin" (one architecture). ValueError when nvcc is missing or fails (its message)."""
    cmd = nvcc()
    if cmd is None:
        raise ValueError("building CUDA device code needs nvcc (the CUDA toolkit); set CUDA_HOME "
                         "or put nvcc on PATH")
    archs = [archs] if isinstance(archs, str) else list(archs)
    if fmt == "cubin" and len(archs) != 1:
        raise ValueError(f"a cubin holds one architecture, got {archs}")
    if fmt not in ("cubin", "fatbin"):
        raise ValueError(f"fmt must be 'cubin' or 'fatbin', got {fmt!r}")
    flags = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    if fmt == "fatbin":
        newest = max(archs, key=lambda a: int("".join(c for c in a[3:] if c.isdigit())))
        flags.append(f"-gencode=arch=compute_{newest[3:]},code=compute_{newest[3:]}")
    with tempfile.TemporaryDirectory(prefix="hla_tvm_nvcc_") as tmp:
        src, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, f"kernels.{fmt}")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        run = subprocess.run([cmd, f"--{fmt}", "-O3", "-w", *flags, "-o", out, src],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise ValueError(f"nvcc failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
        with open(out, "rb") as f:
            return f.read()


def stored_path(folder, source, archs):
    """Where `store` keeps the device code of CUDA `source` for `archs` in `folder`."""
    archs = [archs] if isinstance(archs, str) else sorted(archs)
    digest = hashlib.sha256(source.encode()).hexdigest()
    return os.path.join(folder, f"{digest}-{'-'.join(archs)}.fatbin")


def store(folder, source, archs):
    """The path of the device code of `source` for `archs` in `folder`, built with nvcc
    (`compile_cuda`) unless it is there already."""
    path = stored_path(folder, source, archs)
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(compile_cuda(source, archs))
        os.replace(tmp, path)
    return path


def serve(folder, arch, *, override=True):
    """Register TVM's `tvm_callback_cuda_compile` hook (called when a module holding CUDA source
    is loaded) to return the device code `store` keeps in `folder`, building what is missing
    with nvcc for `arch` ("sm_90"). override=False keeps a hook already registered (TVM's own,
    where its compiler is installed). Returns the hook in force."""
    import tvm_ffi

    current = tvm_ffi.get_global_func(HOOK, allow_missing=True)
    if current is not None and not override:
        return current

    def device_code(source, *_):
        with open(store(folder, source, [arch]), "rb") as f:
            return f.read()

    tvm_ffi.register_global_func(HOOK, device_code, override=True)
    return tvm_ffi.get_global_func(HOOK)


def load_cuda_runtime(lib_dir):
    """Load TVM's CUDA runtime (`libtvm_runtime_cuda.so` in `lib_dir`, beside
    libtvm_runtime.so, which must be loaded already) into the process, with the CUDA runtime
    library it links to (libcudart.so.13: already loaded by PyTorch, else from the NVIDIA wheels
    or the CUDA toolkit). OSError naming what is missing."""
    import ctypes
    import glob
    import sys

    for pattern in ("nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.13"):
        found = [p for d in sys.path if d for p in glob.glob(os.path.join(d, pattern))]
        if found:
            ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
            break
    path = os.path.join(lib_dir, "libtvm_runtime_cuda.so")
    if not os.path.isfile(path):
        raise OSError(f"TVM's CUDA runtime is missing: no {path}")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
