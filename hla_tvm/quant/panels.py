"""Panel layout of a compiled model's CPU weights: the values q [R, N] a projection reads by
column n (a float32 W [K, N], or a scheme's packed rows, `scheme`) stored as

    panels [N / P, R, P],   panels[n // P, r, n % P] = q[r, n]

P is the column width of the one-row register tile (`schedule.rules.cpu.matmul_tiles`,
`tile_shape`: the widest of 128 / 64 / 32 / 16 / 8 that divides N within 8 vectors, so 128 on
AVX-512 and 64 below where N allows). A decode step's thread then reads its P columns as one
contiguous block of R * P values, where the [R, N] layout gives it R segments of P values
N apart (speed: docs/cpu_schedules.md). Scales stay [K / g, N] (one read
per group). bf16 values are stored in row pairs first (`pairs`: q [K / 2, N] uint32), the
layout of AMX's B tile and of vdpbf16ps's operand (`quant.amx`). Where no tile width divides N, on GPUs, and for weights a scheme keeps float32
(K not splitting into its groups), weights stay [R, N] (P None);
`frontend.pack_weights.panel_width` picks P."""
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


def stored(sch, q, p):
    """The array a compiled module stores for the scheme `sch`'s values `q` [R, N] (None:
    float32 W): bf16 in row pairs (`pairs`), then in panels of `p` columns (`to_panels`)."""
    if sch is not None and sch.name == "bf16":
        q = pairs(q)
    return to_panels(q, p)
