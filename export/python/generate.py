"""Generation with a module compiled by `hla-tvm compile`, needing only numpy, the
`apache-tvm-ffi` package and TVM's runtime library `libtvm_runtime.so` (no TVM Python package,
no TVM compiler, no torch, no hla_tvm):

    python generate.py model.so --prompt-ids 5,9,2,33 --tokens 12 [--temperature T --top-k K
                                                                   --seed S]
    python generate.py model.so --text "def fib(" --tokens 200      # models with text

prints the generated token ids on one line, separated by spaces (as export/cpp's app does), or
for --text the prompt and the generated text. libtvm_runtime.so is found at --runtime-lib, else
$TVM_RUNTIME_LIB, else runtime/tvm/lib/ beside this script (a bundle from `hla-tvm bundle`),
else in the installed `tvm` package (found, not imported).

A module compiled for an NVIDIA GPU (`hla-tvm compile --target cuda`) has its device code in a
folder beside it (model.so -> model.device/, `hla_tvm.device_code`): the script then runs it on
the first GPU, loading TVM's CUDA runtime (libtvm_runtime_cuda.so beside libtvm_runtime.so, with
libcudart.so.13 beside it, in the `nvidia` pip packages or on the library path, and the NVIDIA
driver) and serving that device code to TVM when the module loads (no CUDA toolkit needed).

The module's entry points: prefill(tokens [1, T] int64, *state) -> (logits [1, T, vocab],
*state) for T >= 2, decode(tokens [1] int64, *state) -> (logits [1, vocab], *state) (and
decode_1, the same with the batch fixed to 1, which is used where the module has it), and
hla_tvm_meta() -> the JSON metadata ("state": [[name, shape without batch, dtype], ...],
"config": {"vocab": "bytes" for byte-level models, ...}, "tokenizer": the tokenizer.json text
of a model compiled with --tokenizer, which --text then needs the `tokenizers` package for)."""
import argparse
import codecs
import ctypes
import glob
import hashlib
import importlib.util
import json
import os
import platform
import struct
import sys

import numpy as np

ALIGN = 64   # TVM's kernels assume 64-byte aligned tensors
KDL_CPU, KDL_CUDA = 1, 2   # DLPack device types
POOLED = 2                 # the virtual machine's pooled allocator


def text_codec(meta):
    """(encode(text) -> ids, decode(ids, final=False) -> text, incremental) of a module with
    text (its tokenizer, else UTF-8 bytes for a byte-level model), or None (token ids only)."""
    if meta.get("tokenizer"):
        try:
            from tokenizers import Tokenizer
            from tokenizers.decoders import DecodeStream
        except ImportError:
            raise SystemExit("generate.py: this module was compiled with a tokenizer: --text "
                             "needs the `tokenizers` package (pip install tokenizers)") from None
        tok, stream = Tokenizer.from_str(meta["tokenizer"]), DecodeStream(skip_special_tokens=False)
        return (lambda text: tok.encode(text, add_special_tokens=False).ids,
                lambda ids, final=False: "".join(
                    s for s in (stream.step(tok, int(i)) for i in ids) if s))
    if (meta.get("config") or {}).get("vocab") == "bytes":
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return (lambda text: list(text.encode("utf-8")),
                lambda ids, final=False: dec.decode(bytes(ids), final))
    return None


def runtime_library(given=None):
    """The path of libtvm_runtime.so (see the module docstring for where it is looked for)."""
    if given is not None and not os.path.isfile(given):
        raise FileNotFoundError(f"--runtime-lib {given}: no such file")
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [given, os.environ.get("TVM_RUNTIME_LIB"),
                  os.path.join(here, "runtime", "tvm", "lib", "libtvm_runtime.so")]
    try:
        spec = importlib.util.find_spec("tvm")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(p, "lib", "libtvm_runtime.so")
                       for p in spec.submodule_search_locations]
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    raise FileNotFoundError("libtvm_runtime.so not found: give --runtime-lib PATH or set "
                            "TVM_RUNTIME_LIB (it ships in the apache-tvm wheel under tvm/lib/)")


def aligned(array):
    """A copy of `array` in 64-byte aligned memory (numpy aligns to 16 bytes only)."""
    array = np.asarray(array)
    buf = np.empty(array.nbytes + ALIGN, dtype=np.uint8)
    start = (-buf.ctypes.data) % ALIGN
    out = buf[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


# a module's trailer, as `hla_tvm.libfile` writes it: b"HLATVMSL", a tag (32 bytes), the sha256
# of every byte before the trailer (32 bytes), b"HLATVMEN"
TRAILER = 80
NOTE = b"HLATVMNT"   # ends the metadata note before the trailer: [note, its length, NOTE]
MODULE_FORMAT = "hla_tvm.module/1"
# text prompts are sampled as `hla-tvm run` samples them (hla_tvm.generate's TEXT_SAMPLING)
TEXT_TEMPERATURE, TEXT_TOP_K = 0.9, 40
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 40: "arm", 243: "riscv64"}


def _machine_code(path):
    """The ELF e_machine code of the file at `path`, or None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")


# /proc/cpuinfo flag -> LLVM feature, as `hla_tvm.runtime.cpu_features.X86` (this script imports
# nothing of hla_tvm): the features a module's metadata may record ("cpu_features")
X86 = {
    "sse4_2": "sse4.2", "avx": "avx", "f16c": "f16c", "fma": "fma", "avx2": "avx2",
    "bmi2": "bmi2", "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512vbmi": "avx512vbmi",
    "avx512_vbmi2": "avx512vbmi2", "avx512_vnni": "avx512vnni", "avx_vnni": "avxvnni",
    "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16", "amx_tile": "amx-tile",
    "amx_bf16": "amx-bf16", "amx_int8": "amx-int8",
}


def host_features():
    """The LLVM names of the X86 features this CPU reports, or None (not x86-64 Linux)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    return {llvm for flag, llvm in X86.items() if flag in flags}
    except OSError:
        return None
    return None


def check_features(path, meta):
    """ValueError (one line) naming the features the module's code may use that this CPU
    lacks (running it would stop with an illegal instruction), as `hla_tvm.runtime.load`."""
    have = host_features()
    needed = meta.get("cpu_features") or []
    lacking = [f for f in needed if have is not None and f in X86.values() and f not in have]
    if lacking:
        raise ValueError(f"{path} was compiled for a CPU with {', '.join(lacking)}, which this "
                         "CPU lacks (its code would stop with an illegal instruction): compile "
                         "it on this machine or for every x86-64 CPU (--target x86-64)")


def check_module(path):
    """Refuse (ValueError, one line) a file that is not a whole, unmodified module written by
    `hla-tvm compile` for this machine's architecture, before it is loaded: a truncated library
    would kill the process when mapped, an altered one compute wrong answers, and a library
    that is not an hla_tvm model (its metadata note, outside the loaded image, says what it
    is) would run its code when loaded."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(20)
            f.seek(max(0, size - TRAILER))
            trailer = f.read(TRAILER)
            if len(head) < 20 or head[:4] != b"\x7fELF":
                raise ValueError(f"{path}: not a compiled module (no ELF shared-library header)")
            code = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
            host = _machine_code("/proc/self/exe")   # (what this process runs as)
            if host is not None and code != host:
                arch = ELF_MACHINES.get(code, f"machine {code}")
                raise ValueError(f"{path} was compiled for {arch}, this machine is "
                                 f"{platform.machine()}: run it (or its bundle) there")
            if size < 64 + TRAILER or trailer[:8] != b"HLATVMSL" or trailer[-8:] != b"HLATVMEN":
                raise ValueError(f"{path}: the module has no hla_tvm checksum trailer "
                                 "(truncated, or not written by `hla-tvm compile`)")
            digest, left = hashlib.sha256(), size - TRAILER
            f.seek(0)
            while left:
                block = f.read(min(left, 1 << 20))
                digest.update(block)
                left -= len(block)
            if digest.digest() != trailer[40:72]:
                raise ValueError(f"{path}: the module is corrupt (its sha256 does not match the "
                                 "checksum recorded when it was compiled)")
            f.seek(max(0, size - TRAILER - 16))
            tail = f.read(16)
            note = None
            if len(tail) == 16 and tail[8:] == NOTE:
                (n,) = struct.unpack("<Q", tail[:8])
                if n <= size - TRAILER - 16 - 64:
                    f.seek(size - TRAILER - 16 - n)
                    note = f.read(n)
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        meta = json.loads(note.decode()) if note is not None else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != MODULE_FORMAT:
        raise ValueError(f"{path}: not an hla_tvm compiled model (its metadata note "
                         f"{'is missing' if note is None else 'does not name ' + MODULE_FORMAT}"
                         "); compile it with `hla-tvm compile`")
    check_features(path, meta)


def device_code_folder(module):
    """Where `hla-tvm compile` puts a CUDA module's device code: model.so -> model.device."""
    root, ext = os.path.splitext(module)
    return (root if ext == ".so" else module) + ".device"


def _arch_number(name):
    """90 for "sm_90" or "sm_90a", None for other text."""
    digits = "".join(c for c in name[3:] if c.isdigit()) if name.startswith("sm_") else ""
    return int(digits) if digits else None


def read_checked(path):
    """The bytes of the device code at `path`; ValueError unless they match the sha256 kept
    beside them (path + ".sha256"). (`hla_tvm.device_code` writes and reads this format; the
    script repeats its check, the pick rule and libfile's trailer because it imports nothing
    of hla_tvm.)"""
    with open(path, "rb") as f:
        data = f.read()
    try:
        with open(path + ".sha256", "rb") as f:
            want = f.read().decode("ascii", "replace").strip()
    except OSError:
        raise ValueError(f"{path}: device code without its checksum file") from None
    if hashlib.sha256(data).hexdigest() != want:
        raise ValueError(f"{path}: the device code does not match its checksum (truncated or "
                         "altered); copy the module's .device folder again")
    return data


def device_code_for(folder, source, arch):
    """The path of the device code in `folder` for CUDA `source` on a GPU of compute capability
    `arch` (90 for sm_90): files are named <sha256 of the source>-<sm_XX[-sm_YY]>.fatbin; the one
    built for the newest architecture not above `arch` (its PTX serves later GPUs, except an
    architecture-specific build such as sm_90a, which serves its own only). None when there
    is none."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    best = None
    for path in glob.glob(os.path.join(glob.escape(folder), digest + "-*.fatbin")):
        built = os.path.basename(path)[len(digest) + 1:-len(".fatbin")].split("-")
        fits = [n for a, n in zip(built, map(_arch_number, built))   # ("sm_90a": its own only)
                if n is not None and n <= arch and (not a[-1].isalpha() or n == arch)]
        if fits and (best is None or max(fits) > best[0]):
            best = (max(fits), path)
    return None if best is None else best[1]


def cuda_device(runtime_lib, folder):
    """The first GPU (a tvm_ffi device), with TVM's CUDA runtime loaded from beside
    `runtime_lib` and a `tvm_callback_cuda_compile` hook serving the device code in `folder`
    (TVM calls it with the module's CUDA source when the module loads). OSError when the CUDA
    runtime, the driver or a GPU is missing."""
    import tvm_ffi

    for path in glob.glob(os.path.join(glob.escape(folder), "*.fatbin")):
        read_checked(path)   # every file checked before anything runs
    lib_dir = os.path.dirname(runtime_lib)
    for pattern in ("libcudart.so.13", "nvidia/cu13/lib/libcudart.so.13",
                    "nvidia/cuda_runtime/lib/libcudart.so.13"):
        found = [p for d in [lib_dir] + sys.path if d for p in glob.glob(os.path.join(d, pattern))]
        if found:
            ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
            break
    try:
        ctypes.CDLL(os.path.join(lib_dir, "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise OSError(f"TVM's CUDA runtime does not load ({err}); a module for an NVIDIA GPU "
                      "needs the NVIDIA driver (libcuda.so.1) and the CUDA 13 runtime "
                      "(libcudart.so.13)") from None
    attr = tvm_ffi.get_global_func("runtime.GetDeviceAttr")
    if not attr(KDL_CUDA, 0, 0):   # kExist
        raise OSError("no NVIDIA GPU is visible to this process")
    major, _, minor = str(attr(KDL_CUDA, 0, 4)).partition(".")   # kComputeVersion: "9.0"
    arch = int(major + minor)

    def hook(source, *_):
        path = device_code_for(folder, source, arch)
        if path is None:
            raise ValueError(f"no device code for this module and an sm_{arch} GPU in {folder}")
        return read_checked(path)

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", hook, override=True)
    return tvm_ffi.device("cuda", 0)


class Tensors:
    """Arrays to and from the module's device: on the CPU through DLPack (64-byte aligned
    copies), on a GPU through TVM's runtime (allocation and copies by bytes)."""

    def __init__(self, device):
        import tvm_ffi

        self.device = device
        self.gpu = device.dlpack_device_type() == KDL_CUDA
        if self.gpu:
            get = tvm_ffi.get_global_func
            self._alloc = get("runtime.TVMTensorAllocWithScope")
            self._to, self._from = (get("runtime.TVMTensorCopyFromBytes"),
                                    get("runtime.TVMTensorCopyToBytes"))

    def put(self, array):
        import tvm_ffi

        array = np.ascontiguousarray(array)
        if not self.gpu:
            return tvm_ffi.from_dlpack(aligned(array))
        out = self._alloc(tvm_ffi.Shape(array.shape), tvm_ffi.dtype(str(array.dtype)),
                          self.device, None)
        self._to(out, ctypes.c_void_p(array.ctypes.data), array.nbytes)
        return out

    def get(self, tensor):
        if tensor.device.dlpack_device_type() == KDL_CPU:
            return np.from_dlpack(tensor)
        out = np.empty(tuple(tensor.shape), dtype=str(tensor.dtype))
        self._from(tensor, ctypes.c_void_p(out.ctypes.data), out.nbytes)
        return out


def load(path, runtime_lib=None):
    """(virtual machine module, metadata dict, Tensors of its device) of the compiled module at
    `path`: on the first GPU when its device code lies beside it (`device_code_folder`)."""
    import tvm_ffi   # first: loads libtvm_ffi.so, which libtvm_runtime.so links to

    path = os.path.abspath(path)   # (a bare file name would be looked for on the library path)
    check_module(path)
    lib = runtime_library(runtime_lib)
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    folder = device_code_folder(path)
    device = cuda_device(lib, folder) if os.path.isdir(folder) else tvm_ffi.device("cpu", 0)
    try:
        vm = tvm_ffi.load_module(path)["vm_load_executable"]()
    except Exception as err:   # (tvm_ffi raises its own error types)
        if "load_from_bytes.cuda" in str(err):
            raise ValueError(f"{path} was compiled for an NVIDIA GPU, but its device code "
                             f"({folder}) is not beside it: copy that folder along") from None
        hint = "" if path.endswith(".so") else "; its name must end in .so"
        why = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise ValueError(f"{path}: not a loadable module ({why}){hint}") from None
    init = [device.dlpack_device_type(), device.index, POOLED]
    if init[0] != KDL_CPU:
        init += [KDL_CPU, 0, POOLED]   # the host, for the model's shape computations
    vm["vm_initialization"](*init)
    tensors = Tensors(device)
    meta = json.loads(bytes(tensors.get(vm["hla_tvm_meta"]())).decode())   # (a constant: on
    return vm, meta, tensors                                                  # the device)


# tokens per piece of a CPU prefill, as hla_tvm.runtime.PREFILL_PIECE
PREFILL_PIECE = 4096


def prefill_pieces(T, chunk=None):
    """Boundaries [0, ..., T] of the pieces a CPU prefill of T tokens runs in, as
    `hla_tvm.runtime.prefill_pieces` (this script imports nothing of hla_tvm): PREFILL_PIECE
    tokens rounded down to whole chunks (one chunk at least; chunk 64 when unknown), the last
    piece of 2 tokens or more (the prefill entry's least)."""
    chunk = chunk if isinstance(chunk, int) and chunk > 0 else 64
    piece = chunk * max(1, PREFILL_PIECE // chunk)
    bounds = list(range(0, T, piece)) + [T]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < 2:   # a last piece of one token
        bounds[-2] -= chunk
        if bounds[-2] <= bounds[-3]:
            del bounds[-2]
    return bounds


def generate(vm, meta, tensors, prompt, steps, temperature=0.0, top_k=0, seed=0,
             on_token=None):
    """`steps` token ids following `prompt`: greedy, or sampled at `temperature` from the
    `top_k` most likely (0: all) with a seeded generator; `tensors` (a `Tensors`) moves arrays
    to and from the module's device."""
    rng = np.random.default_rng(seed)
    state = [tensors.put(np.zeros((1, *shape), dtype=dtype)) for _, shape, dtype in meta["state"]]
    entries = meta.get("entries", ["prefill", "decode"])
    step_entry = "decode_1" if "decode_1" in entries else "decode"   # one stream, static shapes

    def run(entry, tokens):
        nonlocal state
        out = list(vm[entry](tensors.put(tokens), *state))
        state = out[1:]
        logits = tensors.get(out[0])
        return logits.reshape(-1, logits.shape[-1])[-1].astype(np.float64)

    if len(prompt) >= 2 and "prefill" in entries:   # the prefill entry takes T >= 2
        # on a CPU a long prompt in pieces, each continuing the state (as hla_tvm.runtime)
        bounds = prefill_pieces(len(prompt), (meta.get("config") or {}).get("chunk_size")) \
            if not tensors.gpu else [0, len(prompt)]
        skips = meta.get("prefill_skips") or ()   # lengths the prefill entry must not take
        for start, end in zip(bounds, bounds[1:]):
            if end - start in skips:
                for t in prompt[start:end]:
                    logits = run(step_entry, np.array([t], dtype=np.int64))
            else:
                logits = run("prefill", np.array([prompt[start:end]], dtype=np.int64))
    else:
        for t in prompt:
            logits = run(step_entry, np.array([t], dtype=np.int64))
    out = []
    for step in range(steps):
        if temperature > 0:
            order = np.argsort(-logits, kind="stable")[: top_k or len(logits)]
            p = np.exp((logits[order] - logits[order[0]]) / temperature)
            nxt = int(order[rng.choice(len(order), p=p / p.sum())])
        else:
            nxt = int(np.argmax(logits))
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if step + 1 < steps:
            logits = run(step_entry, np.array([nxt], dtype=np.int64))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Generate tokens (or text) with a module compiled by `hla-tvm compile`, "
                    "needing only numpy, apache-tvm-ffi and TVM's runtime library (a module "
                    "compiled for an NVIDIA GPU runs on the first GPU).")
    p.add_argument("module", help="the compiled module (model.so)")
    p.add_argument("--prompt-ids", "--prompt", dest="prompt", default=None,
                   help="prompt token ids, e.g. 5,9,2 (--prompt-ids as in `hla-tvm run`; "
                        "--prompt, this script's first spelling, takes ids too)")
    p.add_argument("--text", default=None,
                   help="prompt text (byte-level models, and models compiled with --tokenizer; "
                        "`hla-tvm run --text` too)")
    p.add_argument("--tokens", "--steps", dest="steps", type=int, default=16,
                   help="tokens to generate (default: 16)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0 greedy (default: 0.9 for --text, 0 for "
                        "--prompt-ids, as `hla-tvm run`)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample from the k most likely tokens, 0 all (default: 40 when "
                        "sampling --text, else 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default: 0)")
    p.add_argument("--runtime-lib", default=None,
                   help="path of libtvm_runtime.so (default: $TVM_RUNTIME_LIB, a bundle's "
                        "runtime/, or the installed tvm package's)")
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.text is None):
        p.error("give --prompt-ids IDS or --text TEXT")
    text = args.text is not None   # (text samples as `hla-tvm run` does unless told otherwise)
    if args.temperature is None:
        args.temperature = TEXT_TEMPERATURE if text else 0.0
    if args.top_k is None:
        args.top_k = TEXT_TOP_K if text and args.temperature > 0 else 0
    if args.text is not None:
        if not args.text:
            p.error("--text must not be empty")
    else:
        try:
            prompt = [int(x) for x in args.prompt.split(",")]
        except ValueError:
            p.error("--prompt-ids must be ids such as 5,9,2")
        if min(prompt) < 0:
            p.error(f"prompt ids must be >= 0, got {min(prompt)}")
    for bad, what in ((args.steps < 1, f"--tokens must be positive, got {args.steps}"),
                      (not args.temperature >= 0,
                       f"--temperature must be >= 0, got {args.temperature}"),
                      (args.top_k < 0, f"--top-k must be >= 0, got {args.top_k}")):
        if bad:
            p.error(what)
    try:
        vm, meta, tensors = load(args.module, args.runtime_lib)
    except (OSError, ValueError) as err:   # one line, as the C++ app says it
        print(f"generate.py: {err}", file=sys.stderr)
        return 1
    if args.text is not None:
        codec = text_codec(meta)
        if codec is None:
            p.error("--text needs a model with text (byte-level, or compiled with "
                    "--tokenizer); give --prompt ids")
        encode, decode = codec
        prompt = encode(args.text)
        if not prompt:
            p.error("--text gives no tokens")
    vocab = meta.get("vocab_size")
    if vocab and max(prompt) >= vocab:
        p.error(f"prompt ids must lie below the vocabulary size {vocab}")
    if args.text is not None:
        sys.stdout.write(args.text)
        generate(vm, meta, tensors, prompt, args.steps, args.temperature, args.top_k, args.seed,
                 on_token=lambda t: (sys.stdout.write(decode([t])), sys.stdout.flush()))
        sys.stdout.write(decode([], final=True) + "\n")
        return 0
    print(" ".join(map(str, generate(vm, meta, tensors, prompt, args.steps, args.temperature,
                                     args.top_k, args.seed))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
