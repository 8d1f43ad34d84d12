"""`hla_tvm.compile(model, ...)`: a PyTorch HLA model to a deployable TVM module.

The module has two entry points with explicit state (every layer's HLA summaries, flattened in
layer order and `state_names` order):
    prefill(tokens [B, T] int64, *state) -> (logits [B, T, vocab], *state)     T symbolic
    decode(tokens [B] int64, *state)     -> (logits [B, vocab], *state)
and metadata (`hla_tvm_meta`: a JSON string with the state layout, max_batch and the weights'
digest) for `hla_tvm.runtime`. The library file is sealed (`hla_tvm.runtime.libfile`)."""
from __future__ import annotations

import copy
import json
import shutil

import torch
from torch import nn

from . import validate
from .progress import Stages
from .runtime import META_FUNC, MODULE_FORMAT
from .runtime.model import DECODE_ONE
from .target import cross_compiler


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
    from torch.export import Dim

    from .frontend.relax_hla import chunks_for
    from .frontend.torch_export import import_exported

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
    import torch

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


def prepare(mod, target, quantize=None):
    """The Relax module of `to_relax` (or the ONNX importer) in the form whose functions are
    scheduled: embedding lookups clamped (`safe_take`), one-sided integer clamps bounded
    (`int_clip`), RMSNorms as one operator each (`fused_rms_norm`), the other small whole
    powers as products (`int_power`, after the norms it would hide), projection scales next to
    their products (`scale_epilogue`), the products of one input with several weights one
    product (`parallel_products`), the weights stored as the kernels read them
    (`pack_weights`: packed under `quantize`, a `quant.Scheme`, and in panels on CPUs), slices
    that provably lie within their input marked so (`inbound_slices`), then `legalize`d, the
    functions only a prefill runs marked (`prefill_rows`). Returns the module, or (module, the
    packing's report) when `quantize` is given."""
    from .frontend.fused_rms_norm import fused_rms_norm
    from .frontend.inbound_slices import inbound_slices
    from .frontend.int_clip import int_clip
    from .frontend.int_power import int_power
    from .frontend.pack_weights import pack_weights
    from .frontend.parallel_products import parallel_products
    from .frontend.prefill_rows import mark_prefill_kernels
    from .frontend.safe_take import safe_take
    from .frontend.scale_epilogue import scale_epilogue

    mod = scale_epilogue(int_power(fused_rms_norm(int_clip(safe_take(mod)))))
    mod = parallel_products(mod)
    mod, report = pack_weights(mod, quantize, target)
    mod = mark_prefill_kernels(legalize(inbound_slices(mod), target))
    return mod if quantize is None else (mod, report)


def legalize(mod, target):
    """`mod` with its Relax operators lowered to TensorIR functions and fused (TVM's generic
    library-dispatch and legalization passes; on CPUs a float32 sigmoid through `fast_exp`,
    `frontend.fast_sigmoid`), the form whose functions are scheduled. (TVM's
    CUDA legalization is the same plus dlight's schedules, which `lowering_pipeline` applies
    after the HLA kernels are scheduled.)"""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from .frontend.fast_sigmoid import LEGALIZE

    # (on CPUs; TVM's own LegalizeOps after it finds nothing left)
    fast = [relax.transform.LegalizeOps(LEGALIZE)] if target.kind.name == "llvm" else []
    with target:
        return tvm.transform.Sequential(cpu.library_dispatch_passes(target) + fast
                                        + cpu.legalize_passes(target))(mod)


def lowering_pipeline(target):
    """The Relax pipeline after `legalize` and `schedule.tuning.model.schedule_model`: default
    schedules for the functions not scheduled yet, then TVM's lowering and finalization passes
    for the target's kind. CPU: `GroupMatvec` for a decode step's int8 / int4 products,
    `MatmulTiles` for x @ W[K, N] with its epilogue, `SerialSmall` for small static functions,
    dlight's CPU GEMV and reduction rules, then `ParallelFallback`; CUDA: dlight's GPU rules
    (Matmul, GEMV, Reduction, GeneralReduction, Fallback)."""
    import tvm
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as passes

        return tvm.transform.Sequential(
            [cuda_default_schedules()]
            + passes.dataflow_lower_passes(target) + passes.finalize_passes(target))
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from .schedule.rules.cpu import GroupMatvec, MatmulTiles, ParallelFallback, SerialSmall

    return tvm.transform.Sequential(
        [dl.ApplyDefaultSchedule(GroupMatvec(), MatmulTiles(), SerialSmall(), dl.cpu.GEMV(),
                                 dl.cpu.Reduction(),
                                 ParallelFallback())]
        + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))


def cuda_default_schedules():
    """The pass giving a CUDA module's functions not scheduled yet (its projections, quantized
    or not, norms, element-wise work) dlight's GPU rules: Matmul, GEMV, Reduction,
    GeneralReduction, Fallback (inside `with target`)."""
    from tvm.s_tir import dlight as dl

    return dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                   dl.gpu.GeneralReduction(), dl.gpu.Fallback())


def cpu_pipeline(target):
    """The whole CPU Relax pipeline with default schedules: `legalize`, the HLA kernels'
    default rules (`schedule.tuning.model.schedule_model`), then `lowering_pipeline`."""
    import tvm

    from .schedule.tuning.model import schedule_model

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod, _ctx):
        mod = schedule_model(legalize(mod, target), target)[0]
        with target:
            return lowering_pipeline(target)(mod)

    return _pipeline


def _with_meta(mod, meta):
    """Add a Relax function returning the metadata JSON as uint8 bytes (readable by the runtime
    alone)."""
    import numpy as np
    from tvm import relax

    bb = relax.BlockBuilder(mod)
    with bb.function(META_FUNC, []):
        blob = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        bb.emit_func_output(relax.const(blob))
    return bb.get()


def compile(model, *, target="llvm", out="model.so", schedules="auto", max_batch=None,  # noqa: A001
            quantize=None, group_size=None, tokenizer=None):
    """Export `model`, lower its HLA layers onto the TensorIR kernels, compile for `target`
    (None / "llvm": this CPU; a preset such as "aarch64", cross-linked with
    aarch64-linux-gnu-gcc; "cuda" or {"kind": "cuda", "arch": "sm_90"} for an NVIDIA GPU, the
    library then holding the kernels' CUDA source and, where nvcc is installed, their device
    code in a folder beside it (model.so -> model.device/, `device_code.ship`; elsewhere the
    GPU machine builds it when loading); a TVM target dict) and write the library to `out`.
    Returns `out`.

    schedules: "auto" uses the tuned records for the target (the user's, else the shipped
    `schedules/<target>/`) where they exist and the default schedules for kernels without
    one; "default" always the default schedules; a path that records folder. The module's
    metadata says which kernels were scheduled from records (`hla-tvm run --info`).
    max_batch: an upper bound of the batch size (TVM then plans memory statically); the
    runtime refuses larger batches.
    quantize: None (float32 weights), "bf16", "int8" or "int4" (or a `quant.Scheme`, as the
    command line passes it): the weights of the projections,
    the embedding and the output head stored packed and dequantized inside the kernels that
    read them (`hla_tvm.quant`); activations, norms and the HLA state stay float32.
    group_size: input elements per scale (int4: 32 by default, or 64, 128; int8: per output
    channel by default, or a group size).
    tokenizer: a tokenizer.json (Hugging Face `tokenizers`) whose vocabulary fits the model's,
    kept in the module: `hla-tvm run --prompt`, `hla-tvm serve` and the runtime's `text` then
    take and give text (byte-level models have it without one)."""
    from .quant import scheme

    sch = scheme(quantize, group_size)
    for attr in ("init_state", "forward"):
        if not callable(getattr(model, attr, None)):
            raise TypeError(f"model must be an HLALM-like torch module with forward(tokens, "
                            f"state) and init_state(batch); {type(model).__name__} has no {attr}")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int)
                                  or max_batch < 1):
        raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
    out = validate.output_path("out", out)
    tgt = resolve_model_target(target)
    records_path = records_folder(schedules, tgt)
    from .models.hlalm import weights_digest

    config = getattr(model, "config", None)
    text = tokenizer_text(tokenizer, int(config["vocab_size"]) if config else None)
    meta = {"format": MODULE_FORMAT, "state": flat_state_spec(model),
            "vocab_size": int(config["vocab_size"]) if config else None,
            "config": config, "max_batch": max_batch,
            "weights_sha256": weights_digest(config, model.state_dict()),
            "quantize": None if sch is None else sch.as_meta(), **text}
    stages = Stages("compile")
    stages("exporting the model (torch.export, to Relax)")
    mod = to_relax(model, max_batch=max_batch, target=tgt)
    out = build(mod, meta, tgt, out, records_path, stages, sch)
    stages.done()
    return out


def tokenizer_text(path, vocab_size):
    """{metadata key: the checked tokenizer.json text, and the chat template of a
    tokenizer_config.json beside it where there is one} for the module, or {} for None."""
    if path is None:
        return {}
    from .runtime.text import CHAT, TOKENIZER, read_chat, read_tokenizer

    out = {TOKENIZER: read_tokenizer(path, vocab_size)}
    chat = read_chat(path)
    if chat is not None:
        out[CHAT] = chat
    return out


def records_folder(schedules, target):
    """The records folder schedules= names for `target` (None: the default schedules), checked
    before any model work."""
    from .schedule.tuning import records

    path = records.resolve(schedules, target)
    if path is not None:
        records.load(path)   # a corrupt database fails here, with its file and line
    return path


def resolve_model_target(target):
    """The tvm.target.Target for `target` (checked: ValueError/TypeError for a bad one, or
    for another CPU architecture whose cross linker is missing); NotImplementedError for kinds
    other than llvm (CPU) and cuda."""
    from .target import resolve

    tgt = resolve(target)
    if tgt.kind.name not in ("llvm", "cuda"):
        raise NotImplementedError(f"compiling models for target kind {tgt.kind.name!r} is not "
                                  "supported; use an llvm (CPU) or cuda target")
    cross_compiler(tgt)
    return tgt


def build(mod, meta, target, out, records_path=None, stages=None, sch=None):
    """Compile the Relax module `mod` (prefill/decode entries, `target_entries` added) with
    `meta` embedded for `target` (`executable`; its "entries" set here) and write the sealed
    library to `out` (atomically); for a CUDA target, its device code beside it where nvcc is
    installed (`device_code.ship`). `stages`: a `progress.Stages` told each stage; `sch`: the
    weights' `quant.Scheme` (None: the one `meta` records, if any). Returns `out`."""
    from .runtime import device_code, libfile

    stages = stages or Stages("compile", show=False)
    mod = target_entries(mod, target)
    meta = {**meta, "entries": entries(mod)}
    if "prefill" in meta["entries"] and mod["prefill"].attrs and \
            PREFILL_SKIPS in mod["prefill"].attrs:
        meta["prefill_skips"] = [int(t) for t in mod["prefill"].attrs[PREFILL_SKIPS]]
    exe, meta = executable(mod, meta, target, records_path, stages, sch)
    stages("writing the library")
    if target.kind.name == "cuda":   # first: a failing nvcc leaves no library behind
        device_code.ship(exe, out, str(target.attrs["arch"]))
    else:   # an earlier GPU build's device code would make the apps take this for a GPU module
        shutil.rmtree(device_code.folder_beside(out), ignore_errors=True)
    return libfile.export(exe, out, cc=cross_compiler(target), note=json.dumps(meta).encode())


def _logits_width(mod):
    """The static last dimension of the logits (the first output) of `mod`'s decode entry, or
    None."""
    import tvm

    if "decode" not in [gv.name_hint for gv in mod.get_global_vars()]:
        return None
    out = mod["decode"].ret_ty
    fields = getattr(out, "fields", None)
    shape = getattr(fields[0] if fields else out, "shape", None)
    return int(shape[-1]) if shape and isinstance(shape[-1], tvm.tirx.IntImm) else None


def executable(mod, meta, target, records_path=None, stages=None, sch=None):
    """(executable, its metadata): `tvm.compile` of the Relax module `mod` with `meta`, its
    device and the schedules used added, embedded for `target`, its HLA kernels and projections
    scheduled from the records folder `records_path` where it holds their records (the default
    schedules elsewhere)."""
    import tvm

    from .frontend.safe_take import token_rows
    from .schedule.tuning import records
    from .schedule.tuning.model import schedule_model

    if meta.get("vocab_size") is None:   # a model without a config: the runtime checks every
        # token id against the rows of the table the ids index, else the logits' width
        meta = {**meta, "vocab_size": token_rows(mod) or _logits_width(mod)}
    from .quant import from_meta

    stages = stages or Stages("compile", show=False)
    stages("preparing the graph (weights packed, operators fused)")
    sch = sch or from_meta(meta)
    if sch is None:
        mod = prepare(mod, target)
    else:
        mod, report = prepare(mod, target, sch)
        meta = {**meta, "quantize": {**sch.as_meta(), **report}}
    stages("scheduling the kernels")
    mod, used = schedule_model(mod, target, records_path)
    from .target import cpu_features

    features = cpu_features(target)   # what the loader checks this CPU for
    meta = {**meta, **({"cpu_features": features} if features else {}),
            "device": "cuda" if target.kind.name == "cuda" else "cpu", "schedules": {
        "target": records.target_folder(target), "records": records.display(records_path),
        "records_sha256": None if records_path is None else records.digest(records_path),
        **used}}
    mod = _with_meta(mod, meta)
    stages("compiling the graph and kernels (tvm.compile)")
    with target:
        return tvm.compile(mod, target=target, relax_pipeline=lowering_pipeline(target)), meta
