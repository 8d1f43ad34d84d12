"""The `hla-tvm` command line: one module per command in this package, each with its
arguments (`add_arguments`) and its run function (`main(args)`), a call into the library (the
programs of `demo`, `bench`, `train` and `eval` are `hla_tvm.demo`, `hla_tvm.bench`,
`hla_tvm.train` and `hla_tvm.evaluate`). Only the command given is imported (`hla-tvm run` imports neither torch
nor TVM's compiler).

Expected errors (a missing or bad file, a bad target or argument) end the command with one line
on stderr, `hla-tvm COMMAND: error: ...`, and exit code 2; `--debug` shows the traceback.
SIGTERM stops a command (`serve` aside, which drains its streams) with an exception in the main
thread, so that the files it was writing are removed on the way out (`paths.stop_on_sigterm`);
it ends with one line and exit code 143 (128 + SIGTERM)."""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from ..version import __version__
from .args import Defaults

# what a user can cause: bad files, targets, arguments, unsupported options
EXPECTED_ERRORS = (ValueError, TypeError, OSError, NotImplementedError)

# name -> (its module in this package, what it does: the line `hla-tvm --help` shows)
COMMANDS = {
    "demo": ("demo",
        "compile the shipped byte-level HLA model for this CPU, stream the Python it writes, "
        "compare its speed and logits with PyTorch"),
    "bench": ("bench",
        "time decode or prefill: the TVM kernels beside the fastest PyTorch forms, one table "
        "with ratios"),
    "train": ("train",
        "train a byte-level HLALM on this Python's standard library source (how the shipped "
        "demo model was made)"),
    "compile": ("compile",
        "compile an HLALM checkpoint, your own model (module:factory) or an ONNX model from "
        "`export-onnx` into a deployable module (prefill/decode entry points, runtime-only "
        "loading; float32, bf16, int8 or int4 weights)"),
    "export-onnx": ("export_onnx",
        "export an HLALM checkpoint to ONNX with hla_tvm::HLA nodes and their function bodies "
        "(runs in ONNX Runtime as is; `compile` takes it too)"),
    "run": ("run",
        "generate with a compiled module (TVM runtime only): text for models with text "
        "(byte-level, or compiled with --tokenizer), token ids for others"),
    "bundle": ("bundle",
        "a folder with a compiled module and what runs it without TVM's compiler: the runtime "
        "libraries, a Python script (numpy + apache-tvm-ffi) and the C++ app's source; a module "
        "for an NVIDIA GPU with its device code and TVM's CUDA runtime (the GPU machine needs "
        "only the driver)"),
    "eval": ("evaluate",
        "bits per byte (or per token) of compiled modules and checkpoints over one text, side "
        "by side, with the largest logit difference to the first (quantized against float32)"),
    "serve": ("serve",
        "serve a compiled module over HTTP with OpenAI's completions and chat API: many "
        "streams batched together, logprobs and n choices, sessions and a prefix-state cache, "
        "Prometheus metrics, Ray Serve replicas"),
    "tune": ("tune",
        "auto-tune an operator's kernels or a model's kernels and projections with "
        "meta_schedule and write tuned records (used by hla(), decode_(), compile with "
        "schedules='auto')"),
    "cache": ("cache",
        "show (or --clear) the cache folder: compiled kernels, the demo's compiled model, "
        "downloaded runtimes, and your tuned records"),
}


def command_module(name):
    """The module of command `name` (imported on first use)."""
    return importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")


def build_parser(only=None):
    """The `hla-tvm` parser; the arguments of command `only` (None: every command) added."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    p = argparse.ArgumentParser(
        prog="hla-tvm",
        description="Higher-order Linear Attention compiled with Apache TVM. Kernels are "
                    "compiled for this CPU on first use and cached (see `hla-tvm cache`).")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    p.add_argument("--version", action="version", version=f"hla-tvm {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.commands = sub.choices   # name -> the command's parser (`main` reports its errors)
    for name, (_, help_) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_, parents=[common], formatter_class=Defaults)
            continue
        module = command_module(name)
        cmd = sub.add_parser(name, help=help_, parents=[common], formatter_class=Defaults,
                             description=getattr(module, "DESCRIPTION", None)
                             or help_[0].upper() + help_[1:] + ".")
        module.add_arguments(cmd)
        cmd.set_defaults(func=module.main)
    return p


def _command_of(argv):
    """The command named in `argv` (the first word that is one), or None."""
    return next((w for w in argv if w in COMMANDS), None)


def main(argv=None):
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=_command_of(words))
    args, extra = parser.parse_known_args(words)
    if extra:   # after the command: named by the command's own usage, not the top level's
        command = getattr(args, "command", None)
        after = command in words and extra[0] in words[words.index(command) + 1:]
        (parser.commands[command] if after else parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # the runtime (numpy) is imported once a command runs: `hla-tvm --help` stays fast
    from ..runtime import paths

    stopped = []   # (the signal, once SIGTERM came)
    try:
        with paths.stop_on_sigterm(stopped, args.command != "serve"):
            return args.func(args)
    except BaseException as err:
        debug = getattr(args, "debug", False)
        if stopped and not debug:
            print(f"hla-tvm {args.command}: stopped by SIGTERM (its unfinished files removed)",
                  file=sys.stderr)
            return 128 + signal.SIGTERM
        if isinstance(err, BrokenPipeError):   # the reader went away (`hla-tvm cache | head`)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if not isinstance(err, EXPECTED_ERRORS) or debug:
            raise
        lines = [line for line in str(err).splitlines() if line.strip()] or \
            [type(err).__name__]
        message = lines[0] + (" ..." if len(lines) > 1 else "")
        if isinstance(err, FileNotFoundError) and err.filename and err.filename not in message:
            message = f"{message}: {err.filename}"
        print(f"hla-tvm {args.command}: error: {message} (--debug shows the traceback)",
              file=sys.stderr)
        return 2
