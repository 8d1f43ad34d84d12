"""Emitting one HLA operator as Relax calls into the scheduled TensorIR kernels.

`emit_hla(bb, target, q, k, v, state, gamma, opts)` works on Relax expressions with (possibly
symbolic) shapes q [B, H, T, Dk], k, v [B, H, T, .] and returns (o, new_state): T == 1 (static)
uses the decode kernel, any other T the chunked prefill, whose chunk count is ceil(T / n) in the
Relax shapes. State updates use call_tir_inplace, so a compiled module advances the caller's state
buffers in place."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir
from tvm.tirx import IntImm

from .. import operators
from ..kernels import KERNELS, _tir, hla2
from ..schedule import cpu

def _add(bb, name, func):
    """Schedule `func` with the default CPU rules and add it to the module under `name`."""
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    sch = s_tir.Schedule(mod)
    cpu.apply(sch, name)
    existing = [gv for gv in bb.get().get_global_vars() if gv.name_hint == name]
    if existing:
        return existing[0]
    # marked scheduled: the pipeline's default rules leave it alone
    return bb.add_func(sch.mod[name].with_attr("tirx.is_scheduled", True), name)


def _tt(shape, dtype):
    return relax.TensorType(shape, dtype)


def _shape(expr):
    return list(expr.ty.shape)


def _tag(opts):
    """A name suffix unique to the options baked into a kernel."""
    parts = [opts["dtype"], f"n{opts.get('chunk', 0)}"]
    for key in ("masked", "normalize"):
        if key in opts:
            parts.append(f"{key[0]}{int(opts[key])}")
    for key in ("eps", "ridge"):
        if key in opts:
            parts.append(f"{key[0]}{opts[key]:g}".replace(".", "p").replace("-", "m"))
    return "_".join(parts)


def emit_hla(bb, name, q, k, v, state, gamma, *, chunk, dtype, **opts):
    """(o, new_state list) for operator `name` (hla2, hla2d, ahla, hla3); gamma [H] or None."""
    B, H, T, dk = _shape(q)
    dv = _shape(v)[-1]
    dk, dv = int(dk), int(dv)
    acc = _tir.accum_dtype(dtype)
    tag = _tag({"dtype": dtype, "chunk": chunk, **opts})
    decode = isinstance(T, IntImm) and int(T) == 1
    if gamma is None and (decode or name != "hla2"):   # every kernel but hla2's prefill takes it
        gamma = relax.const(np.ones(int(H), dtype=acc))
    st_sh = [list(_shape(s)) for s in state]
    st_ty = [_tt(sh, acc) for sh in st_sh]
    out_ty = _tt([B, H, T, dv], dtype)
    if decode:  # one kernel per operator; second order without decay: hla2d with gamma = 1
        kname = "hla2d" if name == "hla2" else name
        gv = _add(bb, f"{kname}_decode_{tag}", KERNELS[kname].decode(dk, dv, dtype=dtype, **opts))
        args = [q, k, v, gamma] + list(state)
        first = len(args) - len(state)
        res = bb.emit(relax.call_tir_inplace(gv, args, list(range(first, len(args))) + [-1],
                                             st_ty + [out_ty]))
        return bb.emit(relax.TupleGetItem(res, len(state))), \
            [bb.emit(relax.TupleGetItem(res, i)) for i in range(len(state))]
    nc = (T + chunk - 1) // chunk
    e = lambda *s: _tt([B, H, nc, *s], acc)  # noqa: E731
    if name == "hla2":
        gs = _add(bb, f"hla2_chunk_summary_{tag}", hla2.chunk_summary(dk, dv, chunk, dtype=dtype))
        summ = bb.emit(relax.call_tir(gs, [q, k, v], [e(dk, dk), e(dk, dv), e(dk), e(dk, dv),
                                                      e(dk)]))
        d = [bb.emit(relax.TupleGetItem(summ, i)) for i in range(5)]
        gc = _add(bb, f"hla2_chunk_carry_{tag}", hla2.chunk_carry(
            dk, dv, masked=opts["masked"], ridge=opts["ridge"], dtype=dtype))
        car = bb.emit(relax.call_tir_inplace(gc, d + list(state), [5, 6, 7, 8, 9, -1, -1, -1],
                                             st_ty + [e(dk, dk), e(dk, dv), e(dk)]))
        new_state = [bb.emit(relax.TupleGetItem(car, i)) for i in range(5)]
        rec = [bb.emit(relax.TupleGetItem(car, i)) for i in range(5, 8)]
        go = _add(bb, f"hla2_chunk_output_{tag}", hla2.chunk_output(dk, dv, chunk, dtype=dtype,
                                                                  **opts))
        return bb.emit(relax.call_tir(go, [q, k, v] + rec, out_ty)), new_state
    return _emit_scan_family(bb, name, tag, q, k, v, state, gamma, chunk, dtype, opts, e,
                             st_sh, out_ty, dk, dv)


def _emit_scan_family(bb, name, tag, q, k, v, state, gamma, chunk, dtype, opts, e, st_sh,
                      out_ty, dk, dv):
    """summary -> scans of the prefix sums -> cross -> scans of the cross states -> output."""
    kmod = KERNELS[name]
    acc = _tir.accum_dtype(dtype)
    kk, kv, vec = (dk, dk), (dk, dv), (dk,)
    summary_out = {"hla2d": [kk, kv, vec, kk, kv, vec], "ahla": [kk, kv, vec, kv, vec],
                   "hla3": [kk, kv, vec, kk, kv, vec, kk, kv, vec]}[name]
    gs = _add(bb, f"{name}_chunk_summary_{tag}", kmod.chunk_summary(dk, dv, chunk, dtype=dtype))
    summ = bb.emit(relax.call_tir(gs, [q, k, v, gamma], [e(*s) for s in summary_out] + [e()]))
    d = [bb.emit(relax.TupleGetItem(summ, i)) for i in range(len(summary_out) + 1)]
    gl = d[-1]

    def scan(st, delta):
        """(new state, per-chunk record) of one element-wise chunk scan."""
        sh = st_sh[state.index(st)]
        width = int(np.prod([int(x) for x in sh[2:]]))
        gv = _add(bb, f"chunk_scan_w{width}_{acc}", _tir.chunk_scan(width, dtype=dtype))
        flat = bb.emit(relax.op.reshape(st, [sh[0], sh[1], width]))
        dflat = bb.emit(relax.op.reshape(delta, [sh[0], sh[1], -1, width]))
        dsh = list(dflat.ty.shape)
        res = bb.emit(relax.call_tir_inplace(gv, [flat, dflat, gl], [0, -1],
                                             [_tt([sh[0], sh[1], width], acc),
                                              _tt(dsh, acc)]))
        new = bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(res, 0)), sh))
        rec = bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(res, 1)), delta.ty.shape))
        return new, rec

    gx = _add(bb, f"{name}_chunk_cross_{tag}", kmod.chunk_cross(dk, dv, dtype=dtype))
    go = _add(bb, f"{name}_chunk_output_{tag}", kmod.chunk_output(dk, dv, chunk, dtype=dtype,
                                                                **opts))
    if name == "ahla":
        P, m, E, n = state
        R, dP, dm, dE, dn = d[:5]
        (P2, Pc), (m2, mc) = scan(P, dP), scan(m, dm)
        cr = bb.emit(relax.call_tir(gx, [R, Pc, mc, dE, dn, gl], [e(*kv), e(*vec)]))
        (E2, Ec), (n2, ncs) = scan(E, bb.emit(relax.TupleGetItem(cr, 0))), \
            scan(n, bb.emit(relax.TupleGetItem(cr, 1)))
        o = bb.emit(relax.call_tir(go, [q, k, v, gamma, Ec, Pc, ncs, mc], out_ty))
        return o, [P2, m2, E2, n2]
    if name == "hla3":
        S, P, m, F, eta = state
        dS, dP, dm, A1, A2, a2, A3, A4, a4 = d[:9]
        (S2, Sc), (P2, Pc), (m2, mc) = scan(S, dS), scan(P, dP), scan(m, dm)
        cr = bb.emit(relax.call_tir(gx, [Sc, Pc, mc, A1, A2, a2, A3, A4, a4, gl],
                                    [e(*kv), e(*vec)]))
        (F2, Fc), (eta2, etac) = scan(F, bb.emit(relax.TupleGetItem(cr, 0))), \
            scan(eta, bb.emit(relax.TupleGetItem(cr, 1)))
        o = bb.emit(relax.call_tir(go, [q, k, v, gamma, Sc, Pc, mc, Fc, etac], out_ty))
        return o, [S2, P2, m2, F2, eta2]
    S, C, m, G, h = state
    dS, dC, dm, KK, dG, dh = d[:6]
    (S2, Sc), (C2, Cc), (m2, mc) = scan(S, dS), scan(C, dC), scan(m, dm)
    cr = bb.emit(relax.call_tir(gx, [KK, Cc, mc, dG, dh, gl, gamma], [e(*kv), e(*vec)]))
    (G2, Gc), (h2, hc) = scan(G, bb.emit(relax.TupleGetItem(cr, 0))), \
        scan(h, bb.emit(relax.TupleGetItem(cr, 1)))
    o = bb.emit(relax.call_tir(go, [q, k, v, gamma, Sc, Cc, mc, Gc, hc], out_ty))
    return o, [S2, C2, m2, G2, h2]


def zero_state(bb, q, shapes):
    """Distinct zero tensors of `shapes` [B, H, ...] computed from q's shape at run time (never
    folded into module constants, which the in-place kernels would otherwise mutate)."""
    tails = [tuple(int(d) for d in sh[2:]) for sh in shapes]
    name = "hla_zero_state_" + "_".join("x".join(map(str, t)) for t in tails)
    gv = next((g for g in bb.get().get_global_vars() if g.name_hint == name), None)
    if gv is None:
        gv = bb.add_func(_tir.zero_state(tails).with_attr("global_symbol", name), name)
    res = bb.emit(relax.call_tir(gv, [q], [relax.TensorType(sh, "float32") for sh in shapes]))
    return [bb.emit(relax.TupleGetItem(res, i)) for i in range(len(shapes))]


def emit_operator(bb, order, asymmetric, q, k, v, state, decay, *, masked=True,
                  normalize=False, eps=1e-6, ridge=0.0, chunk=64):
    """(o, new_state list) of one HLA operator call with grouped key/value heads: q [B, H, T, Dk],
    k [B, Hkv, T, Dk], v [B, Hkv, T, Dv], state entries in `state_names` order (k/v-only entries
    with Hkv heads; empty for a fresh sequence, which starts from zeros), decay: per-query-head
    gamma [H] or None. The kernels run H heads: k, v and the k/v-only entries are repeated, and
    the new k/v-only entries keep each group's first."""
    op = operators.get(order, asymmetric)
    H, Hkv = int(q.ty.shape[1]), int(k.ty.shape[1])
    group = H // Hkv
    names = op.state_names
    if not state:   # a fresh sequence
        shapes = op.state_shapes(_shape(q)[0], H, Hkv, int(q.ty.shape[3]), int(v.ty.shape[3]))
        state = zero_state(bb, q, [list(shapes[n]) for n in names])
    if group > 1:
        k, v = (bb.emit(relax.op.repeat(x, group, axis=1)) for x in (k, v))
        state = [bb.emit(relax.op.repeat(s, group, axis=1)) if n in op.kv_state else s
                 for n, s in zip(names, state)]
    opts = dict(normalize=bool(normalize), eps=float(eps))
    name = op.name
    if op.has_mask_ridge:
        opts.update(masked=bool(masked), ridge=float(ridge))
        if decay is not None:
            name = "hla2d"
    out, new_state = emit_hla(bb, name, q, k, v, list(state), decay, chunk=int(chunk),
                              dtype=str(q.ty.dtype), **opts)
    if group > 1:
        new_state = [bb.emit(relax.op.strided_slice(s, axes=[1], begin=[0], end=[H],
                                                    strides=[group]))
                     if n in op.kv_state else s for n, s in zip(names, new_state)]
    return out, new_state
