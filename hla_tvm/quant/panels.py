"""Panel layout of a compiled model's CPU weights: the values q [R, N] a projection reads by
column n (a float32 W [K, N], or a scheme's packed rows, `scheme`) stored as

    panels [N / P, R, P],   panels[n // P, r, n % P] = q[r, n]

P is the column width of the one-row register tile (`schedule.rules.cpu.matmul_tiles`,
`tile_shape`: the widest of 128 / 64 / 32 / 16 / 8 that divides N within 8 vectors, so 128 on
AVX-512 and 64 below where N allows). A decode step's thread then reads its P columns as one
contiguous block of R * P values, where the [R, N] layout gives it R segments of P values
N apart (speed: docs/cpu_schedules.md). Scales stay [K / g, N] (one read
per group). bf16 values are stored in row pairs first (`pairs`: q [K / 2, N] uint32), the
layout of AMX's B tile and of vdpbf16ps's operand (`quant.amx`); int8 and int4 values, where
the target multiplies them on VPDPBUSD (`quant.vnni`), in quads first (`quads`: 32-bit words of
four unsigned bytes, four rows of a column). Where no tile width divides N, on GPUs, and for
weights a scheme keeps float32 (K not splitting into its groups), weights stay [R, N] (P None);
`compiler.passes.pack_weights.panel_width` picks P."""
from __future__ import annotations

import numpy as np


def to_panels(q, p):
    """The [N / p, R, p] panels of the [R, N] array `q` (itself for p None)."""
    if p is None:
        return q
    r, n = q.shape
    if n % p:
        raise ValueError(f"N = {n} columns do not split into panels of {p}")
    return np.ascontiguousarray(q.reshape(r, n // p, p).transpose(1, 0, 2))


def from_panels(panels):
    """The [R, N] array that the [N / p, R, p] `panels` store."""
    count, r, p = panels.shape
    return np.ascontiguousarray(panels.transpose(1, 0, 2).reshape(r, count * p))


def at(q, row, n, p):
    """The TIR expression for q[row, n] of the te tensor `q` stored as panels of `p` columns
    (or [R, N] for p None)."""
    return q[row, n] if p is None else q[n // p, row, n % p]


def pairs(q):
    """The bfloat16 values `q` [K, N] (uint16, K even) in row pairs [K / 2, N] uint32: row 2r in
    the low half, row 2r + 1 in the high half."""
    q = np.asarray(q, dtype=np.uint16)
    if q.shape[0] % 2:
        raise ValueError(f"K = {q.shape[0]} rows do not split into pairs")
    return (q[0::2].astype(np.uint32) | (q[1::2].astype(np.uint32) << 16)).astype(np.uint32)


def from_pairs(p):
    """The [K, N] uint16 values that the row pairs `p` [K / 2, N] store."""
    out = np.empty((2 * p.shape[0], p.shape[1]), dtype=np.uint16)
    out[0::2] = (p & 0xFFFF).astype(np.uint16)
    out[1::2] = (p >> 16).astype(np.uint16)
    return out


def quads(name, q):
    """The int8 values q [K, N] (`name` "int8") or int4 bytes q [K / 2, N] ("int4", two rows a
    byte, `scheme`) as 32-bit words of four unsigned bytes, uint32:

        int8  [K / 4, N]: byte j of word r holds u = q[4r + j, n] + 128
        int4  [K / 8, N]: byte j of word r holds u of row 8r + j (low nibble) and of row
              8r + 4 + j (high nibble)

    VPDPBUSD's unsigned operand: four inputs of one column a 32-bit lane (`quant.vnni`)."""
    if name == "int8":
        u = (np.asarray(q, dtype=np.int16) + 128).astype(np.uint32)
        if u.shape[0] % 4:
            raise ValueError(f"K = {u.shape[0]} rows do not split into quads")
        return (u[0::4] | (u[1::4] << 8) | (u[2::4] << 16) | (u[3::4] << 24)).astype(np.uint32)
    q = np.asarray(q, dtype=np.uint8)
    if q.shape[0] % 4:
        raise ValueError(f"K = {2 * q.shape[0]} rows do not split into quads of row pairs")
    lo, hi = (q & 15).astype(np.uint32), (q >> 4).astype(np.uint32)
    rows = np.empty((2 * q.shape[0], q.shape[1]), dtype=np.uint32)   # u of each row
    rows[0::2], rows[1::2] = lo, hi
    rows = rows.reshape(-1, 8, q.shape[1])
    nibbles = rows[:, :4] | (rows[:, 4:] << 4)                       # [K / 8, 4, N] bytes
    return (nibbles[:, 0] | (nibbles[:, 1] << 8) | (nibbles[:, 2] << 16) |
            (nibbles[:, 3] << 24)).astype(np.uint32)


def from_quads(name, w):
    """The int8 values [K, N] or int4 bytes [K / 2, N] that the quads `w` store (`quads`)."""
    w = np.asarray(w, dtype=np.uint32)
    b = np.stack([(w >> (8 * j)) & 255 for j in range(4)], axis=1)   # [K / 4 or / 8, 4, N]
    if name == "int8":
        return (b.reshape(-1, w.shape[1]).astype(np.int16) - 128).astype(np.int8)
    rows = np.concatenate([b & 15, b >> 4], axis=1).reshape(-1, w.shape[1])   # u per row
    return (rows[0::2] | (rows[1::2] << 4)).astype(np.uint8)


def stored(sch, q, p, in_quads=False):
    """The array a compiled module stores for the scheme `sch`'s values `q` [R, N] (None:
    float32 W): bf16 in row pairs (`pairs`), int8 / int4 in quads where `in_quads` (`quads`),
    then in panels of `p` columns (`to_panels`)."""
    if sch is not None and sch.name == "bf16":
        q = pairs(q)
    elif in_quads:
        q = quads(sch.name, q)
    return to_panels(q, p)
