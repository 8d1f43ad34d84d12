"""A compiled model driven by the TVM runtime alone: `load` gives a `CompiledModel` with
`init_state`, `prefill`, `decode` and the state's copy, save and load; `read_meta` describes a
module from its library's note without loading it.

This module imports neither torch nor TVM's compiler library: unless TVM is already imported, it
sets TVM_USE_RUNTIME_LIB=1 and keeps tvm_ffi's optional `import torch` from loading torch
(`pool.import_tvm_runtime`). The state is a list of numpy arrays on a CPU (views of the
module's tensors: no copies), of the module's device tensors on a GPU, advanced in place by the
compiled kernels: the list passed to prefill/decode is consumed; use `copy_state` to branch a
sequence, `save_state`/`load_state` to keep one. A state of your own (numpy arrays or torch
tensors of the layout `state_spec` gives) is checked and copied in. One loaded model may serve
several threads at once (each runs its own sequences)."""
from __future__ import annotations

import json
import math
import operator
import os
import threading
import weakref
import zipfile

import numpy as np

from . import cpu_features, libfile
from .pool import (
    Adaptive,
    env_threads,
    import_tvm_runtime as _import_tvm_runtime,
    set_threads,
    use_threads,
)

MODULE_FORMAT = "hla_tvm.module/1"
META_FUNC = "hla_tvm_meta"
DECODE_ONE = "decode_1"   # an entry: one stream's decode step with static shapes (batch 1)
STATE_MODEL = "hla_tvm.model"   # a state file's entry: the digest of the model it belongs to
# a state file's optional entry: token ids chosen but not fed yet (a served stream's last token),
# which a continuation feeds first
STATE_PENDING = "hla_tvm.pending"
MAX_PENDING = 1 << 20   # the most token ids a state file's pending entry may hold
# The compiled kernels assume 64-byte aligned data (TVM's allocation alignment) and load it with
# aligned vector instructions: data that starts elsewhere is copied on the way in
ALIGN = 64


def read_meta(path):
    """The metadata of the compiled model at `path` (state layout, configuration, device,
    schedules) from the copy its library holds beside the code (`libfile.note`), read without
    loading it: a module for a GPU or another CPU architecture is described on any machine,
    and a library that is not an hla_tvm model is refused before its code can run (the
    dynamic loader runs a library's constructors). ValueError for a file that is not a whole
    sealed library with the note of an hla_tvm model."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no compiled module at {path}")
    raw = libfile.note(path)
    if raw is None:
        raise ValueError(f"{path}: not an hla_tvm compiled model (it carries no metadata note: "
                         "written by an older hla_tvm, or not by hla-tvm compile); compile it "
                         "again")
    return _checked_meta(path, raw)


def _checked_meta(path, raw):
    """The metadata dict in `raw` (JSON bytes) of the module at `path`; ValueError unless it is
    an hla_tvm module of MODULE_FORMAT."""
    try:
        meta = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not an hla_tvm compiled model (its metadata does not read: "
                         f"{err})") from None
    if not isinstance(meta, dict) or meta.get("format") != MODULE_FORMAT:
        raise ValueError(f"{path}: module format "
                         f"{meta.get('format') if isinstance(meta, dict) else None!r}, "
                         f"expected {MODULE_FORMAT!r}")
    quant = meta.get("quantize")
    if quant is not None and not (
            isinstance(quant, dict) and isinstance(quant.get("scheme"), str) and
            (quant.get("group_size") is None or type(quant.get("group_size")) is int)):
        raise ValueError(f"{path}: its metadata's quantize entry is not a scheme record "
                         f"(scheme, group_size): {quant!r}")
    return meta


def scheme_name(meta):
    """The weights' scheme a module's metadata records: "float32", or e.g. "int4 (group 32)"."""
    quant = meta.get("quantize")
    if not quant:
        return "float32"
    group = quant.get("group_size")
    return quant["scheme"] + (f" (group {group})" if group else
                              " (per channel)" if quant["scheme"] == "int8" else "")


def weights_summary(meta):
    """The weights a module's metadata records, one line for people: the scheme, and for a
    quantized module how many weights are packed (their bytes, and those of float32) and how
    many a scheme left float32."""
    quant = meta.get("quantize")
    if not quant:
        return scheme_name(meta)
    kept, other = quant.get("kept") or (), quant.get("unpacked") or ()
    mb = {key: quant.get(key, 0) / 1e6 for key in ("bytes", "float_bytes")}
    ops = sorted({w.get("op", "?") for w in other if isinstance(w, dict)})
    return (f"{scheme_name(meta)}, {quant.get('packed')} packed ({mb['bytes']:.2f} MB, "
            f"float32 {mb['float_bytes']:.2f} MB)"
            + (f", {len(kept)} kept float32 (K not a multiple of the group)" if kept else "")
            + (f", {len(other)} more float32 (read by {', '.join(ops)}, which no packed "
               "product replaces)" if other else ""))


def state_bytes(spec):
    """The bytes of one stream's state for a module's state layout (`meta["state"]`: [(name,
    shape without the batch, dtype)]), HLA summaries, key/value caches and counters alike."""
    return sum(int(np.prod(shape, dtype=np.float64)) * np.dtype(dtype).itemsize
               for _, shape, dtype in spec)


def load(path, device="cpu", threads=None):
    """The compiled model at `path` on `device`: "cpu" for a module compiled for a CPU target,
    "cuda" or "cuda:N" for one compiled for a CUDA target (the state then lives on that GPU);
    CPU kernels run by `threads` threads, or with None ($TVM_NUM_THREADS unset) by as many as
    each kind of call runs fastest with at the time, up to one per physical core, chosen by
    timing the calls (`pool.Adaptive`: on a machine shared with busy processes the calling
    thread alone is often fastest, on a quiet one a large prefill wants every core)."""
    return CompiledModel(path, device, threads)


def _parse_device(device):
    """("cpu", 0) or ("cuda", N) for a device name; ValueError otherwise."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind in ("cpu", "cuda") and (index == "" or index.isdigit()) and \
            not (kind == "cpu" and index not in ("", "0")):
        return kind, int(index or 0)
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _cuda_device(tvm, index):
    """TVM's CUDA device `index`, its runtime loaded (a runtime-only TVM does not load it) and
    a device-code hook registered for modules holding CUDA source (`device_code.serve`, unless
    TVM's own is there)."""
    # TVM, tvm_ffi and what CUDA modules (cache, device_code), text (text) and saving a state
    # (paths) need are imported where used: `import hla_tvm.runtime` stays light and loads no TVM
    # library
    from . import cache
    from .device_code import load_cuda_runtime, serve

    if tvm.get_global_func("device_api.cuda", allow_missing=True) is None:
        try:
            load_cuda_runtime(os.path.join(os.path.dirname(tvm.__file__), "lib"))
        except OSError as err:
            raise ValueError(f"device='cuda': TVM's CUDA runtime cannot be loaded ({err})") \
                from None
    dev = tvm.cuda(index)
    if not dev.exist:
        raise ValueError(f"device='cuda:{index}': no such GPU here")
    arch = "sm_" + dev.compute_version.replace(".", "")
    # (a runtime-only TVM registers its own hook, which needs the compiler: replaced)
    serve(cache.folder("device"), arch,
          override=bool(getattr(tvm, "_RUNTIME_ONLY", False)))
    return dev


def _check_device(path, meta, kind):
    """ValueError unless the module at `path` with metadata `meta` was compiled for the device
    kind `kind` ("cpu" or "cuda")."""
    built_for = meta.get("device", "cpu")
    if built_for != kind:
        what = "an NVIDIA GPU" if built_for == "cuda" else "the CPU"
        raise ValueError(f"{path} was compiled for {what}: load it with device={built_for!r}")


class CompiledModel:
    """A compiled HLA model: `init_state`, `prefill`, `decode`, and state copy/save/load.

    Threads: one CompiledModel may be shared by any number of threads. The library is loaded
    once; each thread drives its own Relax virtual machine over it (created on the thread's
    first call; a VM holds one register file and must not run two calls at once), so calls from
    different threads run concurrently and give the results a serial run gives. A state list
    belongs to one sequence: two threads must not advance the same state at once. Each thread
    that calls a kernel gets its own TVM worker pool of `threads` workers; with many serving
    threads, load with threads=1."""

    def __init__(self, path, device="cpu", threads=None):
        tvm = _import_tvm_runtime()

        kind, index = _parse_device(device)
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no compiled module at {path}")
        meta = read_meta(path)   # (from the library's note, before loading)
        _check_device(path, meta, kind)
        if kind == "cpu":
            cpu_features.check(path, meta)   # (its code on a CPU without them: SIGILL)
        # a fixed count (threads=, $TVM_NUM_THREADS), else chosen per kind of call (`_chooser`)
        self.adaptive = threads is None and not env_threads()
        self.threads = set_threads(threads)
        self._tvm = tvm
        self.device = tvm.cpu() if kind == "cpu" else _cuda_device(tvm, index)
        if kind == "cuda":   # its device code, where it was compiled with nvcc at hand
            from .device_code import add_shipped, folder_beside

            for where in {path, os.path.realpath(path)}:   # (beside a link, or its file)
                add_shipped(folder_beside(where))
        self.on_gpu = kind == "cuda"
        # checked before the loader maps it: a bad file must not crash the process
        try:
            self._lib = libfile.load(path)
        except ValueError as err:
            if "load_from_bytes.cuda" in str(err):
                raise ValueError(f"{path} was compiled for an NVIDIA GPU: load it with "
                                 "device='cuda' on a machine with one") from None
            raise
        self._local = threading.local()
        try:
            raw = bytes(self._vm()[META_FUNC]().numpy())
        except Exception as err:
            raise ValueError(f"{path}: not an hla_tvm compiled model ({err})") from None
        self.meta = _checked_meta(path, raw)
        if self.meta != meta:   # (the note was checked before loading: it must be the same)
            raise ValueError(f"{path}: its metadata note does not match the metadata compiled "
                             "into the library (the note was edited); compile it again")
        _check_device(path, self.meta, kind)
        self.state_spec = [(n, tuple(s), d) for n, s, d in self.meta["state"]]
        self.vocab_size = self.meta.get("vocab_size")
        # what token ids mean: "bytes" (UTF-8 text, id = byte) or None (the model's own ids)
        self.vocab = (self.meta.get("config") or {}).get("vocab")
        self.max_batch = self.meta.get("max_batch")
        self._text = False   # the text codec (`text`), made on first use
        self.entries = tuple(self.meta.get("entries", ("prefill", "decode")))
        self.path = path
        # what a state file names as the model it belongs to: the weights (any target, any
        # compile of them) and their quantization, else the ONNX file, else this library
        self.model_digest = self.meta.get("weights_sha256") or self.meta.get("onnx_sha256") \
            or libfile.check(path).hex()
        if self.meta.get("quantize"):
            self.model_digest += "+" + scheme_name(self.meta).replace(" ", "")

    @property
    def text(self):
        """The module's text codec (`runtime.text`: UTF-8 bytes for byte-level models, the
        tokenizer it was compiled with), or None where it takes token ids only."""
        if self._text is False:
            from .text import codec

            self._text = codec(self.meta)
        return self._text

    def _vm(self):
        """This thread's virtual machine over the shared library."""
        vm = getattr(self._local, "vm", None)
        if vm is None:
            from tvm.runtime import vm as tvm_vm

            if threading.current_thread() is not threading.main_thread():
                set_threads(self.threads)
            vm = self._local.vm = tvm_vm.VirtualMachine(self._lib, self.device)
            self._local.issued = ((), None, ())
            self._local.choosers = {}
            self._local.in_place = {}   # entry -> every state entry advanced in place
            self._local.functions = {}   # entry -> the VM's function (looked up once)
        return vm

    def _chooser(self, entry, shape):
        """This thread's `pool.Adaptive` for calls of `entry` with tokens of `shape` (prefill
        lengths bucketed by powers of two), or None for a fixed thread count or a GPU."""
        if not self.adaptive or self.on_gpu:
            return None
        key = (entry, shape[0], 1 << (int(shape[1]) - 1).bit_length() if len(shape) > 1 else 0)
        chooser = self._local.choosers.get(key)
        if chooser is None:
            chooser = self._local.choosers[key] = Adaptive(self.threads, use_threads)
        return chooser

    # --- state -------------------------------------------------------------------------------
    def _check_batch(self, batch, what):
        if self.max_batch is not None and batch > self.max_batch:
            raise ValueError(f"{what}: batch {batch} exceeds this module's max_batch "
                             f"{self.max_batch} (compiled with --max-batch {self.max_batch}; "
                             "compile again with a larger bound or none)")

    def init_state(self, batch):
        """The zero state of `batch` fresh sequences."""
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        batch = int(batch)
        self._check_batch(batch, "init_state")
        return self._hold([self._tvm.runtime.tensor(np.zeros((batch, *shape), dtype=dtype),
                                                    self.device)
                           for _, shape, dtype in self.state_spec])

    def copy_state(self, state):
        """An independent copy of `state` (to branch a sequence)."""
        state = self._check_state(state, _batch_of(state), "copy_state")[0]
        return self._hold([self._tvm.runtime.tensor(x.numpy(), self.device) for x in state])

    def _hold(self, tensors):
        """The state as the caller holds it: the module's device tensors on a GPU, numpy views
        of them on a CPU (`_view`: no copy; the kernels advance them in place)."""
        return list(tensors) if self.on_gpu else [_view(t) for t in tensors]

    def save_state(self, state, path, pending=()):
        """Write the state to the file `path` as it is named (an .npz archive: one array per
        entry, named as in state_spec, and the digest of the model it belongs to under
        STATE_MODEL; `pending` token ids, chosen but not fed to the state yet, under
        STATE_PENDING: `pending_tokens` reads them), through a temporary file beside it
        (`paths.replacing`)."""
        from .paths import output_path, replacing

        state = self._check_state(state, _batch_of(state), "save_state")[0]
        path = output_path("path", path)
        arrays = {n: x.numpy() for (n, _, _), x in zip(self.state_spec, state)}
        arrays[STATE_MODEL] = np.frombuffer(self.model_digest.encode(), dtype=np.uint8)
        if len(pending):
            arrays[STATE_PENDING] = self._tokens(pending, 1, "pending")
        with replacing(path) as f:   # (a file object: numpy adds no .npz to the name)
            np.savez(f, **arrays)

    def pending_tokens(self, path):
        """The pending token ids a state file records (save_state's `pending`; [] for none),
        checked against the vocabulary: ValueError naming the file otherwise. Its entry's
        header is checked before its data is read (`_npz_entries`)."""
        def check(dtype, shape):
            if dtype != np.int64 or len(shape) != 1 or shape[0] > MAX_PENDING:
                return (f"its {STATE_PENDING} entry must be at most {MAX_PENDING} token ids "
                        f"(int64), got {dtype} {list(shape)}")
            return None

        ids = _npz_entries(path, {STATE_PENDING: check}).get(STATE_PENDING,
                                                             np.zeros(0, np.int64))
        if len(ids) and self.vocab_size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"{path}: its {STATE_PENDING} entry must be token ids in [0, "
                             f"{self.vocab_size}), got {ids.dtype} {list(ids.shape)}")
        return [int(x) for x in ids]

    def load_state(self, path, other_model=False, *, batch=None):
        """A state written by save_state, checked against this model (the model digest it
        records, names, shapes, dtypes, finite values); ValueError naming the file and the
        entry otherwise. other_model=True accepts a state saved by another model (or one that
        records no model) whose state layout equals this one's; `batch`: the batch the state
        must have (None: any the module takes). Each entry's header (dtype, shape) is checked
        before its data is read (`_npz_entries`): a file cannot make this allocate more than
        the state it declares, within those bounds."""
        path = os.fspath(path)
        seen = {"batch": batch}

        def check(name, shape, dtype):
            def entry(got_dtype, got):
                b = got[0] if len(got) == len(shape) + 1 and got[0] >= 1 else None
                if b is None or tuple(got[1:]) != shape or (
                        seen["batch"] is not None and b != seen["batch"]):
                    return (f"state entry {name} must have shape {_want(shape, seen['batch'])}, "
                            f"got {list(got)}")
                if str(got_dtype) != dtype:
                    return f"state entry {name} must be {dtype}, got {got_dtype}"
                if seen["batch"] is None:
                    self._check_batch(b, path)
                    seen["batch"] = b
                return None
            return entry

        def digest(dtype, shape):   # (the model's digest, hex: read where it is one)
            return None if dtype == np.uint8 and len(shape) == 1 and shape[0] <= 256 else \
                "not a digest"

        wanted = {name: check(name, shape, dtype) for name, shape, dtype in self.state_spec}
        if not other_model:
            wanted[STATE_MODEL] = digest
        got = _npz_entries(path, wanted, skip=(STATE_MODEL,))
        missing = [n for n, _, _ in self.state_spec if n not in got]
        if missing:
            raise ValueError(f"{path}: not a state of this model (missing entries "
                             f"{missing[:3]}{' ...' if len(missing) > 3 else ''})")
        if not other_model:
            owner = got.get(STATE_MODEL)
            owner = None if owner is None else bytes(owner).decode("ascii", "replace")
            if owner != self.model_digest:
                raise ValueError(
                    f"{path}: a state of another model (it records "
                    f"{'no model digest' if owner is None else 'model ' + owner[:16]}, this "
                    f"module is model {self.model_digest[:16]}); load_state(path, "
                    "other_model=True) takes it where the state layouts are equal")
        arrays = [got[n] for n, _, _ in self.state_spec]
        # (names, shapes, dtype and finite values: the check every state passed in gets)
        return self._hold(self._check_state(arrays, seen["batch"], path)[0])

    def _check_state(self, state, batch, what="state"):
        """(the module's tensors for `state`, the entries of `state` that are views of them
        (None for the others)), checked: ValueError naming `what` and the entry. An entry this
        package made (`_view`, or a device tensor) is used as it is; the caller's own numpy
        arrays or torch tensors are checked for finite values and copied in."""
        tensors = self._issued(state, batch)
        if tensors is not None:   # the state this thread's last call returned: checked already
            return list(tensors), list(state)
        if not isinstance(state, (list, tuple)) or len(state) != len(self.state_spec):
            got = f"{type(state).__name__} of {len(state)}" \
                if isinstance(state, (list, tuple)) else type(state).__name__
            raise ValueError(f"{'' if what == 'state' else what + ': '}state must be a list of "
                             f"{len(self.state_spec)} tensors, got {got}; a sequence starts "
                             "from init_state(batch)")
        self._check_batch(batch, what)
        out, views = [], []
        for (name, shape, dtype), x in zip(self.state_spec, state):
            got = tuple(getattr(x, "shape", ()))
            if got != (batch, *shape):
                raise ValueError(f"{what}: state entry {name} must have shape "
                                 f"{_want(shape, batch)}, got {list(got)}")
            if str(getattr(x, "dtype", None)).replace("torch.", "") != dtype:
                raise ValueError(f"{what}: state entry {name} must be {dtype}, got "
                                 f"{getattr(x, 'dtype', type(x).__name__)}")
            if any(x is y for y in state[:len(out)]):
                raise ValueError(f"{what}: state entry {name} is the same array as another "
                                 "entry; each entry needs its own (from init_state, "
                                 "copy_state or load_state)")
            view = x if not self.on_gpu and _OURS.get(id(x)) is x else None
            if view is not None:   # a view this package made of an aligned host tensor
                x = _tvm_ffi().from_dlpack(view)
            elif not isinstance(x, self._tvm.runtime.Tensor):   # numpy or torch: copied in
                x = _host_array(x)
                if not np.isfinite(x).all():
                    raise ValueError(f"{what}: state entry {name} holds non-finite values "
                                     "(NaN or inf); refusing it")
                x = self._tvm.runtime.tensor(np.ascontiguousarray(x), self.device)
            out.append(x)
            views.append(view)
        return out, views

    def _issued(self, state, batch):
        """The module's tensors of `state` where it is exactly the state (the same arrays) of
        `batch` sequences this thread's last call returned, else None."""
        issued, issued_batch, tensors = getattr(self._local, "issued", ((), None, ()))
        if batch == issued_batch and isinstance(state, (list, tuple)) and \
                len(state) == len(issued) and all(map(operator.is_, state, issued)):
            return tensors
        return None

    # --- running -----------------------------------------------------------------------------
    def _tokens(self, tokens, ndim, what):
        arr = np.asarray(tokens)
        if arr.ndim != ndim or arr.dtype.kind not in "iu":   # (numpy's bool is kind "b")
            raise ValueError(f"{what} must be an integer array of shape "
                             f"{'[B, T]' if ndim == 2 else '[B]'}, got {arr.dtype} "
                             f"{list(arr.shape)}")
        if arr.size == 0:
            raise ValueError(f"{what} must not be empty")
        if self.vocab_size:
            # (a decode step's few ids: Python's min and max, 10x faster than numpy's)
            if arr.size <= 64:
                ids = arr.ravel().tolist()
                lo, hi = min(ids), max(ids)
            else:
                lo, hi = arr.min(), arr.max()
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"{what} must lie in [0, {self.vocab_size}), got "
                                 f"{lo if lo < 0 else hi}")
        self._check_batch(arr.shape[0], what)
        # numpy arrays go to the module through DLPack, no copy
        return np.ascontiguousarray(arr, dtype=np.int64)

    def prefill(self, tokens, state, logits="all"):
        """(logits numpy, state) after the prompt `tokens` [B, T]: logits [B, T, vocab] for
        logits="all", those of the last position [B, vocab] for "last" (what generation
        needs: only those rows are copied from the module's output, from a GPU too, and on a
        CPU a long prompt then holds no [B, T, vocab] array). On a CPU a long
        prompt runs in pieces of whole chunks (`prefill_pieces`), each continuing the state
        the piece before left: the same logits, with the module's per-chunk buffers bounded by
        the piece, not the prompt. Continue from the returned state: the given arrays may
        have been advanced in place or not (arrays of your own are copied; some entries of
        grouped models come back as new arrays)."""
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        last = logits == "last"
        arr = np.asarray(tokens)
        if arr.ndim == 2 and (arr.shape[1] == 1 or "prefill" not in self.entries):
            # the prefill entry takes T >= 2; modules compiled from a decode graph have none
            self._tokens(tokens, 2, "tokens")
            return self._decode_steps(arr, state, last)
        t = self._tokens(tokens, 2, "tokens")
        bounds = [0, t.shape[1]] if self.on_gpu else \
            prefill_pieces(t.shape[1], (self.meta.get("config") or {}).get("chunk_size"))
        # lengths the prefill entry must not take (`compiler.export_prefill`): decode steps
        skips = self.meta.get("prefill_skips") or ()
        out = None
        for start, end in zip(bounds, bounds[1:]):
            piece = np.ascontiguousarray(t[:, start:end])
            part, state = self._decode_steps(piece, state, last) if end - start in skips else \
                self._run("prefill", piece, state, last)
            if last or len(bounds) == 2:
                out = part
            else:
                if out is None:
                    out = np.empty((t.shape[0], t.shape[1], *part.shape[2:]), part.dtype)
                out[:, start:end] = part
        return out, state

    def _decode_steps(self, tokens, state, last):
        """(logits, state) of the prompt `tokens` [B, T] run as T decode steps: [B, T, vocab],
        or [B, vocab] of the last where `last`."""
        steps = []
        for t in range(tokens.shape[1]):
            out, state = self.decode(tokens[:, t], state)
            steps.append(out)
        return (steps[-1] if last else np.stack(steps, axis=1)), state

    def decode(self, tokens, state):
        """(logits [B, vocab] numpy, state) after one token per sequence, `tokens` [B]."""
        t = self._tokens(tokens, 1, "tokens")
        # one stream: the module's static-shape step where it has one (no shape work per call)
        one = t.shape[0] == 1 and DECODE_ONE in self.entries
        return self._run(DECODE_ONE if one else "decode", t, state)

    def _run(self, entry, tokens, state, last=False):
        """(logits numpy, new state) of `entry`; logits [B, T, ...] of a prefill are those of
        the last position alone, [B, ...], when `last` (copied alone from the device)."""
        vm = self._vm()
        batch = tokens.shape[0]
        issued = self._issued(state, batch)
        again = issued is not None   # (then every view is ours)
        state, views = (list(issued), list(state)) if again else \
            self._check_state(state, batch)
        if self.on_gpu:   # the module's inputs live on its device
            tokens = self._tvm.runtime.tensor(tokens, self.device)
        else:   # (numpy allocates 16-byte aligned: 8 int64 token ids crashed a decode step)
            tokens = aligned_array(tokens, self._local)
        chooser = self._chooser(entry, tokens.shape)
        # whether each state entry comes back as the tensor passed in (advanced in place): the
        # compiled function decides that, the same at every call, so it is learnt at this
        # thread's first call of `entry`; where all are, only the logits are taken from the
        # result (a slice of the whole result array costs 7 us, a decode step of the demo
        # model about 100)
        every = self._local.in_place.get(entry)

        fn = self._local.functions.get(entry)
        if fn is None:
            fn = self._local.functions[entry] = vm[entry]

        def call():
            res = fn(tokens, *state)
            return (res[0], None) if every else (res[0], res[1:])

        if chooser is None:
            if not self.on_gpu:   # (its fixed count, where another call on this thread changed it)
                use_threads(self.threads)
            logits, tensors = call()
        else:
            logits, tensors = chooser.run(call)
        if tensors is None:   # every entry advanced in place
            if again:   # the caller's arrays again: this thread's record of them holds
                return self._logits(logits, last), views
            tensors = state
            new_state = list(state) if self.on_gpu else \
                [v if v is not None else _view(s) for v, s in zip(views, state)]
        else:
            if every is None:
                self._local.in_place[entry] = all(t.same_as(s) for t, s in zip(tensors, state))
            if self.on_gpu:
                new_state = list(tensors)
            else:   # (an entry advanced in place is the caller's view still)
                new_state = [v if v is not None and t.same_as(s) else _view(t)
                             for v, t, s in zip(views, tensors, state)]
        # tuples: the caller's list may change
        self._local.issued = (tuple(new_state), batch, tuple(tensors))
        return self._logits(logits, last), new_state

    def _logits(self, logits, last):
        """numpy logits of the module's result `logits`: those of the last position alone
        (copied alone from the device) when `last`."""
        if last:
            return last_position(logits)
        return logits.numpy() if self.on_gpu else np.from_dlpack(logits).copy()


# numpy views of the module's host tensors that this package handed out (`_view`), by id: used
# in place when passed back (the caller's own arrays are copied)
_OURS = weakref.WeakValueDictionary()


def _view(tensor):
    """A numpy array viewing the host tensor `tensor` (no copy; it keeps the tensor alive),
    remembered as one of ours."""
    view = np.from_dlpack(tensor)
    _OURS[id(view)] = view
    return view


def leading_rows(state, n):
    """Views of the first `n` rows of each entry of `state` (a CPU state this package handed
    out), which prefill/decode take as the package's own: no copy, advanced in place."""
    views = []
    for x in state:
        if _OURS.get(id(x)) is not x:
            raise ValueError("leading_rows takes a state from init_state, copy_state or "
                             "load_state of a module on a CPU")
        view = x[:n]
        _OURS[id(view)] = view
        views.append(view)
    return views


def aligned_array(a, scratch=None):
    """The contiguous numpy array `a` when its data is ALIGN-byte aligned, else an aligned copy
    (what a module's kernels may be given without a copy through DLPack). `scratch`: an object
    (a thread's `threading.local`) holding the aligned copy of the last shape for reuse, for
    arrays used only until the next call on that thread: an array of that shape is copied there
    at once (a few token ids copy in a tenth of the time that reading an address takes)."""
    out = getattr(scratch, "aligned", None)
    if out is not None and out.shape == a.shape and out.dtype == a.dtype:
        out[...] = a
        return out
    if a.flags.c_contiguous and a.__array_interface__["data"][0] % ALIGN == 0:
        return a
    raw = np.empty(a.nbytes + ALIGN, dtype=np.uint8)
    start = -raw.__array_interface__["data"][0] % ALIGN
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    if scratch is not None:
        scratch.aligned = out
    out[...] = a
    return out


def _tvm_ffi():
    import tvm_ffi

    return tvm_ffi


def _host_array(x):
    """numpy view (or copy) of a numpy array or a torch tensor (on any device, with or without
    gradients)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):   # torch, without importing it
        x = x.detach().cpu()
    return np.asarray(x)


def last_position(logits):
    """numpy [B, ...] of a TVM tensor [B, T, ...] (compact, on any device) at t = T - 1: the B
    rows are copied alone, through views, not the whole tensor."""
    shape = tuple(int(n) for n in logits.shape)
    row = shape[2:]
    size = int(np.prod(row, dtype=np.int64)) * np.dtype(str(logits.dtype)).itemsize
    return np.stack([logits._create_view(row, logits.dtype, relative_byte_offset=(
        (b * shape[1] + shape[1] - 1) * size)).numpy() for b in range(shape[0])])


# Tokens per piece of a CPU prefill (`prefill_pieces`). The shipped demo model (2 heads of 64,
# 4 layers; 2-core VM, timed in rounds) prefilled 65,536 tokens in 2.52 s holding 718 MB at
# once; in pieces of 2,048, 4,096 and 8,192 tokens in 2.04, 1.98 and 1.99 s (4,096: 117 MB).
PREFILL_PIECE = 4096


def prefill_pieces(T, chunk=None):
    """Boundaries [0, ..., T] of the pieces a CPU prefill of T tokens runs in: whole chunks
    (of `chunk` tokens, 64 when unknown) of PREFILL_PIECE tokens rounded down to whole chunks
    (one chunk at least), the last one of 2 tokens or more (the prefill entry's least)."""
    chunk = chunk if isinstance(chunk, int) and chunk > 0 else 64
    piece = chunk * max(1, PREFILL_PIECE // chunk)
    bounds = list(range(0, T, piece)) + [T]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < 2:   # a last piece of one token
        bounds[-2] -= chunk
        if bounds[-2] <= bounds[-3]:
            del bounds[-2]
    return bounds


def _batch_of(state):
    """The leading dimension of a state's first entry (0 when there is none)."""
    if isinstance(state, (list, tuple)) and state and len(getattr(state[0], "shape", ())) >= 1:
        return int(state[0].shape[0])
    return 0


def _want(shape, batch=None):
    return "[" + ", ".join([str(batch) if batch is not None else "B", *map(str, shape)]) + "]"


def _npz_entries(path, wanted, skip=()):
    """{name: array} of the entries named in `wanted` that the .npz archive `path` holds, each
    read only after its .npy header passed wanted[name](dtype, shape) (None, or the reason to
    refuse it) and the zip member's size equals what the header declares: a file cannot make
    this allocate more than the arrays it declares and the checks allow, however far its
    compressed data would expand. An entry in `skip` that fails its check is left out instead.
    ValueError naming the file (and the entry) otherwise; FileNotFoundError where there is
    none."""
    path = os.fspath(path)
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            members = {i.filename: i for i in z.infolist()}
            for name, check in wanted.items():
                info = members.get(name + ".npy") or members.get(name)
                if info is None:
                    continue
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f"unsupported .npy format {version}")
                    shape, fortran, dtype = (np.lib.format.read_array_header_1_0 if version ==
                                             (1, 0) else np.lib.format.read_array_header_2_0)(f)
                    reason = "it holds Python objects" if dtype.hasobject else check(dtype,
                                                                                     shape)
                    if reason and name in skip:
                        continue
                    if reason:
                        raise ValueError(f"{path}: {reason}")
                    count = math.prod(shape)
                    size = count * dtype.itemsize
                    if info.file_size != f.tell() + size:
                        raise ValueError(f"{path}: entry {name} holds {info.file_size} bytes, "
                                         f"not the {f.tell() + size} its header {list(shape)} "
                                         f"{dtype} declares")
                    array = np.empty(count, dtype)
                    data, done = memoryview(array.view(np.uint8)), 0
                    while done < size:   # (in pieces: read() of it all would copy it whole)
                        n = f.readinto(data[done:done + (1 << 22)])
                        if not n:
                            break
                        done += n
                    if done != size or f.read(1):
                        raise ValueError(f"{path}: entry {name} is cut short")
                    out[name] = array.reshape(shape, order="F" if fortran else "C")
    except FileNotFoundError:
        raise
    except ValueError as err:
        if str(err).startswith(f"{path}: "):
            raise
        raise ValueError(f"{path}: not a readable state file ({err})") from None
    except zipfile.BadZipFile as err:
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{path}: not a state file written by save_state (not an .npz "
                             "archive of arrays)") from None
        raise ValueError(f"{path}: not a readable state file ({err})") from None
    except (OSError, EOFError, KeyError, NotImplementedError, RuntimeError) as err:
        raise ValueError(f"{path}: not a readable state file ({err})") from None
    return out
