"""The records an operator is: `Operator` (its math, fast PyTorch forms, state and options) and
`Family` (one set of TensorIR kernels with its prefill chain)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

import torch


def state_dtype(dtype):
    """The torch dtype of the state (and accumulation) for inputs of torch dtype `dtype`:
    float64 for float64, float32 for float16, bfloat16 and float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Operator:
    """One HLA operator, everything that defines it found from here:

    name        hla2 (second order), ahla (asymmetric), hla3 (third order)
    order, asymmetric   how `hla(order=, asymmetric=)` names it
    ref         its float64 specification (`reference.py`: quadratic, serial, step, chunked,
                state_shapes, zero_state, STATE_NAMES)
    fast        its fast PyTorch forms (`fast.py`: chunked with every chunk at once, step_ in
                place)
    kv_state    state entries built from k, v alone: one per key/value head
    has_mask_ridge  accepts masked=False and ridge
    families    {"prefill": its undecayed prefill's family, "prefill_decay": its decayed
                one's, "prefill_gpu": its undecayed one's on GPUs, "decode": its decode's}
                (`Family` names; a missing one is "prefill"'s; `family` picks one)"""
    name: str
    order: int
    asymmetric: bool
    ref: ModuleType
    fast: ModuleType
    kv_state: tuple
    has_mask_ridge: bool
    families: dict = field(default_factory=dict)

    def __deepcopy__(self, memo):  # immutable; copies of a model share it
        return self

    def __hash__(self):
        return hash(self.name)

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

    def family(self, *, decayed, decode, gpu=False):
        """The name of the kernel family that runs a prefill (decode=False) or a decode step of
        this operator, with or without decay, on a GPU or not (`families`)."""
        if decode:
            return self.families["decode"]
        if decayed:
            return self.families.get("prefill_decay", self.families["prefill"])
        if gpu:
            return self.families.get("prefill_gpu", self.families["prefill"])
        return self.families["prefill"]


@dataclass(frozen=True)
class Family:
    """One set of TensorIR kernels: its name (the kernels' function names start with it), the
    operator it computes, its prefill chain's calls, and the module of its kernel builders
    (imported on first use: building kernels needs TVM's compiler, the chains do not)."""
    name: str
    operator: str
    prefill: tuple
    kernels: str            # module path of its kernel builders
    gpu_options: dict = field(default_factory=dict)   # decode options on GPUs
    # its prefill kernels take bf16_products (`ops.common.pairs`), run where a CPU has
    # AVX512-BF16 (`chains.target_options`)
    bf16_products: bool = False

    def __hash__(self):
        return hash(self.name)

    def kernel_module(self):
        return importlib.import_module(self.kernels)
