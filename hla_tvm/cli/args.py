"""Argument types and the help formatter the `hla-tvm` commands share."""
from __future__ import annotations

import argparse
import math


def positive(text):
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text):
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def quantize_arguments(p, what):
    """Add --quantize (help: `what`) and --group-size, the weight scheme as `hla_tvm.compile`
    takes it (`quant.scheme`), to the parser `p`."""
    # quant.scheme imports numpy: `hla-tvm --help` imports this module
    from ..quant.scheme import GROUP_SIZES, SCHEMES

    p.add_argument("--quantize", choices=SCHEMES, default=None, help=what)
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="input elements per scale (int4: default 32; int8: default one scale "
                        "per output channel)")


def checked_scheme(args):
    """The `quant.Scheme` of a command's --quantize and --group-size (None without
    --quantize); ValueError naming the flags for a combination the scheme refuses."""
    from ..quant.scheme import FLAGS, scheme

    return scheme(args.quantize, args.group_size, names=FLAGS)


def decay(text):
    """argparse type: a decay factor in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {value}")
    return value


def decays(text):
    """argparse type: "none", or decay factors in (0, 1] separated by commas (a float or a
    list of them)."""
    if text.strip().lower() == "none":
        return None
    values = [decay(part) for part in text.split(",")]
    return values[0] if len(values) == 1 else values


def describe_target(tgt):
    """A target in a few words: the CPU name or triple, or cuda and the GPU architecture."""
    if tgt.kind.name == "cuda":
        return f"cuda {tgt.attrs.get('arch')}"
    return str(tgt.attrs.get("mcpu") or tgt.attrs.get("mtriple") or tgt.kind.name)


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Options' help with their defaults, unless the help already says its default or there is
    none to say (None, or an off flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)
