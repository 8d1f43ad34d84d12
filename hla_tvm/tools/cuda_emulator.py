"""Running a scheduled CUDA kernel on the CPU, thread by thread, to check it without a GPU.

`Emulated(func, shapes, target)` lowers the scheduled PrimFunc `func`, specialized to the
argument `shapes`, exactly as `tvm.compile` does for the CUDA `target`, takes the CUDA source
TVM generates and the kernel launches of its host function (grid, block, dynamic shared
memory), and compiles that source as C++ for this CPU (g++) with a small emulation layer:
every CUDA thread of a block is a coroutine (ucontext) and `__syncthreads()` switches to the
next one, so the threads of a block run one phase (barrier to barrier) at a time, in an order
the caller picks: forward, reverse or shuffled, threads and blocks alike. Calling it on torch
CPU tensors runs the kernel's launches in order.

What it finds: a kernel whose result depends on that order (a missing barrier: one thread
reads what another writes in the same phase, or blocks that share an element), barriers that
not every thread of a block reaches together (divergent `__syncthreads`, undefined on a GPU),
and reads of shared memory no thread wrote (shared memory starts as NaN). It does not model
warps (no warp shuffles; a kernel using them fails to compile here), caches or timing.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import threading

from ..ops import chains
from ..runtime import cache
from ..runtime.device_code import cuda_source
from ..runtime.paths import replacing_path
from ..schedule.common import walk
from ..schedule.gpu_limits import split_host_device
from ..schedule.rules.cuda import scheduled
from ..schedule.shapes import specialize

FORWARD, REVERSE, SHUFFLED = 0, 1, 2

# the emulation layer compiled before the CUDA source (C++17)
_HEADER = r"""
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>
using std::max; using std::min;
struct emu_dim3 { unsigned x = 0, y = 0, z = 0; };
static emu_dim3 emu_tid, emu_bid, emu_bdim, emu_gdim;
#define threadIdx emu_tid
#define blockIdx emu_bid
#define blockDim emu_bdim
#define gridDim emu_gdim
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short
static inline float __fdividef(float a, float b) { return a / b; }
// CUDA's vector types, as TVM's vectorized loads and stores use them (dlight's Matmul)
#define EMU_VEC2(T, N) struct alignas(2 * sizeof(T)) N { T x, y; }; \
  static inline N make_##N(T a, T b) { N v; v.x = a; v.y = b; return v; }
#define EMU_VEC4(T, N) struct alignas(4 * sizeof(T)) N { T x, y, z, w; }; \
  static inline N make_##N(T a, T b, T c, T d) { N v; v.x = a; v.y = b; v.z = c; v.w = d; \
                                                 return v; }
EMU_VEC2(float, float2) EMU_VEC4(float, float4) EMU_VEC2(int, int2) EMU_VEC4(int, int4)
EMU_VEC2(unsigned, uint2) EMU_VEC4(unsigned, uint4)
EMU_VEC2(unsigned short, ushort2) EMU_VEC4(unsigned short, ushort4)
EMU_VEC2(unsigned char, uchar2) EMU_VEC4(unsigned char, uchar4)
EMU_VEC2(signed char, char2) EMU_VEC4(signed char, char4)
struct nv_bfloat16 {   // bfloat16 storage; arithmetic through float, as the kernels do
  unsigned short bits;
  nv_bfloat16() = default;
  nv_bfloat16(float f) {   // round to nearest even, as __float2bfloat16_rn
    unsigned u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = (unsigned short)((u >> 16) | 0x40); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = (unsigned short)(u >> 16);
  }
  operator float() const { unsigned u = (unsigned)bits << 16; float f; memcpy(&f, &u, 4); return f; }
};

enum { EMU_RUNNING = 0, EMU_BARRIER = 1, EMU_DONE = 2 };
struct emu_fiber { ucontext_t ctx; int state; int line; };
static ucontext_t emu_main;
static std::vector<emu_fiber> emu_threads;
static std::vector<char> emu_stacks;
static const size_t EMU_STACK = 256 << 10;
static int emu_cur;
static std::function<void()> emu_body;
static char emu_error[512];
alignas(256) static unsigned char emu_dyn_shmem[256 << 10];

static void emu_barrier(int line) {
  emu_threads[emu_cur].state = EMU_BARRIER;
  emu_threads[emu_cur].line = line;
  swapcontext(&emu_threads[emu_cur].ctx, &emu_main);
}
#define __syncthreads() emu_barrier(__LINE__)

static void emu_entry() { emu_body(); emu_threads[emu_cur].state = EMU_DONE; }

static void emu_order(std::vector<int>& order, int mode, std::mt19937& rng) {
  for (size_t i = 0; i < order.size(); ++i) order[i] = (int)i;
  if (mode == 1) std::reverse(order.begin(), order.end());
  if (mode == 2) std::shuffle(order.begin(), order.end(), rng);
}

// one thread block, phase by phase; 0 or an error (emu_error says which)
static int emu_block(int n, int mode, std::mt19937& rng) {
  if (emu_stacks.size() < n * EMU_STACK) emu_stacks.resize(n * EMU_STACK);
  emu_threads.resize(n);
  for (int i = 0; i < n; ++i) {
    emu_fiber& f = emu_threads[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = emu_stacks.data() + i * EMU_STACK;
    f.ctx.uc_stack.ss_size = EMU_STACK;
    f.ctx.uc_link = &emu_main;
    makecontext(&f.ctx, emu_entry, 0);
    f.state = EMU_RUNNING;
  }
  std::vector<int> order(n);
  for (;;) {
    emu_order(order, mode, rng);
    for (int i : order) {
      if (emu_threads[i].state == EMU_DONE) continue;
      emu_threads[i].state = EMU_RUNNING;
      emu_cur = i;
      emu_tid.x = i % emu_bdim.x;
      emu_tid.y = (i / emu_bdim.x) % emu_bdim.y;
      emu_tid.z = i / (emu_bdim.x * emu_bdim.y);
      swapcontext(&emu_main, &emu_threads[i].ctx);
    }
    int done = 0, line = -1;
    for (int i = 0; i < n; ++i) {
      if (emu_threads[i].state == EMU_DONE) { ++done; continue; }
      if (line >= 0 && emu_threads[i].line != line) {
        snprintf(emu_error, sizeof emu_error, "block (%u,%u,%u): threads wait at different "
                 "barriers (source lines %d and %d)", emu_bid.x, emu_bid.y, emu_bid.z, line,
                 emu_threads[i].line);
        return 1;
      }
      line = emu_threads[i].line;
    }
    if (done == n) return 0;
    if (done) {
      snprintf(emu_error, sizeof emu_error, "block (%u,%u,%u): %d of %d threads ended while "
               "the others wait at the barrier of source line %d", emu_bid.x, emu_bid.y,
               emu_bid.z, done, n, line);
      return 1;
    }
  }
}

// dims: grid x, y, z, block x, y, z, dynamic shared bytes
static int emu_grid(const long* dims, int mode, unsigned seed) {
  if (dims[6] > (long)sizeof emu_dyn_shmem) {
    snprintf(emu_error, sizeof emu_error, "%ld bytes of dynamic shared memory", dims[6]);
    return 2;
  }
  std::mt19937 rng(seed);
  emu_gdim.x = dims[0]; emu_gdim.y = dims[1]; emu_gdim.z = dims[2];
  emu_bdim.x = dims[3]; emu_bdim.y = dims[4]; emu_bdim.z = dims[5];
  int blocks = dims[0] * dims[1] * dims[2], threads = dims[3] * dims[4] * dims[5];
  std::vector<int> order(blocks);
  emu_order(order, mode, rng);
  for (int b : order) {
    emu_bid.x = b % dims[0]; emu_bid.y = (b / dims[0]) % dims[1];
    emu_bid.z = b / (dims[0] * dims[1]);
    memset(emu_dyn_shmem, 0xff, sizeof emu_dyn_shmem);   // NaN until written
    int rc = emu_block(threads, mode, rng);
    if (rc) return rc;
  }
  return 0;
}

extern "C" const char* emu_last_error() { return emu_error; }
"""

_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\)'
                     r'\s*\{')
_DYN_SHARED = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?(\w+) (\w+)\[\];")
_AXES = {"blockIdx.x": 0, "blockIdx.y": 1, "blockIdx.z": 2,
         "threadIdx.x": 3, "threadIdx.y": 4, "threadIdx.z": 5}
_LOCK = threading.Lock()


def _spec(x):
    """(shape, dtype name) of torch tensor x, as the kernels' argument shapes spell them."""
    return tuple(x.shape), str(x.dtype).replace("torch.", "")


def _host_launches(func, target):
    """(CUDA source, [(kernel name, [argument index], dims)]) of the scheduled, specialized
    `func` compiled for `target`: the launches its host function makes, in order."""
    exe, _, split = split_host_device(func, target)
    host = next(f for f in split if f.attrs is not None and "tirx.is_entry_func" in f.attrs)
    params = [p.name for p in host.params]
    launches = []

    def visit(node):
        if type(node).__name__ != "Call" or getattr(node.op, "name", "") != \
                "tirx.call_ffi_kernel":
            return
        axes = [str(x) for x in node.attrs.launch_params]
        args = list(node.args)
        name, values = str(args[0].value), args[len(args) - len(axes):]
        dims = [1, 1, 1, 1, 1, 1, 0]
        for axis, value in zip(axes, values):
            dims[_AXES.get(axis, 6)] = int(value)
        index = []
        for arg in args[1:len(args) - len(axes)]:
            if type(arg).__name__ != "Call" or arg.op.name != "tirx.buffer_data":
                raise NotImplementedError(f"emulator: kernel argument {arg} (only buffers of "
                                          "statically shaped kernels)")
            index.append(params.index(arg.args[0].name))
        launches.append((name, index, dims))

    walk(host.body, visit)
    return cuda_source(exe), launches


def _launcher(name, params):
    """C++ of `extern "C" int emu_launch_<name>(void** args, const long* dims, int mode,
    unsigned seed)` calling kernel `name` with parameters `params` (its C declarations: buffer
    pointers, the only arguments `_host_launches` passes)."""
    casts = [f"({re.sub(r'__restrict__', '', p.rsplit(None, 1)[0]).strip()})a[{i}]"
             for i, p in enumerate(params)]
    return (f'extern "C" int emu_launch_{name}(void** a, const long* dims, int mode, '
            f"unsigned seed) {{\n  emu_body = [=]() {{ {name}({', '.join(casts)}); }};\n"
            f"  return emu_grid(dims, mode, seed);\n}}\n")


def translate(source):
    """(C++ source, {kernel name: number of parameters}) of TVM's CUDA `source`: the kernels
    with the emulation layer and one launcher each."""
    start = source.find('extern "C" __global__')
    if start < 0:
        raise ValueError("emulator: no __global__ kernel in the CUDA source")
    body = _DYN_SHARED.sub(r"\1* \2 = (\1*)emu_dyn_shmem;", source[start:])
    body = body.replace("__shared__", "static")
    # (a shared array's alignment: C++ wants it before `static`)
    body = re.sub(r"static alignas\((\d+)\)", r"alignas(\1) static", body)
    kernels = {m.group(1): [p.strip() for p in m.group(2).split(",") if p.strip()]
               for m in _KERNEL.finditer(body)}
    return _HEADER + body + "\n" + "".join(_launcher(n, p) for n, p in kernels.items()), \
        {n: len(p) for n, p in kernels.items()}


def _compile(cpp):
    """The loaded shared library of C++ source `cpp` (built once per source, cached)."""
    folder = cache.folder("emulator")
    path = os.path.join(folder, hashlib.sha256(cpp.encode()).hexdigest()[:24] + ".so")
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory() as tmp, \
                replacing_path(path, suffix=".so", executable=True) as tmp_lib:
            src = os.path.join(tmp, "kernel.cpp")
            with open(src, "w") as f:
                f.write(cpp)
            res = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", src,
                                  "-o", tmp_lib], capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError("emulator: g++ could not compile the kernel's CUDA source:\n"
                                   + res.stderr[-3000:])
    return ctypes.CDLL(path)


class Emulated:
    """The scheduled CUDA kernel `func` (a PrimFunc), specialized to `shapes` [(shape,
    dtype)] and run on the CPU: `self(*tensors, mode=FORWARD, seed=0)` on contiguous torch CPU
    tensors of those shapes runs its launches (threads and blocks in the order `mode` gives)."""

    def __init__(self, func, shapes, target, name="kernel"):
        self.name, self.shapes = name, [(tuple(int(d) for d in s), str(t)) for s, t in shapes]
        source, self.launches = _host_launches(specialize(func, shapes), target)
        self.lib = _compile(translate(source)[0])

    def __call__(self, *tensors, mode=FORWARD, seed=0):
        if len(tensors) != len(self.shapes):
            raise TypeError(f"{self.name}: {len(tensors)} tensors for {len(self.shapes)} "
                            "parameters")
        for i, (x, (shape, dtype)) in enumerate(zip(tensors, self.shapes)):
            if _spec(x) != (shape, dtype) or x.device.type != "cpu" or not x.is_contiguous():
                raise ValueError(f"{self.name}: argument {i} is {tuple(x.shape)} "
                                 f"{x.dtype} on {x.device}; expected a contiguous CPU tensor "
                                 f"{shape} {dtype}")
        with _LOCK:   # the layer keeps its threads in globals
            for kernel, index, dims in self.launches:
                ptrs = (ctypes.c_void_p * max(1, len(index)))(
                    *[tensors[i].data_ptr() for i in index])
                rc = getattr(self.lib, f"emu_launch_{kernel}")(
                    ptrs, (ctypes.c_long * 7)(*dims), ctypes.c_int(mode), ctypes.c_uint(seed))
                if rc:
                    self.lib.emu_last_error.restype = ctypes.c_char_p
                    raise RuntimeError(f"{self.name} ({kernel}): "
                                       f"{self.lib.emu_last_error().decode()}")


class _ByShape:
    """A scheduled kernel emulated for the shapes of the tensors it is called with (built once
    per shapes); threads in order `mode` (its own unless the call gives one)."""

    def __init__(self, func, name, target, mode, seed):
        self.func, self.name, self.target, self.mode, self.seed = func, name, target, mode, seed
        self.built = {}

    def __call__(self, *tensors, mode=None):
        shapes = tuple(_spec(x) for x in tensors)
        if shapes not in self.built:
            self.built[shapes] = Emulated(self.func, shapes, self.target, self.name)
        self.built[shapes](*tensors, mode=self.mode if mode is None else mode, seed=self.seed)


def chain_functions(chain, dk, dv, target, *, chunk=None, group=1, mode=FORWARD, seed=0,
                    **opts):
    """What `hla_tvm.backend.run_chain` calls for `chain` (`ops.chains`) on torch CPU
    tensors: each call's kernel under the default CUDA schedule for `target`, emulated (threads
    and blocks in `mode`'s order, or in that of a `mode=` keyword to the call); opts: the
    kernels' (dtype, normalize, ...)."""
    funcs = chains.kernels(chain, dk, dv, chunk=chunk, group=group,
                           **{**opts, **chains.gpu_options(chain)})
    return [_ByShape(scheduled(funcs[name].with_attr("global_symbol", name)), name, target,
                     mode, seed)
            for name in (chains.kernel_name(chain, c, dk, dv, group) for c in chain.calls)]
