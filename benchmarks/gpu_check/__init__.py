"""Every HLA kernel checked on an NVIDIA GPU against the float64 reference, and decode and
prefill timed there beside PyTorch, from a bundle made on a machine with TVM's compiler.

    python benchmarks/gpu_check prepare [--bundle gpu_bundle] [--arch sm_90]
        (here: TVM's compiler and nvcc) compiles the CUDA kernel modules the check runs (and
        the timed prefills' schedule variants), builds their device code with nvcc, and
        gathers the runtime: libtvm_runtime.so,
        libtvm_runtime_cuda.so and a cp312 apache-tvm-ffi wheel (pip downloads it once).
    python benchmarks/gpu_check emulate [--only 'hla2_decay,float32,8;ahla'] [--arch sm_90]
        (here, no GPU) the same checks with every CUDA kernel emulated on the CPU thread by
        thread (`hla_tvm.tools.cuda_emulator`), threads in forward and in reverse order.
    python benchmarks/gpu_check run [--bundle gpu_bundle] [--out DIR]
        (on the GPU machine: PyTorch with CUDA and apache-tvm-ffi; no TVM) runs the checks, each
        group of kernels in its own process (a kernel that faults or hangs fails its group
        alone), then the timings; prints Markdown tables and writes DIR/gpu_check.json and .md.
    python benchmarks/gpu_check models [--out DIR]
        (on the GPU machine: TVM's runtime alone) the bundle's compiled models (a tiny HLALM and
        the shipped demo model with float32 and int4 weights, `hla-tvm compile --target cuda
        [--quantize int4]`) through `hla_tvm.runtime.load(device="cuda")` against their
        checkpoints in PyTorch (quantized: with the dequantized weights); then each
        model's `hla-tvm bundle`, made there, through its generate.py and the C++ app (built by
        `prepare`), their greedy tokens against PyTorch's.
    python benchmarks/gpu_check api [--out DIR] [--device cuda]
        (on a GPU machine with TVM's compiler) `hla()` and `decode_()` on CUDA tensors against
        the float64 reference: the user's path, kernels compiled there on first use.

On a lent GPU machine (the `device` tool; the bundle is git-ignored, so carry it), one call:

    carry ["gpu_bundle"]; command:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site gpu_bundle/wheels/*.whl &&
    tar -xJf gpu_bundle/runtime/tvm-python.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site &&
    python3 benchmarks/gpu_check run --out $OUT && python3 benchmarks/gpu_check models --out $OUT

(`api` needs TVM's compiler there: its 100 MB wheel does not fit one call; split in two parts
carried by two calls while the machine stays warm, it did.)

The kernels run through `hla_tvm.backend.run_chain` with the chains of `hla_tvm.ops.chains`
(neither needs TVM's compiler); the references are `hla_tvm.reference` in float64 on the GPU.
Timed: decode at B64 H32 D128 (float32 state) against `hla_tvm.fast.step` eager and under
torch.compile, as a share of the measured copy bandwidth; prefill at B1 H32 T32768 D128 bfloat16
against `hla_tvm.fast.chunk` (float32 work, as `hla(backend="torch")`) eager and under
torch.compile, and SDPA causal softmax (flash) on the same inputs, each family's chain also
with the schedule variants of `VARIANTS` (the schedule the H200 timed among them), so a
schedule change is judged beside its predecessor in one run.

TVM 0.27 keeps a module's CUDA code as source and builds it when the module is loaded, through
the `tvm_callback_cuda_compile` hook. `run` registers a hook serving the device code `prepare`
built (looked up by the source's sha256; nvcc there builds any source not found).

The modules (`python benchmarks/gpu_check <command>` runs `__main__`, which parses the
command's arguments and calls its function):

    entries   what is compiled, checked and timed: CHECKS, VARIANTS, MODELS, entry ids
    bundle    the bundle: `prepare` makes it here, `load_runtime` loads it on the GPU machine
    checks    the kernel checks against the float64 reference (`Kernels`, `check_entry`,
              `judged`) and the worker process of each family's checks
    emulate   `emulate`: the same checks with the CUDA kernels emulated on the CPU
    timing    the timing worker process: copy bandwidth, decode and prefill beside PyTorch
    run       `run`: the check workers, then the timing worker; the report to --out
    report    the report's Markdown tables
    models    `models`: the compiled models and their bundles against PyTorch
    api       `api`: hla() and decode_() on CUDA tensors against the float64 reference"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))   # this package: `python HERE <command>`
ROOT = os.path.dirname(os.path.dirname(HERE))       # the repository
sys.path.insert(0, ROOT)
