"""`decode_(q, k, v, state, ...)`: one token of any HLA operator, state updated in place, through
a call path as thin as the compiled kernel; `init_state(...)`: the zero state it advances.

Everything that depends only on shapes, dtypes and options (argument checks, the kernel, the
decay vector) is worked out once and kept in a plan keyed by them, so a call costs a dictionary
lookup, a comparison of the state tensors' addresses with those of the last state that passed
the full check (shapes, dtypes, layout, alignment, no overlap: run again where they differ; the
compiled function checks shapes, dtypes and layout at every call), and the kernel."""
from __future__ import annotations

import operator
import threading

import numpy as np
import torch

from . import backend, ops, options, validate
from .backend import on_stream
from .ops import chains, state_dtype
from .ops.common.reference import gamma
from .options import Options
from .runtime.pool import Adaptive, default_threads, env_threads, use_threads
from .target import for_device
from .validate import ALIGN, aligned

_PLANS: dict = {}
_LOCK = threading.Lock()


def init_state(batch, heads, head_dim, value_dim=None, *, kv_heads=None, order=2,
               asymmetric=False, dtype=torch.float32, device="cpu"):
    """The zero state of `batch` fresh sequences, the dict `hla(..., return_state=True)` returns
    and `decode_` advances: entries built from k, v alone have `kv_heads` heads (default
    `heads`), the rest `heads`; float64 for float64 inputs (`dtype`), else float32."""
    batch = validate.integer("batch", batch, low=1)
    heads = validate.integer("heads", heads, low=1)
    head_dim = validate.integer("head_dim", head_dim, low=1)
    value_dim = head_dim if value_dim is None else validate.integer("value_dim", value_dim, low=1)
    kv_heads = heads if kv_heads is None else validate.integer("kv_heads", kv_heads, low=1)
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
    if dtype not in validate.FLOATS:
        raise TypeError(f"dtype must be the inputs' floating dtype, got {dtype}")
    try:
        device = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got "
                         f"{device!r} ({str(err).splitlines()[0]})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: PyTorch sees no CUDA GPU here")
    op = ops.get(order, asymmetric)
    shapes = op.state_shapes(batch, heads, kv_heads, head_dim, value_dim)
    return {n: torch.zeros(shapes[n], dtype=state_dtype(dtype), device=device)
            for n in op.state_names}


class _Plan:
    """What one (shapes, dtype, options) combination needs at call time."""

    def __init__(self, q, k, v, call):
        if not (q.dim() == k.dim() == v.dim()) and {q.dim(), k.dim(), v.dim()} <= {3, 4}:
            raise ValueError(f"decode_ takes q, k, v all [B, H, D] or all [B, H, 1, D], got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        q4, k4, v4 = (x if x.dim() == 4 else x.unsqueeze(2) for x in (q, k, v))
        B, H, Hkv, T, dk, dv = validate.qkv(q4, k4, v4)
        if T != 1:
            raise ValueError(f"decode_ takes one token: q [B, H, Dk] or [B, H, 1, Dk], got "
                             f"{tuple(q.shape)}")
        opts = Options.checked(H, Hkv, **call)
        op, decay = opts.op, opts.decay
        tgt = for_device(q.device, opts.target)   # (ValueError for other devices)
        self.device = q.device
        self.group = H // Hkv
        self.acc = state_dtype(q.dtype)
        self.names = tuple(op.state_names)
        self.get = operator.itemgetter(*self.names)
        shapes = op.state_shapes(B, H, Hkv, dk, dv)
        self.shapes = tuple(torch.Size(shapes[n]) for n in self.names)
        self.kv = tuple(n in op.kv_state for n in self.names)
        self.out_shape = torch.Size((B, H, 1, dv))
        self.like_q = dv == dk   # o is shaped as q [B, H, 1, Dk], in its dtype and device
        self.dtype, self.ndim = q.dtype, q.dim()
        self.context = f"{op.name} with B={B}, H={H}, Hkv={Hkv}, Dk={dk}, Dv={dv}"
        self.decayed = opts.decayed
        chain = chains.decode(chains.family(op.name, decayed=opts.decayed, decode=True))
        mod = backend.module(chain, dk, dv, tgt, group=H // Hkv, schedules=opts.schedules,
                             **chains.kernel_options(q.dtype, **opts.kernel()))
        self.fn, = backend.functions(chain, mod, dk, dv)   # (q, k, v, gamma, *state, o)
        self.gamma = gamma(decay, torch.empty(1, H, 0, dtype=self.acc,
                                              device=q.device))[0].contiguous()
        self.cuda = q.is_cuda
        self.apart = None   # the data pointers of the last state (and out) found apart
        self.state_ok = None   # those of the last state that passed check_state and apart
        self._local = threading.local()   # each thread's worker-count chooser

    def check_apart(self, st, out=None):
        """ValueError when two state tensors, or `out` and a state tensor, share memory (the
        kernel writes them all in place: shared ones would hold garbage). Checked once per
        set of data pointers."""
        try:
            ptrs = tuple(x.data_ptr() for x in st) + (() if out is None else (out.data_ptr(),))
        except AttributeError:   # not tensors: the call's own checks explain it
            return
        if ptrs == self.apart or 0 in ptrs:   # (0: no data, as meta tensors: explained later)
            return
            return
        names = [f"state[{n!r}]" for n in self.names] + ["out"]
        spans = sorted((p, p + x.numel() * x.element_size(), i)
                       for i, (p, x) in enumerate(zip(ptrs, [*st, out])) if x is not None)
        for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
            if end > start:
                raise ValueError(f"{names[j]} is the same memory as {names[i]} (or overlaps "
                                 "it): the kernel writes each in place; give each entry a "
                                 "tensor of its own (init_state makes them)")
        self.apart = ptrs

    def check_state(self, state):
        """The state's tensors in kernel order; ValueError/TypeError naming the entry."""
        if not isinstance(state, dict) or len(state) != len(self.names):
            if not isinstance(state, dict):
                raise TypeError(f"state must be a dict of tensors {list(self.names)}, got "
                                f"{type(state).__name__}")
            raise ValueError(f"state must have exactly the keys {list(self.names)}, got "
                             f"{sorted(state)}")
        out = []
        for name, shape in zip(self.names, self.shapes):
            x = state.get(name)
            if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != self.acc or \
                    not x.is_contiguous() or x.device != self.device or x.data_ptr() % ALIGN:
                self._explain(name, x, shape)
            out.append(x)
        return out

    def _explain(self, name, x, shape):
        if x is None:
            raise ValueError(f"state must have exactly the keys {list(self.names)}: "
                             f"{name!r} is missing")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"state[{name!r}] must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != shape:
            raise ValueError(f"state[{name!r}] must have shape {list(shape)} for {self.context},"
                             f" got {tuple(x.shape)}")
        if x.dtype != self.acc:
            raise TypeError(f"state[{name!r}] must be {self.acc} for {self.dtype} inputs (it is "
                            f"updated in place), got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"state[{name!r}] must be on {self.device} as q is, got {x.device}")
        if not x.is_contiguous():
            raise ValueError(f"state[{name!r}] must be contiguous (it is updated in place)")
        raise ValueError(f"state[{name!r}] must start at a {ALIGN}-byte aligned address (it is "
                         f"updated in place); this one is a view at an odd offset: pass a copy "
                         f"(.clone()) or a tensor from init_state")

    def check_out(self, out):
        if type(out) is not torch.Tensor or out.dtype != self.dtype or \
                out.numel() != self.out_shape.numel() or not out.is_contiguous() or \
                out.data_ptr() % ALIGN:
            raise ValueError(f"out must be a contiguous, {ALIGN}-byte aligned {self.dtype} "
                             f"tensor of "
                             f"{list(self.out_shape)} (or [B, H, Dv]), got "
                             f"{getattr(out, 'dtype', type(out).__name__)} "
                             f"{tuple(getattr(out, 'shape', ()))}")
        return out.view(self.out_shape)

    def run(self, q, k, v, st, out):
        """o [B, H, 1, Dv] after one token; the tensors of `st` advanced in place."""
        if self.cuda:   # on the device's current PyTorch stream
            with on_stream(self.device):
                return self._run(q, k, v, st, out)
        return self._run(q, k, v, st, out)

    def _run(self, q, k, v, st, out):
        if self.group > 1:
            return self._run_grouped(q, k, v, st, out)
        self._call(q, k, v, self.gamma, *st, out)
        return out

    def _call(self, *args):
        """The kernel on a CPU with the worker count this thread's `pool.Adaptive` picks (a
        step this small runs on the calling thread alone: beside PyTorch's spinning OpenMP
        workers a pooled step took 80x its quiet time, measured); with $TVM_NUM_THREADS or on
        a GPU as it is."""
        if self.cuda or env_threads():
            return self.fn(*args)
        chooser = getattr(self._local, "chooser", None)
        if chooser is None:
            chooser = self._local.chooser = Adaptive(default_threads(), use_threads)
        chooser.run(self.fn, *args)

    def _run_grouped(self, q, k, v, st, out):
        """The kernels run every query head (reading key/value head h // group of k, v): the
        key/value-only entries are repeated, and each group's first copy of the updated
        entries is written back in place."""
        g = self.group
        full = [_repeat_heads(x, g) if kv else x for x, kv in zip(st, self.kv)]
        self._call(q, k, v, self.gamma, *full, out)
        for x, y, kv in zip(st, full, self.kv):
            if kv and not x.is_cpu:
                x.copy_(y.view(x.shape[0], x.shape[1], g, *x.shape[2:])[:, :, 0])
            elif kv:   # (numpy: copies on this thread, see backend.private_copy)
                np.copyto(x.numpy(), y.numpy().reshape(x.shape[0], x.shape[1], g,
                                                       *x.shape[2:])[:, :, 0])
        return out


def _needs_gradient(q, k, v, decay, state):
    """Whether a tensor of the call may require grad (`validate.no_gradients` then looks: it
    also takes arguments that are no tensors)."""
    try:
        return q.requires_grad or k.requires_grad or v.requires_grad or \
            getattr(decay, "requires_grad", False) or \
            any(x.requires_grad for x in state.values())
    except (AttributeError, TypeError):
        return True


def _repeat_heads(x, group):
    """x [B, Hkv, ...] with each head repeated `group` times: a new aligned tensor [B, H, ...],
    filled on this thread."""
    if not x.is_cpu:
        return x.repeat_interleave(group, 1)
    full = torch.empty(x.shape[0], x.shape[1] * group, *x.shape[2:], dtype=x.dtype)
    np.copyto(full.numpy().reshape(x.shape[0], x.shape[1], group, *x.shape[2:]),
              x.numpy()[:, :, None])
    return full


def decode_plan(q, k, v, call, key=None):
    """The `_Plan` of one token on q, k, v with the keyword options `call` (`options.DEFAULTS`),
    made once per shapes, dtypes, device and options and kept. key: the plan's key where the
    caller made it (`_fast_key`)."""
    if key is None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        opts = options.key(call)
        key = None if opts is None else \
            (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, opts)
    plan = None if key is None else _PLANS.get(key)
    if plan is None:   # (an unhashable option: checked, and refused, by the plan)
        plan = _Plan(q, k, v, call)
        if key is not None:
            with _LOCK:
                _PLANS[key] = plan
    return plan


def _fast_key(q, k, v, opts):
    """A key of `decode_plan` for tensors q, k, v and the options `opts` (a tuple in
    `options.DEFAULTS`' order) where every option is a plain value (decay None or a number,
    target None or a string), else None (then `options.key` makes one)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or \
            type(v) is not torch.Tensor:
        return None
    decay, target = opts[6], opts[7]
    if not (decay is None or type(decay) in (float, int)) or \
            not (target is None or type(target) is str):
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, opts)


def decode_(q, k, v, state, *, order=2, asymmetric=False, masked=True, normalize=False,
            eps=1e-6, ridge=0.0, decay=None, out=None, target=None, schedules="auto"):
    """One token of HLA (the operators and options of `hla`), with `state` updated in place.

    q [B, H, Dk] or [B, H, 1, Dk]; k [B, Hkv, Dk], v [B, Hkv, Dv] likewise (grouped heads when
    Hkv divides H). state: the dict `hla(..., return_state=True)` or `init_state` gave, its
    tensors contiguous, on q's device (CPU or CUDA), in the state dtype (float32, float64 for
    float64 inputs); they are advanced in place (PyTorch's trailing-underscore convention). out:
    an optional preallocated output. target, schedules: as for `hla`. Returns o, [B, H, Dv] or
    [B, H, 1, Dv] as q, in q's dtype.

    Use `decode_` to stream tokens (it costs about the kernel); `hla` is functional (it copies
    the state, leaving the caller's untouched) and handles prompts of any length."""
    # (each check below costs well under a microsecond where it passes; the kernel of the
    # B1 H8 D64 step takes about 8)
    if torch.is_grad_enabled() and _needs_gradient(q, k, v, decay, state):
        validate.no_gradients("decode_", q=q, k=k, v=v, decay=decay, state=state)
    opts = (order, asymmetric, masked, normalize, eps, ridge, decay, target, schedules)
    key = _fast_key(q, k, v, opts)
    try:
        plan = None if key is None else _PLANS.get(key)
    except TypeError:   # an unhashable option: checked, and refused, by the plan
        key = plan = None
    if plan is None:
        plan = decode_plan(q, k, v, dict(zip(options.DEFAULTS, opts)), key)
    if plan.out_shape[0] == 0:   # an empty batch: nothing to advance
        plan.check_state(state)
        if out is not None:
            plan.check_out(out)
            return out
        return torch.empty(plan.out_shape if plan.ndim == 4 else plan.out_shape[:2] +
                           plan.out_shape[3:], dtype=plan.dtype, device=plan.device)
    try:
        st = plan.get(state)
        # the tensors at the data pointers the last full check passed (the same state, step
        # after step): the compiled function checks their shapes, dtypes and layout itself
        ok = len(state) == len(plan.names) and plan.group == 1 and \
            [x.data_ptr() for x in st] == plan.state_ok
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        st = plan.check_state(state)   # (grouped: the kernels see repeated copies)
        plan.check_apart(st)
        plan.state_ok = [x.data_ptr() for x in st]
    q, k, v = aligned(q.contiguous()), aligned(k.contiguous()), aligned(v.contiguous())
    if plan.ndim == 3:
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    if out is None:   # (empty_like costs a third of empty with a shape, dtype and device)
        o = torch.empty_like(q) if plan.like_q and type(q) is torch.Tensor else \
            torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
    else:
        o = (out if out.dim() == 4 else out.unsqueeze(2)) if isinstance(out, torch.Tensor) \
            else out
        if o.data_ptr() % ALIGN:
            plan.check_out(out)
        plan.check_apart(st, o)
    try:
        # the compiled function checks every argument's shape, dtype, layout and device before
        # it writes anything; its complaint is explained below
        plan.run(q, k, v, st, o)
    except (ValueError, TypeError, RuntimeError):
        plan.check_state(state)
        if out is not None:
            plan.check_out(out)
        raise
    if out is not None:
        return out
    return o if plan.ndim == 4 else o.squeeze(2)
