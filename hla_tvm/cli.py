"""The `hla-tvm` command line.

Expected errors (a missing or bad file, a bad target or argument) end the command with one line
on stderr, `hla-tvm COMMAND: error: ...`, and exit code 2; `--debug` shows the traceback."""
from __future__ import annotations

import argparse
import os
import sys

# what a user can cause: bad files, targets, arguments, unsupported options
EXPECTED_ERRORS = (ValueError, TypeError, OSError, NotImplementedError)


def _positive(text):
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _demo(args):
    from .demo import run

    from .target import parse

    return run(prompt=args.prompt, tokens=args.tokens, temperature=args.temperature,
               top_k=args.top_k, seed=args.seed, target=parse(args.target))


def _train(args):
    from .train import run

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    shape = {key: getattr(args, name) for key, name in (
        ("d_model", "d_model"), ("n_layers", "layers"), ("n_heads", "heads"),
        ("decay", "decay")) if hasattr(args, name)}
    run(args.output, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, attention=args.attention, seconds=args.seconds,
        progress=not args.quiet, **shape)
    return 0


def _bench(args):
    from .bench import run

    run(mode=args.mode, batch=args.batch, heads=args.heads, seq=args.seq, dk=args.dk,
        dv=args.dv, op=args.op, decay=args.decay, chunk_size=args.chunk_size,
        repeat=args.repeat, json_path=args.json, kv_heads=args.kv_heads)
    return 0


def _tune(args):
    import torch

    from . import backend, operators
    from .schedule import records, tune
    from .target import parse, resolve

    from .target import cross_compiler

    target = resolve(parse(args.target))
    if target.kind.name != "llvm":
        raise NotImplementedError(f"tuning for {target.kind.name} targets is not written yet "
                                  "(llvm only)")
    if (args.rpc_tracker is None) != (args.rpc_key is None):
        raise ValueError("--rpc-tracker and --rpc-key go together")
    rpc = (args.rpc_tracker, args.rpc_key) if args.rpc_tracker else None
    if rpc is None and cross_compiler(target) is not None:
        raise ValueError(f"this machine cannot run code for {target.attrs.get('mtriple')}: "
                         "measure on the device with --rpc-tracker HOST:PORT --rpc-key KEY")
    runner = tune.rpc_runner(*rpc) if rpc else None   # (an unreachable tracker fails here)
    if args.model:
        kernels, what = _model_kernels(args.model, target), args.model
    else:
        op = operators.get(3 if args.op == "hla3" else 2, args.op == "ahla")
        if args.heads % args.kv_heads:
            raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
        kernels, what = backend.operator_kernels(
            op, decayed=args.decay, dk=args.dk, dv=args.dv or args.dk, chunk=args.chunk_size,
            group=args.heads // args.kv_heads, dtype=getattr(torch, args.dtype),
            **op.options(masked=True, normalize=args.normalize, eps=1e-6, ridge=0.0)), args.op
    out = args.output or os.path.join(records.user_root(), records.target_folder(target))
    print(f"tuning {len(kernels)} kernels of {what} for {records.target_folder(target)} "
          f"({args.trials} trials); records go to {out}")
    report = tune.tune(kernels, target, args.trials, out, runner=runner)
    records.forget()
    print(f"{'kernel':<28}{'default':>12}{'tuned':>12}  kept")
    for name, r in report.items():
        tuned = "-" if r["tuned_s"] is None else f"{r['tuned_s'] * 1e3:.3f} ms"
        print(f"{name:<28}{r['default_s'] * 1e3:>9.3f} ms{tuned:>12}  {r['kept']}")
    found = records.resolve("auto", target)
    use = "schedules='auto' (the default)" if found and os.path.samefile(found, out) else \
        f"schedules={out!r}"
    print(f"hla(), decode_(), hla_tvm.compile() and hla-tvm compile use these records with "
          f"{use}")
    return 0


def _model_kernels(path, target):
    """The tunable functions of the model at `path` (a checkpoint or an ONNX file) as `compile`
    builds them for `target`: its HLA kernels and projections, {name: (PrimFunc, argument
    shapes at the tuning shape)}."""
    from .compiler import prepare
    from .schedule.model import tunable

    if str(path).endswith(".onnx"):
        from .onnx.importer import lm_module

        mod = lm_module(path)[0]
    else:
        from .compiler import to_relax
        from .models import HLALM

        mod = to_relax(HLALM.load(path))
    found = tunable(prepare(mod, target), target)
    if not found:
        raise ValueError(f"{path}: the model holds no HLA kernels or projections to tune")
    return found


def _positive_float(text):
    """argparse type: a finite number > 0."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def _decay(text):
    """argparse type: a decay factor in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {value}")
    return value


def _decays(text):
    """argparse type: "none", or decay factors in (0, 1] separated by commas (a float or a
    list of them)."""
    if text.strip().lower() == "none":
        return None
    values = [_decay(part) for part in text.split(",")]
    return values[0] if len(values) == 1 else values


def _describe(tgt):
    """A target in a few words: the CPU name or triple, or cuda and the GPU architecture."""
    if tgt.kind.name == "cuda":
        return f"cuda {tgt.attrs.get('arch')}"
    return str(tgt.attrs.get("mcpu") or tgt.attrs.get("mtriple") or tgt.kind.name)


def _compile(args):
    from .compiler import resolve_model_target
    from .target import parse

    target = parse(args.target)
    if args.arch is not None:
        kind = target.get("kind") if isinstance(target, dict) else target
        if kind != "cuda":
            raise ValueError(f"--arch {args.arch} applies to CUDA targets: give --target cuda")
        target = {**(target if isinstance(target, dict) else {"kind": "cuda"}), "arch": args.arch}
    tgt = resolve_model_target(target)   # a bad target fails before any model work
    from . import validate

    validate.output_path("-o", args.output)   # and a bad output path
    validate.not_an_input("-o", args.output, args.checkpoint)
    if args.checkpoint.endswith(".onnx"):
        from .onnx import compile as compile_onnx

        if args.max_batch is not None:
            raise ValueError("--max-batch applies to checkpoints, not ONNX models")
        print(f"compiling {args.checkpoint} (ONNX, hla_tvm::HLA nodes onto the TVM kernels) for "
              f"{_describe(tgt)} ...", flush=True)
        out = compile_onnx(args.checkpoint, target=tgt, out=args.output,
                           schedules=args.schedules)
    else:
        from .compiler import compile as compile_model
        from .models import HLALM

        model = HLALM.load(args.checkpoint)
        print(f"compiling {args.checkpoint} ({sum(p.numel() for p in model.parameters())} "
              f"parameters) for {_describe(tgt)} ...", flush=True)
        out = compile_model(model, target=tgt, out=args.output, max_batch=args.max_batch,
                            schedules=args.schedules)
    print(f"wrote {out} (hla-tvm run {out} --info describes it)")
    if tgt.kind.name == "cuda":
        from .device_code import folder_beside

        shipped = folder_beside(out)
        print(f"wrote its device code to {shipped}/ (keep it beside the module)"
              if os.path.isdir(shipped) else "no nvcc here: the GPU machine builds the device "
              "code when it loads the module (it needs nvcc there)")
    return 0


def _export_onnx(args):
    from . import validate
    from .models import HLALM
    from .onnx import export

    validate.output_path("-o", args.output)
    validate.not_an_input("-o", args.output, args.checkpoint)
    model = HLALM.load(args.checkpoint)
    entry = "decode step" if args.decode else "prefill from a given state" if args.from_state \
        else "prefill"
    print(f"exporting {args.checkpoint} ({entry}) to ONNX ...", flush=True)
    proto = export(model, args.output, decode=args.decode, from_state=args.from_state)
    n = sum(1 for node in proto.graph.node if node.domain == "hla_tvm")
    bodies = len(proto.functions)
    print(f"wrote {args.output}: {len(proto.graph.node)} nodes, {n} hla_tvm::HLA, "
          f"{bodies} function bod{'y' if bodies == 1 else 'ies'} (opset "
          f"{proto.opset_import[0].version})")
    return 0


def _prompt_ids(text):
    try:
        prompt = [int(x) for x in text.split(",")]
    except ValueError:
        shown = text if len(text) <= 60 else text[:60] + "..."
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {shown!r}") from None
    return prompt


def _prompt_file(path):
    """The text of --prompt-file `path` ("-": standard input), UTF-8."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeError as err:
        raise ValueError(f"--prompt-file {path} is not valid UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise ValueError(f"--prompt-file {path}: {err.strerror}") from None


# a longer text prompt is echoed by its end only
ECHO_CHARS = 2000


def _run(args):
    from .generate import encode_text, generate, text_decoder
    from .runtime import load, read_meta

    if args.info:   # read from the library without loading it where it holds the metadata
        meta = read_meta(args.module)
        print(_module_info(args.module, meta))
        return 0
    given = [o for o, x in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                            ("--prompt-ids", args.prompt_ids)) if x is not None]
    if len(given) > 1:
        raise ValueError(f"give one of --prompt TEXT, --prompt-file FILE or --prompt-ids 1,2,3, "
                         f"not {' and '.join(given)}")
    if not given:
        raise ValueError("give --prompt TEXT or --prompt-file FILE (byte-level models) or "
                         "--prompt-ids 1,2,3 (or --info to describe the module)")
    from .generate import check_sampling

    try:   # (before the prompt is echoed)
        check_sampling(args.temperature or 0.0, args.top_k or 0, args.seed)
    except ValueError as err:
        raise ValueError(f"--{str(err).replace('_', '-')}") from None
    if args.prompt_file is not None:
        args.prompt = _prompt_file(args.prompt_file)
        if not args.prompt:
            raise ValueError(f"--prompt-file {args.prompt_file} is empty")
    try:
        prompt = encode_text(args.prompt) if args.prompt is not None else \
            _prompt_ids(args.prompt_ids)
    except UnicodeError as err:
        raise ValueError(f"--prompt is not valid text ({err.reason})") from None
    m = load(args.module, args.device, threads=args.threads)
    if args.prompt is not None and m.vocab != "bytes":
        raise ValueError(f"{args.module}: {given[0]} needs a byte-level model (this one's "
                         f"vocabulary is {m.vocab or 'its own token ids'}); give --prompt-ids")
    if args.prompt is not None:
        decode = text_decoder()
        skipped = len(args.prompt) - ECHO_CHARS
        sys.stdout.write(args.prompt if skipped <= 0 else
                         f"[... {skipped} characters of the prompt ...]" + args.prompt[skipped:])
        on_token = lambda tok: (sys.stdout.write(decode([tok])), sys.stdout.flush())  # noqa: E731
    else:
        on_token = None
    from .generate import sampling

    temperature, top_k = sampling(args.prompt is not None, args.temperature, args.top_k)
    tokens, info = generate(m, prompt, args.tokens, temperature=temperature,
                            top_k=top_k, seed=args.seed, on_token=on_token)
    print(decode([], final=True)) if args.prompt is not None else \
        print(" ".join(map(str, tokens)))
    rate = f"{info['decode_steps'] / info['decode_s']:.1f} tokens/s" \
        if info["decode_steps"] and info["decode_s"] > 0 else "no decode steps (--tokens 1)"
    print(f"prefill {len(prompt)} token{'' if len(prompt) == 1 else 's'}: "
          f"{info['prefill_s'] * 1e3:.2f} ms; decode: {rate}",
          file=sys.stderr)
    return 0


def _bundle(args):
    from .bundle import bundle

    info = bundle(args.module, args.output, runtime_from=args.runtime_from, force=args.force)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.output)
                for f in fs)
    gpu = info["device"] == "cuda"
    where = f", NVIDIA GPU {info['gpu']}" if gpu else ""
    print(f"wrote {args.output} ({info['arch']}{where}, "
          f"{total / 1e6:.1f} MB): model.so{', its device code' if gpu else ''}, the TVM runtime "
          f"libraries{' (CUDA too)' if gpu else ''}, generate.py, the C++ app's source; "
          f"{args.output}/README.md says how to run it")
    return 0


def _module_info(path, meta):
    """The metadata of a compiled module, a few lines for people."""
    lines = [f"{path}: hla_tvm module, format {meta.get('format')}"]
    cfg = meta.get("config") or {}
    if cfg:
        lines.append("model: " + ", ".join(f"{k} {v}" for k, v in cfg.items()))
    from .bundle import elf_machine

    host = elf_machine(path)
    lines.append("runs on: " + (f"an NVIDIA GPU, from an {host} host (load with device='cuda', "
                                "hla-tvm run --device cuda)" if meta.get("device") == "cuda"
                                else f"an {host} CPU"))
    lines.append(f"entries: {', '.join(meta.get('entries', ('prefill', 'decode')))}; "
                 f"max batch: {meta.get('max_batch') or 'any'}")
    lines.append(f"state: {len(meta.get('state', []))} entries, " + ", ".join(
        f"{n} {'x'.join(map(str, s))}" for n, s, _ in meta.get("state", [])[:4])
        + (" ..." if len(meta.get("state", [])) > 4 else ""))
    for key in ("weights_sha256", "onnx_sha256"):
        if meta.get(key):
            lines.append(f"{key}: {meta[key]}")
    sched = meta.get("schedules")
    if sched is None:
        lines.append("schedules: default (compiled before tuned records were recorded)")
    else:
        where = sched.get("records") or "none (default schedules)"
        lines.append(f"schedules for {sched.get('target')}: records {where}"
                     + (f" (sha256 {sched['records_sha256']})" if sched.get("records_sha256")
                        else ""))
        for kind, label in (("from_records", "from records"), ("default", "default")):
            names = sched.get(kind, [])
            lines.append(f"  {label}: {len(names)} kernel(s)" +
                         (": " + ", ".join(names) if names else ""))
    return "\n".join(lines)


# how `hla-tvm cache` names each kind of entry (`cache.entries`)
_CACHE_KINDS = {"kernels": "compiled kernel modules", "models": "the demo's compiled models",
                "device": "CUDA device code", "emulator": "emulated CUDA kernels",
                "runtime": "TVM runtimes of other architectures",
                "records": "tuned records (hla-tvm tune)"}


def _cache(args):
    from . import cache

    path = cache.root()
    if args.records and not args.clear:
        raise ValueError("--records goes with --clear (the listing shows the records)")
    if args.clear:
        removed = cache.clear(records=args.records)
        kinds = {}
        for p, kind in removed:
            kinds[kind] = kinds.get(kind, 0) + 1
        what = ", ".join(f"{n} {_CACHE_KINDS[k]}" for k, n in kinds.items()) or "nothing"
        print(f"removed from {path}: {what}")
        kept = [p for p, _ in cache.entries(records=True) if _ == "records"]
        if kept:
            print(f"kept the tuned records in {os.path.join(path, cache.RECORDS)} "
                  f"({', '.join(os.path.basename(p) for p in kept)}): --clear --records "
                  "removes them too")
        left = cache.others(records=True)
        if left:
            print(f"left {len(left)} file(s) that are not the cache's alone, e.g. {left[0]}")
        return 0
    found = cache.entries(records=True)
    if not found:
        print(f"{path}: empty (kernels are compiled and cached on first use)")
        return 0
    print(path)
    for kind, label in _CACHE_KINDS.items():
        mine = [p for p, k in found if k == kind]
        if mine:
            print(f"  {label}: {len(mine)}, {sum(cache.size(p) for p in mine) / 1e6:.1f} MB")
            for p in mine[:20]:
                print(f"    {os.path.relpath(p, path)}{'/' if os.path.isdir(p) else ''}  "
                      f"{cache.size(p) / 1e3:.0f} kB")
            if len(mine) > 20:
                print(f"    ... {len(mine) - 20} more")
    left = cache.others(records=True)
    if left:
        print(f"  not the cache's ({len(left)}; --clear leaves them): "
              + ", ".join(os.path.relpath(p, path) for p in left[:5])
              + (" ..." if len(left) > 5 else ""))
    return 0


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Options' help with their defaults, unless the help already says its default or there is
    none to say (None, or an off flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    p = argparse.ArgumentParser(
        prog="hla-tvm",
        description="Higher-order Linear Attention compiled with Apache TVM. Kernels are "
                    "compiled for this CPU on first use and cached (see `hla-tvm cache`).")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    from . import __version__

    p.add_argument("--version", action="version", version=f"hla-tvm {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.commands = sub.choices   # name -> the command's parser (`main` reports its errors)

    def command(name, **kw):
        if "help" in kw:   # (its --help opens with what the command does)
            kw.setdefault("description", kw["help"][0].upper() + kw["help"][1:] + ".")
        return sub.add_parser(name, parents=[common],
                              formatter_class=_Defaults, **kw)

    from .demo import DEFAULT_PROMPT
    from .generate import TEXT_TEMPERATURE, TEXT_TOP_K

    d = command("demo", help="compile the shipped byte-level HLA model for this CPU, stream the "
                             "Python it writes, compare its speed and logits with PyTorch",
                description="Compile the shipped model (a second-order HLALM trained on "
                            "Python's standard library with `hla-tvm train`) for this CPU with "
                            "the tuned records (cached after the first run), stream a "
                            "continuation of the prompt as the compiled module decodes it, then "
                            "print decode tokens/s of the compiled module beside the same model "
                            "in PyTorch eager mode and the largest logit difference between "
                            "them (exit code 1 when it exceeds 1e-3 of the largest logit).")
    d.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue")
    d.add_argument("--tokens", type=_positive, default=200, help="bytes to generate")
    d.add_argument("--temperature", type=float, default=TEXT_TEMPERATURE,
                   help="sampling temperature (0: greedy)")
    d.add_argument("--top-k", type=int, default=TEXT_TOP_K,
                   help="sample from the k most likely bytes (0: all)")
    d.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    d.add_argument("--target", default="llvm",
                   help='"llvm" for this CPU, or an llvm target as JSON (as for compile)')
    d.set_defaults(func=_demo)

    b = command("bench", help="time decode or prefill: the TVM kernels beside the fastest "
                              "PyTorch forms, one table with ratios",
                description="Time one decode step or a prefill of T tokens in one process: "
                            "decode: tvm (decode_), tvm_hla (hla, which copies the state), "
                            "torch (in-place PyTorch step), torch_compile, state_copy (copying "
                            "the state once, the floor); prefill: tvm, torch (the chunk form "
                            "with every chunk at once), torch_compile, torch_sdpa (causal "
                            "softmax), onnxruntime (one exported hla_tvm::HLA node, where "
                            "onnxruntime is installed), and this machine's sgemm rate. The "
                            "cases are timed in rounds (each once per round), so a noisy "
                            "machine's slow spells fall on all of them, each run starting once the "
                            "threads of the case before are idle. With "
                            "--kv-heads the PyTorch forms repeat k, v for each group.")
    b.add_argument("mode", nargs="?", choices=("decode", "prefill"), default="decode",
                   help="what to time")
    b.add_argument("--op", choices=("hla2", "ahla", "hla3"), default="hla2",
                   help="operator: second order, asymmetric (AHLA) or third order")
    b.add_argument("--batch", type=_positive, default=1, help="batch size B")
    b.add_argument("--heads", type=_positive, default=8, help="heads H")
    b.add_argument("--kv-heads", type=_positive, default=None,
                   help="key/value heads Hkv, dividing H (grouped heads; default: H)")
    b.add_argument("--seq", "--length", dest="seq", type=_positive, default=8192,
                   help="prefill length T")
    b.add_argument("--dk", "--head-dim", dest="dk", type=_positive, default=64,
                   help="key/query head size")
    b.add_argument("--dv", type=_positive, default=None, help="value head size (default: dk)")
    b.add_argument("--decay", type=_decay, default=None, help="decay factor in (0, 1]")
    b.add_argument("--chunk-size", type=_positive, default=64,
                   help="chunk size of the chunked prefill")
    b.add_argument("--repeat", type=_positive, default=5,
                   help="timed runs per case (median and min reported)")
    b.add_argument("--json", default=None, metavar="FILE",
                   help="also write the results as JSON")
    b.set_defaults(func=_bench)

    tr = command("train", help="train a byte-level HLALM on this Python's standard library "
                               "source (how the shipped demo model was made)",
                 description="Train a second-order, byte-level HLALM (256 symbols) on the .py "
                             "files of this interpreter's standard library, 5 percent of the "
                             "files held out for validation, with the differentiable PyTorch "
                             "path; writes the checkpoint and its training curve (CHECKPOINT "
                             "without .pt + .json and .png). The same --seed gives the same "
                             "starting weights and the same batches, so the same run up to "
                             "floating-point rounding: PyTorch's CPU kernels do not promise "
                             "bitwise equal results between runs (their threads and vector code "
                             "may sum in another order), and a --seconds budget stops at "
                             "another step. --attention softmax trains the "
                             "same model with causal softmax attention instead (the baseline; "
                             "curve only). About 10 minutes on 2 cores with the defaults.")
    tr.add_argument("-o", "--output", default="hlalm.pt", help="checkpoint to write")
    tr.add_argument("--steps", type=_positive, default=600, help="optimizer steps")
    tr.add_argument("--batch", type=_positive, default=16, help="windows per step")
    tr.add_argument("--seq-len", type=_positive, default=256, help="bytes per window")
    tr.add_argument("--lr", type=_positive_float, default=3e-3,
                    help="peak learning rate (AdamW)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    tr.add_argument("--d-model", type=_positive, default=argparse.SUPPRESS,
                    help="model width (default: 128, the shipped model's)")
    tr.add_argument("--layers", type=_positive, default=argparse.SUPPRESS,
                    help="blocks (default: 4)")
    tr.add_argument("--heads", type=_positive, default=argparse.SUPPRESS,
                    help="heads (default: 2, head size 64)")
    tr.add_argument("--decay", type=_decays, default=argparse.SUPPRESS, metavar="G[,G...]",
                    help="HLA's per-token decay, one value in (0, 1] for every head or one per "
                         "head, or 'none' (default: 0.8,0.98 for 2 heads, the shipped "
                         "model's, spread from 0.8 to 0.98 for others: without decay a "
                         "byte-level HLALM learns far slower)")
    tr.add_argument("--attention", choices=("hla", "softmax"), default="hla",
                    help="hla: the HLALM; softmax: the same-size softmax-attention baseline")
    tr.add_argument("--seconds", type=_positive_float, default=None,
                    help="stop after this wall time (the learning rate decays over it; "
                         "not reproducible step for step)")
    tr.add_argument("--threads", type=_positive, default=None,
                    help="CPU threads (default: PyTorch's, one per core)")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=_train)

    k = command("compile", help="compile an HLALM checkpoint or an ONNX model from "
                                "`export-onnx` into a deployable module (prefill/decode entry "
                                "points, runtime-only loading)")
    k.add_argument("checkpoint", help="a checkpoint written by HLALM.save, or a .onnx file with "
                                      "hla_tvm::HLA nodes")
    k.add_argument("-o", "--output", default="model.so", help="output library")
    k.add_argument("--target", default="llvm",
                   help='"llvm" for this CPU, a preset (x86-64, aarch64, cuda), a TVM target '
                        'as JSON, e.g. \'{"kind": "llvm", "mcpu": "znver4"}\', or a target '
                        'string TVM parses')
    k.add_argument("--arch", default=None, metavar="sm_XY",
                   help="with --target cuda: the GPU architecture (sm_80 A100, sm_86, sm_89, "
                        "sm_90 H100/H200; default sm_80)")
    k.add_argument("--max-batch", type=_positive, default=None,
                   help="upper bound of the batch size (lets TVM plan memory statically; "
                        "larger batches are refused at run time)")
    k.add_argument("--schedules", default="auto", metavar="auto|default|DIR",
                   help="auto: tuned records for the target where they exist (the user's from "
                        "`hla-tvm tune`, else the shipped ones), the default schedules for the "
                        "other kernels; default: no records; DIR: that records folder")
    k.set_defaults(func=_compile)

    x = command("export-onnx", help="export an HLALM checkpoint to ONNX with hla_tvm::HLA nodes "
                                    "and their function bodies (runs in ONNX Runtime as is; "
                                    "`compile` takes it too)")
    x.add_argument("checkpoint", help="a checkpoint written by HLALM.save")
    x.add_argument("-o", "--output", default="model.onnx", help="output file")
    which = x.add_mutually_exclusive_group()
    which.add_argument("--decode", action="store_true",
                       help="export the one-token decode step (tokens [B] and state in, logits "
                            "[B, vocab] and state out) instead of the prefill graph")
    which.add_argument("--from-state", action="store_true",
                   help="the prefill graph also takes the state to continue from (by default "
                        "it starts a fresh sequence from the tokens alone)")
    x.set_defaults(func=_export_onnx)

    r = command("run", help="generate with a compiled module (TVM runtime only): text for "
                            "byte-level models, token ids for others",
                description="Prefill a prompt, then decode token by token: text prompts "
                            "sampled (--temperature 0.9 --top-k 40 unless given) with a seeded "
                            "generator, so the same --seed gives the same text; --prompt-ids "
                            "greedy unless --temperature is given. Byte-level models (`hla-tvm "
                            "train`, the demo's) take --prompt TEXT and stream text; others "
                            "take --prompt-ids and print ids.")
    r.add_argument("module", help="a library written by `hla-tvm compile`")
    r.add_argument("--prompt", default=None, metavar="TEXT",
                   help="prompt text (byte-level models)")
    r.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="prompt text read from FILE (UTF-8; - for standard input), for prompts "
                        "too long for the command line; echoed by its last 2000 characters "
                        "when longer")
    r.add_argument("--prompt-ids", default=None, help="prompt token ids, e.g. 1,2,3")
    r.add_argument("--info", action="store_true",
                   help="print the module's metadata (model, device, state layout, which "
                        "kernels use tuned records) and exit; read from the library without "
                        "loading it, so modules compiled for a GPU or another CPU are described "
                        "here too")
    r.add_argument("--tokens", "--steps", dest="tokens", type=_positive, default=16,
                   help="tokens to generate")
    r.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0: greedy; default: 0.9 for --prompt TEXT, as "
                        "the demo samples, 0 for --prompt-ids)")
    r.add_argument("--top-k", type=int, default=None,
                   help="sample from the k most likely tokens (0: all; default: 40 for "
                        "--prompt TEXT, else 0)")
    r.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    r.add_argument("--threads", type=_positive, default=None,
                   help="CPU threads for the kernels (default: $TVM_NUM_THREADS, else for each "
                        "kind of call the count that runs it fastest at the time, up to one per "
                        "physical core, chosen by timing the calls)")
    r.add_argument("--device", default="cpu", metavar="cpu|cuda|cuda:N",
                   help="where the module runs: cpu, or the GPU for a module compiled with "
                        "--target cuda")
    r.set_defaults(func=_run)

    u = command("bundle", help="a folder with a compiled module and what runs it without TVM's "
                               "compiler: the runtime libraries, a Python script (numpy + "
                               "apache-tvm-ffi) and the C++ app's source; a module for an "
                               "NVIDIA GPU with its device code and TVM's CUDA runtime (the "
                               "GPU machine needs only the driver)")
    u.add_argument("module", help="a library written by `hla-tvm compile`")
    u.add_argument("-o", "--output", required=True, metavar="DIR", help="the bundle folder")
    u.add_argument("--runtime-from", default=None, metavar="DIR",
                   help="for a module of another architecture (e.g. --target aarch64): a folder "
                        "with that architecture's tvm/ and tvm_ffi/ packages (its apache-tvm "
                        "and apache-tvm-ffi wheels unzipped there)")
    u.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    u.set_defaults(func=_bundle)

    t = command("tune", help="auto-tune an operator's kernels or a model's kernels and "
                             "projections with "
                             "meta_schedule and write tuned records (used by hla(), decode_(), "
                             "compile with schedules='auto')",
                description="Tune the prefill and decode kernels of one operator configuration "
                            "(--op and options) or the HLA kernels and projections of a model "
                            "(a checkpoint or an ONNX file) "
                            "with TVM's meta_schedule (evolutionary search, XGBoost cost model, "
                            "local runner, or the devices of an RPC tracker) at batch 1, 8 "
                            "heads, 4096 tokens, then time each kernel's best trial beside its "
                            "default schedule and keep the tuned one only when it is 3 percent "
                            "faster. Records go to ~/.cache/hla_tvm/schedules/<target>/ (or -o "
                            "DIR; run again with the same folder to resume and add trials). On "
                            "a 2-core machine a trial takes about 3 s after a minute of start "
                            "up; 48 trials (3 minutes) give each kernel of an operator a few "
                            "candidates. Gains measured here so far are per kernel (up to "
                            "1.4x on some chunk kernels), not on whole prefills: see "
                            "docs/tuning.md.")
    t.add_argument("model", nargs="?", default=None,
                   help="a checkpoint (HLALM.save) or an ONNX model with hla_tvm::HLA nodes: "
                        "tune the HLA kernels and projections `hla-tvm compile` builds for it "
                        "(instead of --op and the options below)")
    t.add_argument("--op", choices=("hla2", "ahla", "hla3"), default="hla2",
                   help="operator: second order, asymmetric (AHLA) or third order")
    t.add_argument("--decay", action="store_true",
                   help="the kernels with decay (second order has separate ones)")
    t.add_argument("--normalize", action="store_true", help="the normalized variant")
    t.add_argument("--dk", type=_positive, default=64, help="key/query head size")
    t.add_argument("--dv", type=_positive, default=None, help="value head size (default: dk)")
    t.add_argument("--heads", type=_positive, default=8, help="query heads (with --kv-heads)")
    t.add_argument("--kv-heads", type=_positive, default=8,
                   help="key/value heads (grouped heads when fewer than --heads)")
    t.add_argument("--chunk-size", "--chunk", type=_positive, default=64, help="prefill chunk size")
    t.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"),
                   default="float32", help="input dtype")
    t.add_argument("--target", default="llvm", help="the CPU to tune for (as for compile)")
    t.add_argument("--trials", type=_positive, default=100,
                   help="measured candidates in all, shared among the kernels")
    t.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="records folder (default: the user's folder for the target)")
    t.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on devices registered with this TVM RPC tracker (python -m "
                        "tvm.exec.rpc_tracker) instead of this machine; candidates are built "
                        "here (cross-linked for an aarch64 --target)")
    t.add_argument("--rpc-key", default=None, metavar="KEY",
                   help="the key the device's server registered with (python -m "
                        "tvm.exec.rpc_server --tracker HOST:PORT --key KEY)")
    t.set_defaults(func=_tune)

    c = command("cache", help="show (or --clear) the cache folder: compiled kernels, the demo's "
                              "compiled model, downloaded runtimes, and your tuned records",
                description="List the cache folder ($HLA_TVM_CACHE_DIR, else "
                            "~/.cache/hla_tvm) by kind, or --clear it. --clear removes only "
                            "the files the package put there (compiled kernels and models, "
                            "device code, downloaded runtimes), never another file in the "
                            "folder, and keeps the tuned records of `hla-tvm tune` (minutes to "
                            "hours of work) unless --records is given too.")
    c.add_argument("--clear", action="store_true",
                   help="delete the cached compiled files (not the tuned records)")
    c.add_argument("--records", action="store_true",
                   help="with --clear: delete the tuned records under schedules/ too")
    c.set_defaults(func=_cache)
    return p


def main(argv=None):
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # after the command: named by the command's own usage, not the top level's
        words = list(sys.argv[1:] if argv is None else argv)
        command = getattr(args, "command", None)
        after = command in words and extra[0] in words[words.index(command) + 1:]
        (parser.commands[command] if after else parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except BrokenPipeError:   # the reader went away (`hla-tvm cache | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except EXPECTED_ERRORS as err:
        if getattr(args, "debug", False):
            raise
        lines = [line for line in str(err).splitlines() if line.strip()] or \
            [type(err).__name__]
        message = lines[0] + (" ..." if len(lines) > 1 else "")
        if isinstance(err, FileNotFoundError) and err.filename and err.filename not in message:
            message = f"{message}: {err.filename}"
        print(f"hla-tvm {args.command}: error: {message} (--debug shows the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
