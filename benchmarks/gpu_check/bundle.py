"""The bundle: made here by `prepare` (the kernel modules and their device code, TVM's
runtime, the models, the C++ app), loaded on the GPU machine by `load_runtime`."""
import glob
import json
import os
import shutil
import subprocess
import sys
import time

from . import ROOT
from .entries import MODELS, PREFILL_VARIANTS, VARIANTS, checkpoint_file, entries, entry_id

FFI_WHEEL = "apache-tvm-ffi==0.1.14.post0"   # pyproject's pin


def prepare(args):
    """Compile the check's modules for the GPU, build their device code, gather the runtime."""
    import tvm

    from hla_tvm.build import compile_kernels
    from hla_tvm.runtime.device_code import cuda_source, store
    from hla_tvm.schedule import TUNED
    from hla_tvm.schedule.rules import cuda
    from hla_tvm.schedule.tuning import records
    from hla_tvm.target import resolve

    target = resolve({"kind": "cuda", "arch": args.arch})
    bundle = os.path.abspath(args.bundle)
    for sub in ("modules", "device", "models"):   # built again: never an earlier schedule's
        shutil.rmtree(os.path.join(bundle, sub), ignore_errors=True)
    for sub in ("modules", "device", "runtime", "wheels"):
        os.makedirs(os.path.join(bundle, sub), exist_ok=True)
    manifest = {"arch": args.arch, "tvm": tvm.__version__, "entries": {}}
    wanted = entries(target)
    timed_variants = {entry_id(fam, "prefill", "bfloat16", 128) for fam in PREFILL_VARIANTS}
    for n, (eid, chain, d, group, chunk, opts) in enumerate(wanted):
        decode = chain.calls[0].kernel == "decode"
        t0 = time.time()
        variants = {None: None}
        if not decode and eid in timed_variants:
            variants.update(VARIANTS)
        for variant, how in variants.items():
            how = dict(how or {})
            vchunk = how.pop("chunk", chunk)
            if variant is not None and (vchunk, how) == (chunk, {}):
                continue   # the default itself
            vid = eid if variant is None else f"{eid}@{variant}"
            path = os.path.join(bundle, "modules", vid + ".so")
            if not os.path.exists(path):   # (another entry's module may be this one)
                kernels = records.tuning_kernels(chain, d, d, chunk=vchunk, group=group, **opts)
                funcs = {name: f if variant is None else
                         cuda.scheduled(f.with_attr("global_symbol", name),
                                        rule=cuda.HLAKernels(**how)).with_attr(
                             TUNED, True) for name, (f, _) in kernels.items()}
                exe = compile_kernels(funcs, target)
                store(os.path.join(bundle, "device"), cuda_source(exe), [args.arch])
                exe.export_library(path + ".tmp.so")
                os.replace(path + ".tmp.so", path)
            manifest["entries"][vid] = {
                "family": chain.family, "phase": "decode" if decode else "prefill",
                "dtype": opts["dtype"], "d": d, "group": group, "chunk": vchunk,
                "options": {k: v for k, v in opts.items() if k != "dtype"},
                "module": f"modules/{vid}.so", "variant": variant}
        print(f"[{n + 1}/{len(wanted)}] {eid}: chunk {chunk}, {time.time() - t0:.1f} s", flush=True)
    lib = os.path.join(os.path.dirname(tvm.__file__), "lib")
    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        shutil.copy2(os.path.join(lib, name), os.path.join(bundle, "runtime", name))
    if not glob.glob(os.path.join(bundle, "wheels", "apache_tvm_ffi-*cp312*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp",
                        "--platform", "manylinux_2_28_x86_64", "-d",
                        os.path.join(bundle, "wheels"), FFI_WHEEL], check=True)
    pack_tvm_runtime(os.path.dirname(tvm.__file__), os.path.join(bundle, "runtime",
                                                                 "tvm-python.tar.xz"))
    prepare_models(bundle, args.arch)
    prepare_app(bundle)
    with open(os.path.join(bundle, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(bundle, "**"), recursive=True)
               if os.path.isfile(p))
    print(f"bundle {bundle}: {len(manifest['entries'])} modules, {size / 2**20:.1f} MiB")
    tracked = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True)
    tree = sum(os.path.getsize(os.path.join(ROOT, p)) for p in
               tracked.stdout.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p)))
    total = (size + tree) / 2**20   # what one device call carries: 64 MiB in all
    print(f"bundle and checkout together: {total:.1f} MiB of the 64 MiB one device call "
          "carries" + (" (over: leave modules or models out)" if total > 64 else ""), flush=True)


def pack_tvm_runtime(package, out):
    """TVM's Python package without its compiler library (about 3 MB as .tar.xz): what
    `hla_tvm.runtime` needs (`models`), unpacked on the GPU machine beside the tvm-ffi wheel."""
    import tarfile

    if os.path.exists(out):
        return
    skip = ("/3rdparty", "/__pycache__", "libtvm_compiler.so", "libtvm_runtime_extra.so")
    with tarfile.open(out + ".tmp", "w:xz") as tar:
        tar.add(package, arcname="tvm",
                filter=lambda info: None if any(x in info.name for x in skip) else info)
    os.replace(out + ".tmp", out)


def prepare_models(bundle, arch):
    """Compile the check's models for the GPU (`MODELS`): a tiny decayed HLALM (its checkpoint
    written beside) and the shipped demo model, with float32 and int4 weights."""
    import torch

    from hla_tvm import compile as compile_model
    from hla_tvm.models import HLALM

    os.makedirs(os.path.join(bundle, "models"), exist_ok=True)
    for name, (checkpoint, quantize) in MODELS.items():
        if checkpoint is None:
            torch.manual_seed(0)
            checkpoint = os.path.join(bundle, "models", checkpoint_file(name))
            tiny = HLALM(40, 32, 2, 4, chunk_size=16, decay=[0.9, 0.95, 0.97, 0.99])
            with torch.no_grad():   # larger weights: greedy tokens that depend on the context
                for p in tiny.parameters():   # (at init the tiny model repeats one token)
                    p.mul_(4)
            tiny.save(checkpoint)
        elif not os.path.isfile(os.path.join(bundle, "models", checkpoint_file(name))):
            shutil.copy2(checkpoint, os.path.join(bundle, "models", checkpoint_file(name)))
        t0 = time.time()
        compile_model(HLALM.load(checkpoint), target={"kind": "cuda", "arch": arch},
                      out=os.path.join(bundle, "models", f"{name}.so"), quantize=quantize)
        print(f"model {name}: {time.time() - t0:.1f} s", flush=True)


def prepare_app(bundle):
    """export/cpp's app, built here against the installed wheel's runtime (the GPU machine may
    have no CMake), for `models` to run on the bundles it makes there."""
    import tempfile

    if shutil.which("cmake") is None or shutil.which("c++") is None:
        print("no cmake or C++ compiler here: `models` will not run the C++ app", flush=True)
        return
    with tempfile.TemporaryDirectory() as build:
        for cmd in (["cmake", "-S", os.path.join(ROOT, "export", "cpp"), "-B", build,
                     "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"],
                    ["cmake", "--build", build]):
            subprocess.run(cmd, check=True, capture_output=True)
        os.makedirs(os.path.join(bundle, "app"), exist_ok=True)
        app = os.path.join(bundle, "app", "hla_tvm_app")
        shutil.copy2(os.path.join(build, "hla_tvm_app"), app)
        subprocess.run(["strip", app], check=False)


def load_runtime(bundle):
    """Load TVM's runtime and its CUDA part from the bundle and register the device-code hook."""
    import ctypes

    import torch
    import tvm_ffi  # first: loads libtvm_ffi.so, which TVM's runtime links to

    torch.cuda.init()
    rt = os.path.join(bundle, "runtime")
    ctypes.CDLL(os.path.join(rt, "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    from hla_tvm.runtime.device_code import load_cuda_runtime, serve

    load_cuda_runtime(rt)
    arch = json.load(open(os.path.join(bundle, "manifest.json")))["arch"]
    serve(os.path.join(bundle, "device"), arch)   # nvcc there builds any source not found
    return tvm_ffi
