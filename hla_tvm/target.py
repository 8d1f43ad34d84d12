"""Resolving the `target=` argument to a tvm.target.Target, checked before any other work."""
from __future__ import annotations

import functools
import json
import os
import platform
import shutil

from .runtime import cpu_features as host_cpu
from .runtime.cpu_features import X86

HOST_ALIASES = (None, "llvm", "host")
# named targets besides "llvm"/"host" and TVM target dicts
PRESETS = {
    # any x86-64 CPU (the baseline ISA: SSE2, no AVX), e.g. for a module shipped to unknown PCs
    "x86-64": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"},
    # 64-bit Arm Linux with NEON (Raspberry Pi 4/5, Jetson, Graviton); cross-linked with
    # aarch64-linux-gnu-gcc
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    # NVIDIA GPUs from Ampere on (A100; "sm_90" in a dict for H100/H200)
    "cuda": {"kind": "cuda", "arch": "sm_80"},
}

# per CUDA architecture: the most shared memory one thread block may use (bytes, with the
# dynamic shared memory opt-in, which TVM's CUDA runtime makes); every one has 1024 threads per
# block, 64 K registers per block and warps of 32
CUDA_SHARED_MEMORY = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376,
                      "sm_90": 232448, "sm_90a": 232448, "sm_100": 232448, "sm_120": 101376}
CUDA_LIMITS = {"max_threads_per_block": 1024, "max_num_threads": 1024, "thread_warp_size": 32,
               "registers_per_block": 65536}


@functools.lru_cache(maxsize=None)
def host_target():
    """The machine we run on: LLVM for the host CPU model with all its cores, and with the
    features the CPU reports where LLVM's model of that name differs (`host_mattr`)."""
    # TVM and torch are imported where used: bundle (`hla-tvm bundle`: no TVM compiler) and the cli
    # import this module
    import tvm

    config = {"kind": "llvm", "num-cores": os.cpu_count() or 1,
              "mcpu": tvm.target.codegen.llvm_get_system_cpu()}
    mattr = host_mattr(config["mcpu"])
    return tvm.target.Target({**config, "mattr": mattr} if mattr else config)


def host_mattr(mcpu):
    """["+feature", "-feature", ...]: the x86 features (`runtime.cpu_features.X86`) this CPU
    reports that LLVM's CPU model `mcpu` lacks, and those the model has that this CPU does not
    report (a VM that masks them), and on AVX-512 CPUs "-prefer-256-bit" where the model
    prefers 256-bit vectors; [] where the two agree or the features cannot be read."""
    import tvm

    have = host_cpu.host_features()   # (looked up at each call: tests patch it)
    if have is None:
        return []
    model = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    out = [("+" if feature in have else "-") + feature
           for feature, in_model in _x86_features(model).items() if in_model != (feature in have)]
    # LLVM's Intel models tune for 256-bit vectors, splitting the kernels' 512-bit ones where
    # they convert: an int8 decode product (768 x 2304, one row) took 144 us so and 60 us
    # without it (the Xeon VM seen as rocketlake, 2026-12-07); float32 and int4 ran alike
    if "avx512f" in have and tvm.target.codegen.target_has_features("prefer-256-bit", model):
        out.append("-prefer-256-bit")
    return out


def cpu_features(target):
    """The x86 features (LLVM names, `runtime.cpu_features.X86`) that code compiled for the
    resolved llvm `target` may use: what its module's metadata records and its loader checks;
    [] for other architectures and kinds."""
    if target.kind.name != "llvm" or target_arch(target) != "x86_64":
        return []
    return [feature for feature, has in _x86_features(target).items() if has]


def _x86_features(target):
    """{feature: whether LLVM gives `target` it} for the x86 features of
    `runtime.cpu_features.X86` this LLVM knows."""
    import tvm

    out = {}
    for feature in X86.values():
        try:
            out[feature] = bool(tvm.target.codegen.target_has_features(feature, target))
        except Exception:  # noqa: BLE001 - a feature this LLVM does not know
            continue
    return out


def parse(text):
    """A command-line --target value: "llvm"/"host" for this CPU, a preset name ("x86-64",
    "aarch64", "cuda"), JSON for a dict, or any string TVM's Target parser takes (a kind such as
    "c", a tag such as "nvidia/nvidia-a100")."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--target is not valid JSON: {err}") from None
    return text


def resolve(target):
    """None, "llvm" or "host" -> the host CPU; a name in PRESETS ("x86-64", "aarch64", "cuda")
    -> that target; a dict, a Target, or a string TVM's own parser accepts -> that target.
    ValueError (naming the target and why) for anything else.

    TVM 0.27 no longer parses flag strings ("llvm -mcpu=..."); give a dict instead,
    {"kind": "llvm", "mcpu": "znver4"}. An LLVM CPU name is checked against LLVM's list."""
    import tvm

    if isinstance(target, str) and target.strip() in HOST_ALIASES:
        return host_target()
    if target is None:
        return host_target()
    if isinstance(target, str) and target.strip() in PRESETS:
        target = PRESETS[target.strip()]
    if isinstance(target, tvm.target.Target):
        tgt = target
    elif isinstance(target, (dict, str)):
        try:
            tgt = tvm.target.Target(target)
        except Exception as err:   # TVM raises ValueError, TVMError or KeyError
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"target={target!r} is not a TVM target ({reason}); give 'llvm' for this CPU, "
                f"a preset ({', '.join(PRESETS)}), a dict such as "
                "{'kind': 'llvm', 'mcpu': 'znver4'}, or a target tag") from None
    else:
        raise TypeError(f"target must be None, a string, a dict or a tvm.target.Target, "
                        f"got {type(target).__name__}")
    if tgt.kind.name == "cuda":
        tgt = _with_cuda_limits(tgt, target)
    if tgt.kind.name == "llvm":
        mcpu = str(tgt.attrs.get("mcpu", "") or "")
        triple = str(tgt.attrs.get("mtriple", "") or "") or \
            tvm.target.codegen.llvm_get_system_triple()
        if mcpu and not tvm.target.codegen.llvm_is_valid_cpu(mcpu, triple):
            raise ValueError(f"target={target!r}: LLVM does not know the CPU {mcpu!r} for "
                             f"{triple}")
    return tgt


def device_arch(device):
    """The CUDA architecture name ("sm_90") of a torch CUDA device."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def for_device(device, target=None):
    """The resolved target for tensors on torch `device`: `resolve(target)` for CPU tensors
    (target None: this CPU); for CUDA tensors target None gives the device's own architecture
    (`device_arch`), and a given target must be a CUDA one. ValueError naming the device and the
    target otherwise (other devices are not supported)."""
    if device.type == "cpu":
        tgt = resolve(target)
        if tgt.kind.name != "llvm":
            raise ValueError(f"target={target!r} is a {tgt.kind.name} target, but the tensors "
                             "are on the CPU: move them to the GPU (.cuda()) or give a CPU "
                             "target")
        if not is_host_arch(target_arch(tgt)):
            raise ValueError(f"target={target!r} builds code for {target_arch(tgt)}, which this "
                             "machine cannot run (the kernels run where the tensors are): give "
                             "this CPU's target, or compile a model for that machine with "
                             "hla_tvm.compile")
        return tgt
    if device.type != "cuda":
        raise ValueError(f"tensors on {device} are not supported: give CPU or CUDA tensors")
    if isinstance(target, str) and target.strip() in HOST_ALIASES:
        raise ValueError(f"target={target!r} is this CPU, but the tensors are on {device}")
    if target is None:
        arch = device_arch(device)
        if arch not in CUDA_SHARED_MEMORY:
            raise ValueError(f"the GPU {device} ({arch}) is not one the CUDA kernels know "
                             f"({', '.join(CUDA_SHARED_MEMORY)}); use backend='torch'")
        return _cuda_target(arch)
    tgt = resolve(target)
    if tgt.kind.name != "cuda":
        raise ValueError(f"target={target!r} is a {tgt.kind.name} target, but the tensors are "
                         f"on {device}: give a CUDA target or leave target=None")
    return tgt


@functools.lru_cache(maxsize=None)
def _cuda_target(arch):
    return resolve({"kind": "cuda", "arch": arch})


def _with_cuda_limits(tgt, given):
    """A CUDA target with its architecture's limits (`CUDA_SHARED_MEMORY`, `CUDA_LIMITS`)
    where it does not state them, as TVM would otherwise ask a GPU this machine may not have;
    ValueError for an architecture without a known limit."""
    import tvm

    arch = str(tgt.attrs.get("arch", "") or "")
    if arch not in CUDA_SHARED_MEMORY:
        raise ValueError(f"target={given!r}: give a CUDA architecture, one of "
                         f"{', '.join(CUDA_SHARED_MEMORY)} (e.g. {{'kind': 'cuda', 'arch': "
                         f"'sm_90'}}), got {arch or 'none'}")
    config = dict(tgt.export())
    wanted = {"max_shared_memory_per_block": CUDA_SHARED_MEMORY[arch], **CUDA_LIMITS}
    missing = {k: v for k, v in wanted.items() if config.get(k) in (None, 0, -1)}
    if not missing:
        return tgt
    config.update(missing)
    config.pop("tag", None)
    return tvm.target.Target({k: v for k, v in config.items() if v not in (None, "")})


CROSS_COMPILERS = {"aarch64": "aarch64-linux-gnu-gcc", "arm64": "aarch64-linux-gnu-gcc"}


def target_arch(target):
    """The CPU architecture code for `target` (a resolved Target) runs on: its mtriple's first
    part (its host's for a GPU target), or this machine's (`platform.machine()`) without one."""
    cpu = target if target.kind.name == "llvm" else target.host
    triple = str(cpu.attrs.get("mtriple", "") or "") if cpu is not None else ""
    arch = triple.split("-")[0] or platform.machine()
    return {"AMD64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def is_host_arch(arch):
    """True when code for the architecture `arch` runs on this machine."""
    return arch == {"AMD64": "x86_64", "arm64": "aarch64"}.get(platform.machine(),
                                                                  platform.machine())


def cross_compiler(target):
    """The C compiler command that links libraries for `target` (a resolved Target): None when
    it is this machine's own architecture (`target_arch`); ValueError naming the package to
    install when the cross compiler is missing."""
    arch = target_arch(target)
    if is_host_arch(arch):
        return None
    triple = arch + "-linux-gnu"
    cc = CROSS_COMPILERS.get(arch)
    if cc is None:
        raise ValueError(f"no cross compiler known for {triple!r} (known: "
                         f"{', '.join(sorted(CROSS_COMPILERS))})")
    if shutil.which(cc) is None:
        raise ValueError(f"linking for {triple} needs {cc} (Debian/Ubuntu: apt install "
                         "gcc-aarch64-linux-gnu)")
    return cc
