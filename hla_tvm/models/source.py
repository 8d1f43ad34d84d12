"""Where a command's model comes from: a checkpoint (`HLALM.save`) or `module:factory`, a Python
module and a callable in it that returns the model (the spelling of uvicorn's and gunicorn's
"module:app" and of entry points), for a user's own architecture.

The model protocol `hla_tvm.compile` and the ONNX exporter take: a torch.nn.Module with
    init_state(batch) -> the state of `batch` fresh sequences: a list with one dict of tensors
                         per HLA layer ({name: tensor [batch, ...]}, the layer's init_state)
    forward(tokens [B, T] int64, state or None) -> (logits [B, T, vocab], new state)
whose HLA layers are `hla_tvm.nn` layers (or call `torch.ops.hla_tvm.hla`)."""
from __future__ import annotations

import importlib
import os
import re
import sys

from torch import nn

from .hlalm import HLALM

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_factory(spec):
    """Whether `spec` names module:factory (and no file of that name exists)."""
    return not os.path.exists(str(spec)) and bool(_FACTORY.match(str(spec)))


def check_protocol(model, what="model"):
    """TypeError unless `model` is a torch module with forward(tokens, state) and
    init_state(batch)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} must give a torch.nn.Module, got {type(model).__name__}")
    for attr in ("init_state", "forward"):
        if not callable(getattr(model, attr, None)):
            raise TypeError(f"{what}: {type(model).__name__} has no {attr}; a model needs "
                            "forward(tokens, state) and init_state(batch)")
    return model


def from_factory(spec):
    """The model `module:factory` returns (the module imported as `python -m` would, the
    current folder first; the factory called with no arguments, or used as it is when it is a
    module instance), in eval mode. ValueError for a module or name that is not there."""
    module_name, attr = str(spec).split(":")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{spec}: cannot import {module_name} ({err})") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec}: {module_name} has no {attr}")
        obj = getattr(obj, part)

    model = obj if isinstance(obj, nn.Module) else obj() if callable(obj) else obj
    return check_protocol(model, spec).eval()


def load(spec):
    """The model of `spec`: module:factory, else a checkpoint (`HLALM.load`)."""
    if is_factory(spec):
        return from_factory(spec)

    return HLALM.load(spec)
