"""Weight-only quantization schemes: what a compiled module stores for a weight W [K, N] (the
layout a projection x [.., K] @ W reads, and the embedding table's transpose), in numpy.

    bf16   q [K, N] uint16: the upper half of W's float32 bits, rounded to nearest even;
           W = float32 bits q << 16. Its products take the activations rounded the same way
           (`activations`) and accumulate in float32, as bfloat16 matrix units (AMX, AVX512-BF16)
           and PyTorch's bfloat16 autocast compute
    int8   q [K, N] int8 = round(W / s), s [1, N] = max_k |W[:, n]| / 127 (per output
           channel), or s [K / g, N] per group of g input elements; W = q * s[k // g, n]
    int4   q [K / 2, N] uint8: two 4-bit values u = round(W / s) + 8 in 0..15 a byte (row k in
           the low nibble of byte row k // 2 when k is even, the high one when odd),
           s [K / g, N] = max |W| / 7 over each group of g input elements (symmetric);
           W = (u - 8) * s[k // g, n]

A compiled module stores q in panels on CPUs (`panels`). `quantize` packs, `dequantize` unpacks
(float64 arithmetic on the stored values, rounded to float32 once, as the kernels compute q * s
in float32)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCHEMES = ("bf16", "int8", "int4")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Scheme:
    """A quantization scheme: name in SCHEMES and group_size (input elements per scale; None:
    one scale per output channel, int8 only; bf16 has no scale)."""
    name: str
    group_size: int | None = None

    def as_meta(self):
        """The scheme as a compiled module's metadata records it."""
        return {"scheme": self.name, "group_size": self.group_size}

    def fits(self, k):
        """Whether a weight with K = `k` input elements can take this scheme (bf16: K even, as
        a CPU module stores it in row pairs, `panels.pairs`)."""
        g = self.group_size
        if self.name == "bf16":
            return k % 2 == 0
        return g is None or (k % g == 0 and (self.name != "int4" or g % 2 == 0))

    def group(self, k):
        """Input elements per scale for K = `k`."""
        return self.group_size or k


ARGUMENTS = ("quantize", "group_size")   # how `scheme`'s errors name them (the CLI: flags)
FLAGS = ("--quantize", "--group-size")


def scheme(quantize, group_size=None, names=ARGUMENTS):
    """The checked Scheme for quantize= (None: no quantization, returns None) and group_size=
    (int4: default 32, one of GROUP_SIZES; int8: None for per output channel, else one of
    GROUP_SIZES; bf16: must be None), or `quantize` itself where it is a Scheme already (one
    object travels from the command line to the packing). `names`: what the errors call the
    two (FLAGS for the command line)."""
    q, g = names
    if isinstance(quantize, Scheme):
        if group_size is not None and group_size != quantize.group_size:
            raise ValueError(f"{g} {group_size} differs from the scheme's "
                             f"({quantize.group_size}); give one of them")
        return quantize
    if quantize is None:
        if group_size is not None:
            raise ValueError(f"{g} is given without {q}; give {q} int8 or int4 to use it")
        return None
    if not isinstance(quantize, str) or quantize not in SCHEMES:
        raise ValueError(f"{q} must be None or one of {', '.join(SCHEMES)}, got "
                         f"{quantize!r}")
    if group_size is not None and (isinstance(group_size, bool) or
                                   not isinstance(group_size, int)):
        raise TypeError(f"{g} must be an int, got {type(group_size).__name__}")
    if quantize == "bf16":
        if group_size is not None:
            raise ValueError(f"{g} applies to int8 and int4, not bf16")
        return Scheme("bf16")
    if quantize == "int4" and group_size is None:
        group_size = 32
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"{g} must be one of {', '.join(map(str, GROUP_SIZES))}, got "
                         f"{group_size}")
    return Scheme(quantize, group_size)


def from_meta(meta):
    """The Scheme a module's metadata records (its "quantize" entry), or None; ValueError for
    an entry that names no valid scheme."""
    entry = meta.get("quantize")
    if entry is None:
        return None
    if not isinstance(entry, dict) or not {"scheme", "group_size"} <= set(entry):
        raise ValueError(f"the module's quantize entry is not a scheme record: {entry!r}")
    return scheme(entry["scheme"], entry["group_size"])


def quantize(sch, w):
    """{"q": packed values, "scale": scales (absent for bf16)} of the float32 weight `w`
    [K, N] under the scheme `sch` (see the module docstring); ValueError when K does not fit
    its groups."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"a weight to quantize must be 2-D [K, N], got shape {w.shape}")
    k, n = w.shape
    if not sch.fits(k):
        raise ValueError(f"K = {k} input elements do not split into groups of "
                         f"{sch.group_size}")
    if sch.name == "bf16":
        return {"q": bf16_bits(w)}
    g = sch.group(k)
    groups = w.reshape(k // g, g, n).astype(np.float64)
    top = 127 if sch.name == "int8" else 7
    scale = (np.abs(groups).max(axis=1) / top).astype(np.float32)       # [K / g, N]
    safe = np.where(scale == 0, 1, scale).astype(np.float64)[:, None, :]
    q = np.clip(np.rint(groups / safe), -top, top).reshape(k, n)
    if sch.name == "int8":
        return {"q": q.astype(np.int8), "scale": scale}
    u = (q + 8).astype(np.uint8)
    return {"q": (u[0::2] | (u[1::2] << 4)).astype(np.uint8), "scale": scale}


def bf16_bits(a):
    """The bfloat16 bits (uint16) of the float32 array `a`, rounded to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def activations(sch, x):
    """The activations a product of a module packed under `sch` (None: float32) multiplies:
    for bf16 the float32 array `x` rounded to bfloat16 (as float32), else `x`."""
    if sch is None or sch.name != "bf16":
        return x
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).reshape(np.shape(x))


def values(sch, packed):
    """The stored integer values [K, N] (int8: q; int4: u - 8) of `packed`, or for bf16 the
    float32 weights themselves."""
    q = packed["q"]
    if sch.name == "bf16":
        return (q.astype(np.uint32) << 16).view(np.float32)
    if sch.name == "int8":
        return q.astype(np.int32)
    out = np.empty((2 * q.shape[0], q.shape[1]), dtype=np.int32)
    out[0::2] = (q & 15).astype(np.int32) - 8
    out[1::2] = (q >> 4).astype(np.int32) - 8
    return out


def dequantize(sch, packed):
    """The float32 weight [K, N] that `packed` stands for (what the kernels compute)."""
    vals = values(sch, packed)
    if sch.name == "bf16":
        return vals
    k = vals.shape[0]
    scale = np.repeat(packed["scale"], sch.group(k), axis=0)
    return (vals.astype(np.float32) * scale).astype(np.float32)


def nbytes(packed):
    """Bytes `packed` stores (values and scales)."""
    return sum(int(a.nbytes) for a in packed.values())
