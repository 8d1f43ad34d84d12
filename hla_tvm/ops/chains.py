"""The kernel chain of every HLA operator, stated once.

A chain is the sequence of kernel calls of one prefill or one decode step: which kernel, which
tensors it reads, which state entries it advances in place and which new tensors it writes.
`hla_tvm.backend` runs a chain on torch tensors (eager calls of the compiled kernels) and
`hla_tvm.compiler.relax_hla` emits it as Relax calls inside a compiled model, so a change of
kernels is made in one place: each operator's `chain.py` lists its prefill calls (`FAMILIES`).

Kernel families: hla2 (second order, undecayed prefill: one-product carry), hla2_decay (second
order with decay; its decode also serves undecayed second order with gamma = 1), ahla, hla3.

    hla2 prefill     ksummary -> scan of S -> summary -> carry (in place on the state) -> output
    hla2_decay,      ksummary (+ summary) -> scans of the prefix sums -> cross (the cross-term
    ahla, hla3       increments, the chunk's own terms inside) -> scans of the cross-term states
    prefill          -> output
    decode           one in-place state update and readout

Key/value heads: a call marked kv (the ksummary and the scans of the state entries built from
k, v alone, the operator's `kv_state`) runs on the key/value heads, so with grouped heads its
work is done once per key/value head; gamma is then read at the first query head of each group
(the decay is equal within a group). Every other kernel runs on the query heads and reads the
key/value-head buffers (k, v, those state entries, their records, the ksummary's writes) at
head h // group. The prefill takes the kv_state entries with the key/value heads, as the
operator's state holds them; decode takes every entry with the query heads.

Reads and writes: `common.calls`.
A "scan" call (`common.tir.chunk_scan`) sees its state [B, H, width] and its increments and record
[B, H, NC, width] flattened to the width of the increments' kind; without "gl" among its reads it
is a plain prefix sum.

This module (the chains, not the kernels they name) needs no TVM compiler.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from . import FAMILIES, OPERATORS
from .common.calls import KIND_SHAPES, Call  # noqa: F401  (a chain's calls, named here)
from .common.dtypes import accum_dtype


def kernel_options(dtype, **opts):
    """The options baked into a chain's kernels: the operator's (`Operator.options`) and the
    inputs' dtype (a torch dtype)."""
    return {**opts, "dtype": str(dtype).replace("torch.", "")}


def operator_of(fam):
    """The `Operator` kernel family `fam` computes."""
    return OPERATORS[FAMILIES[fam].operator]


@dataclass(frozen=True)
class Chain:
    family: str
    calls: tuple

    @property
    def state_names(self):
        return operator_of(self.family).state_names

    @property
    def takes_gamma(self):
        return any("gamma" in c.reads for c in self.calls)

    def kinds(self):
        """{buffer name: kind} of every write."""
        return {name: kind for c in self.calls for name, kind in c.writes}

    def kv_buffers(self):
        """Names of the buffers with the key/value heads: the kv calls' state entries and
        writes."""
        return {x for c in self.calls if c.kv for x in c.inplace + tuple(n for n, _ in c.writes)}


def family(op_name, *, decayed, decode, gpu=False):
    """The kernel family running operator `op_name` (hla2, ahla, hla3): `Operator.family`
    (second order runs hla2_decay with decay, for decode, and on GPUs)."""
    return OPERATORS[op_name].family(decayed=decayed, decode=decode, gpu=gpu)


def gpu_options(chain):
    """Kernel options `chain` takes on GPUs, beyond the operator's: its family's decode
    options there (`Family.gpu_options`)."""
    return dict(FAMILIES[chain.family].gpu_options) if chain.calls[0].kernel == "decode" \
        else {}


def target_options(chain, target, dtype):
    """Kernel options `chain` takes on `target` (a tvm Target) for inputs of `dtype` (a dtype
    name), beyond the operator's: on GPUs its family's decode options there (`gpu_options`);
    on CPUs with AVX512-BF16, bfloat16 inputs' products on vdpbf16ps in a family's prefill
    that has them (`Family.bf16_products`)."""
    if target.kind.name == "cuda":
        return gpu_options(chain)
    if dtype == "bfloat16" and chain.calls[0].kernel != "decode" and \
            FAMILIES[chain.family].bf16_products:
        # pairs and tir import TVM: the chains import without it (backend.run_chain with the TVM
        # runtime alone)
        from .common.pairs import available

        if available(target):
            return {"bf16_products": True}
    return {}


def prefill(fam):
    """The chunked prefill chain of kernel family `fam`."""
    return Chain(fam, FAMILIES[fam].prefill)


def decode(fam):
    """The one-token chain of kernel family `fam`: state advanced in place, output o."""
    names = operator_of(fam).state_names
    return Chain(fam, (Call("decode", ("q", "k", "v", "gamma") + names, (("o", "o"),),
                            inplace=names),))


def buffer_shapes(chain, B, H, Hkv, nc, dk, dv, n):
    """{name: shape} of the per-chunk buffers `chain` writes (the output aside), for B batches,
    H query and Hkv key/value heads, nc chunks of n tokens."""
    kv = chain.kv_buffers()
    return {name: (B, Hkv if name in kv else H, nc, *KIND_SHAPES[kind](dk, dv, n))
            for name, kind in chain.kinds().items() if kind != "o"}


def argument_shapes(chain, B, H, Hkv, T, dk, dv, n, dtype):
    """[(call, [(shape, dtype) of each argument])] of every call of `chain` on q [B, H, T, dk]
    with k, v of Hkv heads, inputs in `dtype` (a dtype name): what its kernels are called with
    (`hla_tvm.backend.run_chain`), e.g. to specialize them for tuning."""
    acc = accum_dtype(dtype)
    decode = chain.calls[0].kernel == "decode"
    kv = chain.kv_buffers()
    state = operator_of(chain.family).ref.state_shapes(B, H, dk, dv)
    shapes = {"q": ((B, H, T, dk), dtype), "k": ((B, Hkv, T, dk), dtype),
              "v": ((B, Hkv, T, dv), dtype), "o": ((B, H, T, dv), dtype),
              "gamma": ((H,), acc)}
    for name in chain.state_names:
        heads = Hkv if name in kv and not decode else H
        shapes[name] = ((B, heads, *state[name][2:]), acc)
    nc = -(-T // n)
    shapes.update({name: (shape, acc) for name, shape in
                   buffer_shapes(chain, B, H, Hkv, nc, dk, dv, n).items()})
    out = []
    for call in chain.calls:
        args = [((Hkv,), acc) if call.kv and x == "gamma" else shapes[x]
                for x in call.reads + tuple(name for name, _ in call.writes)]
        if call.kernel == "scan":   # state, increments (and record) flattened, as run_chain
            heads = args[0][0][1]
            w = scan_width(call.writes[0][1], dk, dv)
            args = [((B, heads, w), acc), ((B, heads, nc, w), acc)] + args[2:-1] + \
                [((B, heads, nc, w), acc)]
        out.append((call, args))
    return out


def scan_width(kind, dk, dv):
    w = 1
    for d in KIND_SHAPES[kind](dk, dv, 0):
        w *= d
    return w


def kernel_name(chain, call, dk, dv, group=1):
    """The function name of `call` in a module holding `chain`'s kernels for H / group
    key/value heads."""
    if call.kernel == "scan":
        name = "chunk_scan" if "gl" in call.reads else "chunk_psum"
        grouped = group > 1 and not call.kv and "gl" in call.reads
        return f"{name}_w{scan_width(call.writes[0][1], dk, dv)}" + (f"_g{group}" if grouped
                                                                      else "")
    if call.kernel == "decode":
        return f"{chain.family}_decode"
    return f"{chain.family}_chunk_{call.kernel}"


_PARSE_LOCK = threading.Lock()


def _reset_macro_counts():
    """Restart the expansion count of every TVMScript macro of the kernel modules. TVMScript
    suffixes the block names of a macro's n-th expansion in the process with "_n"; block names
    are part of a kernel's structural hash (how tuned records are found) and of the traces
    records replay, so each kernel must be parsed from a count of zero."""
    from .common import tir

    for mod in (tir, *(f.kernel_module() for f in FAMILIES.values())):
        for obj in vars(mod).values():
            # T.macro gives a function whose closure holds the macro object
            for cell in getattr(obj, "__closure__", None) or ():
                macro = cell.cell_contents
                if hasattr(macro, "call_count") and hasattr(macro, "parse_macro"):
                    macro.call_count = 0


def make_kernel(chain, call, dk, dv, *, chunk, dtype, group=1, **opts):
    """The PrimFunc of `call`; opts: normalize, eps (and masked, ridge for second order). With
    group > 1 the query-head kernels read k, v and the other key/value-head buffers with
    H / group heads (query head h reads key/value head h // group). The same arguments give
    the same function (block names included) whatever was built before in the process."""
    with _PARSE_LOCK:
        _reset_macro_counts()
        return _make_kernel(chain, call, dk, dv, chunk=chunk, dtype=dtype, group=group, **opts)


def _make_kernel(chain, call, dk, dv, *, chunk, dtype, group=1, **opts):
    from .common import tir

    kmod = FAMILIES[chain.family].kernel_module()
    if call.kernel == "scan":
        return tir.chunk_scan(scan_width(call.writes[0][1], dk, dv), dtype=dtype,
                               group=1 if call.kv else group, decayed="gl" in call.reads)
    if call.kernel == "decode":
        return kmod.decode(dk, dv, dtype=dtype, group=group, **opts)
    # (a family's products of two bfloat16 inputs: its ksummary's K^T K, `Family.bf16_products`)
    pairs = {"bf16_products": opts.pop("bf16_products")} if "bf16_products" in opts else {}
    if call.kernel == "ksummary":
        if "v" in call.reads:
            return kmod.chunk_ksummary(dk, dv, chunk, dtype=dtype, **pairs)
        return kmod.chunk_ksummary(dk, chunk, dtype=dtype, **pairs)
    if call.kernel == "summary":
        return kmod.chunk_summary(dk, dv, chunk, dtype=dtype, group=group)
    if call.kernel == "carry":
        return kmod.chunk_carry(dk, dv, masked=opts["masked"], ridge=opts["ridge"], dtype=dtype,
                                group=group)
    if call.kernel == "cross":
        return kmod.chunk_cross(dk, dv, chunk, dtype=dtype, group=group)
    if "k" not in call.reads:   # an output kernel that reads no key/value-head buffers
        return kmod.chunk_output(dk, dv, chunk, dtype=dtype, **opts)
    return kmod.chunk_output(dk, dv, chunk, dtype=dtype, group=group, **opts)


def kernels(chain, dk, dv, *, chunk, dtype, group=1, **opts):
    """{function name: PrimFunc} of every kernel `chain` calls."""
    out = {}
    for call in chain.calls:
        name = kernel_name(chain, call, dk, dv, group)
        if name not in out:
            out[name] = make_kernel(chain, call, dk, dv, chunk=chunk, dtype=dtype, group=group,
                                    **opts)
    return out
