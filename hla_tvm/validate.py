"""Argument checks shared by every entry point: clear ValueError/TypeError before any kernel
runs."""
from __future__ import annotations

import contextlib
import contextvars
import numbers

import torch

from . import ops

# The compiled kernels assume ALIGN-byte aligned data (TVM's allocation alignment) and load it
# with aligned vector instructions: a tensor that starts elsewhere (a view at an odd offset) is
# copied on the way in (`aligned`), and a state or output updated in place is refused.
from .runtime.model import ALIGN
from .runtime.paths import not_an_input, output_path  # noqa: F401  (every entry point's checks)


def aligned(x):
    """x when its data is ALIGN-byte aligned, else an aligned contiguous copy."""
    return x if x.data_ptr() % ALIGN == 0 else x.clone(memory_format=torch.contiguous_format)


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def qkv(q, k, v):
    """Check q [B, H, T, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv]; returns
    (B, H, Hkv, T, Dk, Dv)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOATS:
            raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32, "
                            f"float64), got {x.dtype}")
        if x.dim() != 4:
            want = "[B, H, T, Dv]" if name == "v" else "[B, H, T, Dk]"
            raise ValueError(f"{name} must have shape {want} (4 dims), got {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    has_values("q", q)
    B, H, T, dk = q.shape
    if T == 0 or dk == 0 or v.shape[-1] == 0:
        raise ValueError(f"q and v need T >= 1 and head sizes >= 1, got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    Hkv = k.shape[1]
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != dk:
        raise ValueError(f"k must have shape [B, Hkv, T, Dk] = [{B}, Hkv, {T}, {dk}] to match q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"k has {Hkv} heads, which must divide q's {H} heads")
    if tuple(v.shape[:3]) != (B, Hkv, T):
        raise ValueError(f"v must have shape [B, Hkv, T, Dv] = [{B}, {Hkv}, {T}, Dv] to match k "
                         f"{tuple(k.shape)}, got {tuple(v.shape)}")
    return B, H, Hkv, T, dk, v.shape[-1]


_RECOMPUTING = contextvars.ContextVar("hla_tvm_recomputing", default=False)


@contextlib.contextmanager
def recomputing():
    """Within: the custom op's backward recomputes a forward whose arguments were checked
    (`values_checked`)."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def values_checked():
    """Whether checks of argument values (not shapes) are to be skipped: only while torch.compile
    traces the custom op's backward (`recomputing`), which cannot branch on values and whose
    forward checked them. A compiled caller of `hla` itself keeps every check."""
    return _RECOMPUTING.get() and torch.compiler.is_compiling()


def has_values(name, x):
    """ValueError naming `name` when tensor x is on the meta device (shapes, no values): the
    operator computes values. (torch.export and the nn layers trace meta and fake tensors
    through the custom op's shape function instead.)"""
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values; the operator "
                         "needs tensors with data (CPU or CUDA)")


def real(name, value, *, low=None, low_open=False, high=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if value != value:
        raise ValueError(f"{name} must not be NaN")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def no_gradients(backend, **tensors):
    """ValueError when gradients are being recorded for any of `tensors` (name -> tensor, or a
    dict of them, or None): the compiled kernels compute none, and a dropped gradient would
    train silently wrong."""
    if not torch.is_grad_enabled():
        return
    for name, x in tensors.items():
        items = x.items() if isinstance(x, dict) else [(None, x)]
        for key, t in items:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                what = name if key is None else f"{name}[{key!r}]"
                raise ValueError(f"{what} requires grad, but {backend} computes no gradients: "
                                 "use hla(..., backend='torch') (differentiable) for training, "
                                 "or call it under torch.no_grad()")


def integer(name, value, *, choices=None, low=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


# The largest chunk the compiled kernels take: a chunk's products are unrolled into one kernel;
# at 128 the first compile took 21 s here, at 256 over two minutes, at 5001 it ran out of 24 GB.
MAX_CHUNK = 128


def chunk_size(value, *, compiled=True, name="chunk_size",
               instead="backend='torch' takes any"):
    """`value` checked as a prefill chunk size: an int >= 1, at most MAX_CHUNK where compiled
    kernels run it (the chunked form gives the same outputs for any chunk size); `instead`:
    what the error suggests."""
    value = integer(name, value, low=1)
    if compiled and value > MAX_CHUNK:
        raise ValueError(f"{name} must be at most {MAX_CHUNK} for the compiled kernels, got "
                         f"{value}: a chunk's products are unrolled into one kernel, which then "
                         "compiles for minutes and gigabytes; outputs do not depend on the chunk "
                         f"size ({instead})")
    return value


def decay(value, heads):
    """None, a float in (0, 1], or one value per head in (0, 1]: a tensor of shape [H] (a list,
    tuple or numpy array of H numbers becomes a float64 tensor; a 0-d tensor is a float, or
    expanded to [H] when it requires grad)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        has_values("decay", value)
    if isinstance(value, torch.Tensor) and value.dim() == 0:   # (one value for every head)
        value = value.expand(heads) if value.requires_grad else value.item()
    elif isinstance(value, (list, tuple)) or type(value).__module__ == "numpy":
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        if not isinstance(items, list):   # (a 0-d numpy array)
            return real("decay", items, low=0.0, low_open=True, high=1.0)
        if len(items) != heads:
            raise ValueError(f"decay as one value per head must have H = {heads} values, "
                             f"got {len(items)}")
        value = torch.tensor([real(f"decay[{i}]", x, low=0.0, low_open=True, high=1.0)
                              for i, x in enumerate(items)], dtype=torch.float64)
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.shape[0] != heads:
            raise ValueError(f"decay as a tensor must have shape [H] = [{heads}], "
                             f"got {tuple(value.shape)}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"decay must be a floating tensor, got {value.dtype}")
        if not values_checked() and not bool(((value > 0) & (value <= 1)).all()):
            raise ValueError("decay values must lie in (0, 1]")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"decay must be a real number or one value per head (a tensor or list of "
                        f"{heads}), got {type(value).__name__}")
    return real("decay", value, low=0.0, low_open=True, high=1.0)


def state(st, shapes, context):
    """A state dict with exactly the keys and shapes of `shapes` ({name: shape})."""
    names = list(shapes)
    if not isinstance(st, dict):
        raise TypeError(f"state must be a dict of tensors {names}, got {type(st).__name__}")
    if set(st) != set(names):
        raise ValueError(f"state must have exactly the keys {names}, got {sorted(st)}")
    for name, want in shapes.items():
        x = st[name]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"state[{name!r}] must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"state[{name!r}] must be floating, got {x.dtype}")
        has_values(f"state[{name!r}]", x)
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"state[{name!r}] must have shape {list(want)} for {context}, "
                             f"got {tuple(x.shape)}")
    return st


def attention_mask(mask, B, T):
    """None, or a [B, T] tensor of 0/1 (bool or numbers): 1 = token, 0 = padding."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"attention_mask must have shape [B, T] = [{B}, {T}], "
                         f"got {tuple(mask.shape)}")
    has_values("attention_mask", mask)
    if mask.dtype.is_complex or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return mask.bool()


def operator_options(order, asymmetric, masked, normalize, eps, ridge, decay_arg, H, Hkv):
    """The checked options of one operator call: (op, eps, ridge, decay); the decay as `decay`
    returns it, and with grouped heads equal within each group (their key moment is shared)."""
    order = integer("order", order, choices={2, 3})
    for name, flag in (("asymmetric", asymmetric), ("masked", masked),
                       ("normalize", normalize)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    op = ops.get(order, asymmetric)
    eps = real("eps", eps, low=0.0)
    ridge = real("ridge", ridge, low=0.0)
    if not op.has_mask_ridge and (ridge or not masked):
        raise ValueError(f"masked=False and ridge are defined for second-order symmetric HLA "
                         f"only, not for {op.name}")
    gamma = decay(decay_arg, H)
    group = H // Hkv
    if group > 1 and isinstance(gamma, torch.Tensor) and not values_checked() and \
            not bool((gamma.view(Hkv, group) == gamma.view(Hkv, group)[:, :1]).all()):
        raise ValueError("with grouped key/value heads the decay must be equal within each "
                         "group of query heads that share a key/value head (their key moment "
                         "is stored once)")
    return op, eps, ridge, gamma
