"""torch.export to Relax: a model's prefill and decode (its state flattened in layer order)
exported with torch.export and imported with its HLA layers on the TensorIR kernels
(`torch_export`, `relax_hla`), the entries merged into one module."""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.export import Dim

from ..runtime.model import DECODE_ONE


def flat_state_spec(model):
    """[(name, shape without batch, dtype)] of the flattened state for batch 1."""
    spec = []
    for i, layer in enumerate(model.init_state(1)):
        for n, x in layer.items():
            spec.append((f"layer{i}.{n}", list(x.shape[1:]), str(x.dtype).replace("torch.", "")))
    return spec


class Prefill(nn.Module):
    """forward(tokens [B, T], *flat state) -> (logits [B, T, vocab], *new flat state) of
    `model` (an HLALM-like module; `layout`: each layer's state names): what the prefill entry
    is exported from (here and by the ONNX exporter)."""

    def __init__(self, model, layout):
        super().__init__()
        self.model, self.layout = model, layout

    def forward(self, tokens, *flat):
        logits, st = self.model(tokens, unflatten_state(flat, self.layout))
        return (logits, *flatten_state(st))


class Fresh(Prefill):
    """forward(tokens) from a fresh sequence (no state in; the new state out)."""

    def forward(self, tokens):
        logits, st = self.model(tokens, None)
        return (logits, *flatten_state(st))


class Decode(Prefill):
    """forward(tokens [B], *flat state) -> (logits [B, vocab], *new flat state): one token."""

    def forward(self, tokens, *flat):
        logits, st = self.model(tokens[:, None], unflatten_state(flat, self.layout))
        return (logits[:, 0], *flatten_state(st))


def flatten_state(state):
    """A model's state (one dict per layer) as one list, in layer and state-name order."""
    return [x for layer in state for x in layer.values()]


def unflatten_state(flat, layout):
    """The per-layer dicts of `flatten_state`'s list, for `layout` (each layer's names)."""
    out, i = [], 0
    for names in layout:
        out.append(dict(zip(names, flat[i:i + len(names)])))
        i += len(names)
    return out


def to_relax(model, *, max_batch=None, target=None):
    """The Relax IRModule with `prefill` and `decode` for `model` (an HLALM-like module with
    forward(tokens, state) -> (logits, state) and init_state(batch))."""
    # TVM (relax_hla, torch_export) and sympy are imported where used: the package imports this
    # module without TVM
    from .relax_hla import chunks_for
    from .torch_export import import_exported

    model = copy.deepcopy(model).eval().float()   # the caller's module stays as it was
    layout = [tuple(layer) for layer in model.init_state(1)]
    # upper bounds become Relax's static memory plan: only a batch bound when asked for; a
    # bound of 1 is a static batch (torch.export's dims span at least two values)
    if max_batch == 1:
        batch, rows = None, 1
    else:
        batch, rows = Dim("batch", min=1, max=max_batch) if max_batch else Dim("batch", min=1), 2
    seq = Dim("seq", min=2)
    st = flatten_state(model.init_state(rows))
    state_dims = tuple(_dims({0: batch}) for _ in st)
    mods = {}
    with torch.no_grad(), chunks_for(target):
        check_fixed_state(model, layout, st)
        ep, skips = export_prefill(
            Prefill(model, layout), (torch.zeros(rows, 8, dtype=torch.int64), *st),
            (_dims({0: batch, 1: seq}), state_dims))
        mods["prefill"] = import_exported(ep)
        if skips:
            mods["prefill"]["main"] = mods["prefill"]["main"].with_attr(PREFILL_SKIPS, skips)
        ep = torch.export.export(
            Decode(model, layout), (torch.zeros(rows, dtype=torch.int64), *st),
            dynamic_shapes=(_dims({0: batch}), state_dims))
        mods["decode"] = import_exported(ep)
    return merge_entries(mods)


def check_fixed_state(model, layout, flat):
    """ValueError in one line, naming the entry, where `model`'s state after two tokens
    differs in names, shape or dtype from its `init_state` (`flat`, for `layout`): compiled
    modules keep each stream's state in fixed-size buffers, so a KV cache that grows (torch.cat
    onto the state) cannot be compiled; a fixed-size cache with a position counter can
    (`hla_tvm.nn.SoftmaxAttention`)."""
    tokens = torch.zeros(flat[0].shape[0] if flat else 1, 2, dtype=torch.int64)
    _, out = model(tokens, unflatten_state(flat, layout))
    got = [tuple(layer) if isinstance(layer, dict) else type(layer).__name__
           for layer in (out if isinstance(out, (list, tuple)) else [out])]
    if got != layout:
        raise ValueError(f"the model's state must keep its layers and names from step to step: "
                         f"init_state gives {layout}, forward returns {got}")
    names = [f"layer{i}.{n}" for i, layer in enumerate(layout) for n in layer]
    for name, before, after in zip(names, flat, flatten_state(out)):
        if tuple(before.shape) != tuple(after.shape) or before.dtype != after.dtype:
            raise ValueError(
                f"state entry {name} must keep its shape and dtype from step to step (compiled "
                f"modules hold each stream's state in fixed-size buffers): init_state gives "
                f"{list(before.shape)} {before.dtype}, after 2 tokens it is {list(after.shape)} "
                f"{after.dtype}; a KV cache that grows must be a fixed-size buffer with a "
                f"position counter (hla_tvm.nn.SoftmaxAttention keeps one)")


PREFILL_SKIPS = "hla_tvm.prefill_skips"   # the prefill function's lengths it must not take


def export_prefill(fn, args, dynamic_shapes):
    """(torch.export's program of the prefill `fn`, [prompt lengths it must not take]).

    Where torch refuses the length's range because the model slices the time axis (it guards
    a sliced length against 1: `h[:, :-1]` gives "T - 1 != 1", refusing prompts of 2 tokens),
    the guards are exported as runtime assertions instead, and every one must exclude single
    lengths only (checked here by evaluating it): those lengths are returned, and the runtime
    runs a piece of such a length as decode steps (metadata "prefill_skips"). A condition
    that excludes more (a model whose code branches on the prompt's length) is refused in one
    line."""
    try:
        return torch.export.export(fn, args, dynamic_shapes=dynamic_shapes), []
    except torch._dynamo.exc.UserError as err:
        if "Constraints violated" not in str(err):
            raise
        first = str(err).strip().splitlines()
    try:
        ep = torch.export.export(fn, args, dynamic_shapes=dynamic_shapes,
                                 prefer_deferred_runtime_asserts_over_guards=True)
    except Exception as err:  # noqa: BLE001 - torch's constraint errors, several classes
        if "Constraints violated" not in str(err):
            raise
        guard = next((line.strip(" -") for line in str(err).splitlines()
                      if "guard" in line), first[0])
        raise ValueError(f"the model's prefill depends on the prompt's length in a way "
                         f"torch.export cannot keep symbolic ({guard[:300]})") from None
    return ep, excluded_lengths(ep, first)


def excluded_lengths(ep, reason=()):
    """The prompt lengths 2..256 the runtime assertions of the prefill program `ep` exclude;
    ValueError where one excludes a length beyond them, more than 8, or depends on the
    batch. (Decode steps compute what a causal model's prefill computes.)"""
    import sympy

    tokens = next(n for n in ep.graph.nodes if n.op == "placeholder" and
                  n.name in ep.graph_signature.user_inputs)
    batch, seq = (getattr(d, "node", None) for d in tokens.meta["val"].shape)
    seq_sym = seq.expr if seq is not None else None
    batch_sym = batch.expr if batch is not None and not isinstance(batch.expr, sympy.Integer) \
        else None
    skips = set()
    for node in ep.graph.nodes:
        if node.op != "call_function" or "_assert_scalar" not in str(node.target):
            continue
        cond = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
        expr = getattr(getattr(cond, "node", None), "expr", None)
        if expr is None or seq_sym is None:
            continue
        found = None
        for b in (1, 2, 3, 8):
            subs = {batch_sym: b} if batch_sym is not None else {}
            bad = {t for t in (*range(2, 257), 1000, 4096, 65536)
                   if not bool(expr.subs({**subs, seq_sym: t}))}
            if found is not None and bad != found:
                found = None
                break
            found = bad
        if found is None or len(found) > 8 or any(t > 256 for t in found):
            why = reason[-1].strip() if reason else str(expr)
            raise ValueError(f"the model's prefill depends on the prompt's length in a way "
                             f"torch.export cannot keep symbolic ({expr}; {why[:200]})")
        skips |= found
    return sorted(skips)


def entries(mod):
    """The sorted names of the entries (prefill, decode, DECODE_ONE) the Relax module has: the
    metadata's "entries", by which the runtime picks what to call."""
    return sorted(gv.name_hint for gv in mod.get_global_vars()
                  if gv.name_hint in ("decode", "prefill", DECODE_ONE))


def target_entries(mod, target):
    """`mod` with the entries it is compiled with for `target`: on CPUs DECODE_ONE added
    (`with_decode_one`; measured there), elsewhere as it is."""
    return with_decode_one(mod) if target.kind.name == "llvm" else mod


def with_decode_one(mod):
    """`mod` with the entry DECODE_ONE: its decode with the batch fixed to 1, so that the VM
    does no shape work for one stream's step (fusion gives it kernels of static shapes of its
    own; the weights are the same constants); `mod` itself where its decode's batch is static
    already or it has no decode."""
    import tvm
    from tvm.relax.utils import copy_with_new_vars

    if "decode" not in entries(mod):
        return mod
    # (new variables: a variable defined in two functions fails Relax's FuseOps)
    decode = copy_with_new_vars(mod["decode"])
    batch = decode.params[0].ty.shape[0]
    if not isinstance(batch, tvm.tirx.Var):
        return mod
    out = tvm.IRModule(dict(mod.functions))
    one = decode.bind_symbolic_vars({batch: 1})
    out[DECODE_ONE] = one.with_attr("global_symbol", DECODE_ONE)
    return out


def _dims(axes):
    """torch.export's dynamic_shapes entry for {axis: Dim or None (static)}."""
    dims = {axis: dim for axis, dim in axes.items() if dim is not None}
    return dims or None


def merge_entries(mods):
    """One IRModule from {entry name: IRModule with "main"}: each main becomes the entry; other
    functions are shared by name (kernel names encode everything baked into them)."""
    import tvm

    funcs = {}
    for entry, mod in mods.items():
        for gv, func in mod.functions.items():
            if gv.name_hint == "main":
                funcs[tvm.ir.GlobalVar(entry)] = func.with_attr("global_symbol", entry)
            elif gv.name_hint not in {g.name_hint for g in funcs}:
                funcs[gv] = func
    return tvm.IRModule(funcs)
