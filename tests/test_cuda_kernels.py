"""CUDA without a GPU: every HLA kernel, scheduled by the default CUDA rules, fits sm_80's and
sm_90's limits as TVM lowers it, and its generated source builds to device code with nvcc.
(Running them needs a GPU: `benchmarks/gpu_check` on a lent one.)"""
import concurrent.futures
import hashlib
import os
import re

import pytest

from hla_tvm.ops import chains
from hla_tvm.runtime.device_code import compile_cuda, cuda_source, nvcc
from hla_tvm.schedule import schedule_module
from hla_tvm.schedule.rules import cuda
from hla_tvm.schedule import gpu_limits as limits
from hla_tvm.schedule.gpu_limits import check
from hla_tvm.schedule.tuning import records
from hla_tvm.target import CUDA_SHARED_MEMORY, resolve

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)

FAMILIES = ("hla2", "hla2_decay", "ahla", "hla3")


def _opts(fam, dtype="float32", normalize=False):
    opts = dict(normalize=normalize, eps=1e-6, dtype=dtype)
    if fam.startswith("hla2"):
        opts.update(masked=True, ridge=0.0)
    return opts


def _chains(fam):
    yield chains.prefill(fam)
    if fam != "hla2":   # second order decodes with hla2_decay's kernel
        yield chains.decode(fam)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_fits_the_architecture(arch):
    target = resolve({"kind": "cuda", "arch": arch})
    for fam in FAMILIES:
        for chain in _chains(fam):
            if chain.calls[0].kernel == "decode":   # (as GPUs run it: `chains.gpu_options`)
                for name, (func, shapes) in records.tuning_kernels(
                        chain, 64, 64, **_opts(fam), **chains.gpu_options(chain)).items():
                    check(cuda.scheduled(func), shapes, target, name)
                continue
            # every kernel of the chain is checked at the chunk size chosen
            chunk = limits.gpu_chunk(chain, 64, 64, target, chunk=64, **_opts(fam))
            assert chunk == 64 if arch == "sm_90" else chunk in (32, 64), (fam, chunk)
    # a chunk kernel keeps its tiles in shared memory: q, k, v and the products, within limits
    func, shapes = records.tuning_kernels(chains.prefill("hla2"), 64, 64, chunk=64,
                                          **_opts("hla2"))["hla2_chunk_output"]
    used = check(cuda.scheduled(func), shapes, target)
    assert 3 * 64 * 64 * 4 <= used <= CUDA_SHARED_MEMORY[arch]


def test_scans_alone_run_one_element_per_thread():
    """`scan_lanes` takes every scan (an element-wise recurrence: element i of the state reads
    and writes element i alone) and no other kernel (a carry or decode mixes elements)."""
    import tvm
    from tvm import s_tir

    from hla_tvm.schedule.steps.cuda.scan_lanes import scan_lanes

    for fam in FAMILIES:
        for chain in _chains(fam):
            funcs = chains.kernels(chain, 16, 16, chunk=16, **_opts(fam))
            for call in chain.calls:
                name = chains.kernel_name(chain, call, 16, 16)
                sch = s_tir.Schedule(tvm.IRModule({"main": funcs[name]}))
                assert scan_lanes(sch, 128) == (call.kernel == "scan"), name


def test_grouped_bfloat16_and_normalized_kernels_fit():
    target = resolve({"kind": "cuda", "arch": "sm_80"})
    for fam in ("hla2", "ahla"):
        for chain in _chains(fam):
            opts = _opts(fam, dtype="bfloat16", normalize=True)
            for name, (func, shapes) in records.tuning_kernels(
                    chain, 64, 64, chunk=None if chain.calls[0].kernel == "decode" else 32,
                    group=2, **opts).items():
                check(cuda.scheduled(func), shapes, target, name)


def test_a_head_size_too_large_for_shared_memory_gets_a_smaller_chunk():
    target = resolve({"kind": "cuda", "arch": "sm_80"})
    assert limits.gpu_chunk(chains.prefill("hla3"), 128, 128, target, chunk=64,
                             **_opts("hla3")) == 32


@pytest.mark.skipif(nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_generated_source_builds_device_code_for_sm80_and_sm90():
    import tvm

    funcs = {}
    for fam in FAMILIES:
        for chain in _chains(fam):   # (decode as GPUs run it: `chains.gpu_options`)
            funcs.update(chains.kernels(chain, 64, 64, chunk=32, **_opts(fam),
                                        **chains.gpu_options(chain)))
    target = resolve("cuda")
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
    source = cuda_source(tvm.compile(schedule_module(mod, target), target=target))
    kernels = list(funcs)
    for name in kernels:
        assert f"{name}_kernel(" in source
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        cubins = dict(zip(("sm_80", "sm_90"), pool.map(
            lambda arch: compile_cuda(source, arch, fmt="cubin"), ("sm_80", "sm_90"))))
    for arch, cubin in cubins.items():
        assert cubin[:4] == b"\x7fELF", arch
        for name in kernels:   # every kernel's device function is in the binary
            assert f"{name}_kernel".encode() in cubin, (arch, name)


def test_targets_without_an_architecture_are_refused():
    with pytest.raises(ValueError, match="CUDA architecture"):
        resolve({"kind": "cuda", "arch": "sm_50"})
    assert int(resolve({"kind": "cuda", "arch": "sm_90"}).attrs[
        "max_shared_memory_per_block"]) == CUDA_SHARED_MEMORY["sm_90"]


def _threads(func):
    """The threadIdx.x extent of a scheduled kernel (0 when no loop is bound to it)."""
    from tvm import tirx

    from hla_tvm.schedule.common import walk

    found = []

    def visit(node):
        if isinstance(node, tirx.For) and node.thread_binding is not None and \
                node.thread_binding.thread_tag == "threadIdx.x":
            found.append(int(node.extent))

    walk(func.body, visit)
    return max(found, default=0)


def test_every_kernel_runs_on_many_threads_and_in_place_kernels_are_told_apart():
    """A kernel on a handful of threads ran 280 times slower on an H200 (third order's cross
    kernel: an output written and read back was taken for an in-place update, and a 65-element
    stage then set the thread count to 1)."""
    from hla_tvm.schedule.steps.cuda.shared_scratch import hoist
    from hla_tvm.schedule.steps.cuda.stage_syncs import reads_back, updates_in_place

    in_place = set()
    for fam in FAMILIES:
        for chain in _chains(fam):
            chunk = None if chain.calls[0].kernel == "decode" else 64
            for name, (func, _) in records.tuning_kernels(chain, 128, 128, chunk=chunk,
                                                          **_opts(fam)).items():
                assert _threads(cuda.scheduled(func)) >= 64, name
                plain = hoist(func.with_attr("global_symbol", "main"))
                if updates_in_place(plain):
                    in_place.add(name)
                    assert reads_back(plain), name
    assert "hla3_chunk_cross" not in in_place   # its outputs are read back, not updated
    assert {"hla2_chunk_carry", "hla2_decay_decode", "chunk_psum_w16384"} <= in_place


def test_chains_and_backend_import_without_tvm():
    """A GPU machine with the TVM runtime alone (`benchmarks/gpu_check run`) runs the
    chains through `backend.run_chain`: neither may import TVM's compiler."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['tvm'] = None\n"
            "from hla_tvm import backend\nfrom hla_tvm.ops import chains\n"
            "c = chains.prefill('hla3')\n"
            "assert chains.argument_shapes(c, 1, 2, 2, 70, 8, 8, 32, 'bfloat16')\n"
            "print(chains.kernel_name(c, c.calls[-1], 8, 8))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hla3_chunk_output"


def test_target_follows_the_tensors_device(monkeypatch):
    import torch

    import hla_tvm
    from hla_tvm.target import for_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    assert str(for_device(gpu).attrs["arch"]) == "sm_90"
    assert int(for_device(gpu).attrs["max_shared_memory_per_block"]) == \
        CUDA_SHARED_MEMORY["sm_90"]
    assert str(for_device(gpu, {"kind": "cuda", "arch": "sm_80"}).attrs["arch"]) == "sm_80"
    with pytest.raises(ValueError, match="CUDA target"):
        for_device(gpu, "x86-64")
    with pytest.raises(ValueError, match="this CPU"):
        for_device(gpu, "llvm")
    assert for_device(torch.device("cpu")).kind.name == "llvm"
    with pytest.raises(ValueError, match="on the CPU"):
        for_device(torch.device("cpu"), "cuda")
    with pytest.raises(ValueError, match="not supported"):
        for_device(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"\(sm_75\) is not one the CUDA kernels know"):
        for_device(gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # the operators refuse a CUDA target for CPU tensors before any work
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="on the CPU"):
        hla_tvm.hla(q, q, q, target="cuda")
    st = hla_tvm.init_state(1, 2, 8)
    with pytest.raises(ValueError, match="on the CPU"):
        hla_tvm.decode_(q[:, :, 0], q[:, :, 0], q[:, :, 0], st, target="cuda")


@pytest.mark.skipif(nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_the_device_code_hook_builds_once_and_serves_from_its_folder(tmp_path):
    import tvm_ffi

    from hla_tvm.runtime.device_code import HOOK, _write, serve, stored_path

    source = 'extern "C" __global__ void one(float* x) { x[threadIdx.x] = 1.0f; }\n'
    before = tvm_ffi.get_global_func(HOOK, allow_missing=True)
    try:
        hook = serve(str(tmp_path), "sm_90")
        binary = bytes(hook(source))
        path = stored_path(str(tmp_path), source, "sm_90")
        assert path != stored_path(str(tmp_path), source, "sm_80")
        assert open(path, "rb").read() == binary and b"one" in binary
        with open(path, "ab") as f:   # altered: built again
            f.write(b"!")
        assert bytes(hook(source)) == binary == open(path, "rb").read()
        _write(path, b"stored")   # served from the folder, not built again
        assert bytes(hook(source)) == b"stored"
        os.remove(path + ".sha256")   # (as an older hla_tvm left it): built again
        assert bytes(hook(source)) == binary
        assert serve(str(tmp_path / "other"), "sm_80", override=False).same_as(hook)
    finally:
        _restore_hook(before)


def _restore_hook(before):
    import tvm_ffi

    from hla_tvm.runtime.device_code import HOOK

    if before is not None:
        tvm_ffi.register_global_func(HOOK, before, override=True)
    else:
        tvm_ffi.remove_global_func(HOOK)


def test_shipped_device_code_is_picked_for_the_gpu_architecture(tmp_path, monkeypatch):
    """A module's shipped fatbin serves its own architecture and later ones (the driver
    compiles its PTX), never an older GPU."""
    from hla_tvm.runtime import device_code

    monkeypatch.setattr(device_code, "_SHIPPED", [])
    source = "// some CUDA source\n"
    for arch in ("sm_80", "sm_90"):
        device_code._write(device_code.stored_path(str(tmp_path), source, arch), arch.encode())
    device_code.add_shipped(str(tmp_path))
    picked = {a: device_code.shipped_path(source, a) for a in ("sm_75", "sm_86", "sm_90", "sm_100")}
    assert picked["sm_75"] is None and device_code.shipped_path("// other\n", "sm_90") is None
    assert [open(picked[a], "rb").read() for a in ("sm_86", "sm_90", "sm_100")] == \
        [b"sm_80", b"sm_90", b"sm_90"]
    # an architecture-specific build (its PTX too) serves its own architecture only
    specific = "// sm_90a code\n"
    device_code._write(device_code.stored_path(str(tmp_path), specific, "sm_90a"), b"a")
    assert [device_code.shipped_path(specific, a) for a in ("sm_89", "sm_90", "sm_100")] == \
        [None, device_code.stored_path(str(tmp_path), specific, "sm_90a"), None]
    # the bundle's script picks as the runtime does
    gen = _generate_script()
    for src in (source, specific):
        for a in ("sm_75", "sm_86", "sm_89", "sm_90", "sm_100"):
            assert gen.device_code_for(str(tmp_path), src, int(a[3:])) == \
                device_code.shipped_path(src, a), (src, a)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    """(model, folder): the test model (decayed second order, two layers), its checkpoint ck.pt
    in `folder` and cli.so, written by `hla-tvm compile --target cuda --arch sm_90` with its
    device code beside it (cli.device/)."""
    import torch

    from hla_tvm.cli import main
    from hla_tvm.models import HLALM

    if nvcc() is None:
        pytest.skip("nvcc (the CUDA toolkit) is not installed")
    torch.manual_seed(0)
    model = HLALM(40, 32, 2, 4, chunk_size=16, decay=[0.9, 0.95, 0.97, 0.99])
    folder = tmp_path_factory.mktemp("gpu_model")
    model.save(folder / "ck.pt")
    assert main(["compile", str(folder / "ck.pt"), "--target", "cuda", "--arch", "sm_90",
                 "-o", str(folder / "cli.so")]) == 0
    return model, folder


@pytest.mark.xdist_group("gpu_model")   # (one worker compiles it)
@pytest.mark.skipif(nvcc() is None, reason="nvcc (the CUDA toolkit) is not installed")
def test_the_test_model_compiles_for_sm80_and_sm90(gpu_model, monkeypatch, capsys):
    """A whole HLALM (decayed second order, two layers) for both architectures: the library
    holds its HLA kernel's CUDA source with the model's other functions, that source builds to
    device code for the architecture, and a CPU-only runtime refuses it with a clear word."""
    from hla_tvm import compiler
    from hla_tvm.cli import main
    from hla_tvm.runtime import load

    model, tmp_path = gpu_model
    chain = chains.prefill("hla2_decay")
    for arch in ("sm_80", "sm_90"):
        tgt = resolve({"kind": "cuda", "arch": arch})
        relax_mod = compiler.to_relax(model, target=tgt)
        assert sorted(gv.name_hint for gv in relax_mod.get_global_vars()
                      if gv.name_hint in ("prefill", "decode")) == ["decode", "prefill"]
        exe, _ = compiler.executable(relax_mod, {}, tgt)
        source = cuda_source(exe)
        kernels = ["hla2_decay_decode"] + [chains.kernel_name(chain, c, 8, 8) for c in chain.calls]
        names = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(",
                               source))
        for name in kernels:   # (their names carry the options baked in)
            assert any(n.startswith(name + "_") for n in names), (arch, name)
        assert any(n.startswith("fused_") for n in names)   # dlight's functions
        binary = compile_cuda(source, arch, fmt="cubin")
        for name in names:
            assert name.encode() in binary, (arch, name)
    # the command line (hla_tvm.compile) spells the architecture apart; a CPU-only runtime
    # refuses the library with a clear word
    assert main(["compile", str(tmp_path / "ck.pt"), "--arch", "sm_90"]) == 2
    with pytest.raises(ValueError, match="compiled for an NVIDIA GPU"):
        load(tmp_path / "cli.so")
    # described without a GPU (read from the library, not loaded)
    capsys.readouterr()
    assert main(["run", str(tmp_path / "cli.so"), "--info"]) == 0
    info = capsys.readouterr().out
    assert "runs on: an NVIDIA GPU" in info and "cuda-sm_90" in info, info
    # its device code was written beside it, for the module's own source; a GPU machine
    # without nvcc is served it (and refuses a module whose device code is not there)
    shipped = os.listdir(tmp_path / "cli.device")
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert sorted(shipped) == [f"{digest}-sm_90.fatbin", f"{digest}-sm_90.fatbin.sha256"]
    _served_without_nvcc(tmp_path, source, monkeypatch)


def _served_without_nvcc(tmp_path, source, monkeypatch):
    import tvm_ffi

    from hla_tvm.runtime import device_code

    before = tvm_ffi.get_global_func(device_code.HOOK, allow_missing=True)
    monkeypatch.setattr(device_code, "nvcc", lambda: None)
    monkeypatch.setattr(device_code, "_SHIPPED", [])
    try:
        hook = device_code.serve(str(tmp_path / "cache"), "sm_90")
        with pytest.raises(ValueError, match="no nvcc here to build it"):
            hook(source)
        device_code.add_shipped(device_code.folder_beside(tmp_path / "cli.so"))
        binary = bytes(hook(source))
        assert all(n.encode() in binary for n in
                   re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
        shipped = device_code.shipped_path(source, "sm_90")
        with open(shipped, "ab") as f:   # altered: refused, naming the file
            f.write(b"!")
        try:
            with pytest.raises(ValueError, match="does not match its checksum"):
                hook(source)
        finally:
            with open(shipped, "r+b") as f:   # restored, for the bundle test
                f.truncate(len(binary))
    finally:
        _restore_hook(before)


def _generate_script():
    """export/python/generate.py, imported as a module."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "hla_generate", os.path.join(root, "export", "python", "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _has_nvidia_driver():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.xdist_group("gpu_model")
def test_a_gpu_bundle_holds_its_device_code_and_fails_plainly_without_a_gpu(
        gpu_model, cpp_app, tmp_path, capsys):
    """`hla-tvm bundle` of a module compiled for a GPU: the module, its device code (checked),
    TVM's CUDA runtime; the bundle's script and C++ app pick the device code by the source's
    sha256 and the GPU's architecture (as `hla_tvm.runtime.device_code` does), refuse altered device
    code, and without a GPU or a driver say so. (On a GPU: `benchmarks/gpu_check models`.)"""
    import json
    import shutil
    import subprocess
    import sys

    from hla_tvm.cli import main

    _, folder = gpu_model
    out = tmp_path / "b"
    assert main(["bundle", str(folder / "cli.so"), "-o", str(out)]) == 0
    assert "NVIDIA GPU cuda-sm_90" in capsys.readouterr().out
    (fatbin,) = [f for f in os.listdir(out / "model.device") if f.endswith(".fatbin")]
    assert sorted(os.listdir(out / "model.device")) == [fatbin, fatbin + ".sha256"]
    assert (out / "runtime" / "tvm" / "lib" / "libtvm_runtime_cuda.so").is_file()
    info = json.loads((out / "bundle.json").read_text())
    assert (info["device"], info["gpu"]) == ("cuda", "cuda-sm_90")
    assert "NVIDIA driver" in (out / "README.md").read_text()
    # the device code is picked as the runtime picks it (sm_90 and later GPUs), and checked
    gen = _generate_script()
    assert gen.device_code_for(str(out / "model.device"), "// another source\n", 90) is None
    x = tmp_path / "x"   # a fatbin for two architectures: picked for either and later GPUs
    x.mkdir()
    both = x / f"{hashlib.sha256(b'x').hexdigest()}-sm_80-sm_90.fatbin"
    both.write_bytes(b"2")
    assert [gen.device_code_for(str(x), "x", a) for a in (75, 80, 86, 90, 100)] == \
        [None] + [str(both)] * 4
    # without a driver here: each program says what is missing; altered device code is refused
    # (the C++ app checks it with its own sha256 before anything loads)
    script = [sys.executable, str(out / "generate.py"), str(out / "model.so"), "--prompt", "3,4"]
    app = [cpp_app, str(out / "model.so"), "--prompt", "3,4"]
    if not _has_nvidia_driver():
        for cmd, rc in ((script, 1), (app, 1)):
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert run.returncode == rc and "NVIDIA driver (libcuda.so.1)" in run.stderr, \
                run.stderr
    with open(out / "model.device" / fatbin, "ab") as f:
        f.write(b"!")
    for cmd, rc in ((script, 1), (app, 1)):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert run.returncode == rc and "does not match its checksum" in run.stderr, run.stderr
    with pytest.raises(ValueError, match="does not match its checksum"):
        gen.read_checked(str(out / "model.device" / fatbin))
    # a CPU build where a GPU build was drops its device code (else taken for a GPU module)
    stale = tmp_path / "stale"
    shutil.copytree(out / "model.device", stale / "m.device")
    assert main(["compile", str(folder / "ck.pt"), "-o", str(stale / "m.so")]) == 0
    assert not (stale / "m.device").exists()
    run = subprocess.run(script[:2] + [str(stale / "m.so"), "--prompt", "3,4"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and len(run.stdout.split()) == 16, run.stderr
    # a module whose device code is not beside it: refused by the bundle and both programs
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "cli.so", bare / "m.so")
    assert main(["bundle", str(bare / "m.so"), "-o", str(tmp_path / "b2")]) == 2
    assert "device code is not beside it" in capsys.readouterr().err
    for cmd, rc in (([sys.executable, str(out / "generate.py"), str(bare / "m.so"), "--prompt",
                      "3"], 1), ([cpp_app, str(bare / "m.so"), "--prompt", "3"], 1)):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert run.returncode == rc and "is not beside it" in run.stderr, run.stderr


def test_second_order_prefills_through_the_scan_chain_on_gpus():
    """Undecayed second order on a GPU runs hla2_decay's chain (gamma = 1: one thread block per
    chunk) rather than hla2's carry (one per head), in hla() and in compiled models."""
    import torch

    from hla_tvm import compiler
    from hla_tvm.models import HLALM

    assert chains.family("hla2", decayed=False, decode=False, gpu=True) == "hla2_decay"
    assert chains.family("hla2", decayed=False, decode=False) == "hla2"
    torch.manual_seed(0)
    model = HLALM(40, 32, 1, 4, chunk_size=16)
    names = {gv.name_hint for gv in compiler.to_relax(
        model, target=resolve({"kind": "cuda", "arch": "sm_90"})).get_global_vars()}
    assert any(n.startswith("hla2_decay_chunk_output") for n in names), names
    assert not any(n.startswith("hla2_chunk_carry") for n in names), names
