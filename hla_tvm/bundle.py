"""`hla-tvm bundle`: a compiled module with everything that runs it where TVM's compiler is not
installed. The folder holds:

    model.so                      the module, as compiled
    model.device/                 its device code, for a module compiled for an NVIDIA GPU
    generate.py                   Python generation: numpy + apache-tvm-ffi, no TVM package
    cpp/CMakeLists.txt, main.cc   the C++ app (no Python needed)
    runtime/tvm/lib/libtvm_runtime.so, runtime/tvm/include/
    runtime/tvm_ffi/lib/libtvm_ffi.so, runtime/tvm_ffi/include/
    runtime/tvm/lib/libtvm_runtime_cuda.so, libcudart.so.13     (NVIDIA GPU modules)
    bundle.json                   what was bundled: model, architecture, runtime versions
    README.md                     how to run it

The runtime libraries are the installed wheels' for a module of this machine's architecture;
for another one (an aarch64 module built here) they come from `runtime_from`, a folder with the
target's `tvm/` and `tvm_ffi/` packages, or else from that architecture's apache-tvm and
apache-tvm-ffi wheels of the installed versions (`fetch_runtime`: pip downloads them once into
the cache and keeps only the runtime libraries and headers). A module for an NVIDIA GPU
(`hla-tvm compile --target cuda`, where nvcc built its device code into model.device/) gets TVM's
CUDA runtime and the CUDA runtime library it links to (`device_code.cudart_path`; without one
here, the machine running the bundle must have it); the GPU machine then needs only the NVIDIA
driver."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from importlib.metadata import version

from .runtime import cache, read_meta
from .runtime.device_code import cudart_path, folder_beside, read_checked
from .runtime.generate import TEXT_TEMPERATURE, TEXT_TOP_K
from .runtime.libfile import elf_machine
from .runtime.paths import replacing
from .target import is_host_arch


def export_sources():
    """The folder with the app sources (cpp/, python/): hla_tvm/_export in an installed wheel,
    export/ in a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "_export"), os.path.join(os.path.dirname(here), "export")):
        if os.path.isfile(os.path.join(path, "cpp", "main.cc")):
            return path
    raise FileNotFoundError("the export/ app sources are missing from this installation")


# what a bundle needs from each package: its runtime library and headers
RUNTIME_FILES = {"tvm": ("lib/libtvm_runtime.so", "include/"),
                 "tvm_ffi": ("lib/libtvm_ffi.so", "include/")}
DISTRIBUTIONS = {"tvm": "apache-tvm", "tvm_ffi": "apache-tvm-ffi"}


def fetch_runtime(arch, progress=print):
    """A folder with `arch`'s tvm/ and tvm_ffi/ runtime files (RUNTIME_FILES) from the
    apache-tvm and apache-tvm-ffi wheels of the installed versions for manylinux `arch`:
    downloaded with pip once, then kept in the cache. OSError when pip cannot get them."""
    versions = {pkg: version(dist) for pkg, dist in DISTRIBUTIONS.items()}
    dest = os.path.join(cache.folder("runtime"), f"{arch}-tvm{versions['tvm']}-ffi"
                                                 f"{versions['tvm_ffi']}")
    if all(os.path.isfile(os.path.join(dest, p, RUNTIME_FILES[p][0])) for p in RUNTIME_FILES):
        return dest
    progress(f"downloading the {arch} TVM runtime (apache-tvm {versions['tvm']}, "
             f"apache-tvm-ffi {versions['tvm_ffi']} wheels, about 100 MB; kept in {dest}) ...")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", f"manylinux_2_28_{arch}", "-d", tmp, "-q",
               *(f"{DISTRIBUTIONS[p]}=={v}" for p, v in versions.items())]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise OSError(f"pip could not download the {arch} TVM wheels: "
                          f"{(run.stderr.strip().splitlines() or ['?'])[-1]}")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(dest))
        try:
            for wheel in os.listdir(tmp):
                with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
                    for name in z.namelist():
                        pkg, _, rest = name.partition("/")
                        if pkg in RUNTIME_FILES and any(
                                rest == f or (f.endswith("/") and rest.startswith(f))
                                for f in RUNTIME_FILES[pkg]):
                            z.extract(name, staging)
            try:
                os.replace(staging, dest)
            except OSError:   # another process put a complete copy there first
                if not os.path.isdir(dest):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def runtime_packages(arch, runtime_from=None, progress=print):
    """(tvm folder, tvm_ffi folder) holding lib/ and include/ for `arch`: the installed
    packages' for this machine's architecture, else those under `runtime_from`, else
    `fetch_runtime`'s."""
    if runtime_from is None and not is_host_arch(arch):
        runtime_from = fetch_runtime(arch, progress)
    if runtime_from is None:
        roots = [os.path.dirname(importlib.util.find_spec(p).origin) for p in ("tvm", "tvm_ffi")]
    else:
        roots = [os.path.join(os.fspath(runtime_from), p) for p in ("tvm", "tvm_ffi")]
    for root, lib in zip(roots, ("libtvm_runtime.so", "libtvm_ffi.so")):
        path = os.path.join(root, "lib", lib)
        if not os.path.isfile(path):
            raise ValueError(f"{path} is missing (--runtime-from must hold tvm/lib/ and "
                             "tvm_ffi/lib/)")
        if elf_machine(path) != arch:
            raise ValueError(f"{path} is built for {elf_machine(path)}, the module for {arch}")
    return roots


def bundle(module, out, *, runtime_from=None, force=False, progress=print):
    """Write the bundle of the compiled module `module` to the folder `out` (see the module
    docstring). Refuses a non-empty `out` unless force. Returns the bundle's description."""
    module, out = os.fspath(module), os.path.abspath(os.fspath(out))
    meta = read_meta(module)   # checked: sealed by hla-tvm compile, not truncated or altered
    arch = elf_machine(module)
    if os.path.commonpath([os.path.realpath(module), os.path.realpath(out)]) == \
            os.path.realpath(out):
        raise ValueError(f"-o {out} holds the module itself; bundle into another folder")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ValueError(f"{out} exists and is not empty (--force replaces it)")
    device_code = _device_code(module) if meta.get("device") == "cuda" else None
    tvm_root, ffi_root = runtime_packages(arch, runtime_from, progress)
    if device_code is not None and not os.path.isfile(os.path.join(tvm_root, "lib", CUDA_LIB)):
        raise ValueError(f"{module} was compiled for an NVIDIA GPU, and the TVM runtime in "
                         f"{tvm_root} has no CUDA runtime ({CUDA_LIB})")
    # written beside `out`, then swapped in whole: a failure leaves any old bundle as it was
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(dir=parent, prefix=".bundle-")
    os.chmod(stage, 0o755)
    try:
        info = _write(stage, module, arch, meta, tvm_root, ffi_root, device_code)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return info


CUDA_LIB = "libtvm_runtime_cuda.so"   # TVM's CUDA runtime, beside libtvm_runtime.so


def _device_code(module):
    """The device code folder of the CUDA module at `module` (`device_code.folder_beside`),
    each file checked against its sha256; ValueError when it is missing or does not match."""
    folder = folder_beside(module)
    binaries = sorted(f for f in os.listdir(folder) if f.endswith(".fatbin")) \
        if os.path.isdir(folder) else []
    if not binaries:
        raise ValueError(f"{module} was compiled for an NVIDIA GPU, and its device code is not "
                         f"beside it ({folder}): copy that folder along with the module, or "
                         "compile it again where nvcc (the CUDA toolkit) is installed")
    for name in binaries:
        read_checked(os.path.join(folder, name))
    return folder


def _write(out, module, arch, meta, tvm_root, ffi_root, device_code=None):
    """The bundle's files in the folder `out` (`device_code`: the CUDA module's device code
    folder, or None); returns its description."""
    shutil.copy2(module, os.path.join(out, "model.so"))
    src = export_sources()
    shutil.copytree(os.path.join(src, "cpp"), os.path.join(out, "cpp"),
                    ignore=shutil.ignore_patterns("build*"))
    shutil.copy2(os.path.join(src, "python", "generate.py"), os.path.join(out, "generate.py"))
    gpu_libs = [CUDA_LIB] if device_code is not None else []
    for root, libs in ((tvm_root, ["libtvm_runtime.so", *gpu_libs]), (ffi_root, ["libtvm_ffi.so"])):
        dst = os.path.join(out, "runtime", os.path.basename(root))
        os.makedirs(os.path.join(dst, "lib"))
        for lib in libs:
            shutil.copy2(os.path.join(root, "lib", lib), os.path.join(dst, "lib", lib))
        shutil.copytree(os.path.join(root, "include"), os.path.join(dst, "include"))
    cudart = None
    if device_code is not None:
        shutil.copytree(device_code, os.path.join(out, "model.device"))
        cudart = cudart_path()
        if cudart is not None and elf_machine(cudart) == arch:   # found beside it ($ORIGIN)
            shutil.copy2(cudart, os.path.join(out, "runtime", os.path.basename(tvm_root), "lib",
                                              os.path.basename(cudart)))
        else:
            cudart = None
    info = {"module": os.path.basename(module), "arch": arch,
            "device": "cuda" if device_code is not None else "cpu",
            "gpu": (meta or {}).get("schedules", {}).get("target") if device_code else None,
            "cudart": cudart is not None,
            "vocab": ((meta or {}).get("config") or {}).get("vocab"),
            "config": (meta or {}).get("config"), "tvm_ffi": version("apache-tvm-ffi")}
    with replacing(os.path.join(out, "bundle.json"), "w") as f:
        json.dump(info, f, indent=1)
    with replacing(os.path.join(out, "README.md"), "w") as f:
        f.write(_readme(info))
    return info


def _readme(info):
    text = info["vocab"] == "bytes"
    prompt = '--text "def fib(" --tokens 200' if text else "--prompt-ids 5,9,2,33 --tokens 12"
    if info["config"] is None:   # (an old module for another architecture: its metadata unread)
        prompt = ('--text "def fib(" --tokens 200   # or, for a model of token ids: '
                  '--prompt-ids 5,9,2')
        text = None
    gpu = info.get("device") == "cuda"
    libs = ("The app finds `libtvm_runtime.so` and `libtvm_ffi.so` in `runtime/` (its run path); "
            "copied elsewhere, put them beside the binary"
            + (" (with `libtvm_runtime_cuda.so` and `libcudart.so.13`)" if gpu else "")
            + ". Both programs take `--temperature T --top-k K --seed S` for seeded sampling "
            f"(defaults as `hla-tvm run`: --text samples at temperature {TEXT_TEMPERATURE} from "
            f"the {TEXT_TOP_K} most likely tokens, --prompt-ids is greedy; --temperature 0 makes "
            "--text greedy too, and then the two programs print the same text, while their "
            "samplers draw differently) and print the prompt and the generated text (--text) "
            "or the generated token ids on one line.")
    where = f"an NVIDIA GPU ({info['gpu']}) in an {info['arch']} Linux machine" if gpu else \
        f"{info['arch']} Linux"
    return f"""# hla_tvm bundle

`model.so`: a language model compiled by `hla-tvm compile` for {where}, with what
runs it on a machine that has neither TVM's compiler nor PyTorch. It
{'generates text (byte-level vocabulary)' if text else 'generates token ids' if text is False
 else 'generates text (--text) if its vocabulary is bytes, else token ids (--prompt)'}.

## Python (numpy and apache-tvm-ffi; no TVM package)

```
pip install numpy apache-tvm-ffi=={info['tvm_ffi']}
python generate.py model.so {prompt}
```

`generate.py` loads `runtime/tvm/lib/libtvm_runtime.so` from this folder.
{_gpu_readme(info) if gpu else ""}
## C++ (CMake and a C++17 compiler; no Python)

```
cmake -S cpp -B build -DTVM_ROOT=$PWD/runtime/tvm -DTVM_FFI_ROOT=$PWD/runtime/tvm_ffi
cmake --build build
build/hla_tvm_app model.so {prompt}
```

{textwrap.fill(libs, 96)}
"""


def _gpu_readme(info):
    """The README's words on running a bundle for an NVIDIA GPU."""
    cudart = ("so is the CUDA runtime it links to (`libcudart.so.13`)" if info.get("cudart") else
              "the CUDA 13 runtime (`libcudart.so.13`) was not found where the bundle was made: "
              "install it on the GPU machine (`pip install nvidia-cuda-runtime`, or the CUDA "
              "toolkit)")
    gpu = info["gpu"].replace("cuda-", "") if info.get("gpu") else "the module's architecture"
    text = ("Both programs run the model on the first GPU. Its device code (built by nvcc when "
            "the model was compiled) is in `model.device/`, checked against its sha256 and "
            "handed to TVM when the module loads, so the GPU machine needs no CUDA toolkit: "
            f"only the NVIDIA driver (`libcuda.so.1`) for a GPU of {gpu} or later. TVM's CUDA "
            f"runtime (`libtvm_runtime_cuda.so`) is in `runtime/tvm/lib/`; {cudart}. Keep "
            "`model.device/` beside `model.so`.")
    return "\n## NVIDIA GPU\n\n" + textwrap.fill(text, 96) + "\n"
