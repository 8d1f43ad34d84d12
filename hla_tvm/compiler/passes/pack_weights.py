"""Relax rewrite: a model's weights stored as the kernels read them, packed under a quantization
scheme (`hla_tvm.quant`) or float32, in panels on CPUs (`quant.panels`), and read by kernels that
dequantize them where they are used (`quant.kernels`).

    matmul(x, permute_dims(W [N, K]))  or  matmul(x, W [K, N])   ->  quant.kernels.matmul
    take(E [N, K], ids, axis=0)                                  ->  quant.kernels.take

A bf16 prefill's products (several rows) go to AMX tiles where the target has them
(`quant.amx`); an int8 / int4 decode step's (one row a batch entry) to VPDPBUSD where it has
integer dot products (`quant.vnni`), which stores those weights in quads; a float32 or bf16
product of one stream's step (one row, static shapes) to `quant.matvec` on CPUs.

with W, E Relax constants (a model's parameters). Every weight is stored once in the [K, N]
layout a projection reads: an embedding table tied to the output head (one constant, or equal
bytes) is one stored tensor serving both. A weight whose K does not split into the scheme's
groups stays as it was (`kept`); so does a float32 embedding table that no product reads
(a lookup reads its rows whole)."""
from __future__ import annotations

import functools
import hashlib

import numpy as np
import tvm
from tvm import relax, tirx

from ...quant import amx, dpbf16, kernels, matvec, vnni
from ...quant.panels import stored
from ...quant.scheme import nbytes, quantize
from ...schedule.rules.cpu.matmul_tiles import tile_shape, vector_lanes


def panel_width(n, target):
    """The panel width P (`quant.panels`) of a weight with N = `n` columns compiled for
    `target`: the one-row register tile's width, or None (the [R, N] layout: GPUs, or no
    tile width dividing N)."""
    if target.kind.name != "llvm":
        return None

    return tile_shape(1, n, vector_lanes(target))[1]


def _rows(x):
    """The static row count of the activations `x` [.., rows, K] (1: a decode step), or None
    (symbolic, or fewer than two axes)."""
    shape = getattr(x.ty, "shape", None)
    if shape is None or len(shape) < 2 or not isinstance(shape[-2], tvm.tirx.IntImm):
        return None
    return int(shape[-2])


def _one_row(x):
    """Whether the activations `x` [.., K] hold one row, every leading axis static 1 (a decode
    step of one stream)."""
    shape = getattr(x.ty, "shape", None)
    return shape is not None and len(shape) >= 2 and all(
        isinstance(d, tvm.tirx.IntImm) and int(d) == 1 for d in list(shape)[:-1])


def prefill_blocks(sch, target):
    """The kernel kind (`quant.amx`, else `quant.dpbf16`) a prefill's products of the scheme
    `sch` run on for `target`, or None (float32 products: `quant.kernels`): bf16 weights, and
    int8 / int4 ones where stored in quads (`quant.vnni.lanes`), on AMX tiles where the target
    has AMX-BF16, else on VDPBF16PS where it has AVX512-BF16. Their products round the
    activations to bfloat16 (int8 / int4: W too, `quant.bf16_blocks.dequantized_pairs`)."""
    if sch is None or sch.name not in ("bf16", "int8", "int4"):
        return None
    if sch.name != "bf16" and vnni.lanes(target) is None:
        return None
    return next((kind for kind in (amx, dpbf16) if kind.available(target)), None)


def weight_operand(expr, lookup):
    """(the float32 2-d Relax constant that a matmul's right operand `expr` is, directly or
    through a 2-d transpose; whether transposed), following variable bindings (lookup(var):
    the value bound to it, or None), or None. Only the constant's type is read: nothing is
    copied."""
    permute_op = tvm.ir.Op.get("relax.permute_dims")
    transposed = False
    for _ in range(64):
        bound = lookup(expr) if isinstance(expr, relax.Var) else None
        if bound is not None:
            expr = bound
        elif isinstance(expr, relax.Call) and expr.op.same_as(permute_op) and not transposed:
            axes = expr.attrs.axes
            if axes is not None and [int(a) for a in axes] != [1, 0]:
                return None
            expr, transposed = expr.args[0], True
        else:
            break
    ty = getattr(expr, "ty", None)
    if not isinstance(expr, tvm.ir.expr.Constant) or getattr(ty, "ndim", None) != 2 or \
            str(ty.dtype) != "float32":
        return None
    return expr, transposed


def weight_matrix(found):
    """The [K, N] numpy array of `weight_operand`'s result."""
    const, transposed = found
    data = const.value.numpy()
    return np.ascontiguousarray(data.T) if transposed else data


def pack_weights(mod, sch, target):
    """(`mod` with its weights stored under the scheme `sch` (None: float32) in the layout of
    `target` (`panel_width`), {"packed": count, "kept": [shapes left as they were: K not a
    multiple of the group], "unpacked": [other float32 weights no packed product reads, with
    the operator that reads them: `unpacked_weights`], "bytes": stored bytes of the packed
    weights, "float_bytes": their float32 bytes}). The
    caller's module is unchanged."""
    matmul_op, take_op = (tvm.ir.Op.get(f"relax.{n}") for n in ("matmul", "take"))
    # a prefill's bf16 products on AMX tiles where the target has them (`quant.amx`), else on
    # VDPBF16PS where it has AVX512-BF16 (`quant.dpbf16`)
    blocks = prefill_blocks(sch, target)
    # an int8 / int4 decode step's products on integer dot products where the target has them
    vnni_lanes = vnni.lanes(target) if sch is not None and sch.name in vnni.OFFSET else None
    hand_funcs = {}   # name -> the GlobalVar of a hand-written kernel (amx, vnni, matvec)
    # sha256 of a [K, N] weight's bytes -> (q const, scale const, width, in quads) or None
    packed = {}
    report = {"packed": 0, "kept": [], "bytes": 0, "float_bytes": 0}
    phase = {"products": True}   # the pass rewrites the products, or the lookups

    def key_of(w):
        data = np.ascontiguousarray(w).tobytes() + repr(w.shape).encode()
        return hashlib.sha256(data).hexdigest()

    def pack(w, key):
        """The (q, scale or None, panel width, in quads) of the float32 [K, N] weight `w`, or
        None (kept as it was)."""
        if key not in packed:
            p = panel_width(w.shape[1], target)
            if sch is None and p is None:
                packed[key] = None   # float32 in the layout it has: nothing to store anew
            elif sch is not None and not sch.fits(w.shape[0]):
                report["kept"].append(list(w.shape))
                packed[key] = None
            else:
                arrays = {"q": w} if sch is None else quantize(sch, w)
                report["packed"] += 1
                report["bytes"] += nbytes(arrays)
                report["float_bytes"] += int(w.nbytes)
                scale = arrays.get("scale")
                quads = vnni.fits(sch, *w.shape, p, vnni_lanes)
                packed[key] = (relax.const(stored(sch, arrays["q"], p, quads)),
                               None if scale is None else relax.const(scale), p, quads)
        return packed[key]

    @relax.expr_functor.mutator
    class _Pack(relax.PyExprMutator):
        def _weight(self, expr):
            """The float32 [K, N] weight a matmul's right operand is, or None."""
            found = weight_operand(expr, self.lookup_binding)
            return None if found is None else weight_matrix(found)

        def _call(self, name, data, w):
            """call_tir of the kernel `name` ("matmul": data = x; "take": data = ids) on the
            stored [K, N] weight `w`, or None where `w` stays as it was."""
            key = key_of(w)
            if name == "take" and sch is None and key not in packed:
                return None   # a float32 table that no product reads: its rows, as they are
            found = pack(w, key)
            if found is None:
                return None
            q, scale, p, quads = found
            k, n = w.shape
            extra = dict(sch=sch, k=k, n=n, group=None if sch is None else sch.group(k),
                         panel=p)

            if name == "matmul" and blocks is not None and blocks.fits(k, n, p) and \
                    _rows(data) != 1 and (sch.name == "bf16" or quads):
                return self._bf16_blocks(blocks, data, q, k, n, p, scale if quads else None)
            if name == "matmul" and quads and _rows(data) == 1:
                return self._vnni_matmul(data, q, scale, k, n, p)
            if name == "matmul" and target.kind.name == "llvm" and _one_row(data) and \
                    (sch is None or sch.name == "bf16") and \
                    matvec.fits(sch, k, n, p, vector_lanes(target)):
                return self._matvec(data, q, k, n, p)

            def te_fn(arg, qt, *st):
                s = st[0] if st else None   # (bf16 has no scales)
                if name == "matmul":
                    return kernels.matmul(arg, qt, s, grouped=target.kind.name == "llvm",
                                          **extra)
                return kernels.take(qt, s, arg, **extra)

            return self.builder_.call_te(te_fn, data, q, *([] if scale is None else [scale]),
                                         primfunc_name_hint=f"{sch.name}_{name}" if sch else
                                         f"stored_{name}")

        def _hand_kernel(self, fname, make, x, args, k, n, scratch=None):
            """x [.., K] @ a stored weight through the scheduled PrimFunc `make(fname)` (added
            once a name), called on x as [M, K] rows and `args` (the weight's constants),
            out [M, N] float32 (and a `scratch(m)` output where given), reshaped back."""
            if fname not in hand_funcs:
                hand_funcs[fname] = self.builder_.add_func(make(fname), fname)
            lead = list(x.ty.shape)[:-1]
            m = functools.reduce(lambda a, b: a * b, lead, tirx.IntImm("int64", 1))
            rows = self.builder_.emit(relax.op.reshape(x, [m, k]))
            out_ty = relax.TensorType([m, n], "float32")
            out = self.builder_.emit(relax.call_tir(
                hand_funcs[fname], [rows, *args],
                out_ty if scratch is None else [out_ty, scratch(m)]))
            if scratch is not None:
                out = self.builder_.emit(relax.TupleGetItem(out, 0))
            return relax.op.reshape(out, [*lead, n])

        def _bf16_blocks(self, kind, x, q, k, n, p, scale=None):
            """x [.., K] @ the bf16 weight `q` (pairs in panels of `p`), or the int8 / int4
            weight `q` (quads in panels) with its `scale`, through the output blocks of `kind`
            (`quant.amx`, `quant.dpbf16`: `quant.bf16_blocks`), the kernel's bf16 copy of the
            rows a scratch output."""
            infix = "" if scale is None else f"_{sch.name}"
            return self._hand_kernel(
                f"{kind.PREFIX}{infix}_matmul_{k}_{n}",
                lambda f: kind.matmul_func(k, n, p, f, sch=None if scale is None else sch), x,
                [q] if scale is None else [q, scale], k, n,
                scratch=lambda m: relax.TensorType(
                    [(m + kind.ROWS - 1) // kind.ROWS * kind.ROWS, k], "uint16"))

        def _matvec(self, x, q, k, n, p):
            """x [1, .., 1, K] @ the float32 or bf16 weight `q` in panels of `p`
            (`quant.matvec`)."""
            return self._hand_kernel(
                f"{sch.name if sch else 'float32'}_matvec_{k}_{n}",
                lambda f: matvec.matvec_func(sch, k, n, p, vector_lanes(target), f,
                                             matvec.prefetch_bytes(target)), x, [q], k, n)

        def _vnni_matmul(self, x, q, scale, k, n, p):
            """x [.., 1, K] @ the int8 / int4 weight `q` (quads in panels of `p`) on integer
            dot products (`quant.vnni`)."""
            return self._hand_kernel(
                f"vnni_{sch.name}_matvec_{k}_{n}",
                lambda f: vnni.matvec_func(sch, k, n, p, vnni_lanes, f, matvec.prefetch_bytes(
                    target)), x, [q, scale], k, n)

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(matmul_op) and phase["products"]:
                x = call.args[0]
                if getattr(x.ty, "dtype", None) != "float32" or \
                        call.attrs.out_dtype not in (None, "", "float32", "void"):
                    return call
                w = self._weight(call.args[1])
                out = None if w is None else self._call("matmul", x, w)
                return call if out is None else out
            if call.op.same_as(take_op) and int(call.attrs.axis) == 0 and \
                    not phase["products"]:
                found = weight_operand(call.args[0], self.lookup_binding)
                if found is None or found[1]:   # (a lookup reads the table itself, [N, K])
                    return call
                out = self._call("take", call.args[1],
                                 np.ascontiguousarray(weight_matrix(found).T))
                return call if out is None else out
            return call

    if sch is None and target.kind.name != "llvm":
        return mod, report   # float32 weights stay as they are off CPUs
    # the products first, so that a float32 table's lookups know whether a product reads it
    for products in (True, False):
        phase["products"] = products
        mutator = _Pack(mod)
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gv, relax.analysis.remove_all_unused(
                    mutator.visit_expr(func)))
        mod = mutator.builder_.get()
    if sch is not None:
        report["unpacked"] = unpacked_weights(mod, [c for v in packed.values() if v
                                                    for c in v[:2] if c is not None])
    return mod, report


UNPACKED_MIN = 1024   # elements: smaller float32 constants (norms, biases, decays) go unsaid


def unpacked_weights(mod, made):
    """[{"shape", "op"}] for each float32 constant of two or more axes and UNPACKED_MIN or more
    elements that `mod`'s Relax functions still read and that is none of `made` (the packed
    weights' constants): what a quantizing compile left float32 besides the weights whose K
    does not split into groups (a weight an einsum or a 3-d product reads, a table read other
    than by a lookup), with the operator that reads it."""
    found = {}

    @relax.expr_functor.visitor
    class _Find(relax.PyExprVisitor):
        def visit_call_(self, call):
            for arg in call.args:
                if not isinstance(arg, tvm.ir.expr.Constant) or \
                        any(arg.same_as(m) for m in made):
                    continue
                value = arg.value
                if hasattr(value, "numpy") and str(value.dtype) == "float32" and \
                        len(value.shape) >= 2 and \
                        int(np.prod(value.shape)) >= UNPACKED_MIN:
                    op = call.op.name if isinstance(call.op, tvm.ir.Op) else \
                        getattr(call.op, "name_hint", str(call.op))
                    found.setdefault(hashlib.sha256(value.numpy().tobytes()).hexdigest(),
                                     {"shape": [int(d) for d in value.shape], "op": op})
            super().visit_call_(call)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            _Find().visit_expr(func)
    return list(found.values())
