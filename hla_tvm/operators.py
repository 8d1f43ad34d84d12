"""The HLA operator family: which reference module, state and options each operator has."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from .reference import ahla, hla2, hla3


def state_dtype(dtype):
    """The torch dtype of the state (and accumulation) for inputs of torch dtype `dtype`:
    float64 for float64, float32 for float16, bfloat16 and float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Operator:
    name: str
    ref: ModuleType
    kv_state: tuple           # state entries built from k, v alone: one per key/value head
    has_mask_ridge: bool      # accepts masked=False and ridge

    def __deepcopy__(self, memo):  # immutable; copies of a model share it
        return self

    @property
    def state_names(self):
        return self.ref.STATE_NAMES

    def options(self, *, masked, normalize, eps, ridge):
        """The operator's keyword options: normalize, eps, and masked, ridge where it has
        them (second order)."""
        opts = {"normalize": bool(normalize), "eps": float(eps)}
        if self.has_mask_ridge:
            opts.update(masked=bool(masked), ridge=float(ridge))
        return opts

    def state_shapes(self, B, H, Hkv, dk, dv):
        """{name: shape}; entries in kv_state have Hkv heads (paper Section 5.2)."""
        shapes = dict(self.ref.state_shapes(B, H, dk, dv))
        for name in self.kv_state:
            shapes[name] = (B, Hkv) + tuple(shapes[name][2:])
        return shapes


OPERATORS = {
    (2, False): Operator("hla2", hla2, ("S",), True),
    (2, True): Operator("ahla", ahla, ("P", "m"), False),
    (3, False): Operator("hla3", hla3, ("S", "P", "m"), False),
}


def get(order, asymmetric):
    try:
        return OPERATORS[(order, asymmetric)]
    except (KeyError, TypeError):
        if order not in (2, 3) or isinstance(order, bool):
            raise ValueError(f"order must be 2 or 3, got {order!r}") from None
        raise ValueError(f"order={order} with asymmetric={asymmetric} is not an HLA operator; "
                         "asymmetric=True is defined for order 2 only") from None
