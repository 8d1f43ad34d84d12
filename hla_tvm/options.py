"""The options of one operator call, checked once and passed on whole: `Options`.

`hla()` and `decode_()` take the same keyword options; `Options.checked` checks them (as
`validate` checks every argument: TypeError/ValueError naming the option) and resolves the
operator, so that the PyTorch forms, the decode plan and the kernels receive one object instead
of each option in turn."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import validate
from .ops import Operator

# the keyword options of `hla` and `decode_` that `Options` holds, with their defaults
DEFAULTS = {"order": 2, "asymmetric": False, "masked": True, "normalize": False, "eps": 1e-6,
            "ridge": 0.0, "decay": None, "target": None, "schedules": "auto"}


@dataclass(frozen=True, eq=False)
class Options:
    """op: the operator (`hla_tvm.ops.Operator`); masked, normalize, eps, ridge: its options;
    decay: None, a float in (0, 1], or a tensor [H] (equal within each group of query heads
    sharing a key/value head); target, schedules: where and with which schedules the kernels
    run (as `hla` takes them)."""
    op: Operator
    masked: bool
    normalize: bool
    eps: float
    ridge: float
    decay: object
    target: object = None
    schedules: object = "auto"

    @classmethod
    def checked(cls, H, Hkv, *, order=2, asymmetric=False, masked=True, normalize=False,
                eps=1e-6, ridge=0.0, decay=None, target=None, schedules="auto"):
        """The options of a call on H query and Hkv key/value heads, checked."""
        op, eps, ridge, decay = validate.operator_options(order, asymmetric, masked, normalize,
                                                          eps, ridge, decay, H, Hkv)
        return cls(op, bool(masked), bool(normalize), eps, ridge, decay, target, schedules)

    @property
    def decayed(self):
        return self.decay is not None

    def kernel(self):
        """The options baked into the operator's kernels (`Operator.options`)."""
        return self.op.options(masked=self.masked, normalize=self.normalize, eps=self.eps,
                               ridge=self.ridge)


def key(call):
    """A hashable key of the keyword options `call` ({name: value} as `hla` takes them: a
    decay tensor by its values), or None when one is not hashable (then it is checked, and
    refused, by `Options.checked`)."""
    decay = call.get("decay")
    if isinstance(decay, torch.Tensor):
        decay = tuple(decay.tolist())
    elif decay is not None and not isinstance(decay, (int, float)):
        decay = repr(decay)
    target = call.get("target")
    if target is not None and not isinstance(target, str):
        target = str(target)
    try:
        out = tuple((n, decay if n == "decay" else target if n == "target" else call[n])
                    for n in DEFAULTS if n in call)
        hash(out)
    except TypeError:
        return None
    return out
