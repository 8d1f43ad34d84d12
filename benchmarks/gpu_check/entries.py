"""What the check compiles, checks and times: the configurations (`CHECKS`), the timed
decodes and prefills with their schedule variants (`VARIANTS`), each module's entry id and the
compiled models (`MODELS`)."""
import os

from . import ROOT

OPTS = {"hla2": dict(masked=True, ridge=0.0), "hla2_decay": dict(masked=True, ridge=0.0),
        "ahla": {}, "hla3": {}}
OPERATOR = {"hla2": "hla2", "hla2_decay": "hla2", "ahla": "ahla", "hla3": "hla3"}
# (family, dtype, head size, group, normalize): one module of its prefill chain and one of its
# decode chain (second order decodes with hla2_decay's kernel)
CHECKS = [(fam, dtype, d, 1, False) for fam in ("hla2", "hla2_decay", "ahla", "hla3")
          for dtype in ("float32", "bfloat16") for d in (64, 128)] + [
    ("hla2", "float32", 64, 1, True), ("hla2_decay", "float32", 64, 2, False),
    ("ahla", "bfloat16", 64, 2, True), ("hla3", "float32", 64, 2, False),
    # head size 8 with chunks of 16: the tiny model whose compiled CUDA prefill was wrong past
    # one chunk on the H200 (docs/cuda.md)
    ("hla2", "float32", 8, 1, False), ("hla2_decay", "float32", 8, 1, False)]
DECODE_TIMED = ("hla2_decay", "ahla", "hla3")   # B64 H32 D128 float32
# prefill chains (B1 H32 T D128 bfloat16) built with other schedules too (`cuda.HLAKernels`'s
# variant arguments; "chunk": another chunk size) and timed beside the default in the same
# run: the schedule the H200 timed on 2026-12-04 (scans one block per (batch, head), one output
# per thread, 128 threads), the register tiles on 128 threads, and chunks of 32 (less shared
# memory per block: AHLA's and third order's kernels take up to 197 kB at 64, one block per
# multiprocessor)
PREFILL_VARIANTS = ("hla2_decay", "ahla", "hla3")
VARIANTS = {"h200-timed": dict(lanes=False, tiles=(), chunk_threads=128),
            "tiles-128-threads": dict(chunk_threads=128),
            "chunk-32": dict(chunk=32)}
# the compiled models `prepare` makes and `models` runs: name -> (checkpoint, quantize scheme);
# the tiny one's checkpoint is made then; a quantized module is checked against its model with
# the dequantized weights (`hla_tvm.quant.torch_weights`)
_SHIPPED = os.path.join(ROOT, "hla_tvm", "data", "stdlib-hla2.pt")
MODELS = {"tiny": (None, None), "demo": (_SHIPPED, None), "demo-int4": (_SHIPPED, "int4")}


def checkpoint_file(name):
    """The file name in the bundle's models/ of model `name`'s checkpoint: one copy for the
    models of one checkpoint."""
    checkpoint = MODELS[name][0]
    return f"{name}.pt" if checkpoint is None else os.path.basename(checkpoint)


def reference_model(model, quantize):
    """The PyTorch model a compiled module of `model` with weights under `quantize` (None:
    float32) computes: `model` itself, or a copy with the dequantized weights."""
    if quantize is None:
        return model
    from hla_tvm.quant import scheme
    from hla_tvm.quant.torch_weights import dequantized_model

    return dequantized_model(model, scheme(quantize))


def entry_id(fam, phase, dtype, d, group=1, normalize=False):
    return f"{fam}-{phase}-{dtype}-d{d}" + (f"-g{group}" if group > 1 else "") + \
        ("-norm" if normalize else "")


def entries(target, checks=CHECKS, timed=True):
    """[(entry id, chain, head size, group, chunk, kernel options)] of the modules `checks`
    run (a prefill and a decode each) and, with `timed`, the timed decodes; chunk: what the
    prefill runs with on `target` (`limits.gpu_chunk`), None for decode."""
    from hla_tvm.ops import chains
    from hla_tvm.schedule import gpu_limits as limits

    wanted = []
    for fam, dtype, d, group, normalize in checks:
        opts = dict(OPTS[fam], normalize=normalize, eps=1e-6, dtype=dtype)
        wanted.append((entry_id(fam, "prefill", dtype, d, group, normalize),
                       chains.prefill(fam), d, group, opts))
        dfam = "hla2_decay" if fam == "hla2" else fam
        dchain = chains.decode(dfam)
        wanted.append((entry_id(dfam, "decode", dtype, d, group, normalize), dchain, d, group,
                       dict(OPTS[dfam], normalize=normalize, eps=1e-6, dtype=dtype,
                            **chains.gpu_options(dchain))))
    for fam in DECODE_TIMED if timed else ():   # no decay (gamma = 1), plain options
        dchain = chains.decode(fam)
        plain = dict(OPTS[fam], normalize=False, eps=1e-6, dtype="float32")
        wanted.append((entry_id(fam, "decode", "float32", 128), dchain, 128, 1,
                       dict(plain, **chains.gpu_options(dchain))))
        if chains.gpu_options(dchain):   # timed beside the kernel the CPU runs
            wanted.append((entry_id(fam, "decode", "float32", 128) + "@cpu-kernel", dchain, 128,
                           1, plain))
    out, seen = [], set()
    for eid, chain, d, group, opts in wanted:
        if eid not in seen:
            seen.add(eid)
            chunk = None if chain.calls[0].kernel == "decode" else limits.gpu_chunk(
                chain, d, d, target, chunk=64 if d >= 32 else 16, group=group, **opts)
            out.append((eid, chain, d, group, chunk, opts))
    return out
