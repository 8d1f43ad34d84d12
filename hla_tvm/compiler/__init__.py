"""`hla_tvm.compile(model, ...)`: a PyTorch HLA model to a deployable TVM module.

The module has two entry points with explicit state (every layer's HLA summaries, flattened in
layer order and `state_names` order):
    prefill(tokens [B, T] int64, *state) -> (logits [B, T, vocab], *state)     T symbolic
    decode(tokens [B] int64, *state)     -> (logits [B, vocab], *state)
and metadata (`hla_tvm_meta`: a JSON string with the state layout, max_batch and the weights'
digest) for `hla_tvm.runtime`. The library file is sealed (`hla_tvm.runtime.libfile`)."""
from __future__ import annotations

import json
import shutil

import numpy as np

from .. import validate
from ..models.hlalm import weights_digest
from ..progress import Stages
from ..quant import from_meta, scheme
from ..runtime import META_FUNC, MODULE_FORMAT, device_code, libfile
from ..runtime.text import CHAT, TOKENIZER, read_chat, read_tokenizer
from ..target import cpu_features, cross_compiler, resolve
from .export import (  # noqa: F401 - the package's names
    PREFILL_SKIPS,
    Decode,
    Fresh,
    Prefill,
    check_fixed_state,
    entries,
    excluded_lengths,
    export_prefill,
    flat_state_spec,
    flatten_state,
    merge_entries,
    target_entries,
    to_relax,
    unflatten_state,
    with_decode_one,
)
from .pipeline import (  # noqa: F401
    cpu_pipeline,
    cuda_default_schedules,
    legalize,
    lowering_pipeline,
    prepare,
)


def _with_meta(mod, meta):
    """Add a Relax function returning the metadata JSON as uint8 bytes (readable by the runtime
    alone)."""
    # TVM (and the modules that import it: schedule.tuning, passes) is imported where a module is
    # compiled: this package imports with torch alone (the ONNX exporter, `hla-tvm bench/demo
    # --help` import it)
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

    out = {TOKENIZER: read_tokenizer(path, vocab_size)}
    chat = read_chat(path)
    if chat is not None:
        out[CHAT] = chat
    return out


def records_folder(schedules, target):
    """The records folder schedules= names for `target` (None: the default schedules), checked
    before any model work."""
    from ..schedule.tuning import records

    path = records.resolve(schedules, target)
    if path is not None:
        records.load(path)   # a corrupt database fails here, with its file and line
    return path


def resolve_model_target(target):
    """The tvm.target.Target for `target` (checked: ValueError/TypeError for a bad one, or
    for another CPU architecture whose cross linker is missing); NotImplementedError for kinds
    other than llvm (CPU) and cuda."""
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

    from .passes.safe_take import token_rows
    from ..schedule.tuning import records
    from ..schedule.tuning.model import schedule_model

    if meta.get("vocab_size") is None:   # a model without a config: the runtime checks every
        # token id against the rows of the table the ids index, else the logits' width
        meta = {**meta, "vocab_size": token_rows(mod) or _logits_width(mod)}

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
