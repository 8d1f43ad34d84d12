"""CUDA device code of compiled modules: the source TVM generates and its build with nvcc.

TVM 0.27 keeps a CUDA module as CUDA C++ source and compiles it when the module is first loaded
on a GPU (through the `tvm_callback_cuda_compile` hook, which `tvm.support.nvcc` provides).
Building the same source here with nvcc proves the device code compiles for each architecture
before any GPU sees it, and gives the binaries a runtime-only machine can load: `store` keeps
them in a folder by the source's sha256, and `serve` registers the hook that returns them.
A model compiled for CUDA gets its device code beside it (`ship`: model.so -> model.device/,
built here when nvcc is installed), so the GPU machine needs no CUDA toolkit to load it."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from .paths import replacing

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
    (`compile_cuda`) unless a sound copy is there already (`read_checked`: a file without its
    sha256 or not matching it, e.g. from an older hla_tvm, is built again)."""
    path = stored_path(folder, source, archs)
    if os.path.exists(path):
        try:
            read_checked(path)
            return path
        except ValueError:
            pass
    os.makedirs(folder, exist_ok=True)
    try:
        data = compile_cuda(source, archs)
    except ValueError as err:
        raise ValueError(f"{path}: cannot build this device code: {err}") from None
    _write(path, data)
    return path


def _write(path, data):
    """Write `data` and its sha256 (path + ".sha256"), each through a temporary file
    (`paths.replacing`)."""
    for target, blob in ((path + ".sha256", hashlib.sha256(data).hexdigest().encode()),
                         (path, data)):
        with replacing(target) as f:
            f.write(blob)


def read_checked(path):
    """The bytes of stored device code at `path`; ValueError naming the file when they do not
    match the sha256 kept beside them (a truncated or altered file would otherwise reach the
    CUDA driver)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        with open(path + ".sha256", "rb") as f:
            want = f.read().decode("ascii", "replace").strip()
    except OSError:
        raise ValueError(f"{path}: device code without its checksum file ({path}.sha256); "
                         "delete it, or compile the module again") from None
    if hashlib.sha256(data).hexdigest() != want:
        raise ValueError(f"{path}: the device code does not match its checksum (truncated or "
                         "altered); delete it, or compile the module again")
    return data


def folder_beside(module_path):
    """The folder `ship` writes the device code of the compiled module at `module_path` to:
    model.so -> model.device."""
    root, ext = os.path.splitext(os.fspath(module_path))
    return (root if ext == ".so" else os.fspath(module_path)) + ".device"


def ship(executable, module_path, arch):
    """Build the device code of `executable` (a `tvm.compile` result) for `arch` ("sm_90"; a
    fatbin that also holds PTX for later GPUs) into `folder_beside(module_path)`, replacing
    what an earlier build left there; returns that path, or None when nvcc is not installed
    here (the folder is then removed: the GPU machine builds the code when it loads the
    module). ValueError naming the module when nvcc fails."""
    folder = folder_beside(module_path)
    if nvcc() is None:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    try:
        path = store(folder, cuda_source(executable), [arch])
    except ValueError as err:
        raise ValueError(f"{module_path}: building its device code into {folder} failed "
                         f"({err})") from None
    keep = {os.path.basename(path), os.path.basename(path) + ".sha256"}
    for name in os.listdir(folder):
        if name not in keep:
            os.remove(os.path.join(folder, name))
    return path


def _arch_number(arch):
    """80 for "sm_80", 90 for "sm_90a"; None for other text."""
    digits = "".join(c for c in arch[3:] if c.isdigit()) if arch.startswith("sm_") else ""
    return int(digits) if digits else None


def _serves(built, want):
    """The architecture number of a build for `built` ("sm_80", "sm_90a") when its code runs on
    a GPU of number `want` (90), else None: a build for an older architecture runs through its
    PTX, an architecture-specific one ("sm_90a": its PTX too) on its own architecture only."""
    num = _arch_number(built)
    if num is None or want is None or num > want or (built[-1].isalpha() and num != want):
        return None
    return num


_SHIPPED: list = []        # folders of shipped device code the hook looks in first
_SHIPPED_LOCK = threading.Lock()


def add_shipped(folder):
    """Let the hook `serve` registers find device code in `folder` (a module's
    `folder_beside`)."""
    folder = os.path.abspath(folder)
    with _SHIPPED_LOCK:
        if folder not in _SHIPPED:
            _SHIPPED.append(folder)


def shipped_path(source, arch):
    """The shipped device code of CUDA `source` that runs on a GPU of architecture `arch`, in
    a folder `add_shipped` named: built for `arch`, else for the newest older architecture
    (its PTX is compiled for the GPU by the driver; not an architecture-specific build, `_serves`);
    None when there is none."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    want = _arch_number(arch)
    with _SHIPPED_LOCK:
        folders = list(_SHIPPED)
    best = None
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if not (name.startswith(digest + "-") and name.endswith(".fatbin")):
                continue
            built = name[len(digest) + 1:-len(".fatbin")].split("-")
            fits = [n for n in (_serves(a, want) for a in built) if n is not None]
            if fits and (best is None or max(fits) > best[0]):
                best = (max(fits), os.path.join(folder, name))
    return None if best is None else best[1]


_OURS: list = []   # the hooks `serve` registered


def serve(folder, arch, *, override=True):
    """Register TVM's `tvm_callback_cuda_compile` hook (called when a module holding CUDA source
    is loaded on a GPU of architecture `arch`, "sm_90") to return the device code shipped
    beside the module (`add_shipped`), else the code `store` keeps in `folder`, built with nvcc
    when missing. override=False keeps a hook of ours already registered and puts the shipped
    code in front of another one (TVM's own, where its compiler is installed: it builds the
    rest). Returns the hook in force."""
    # tvm_ffi is imported where a module's device code is served: importing the runtime loads no
    # TVM library
    import tvm_ffi

    current = tvm_ffi.get_global_func(HOOK, allow_missing=True)
    if current is not None and not override and any(current.same_as(h) for h in _OURS):
        return current
    fallback = current if current is not None and not override else None

    def device_code(source, *rest):
        path = shipped_path(source, arch)
        if path is not None:
            return read_checked(path)
        if fallback is not None:
            return fallback(source, *rest)
        if nvcc() is None:
            with _SHIPPED_LOCK:
                where = ", ".join(_SHIPPED) or "none given"
            raise ValueError(f"no device code for {arch} shipped with this module (looked in: "
                             f"{where}; `hla_tvm.compile` writes model.device/ beside model.so "
                             "where nvcc is installed: copy it along) and no nvcc here to "
                             "build it")
        return read_checked(store(folder, source, [arch]))

    tvm_ffi.register_global_func(HOOK, device_code, override=True)
    hook = tvm_ffi.get_global_func(HOOK)
    _OURS.append(hook)
    return hook


CUDART = "libcudart.so.13"   # the CUDA runtime TVM 0.27's libtvm_runtime_cuda.so links to


def cudart_path():
    """The path of libcudart.so.13: from the `nvidia` pip packages on sys.path (PyTorch's CUDA
    builds bring them), else the CUDA toolkit's ($CUDA_HOME, /usr/local/cuda); None when
    neither has it (the system's library path may still)."""
    dirs = [os.path.join(d, sub) for d in sys.path if d
            for sub in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib")]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs.append(os.path.join(home, "lib64"))
    return next((os.path.join(d, CUDART) for d in dirs if os.path.isfile(os.path.join(d, CUDART))),
                None)


def load_cuda_runtime(lib_dir):
    """Load TVM's CUDA runtime (`libtvm_runtime_cuda.so` in `lib_dir`, beside
    libtvm_runtime.so, which must be loaded already) into the process, with the CUDA runtime
    library it links to (libcudart.so.13: already loaded by PyTorch, else `cudart_path`'s, else
    the system's). OSError naming what is missing."""
    found = cudart_path()
    if found is not None:
        ctypes.CDLL(found, mode=ctypes.RTLD_GLOBAL)
    path = os.path.join(lib_dir, "libtvm_runtime_cuda.so")
    if not os.path.isfile(path):
        raise OSError(f"TVM's CUDA runtime is missing: no {path}")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
