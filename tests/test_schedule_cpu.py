"""The default CPU schedule rules for the ops around the HLA kernels, on legalized-style
functions, against float64 numpy: x @ W[K, N] with an element-wise epilogue (static and
symbolic row counts, remainders, column tiles of 64..8), batched operands, and element-wise
chains."""
import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import te  # noqa: E402

from hla_tvm.compiler import resolve_model_target  # noqa: E402
from hla_tvm.schedule.rules.cpu.matmul_tiles import MatmulTiles, is_outer_matmul  # noqa: E402
from hla_tvm.schedule.rules.cpu.parallel_fallback import ParallelFallback  # noqa: E402

RNG = np.random.default_rng(0)


def _i64(*dims):
    return tuple(tvm.tirx.IntImm("int64", d) if isinstance(d, int) else d for d in dims)


def _matmul_silu(rows, k, n, lead=()):
    """out = silu(x @ w) * g with x [*lead, rows, k], w [k, n], g [*lead, rows, n] (int64 dims,
    as Relax legalizes)."""
    rows, k, n, lead = *_i64(rows, k, n), _i64(*lead)
    x = te.placeholder((*lead, rows, k), name="x")
    w = te.placeholder((k, n), name="w")
    g = te.placeholder((*lead, rows, n), name="g")
    r = te.reduce_axis((0, k), name="r")
    mm = te.compute((*lead, rows, n), lambda *i: te.sum(x[(*i[:-1], r)] * w[r, i[-1]], axis=r),
                    name="matmul")
    sig = te.compute(mm.shape, lambda *i: te.sigmoid(mm[i]), name="sig")
    out = te.compute(mm.shape, lambda *i: mm[i] * sig[i] * g[i], name="out")
    return te.create_prim_func([x, w, g, out]), (x, w, g)


def _run(func, rule, shapes):
    tgt = resolve_model_target("llvm")
    sch = rule.apply(func.with_attr("global_symbol", "main"), tgt, False)
    assert sch is not None, "the rule declined the function"
    with tgt:
        lib = tvm.compile(sch.mod, target=tgt)
    args = [RNG.standard_normal(s).astype("float32") for s in shapes]
    out = np.zeros(shapes[-1], "float32")
    lib["main"](*[tvm.runtime.tensor(a) for a in args[:-1]], o := tvm.runtime.tensor(out))
    return args, o.numpy()


def _silu_ref(x, w, g):
    mm = x.astype(np.float64) @ w.astype(np.float64)
    return mm / (1 + np.exp(-mm)) * g


@pytest.mark.parametrize("rows,k,n", [(1, 256, 1024), (13, 64, 1000), (8, 32, 48), (5, 16, 24)])
def test_matmul_tiles_static(rows, k, n):
    func, _ = _matmul_silu(rows, k, n)
    (x, w, g, _), got = _run(func, MatmulTiles(), [(rows, k), (k, n), (rows, n), (rows, n)])
    np.testing.assert_allclose(got, _silu_ref(x, w, g), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [24, 64])   # one- and two-vector column tiles, 12 and 6 rows (AVX2)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_matmul_tiles_symbolic_rows(rows, n):
    t = te.var("T", "int64")
    func, _ = _matmul_silu(t, 48, n, lead=(2,))
    (x, w, g, _), got = _run(func, MatmulTiles(),
                             [(2, rows, 48), (48, n), (2, rows, n), (2, rows, n)])
    np.testing.assert_allclose(got, _silu_ref(x, w, g), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch,entries", [("b", 1), ("b", 2), ("b", 5), (4, 4), (3, 3)])
def test_matmul_tiles_one_row_per_batch_entry(batch, entries):
    """A decode step of several streams (x [B, 1, K]): the entries are the tile's rows,
    `BATCH_ROWS` at a time for a symbolic B (a predicated tail for an odd count) or a static B
    they divide, one at a time for another static B."""
    from hla_tvm.schedule.rules.cpu.matmul_tiles import BATCH_ROWS

    b = te.var("b", "int64") if batch == "b" else batch
    func, _ = _matmul_silu(1, 96, 256, lead=(b,))
    tgt = resolve_model_target("llvm")
    sch = MatmulTiles().apply(func.with_attr("global_symbol", "main"), tgt, False)
    if batch == "b" or batch % BATCH_ROWS == 0:   # the fused entries split by the tile's rows
        assert f"T.unroll(T.int64({BATCH_ROWS}))" in sch.mod.script()
    (x, w, g, _), got = _run(func, MatmulTiles(), [(entries, 1, 96), (96, 256), (entries, 1, 256),
                                                   (entries, 1, 256)])
    np.testing.assert_allclose(got, _silu_ref(x, w, g), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,group", [("bf16", None), ("int8", None), ("int4", 32)])
@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 13), ("b", 7)])
def test_matmul_tiles_dequantize_a_column_tile_once_for_every_row(name, group, batch, rows):
    """A prefill's product with packed weights in panels (symbolic rows, a static or symbolic
    batch): the weight's column tile is dequantized once under the parallel loop, then read by
    every row tile."""
    from hla_tvm.compiler.passes.pack_weights import panel_width
    from hla_tvm.quant.kernels import DEQUANTIZE, matmul
    from hla_tvm.quant.panels import stored
    from hla_tvm.quant.scheme import activations, dequantize, quantize, scheme

    k, n = 64, 256
    sch = scheme(name, group)
    tgt = resolve_model_target("llvm")
    p = panel_width(n, tgt)
    t = te.var("T", "int64")
    b = te.var("b", "int64") if batch == "b" else batch
    entries = 2 if batch == "b" else batch
    x = te.placeholder(_i64(b, t, k), name="x")
    packed = quantize(sch, RNG.standard_normal((k, n)).astype(np.float32) * 0.1)
    qs = stored(sch, packed["q"], p)
    q = te.placeholder(_i64(*qs.shape), str(qs.dtype), name="q")
    scale = packed.get("scale", np.ones((1, n), np.float32))
    s = te.placeholder(_i64(*scale.shape), name="s")
    mm = matmul(x, q, s, sch=sch, k=k, n=n, group=sch.group(k) if group else k, panel=p)
    func = te.create_prim_func([x, q, s, mm])
    rule = MatmulTiles().apply(func.with_attr("global_symbol", "main"), tgt, False)
    # a stage of its own, under the parallel loop (not inlined, not computed whole at the root)
    loops = rule.get_loops(rule.get_sblock(DEQUANTIZE))
    assert rule.get(loops[0]).kind == tvm.tirx.ForKind.PARALLEL
    with tgt:
        lib = tvm.compile(rule.mod, target=tgt)
    xs = RNG.standard_normal((entries, rows, k)).astype(np.float32)
    got = tvm.runtime.tensor(np.zeros((entries, rows, n), np.float32))
    lib["main"](*[tvm.runtime.tensor(a) for a in (xs, qs, np.ascontiguousarray(scale))], got)
    want = activations(sch, xs).astype(np.float64) @ dequantize(sch, packed).astype(np.float64)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_is_outer_matmul_rejects_inner_reduction():
    """x @ W^T with W [N, K] (reduction innermost in both operands) is dlight GEMV's, not ours."""
    x = te.placeholder((4, 32), name="x")
    w = te.placeholder((16, 32), name="w")
    r = te.reduce_axis((0, 32), name="r")
    mm = te.compute((4, 16), lambda i, j: te.sum(x[i, r] * w[j, r], axis=r), name="mm")
    func = te.create_prim_func([x, w, mm])
    assert MatmulTiles().apply(func, resolve_model_target("llvm"), False) is None
    sch = tvm.s_tir.Schedule(func)
    assert not is_outer_matmul(sch.get(sch.get_sblock("mm")))


@pytest.mark.parametrize("n", [256, 1 << 16])
def test_parallel_fallback_elementwise_chain(n):
    """a * sigmoid(a) + b over [2, n]: the chain is inlined; serial below PARALLEL_MIN."""
    a = te.placeholder((2, n), name="a")
    b = te.placeholder((2, n), name="b")
    s = te.compute((2, n), lambda i, j: te.sigmoid(a[i, j]), name="s")
    out = te.compute((2, n), lambda i, j: a[i, j] * s[i, j] + b[i, j], name="out")
    func = te.create_prim_func([a, b, out])
    (av, bv, _), got = _run(func, ParallelFallback(), [(2, n)] * 3)
    a64 = av.astype(np.float64)
    np.testing.assert_allclose(got, a64 / (1 + np.exp(-a64)) + bv, rtol=1e-5, atol=1e-6)


def test_a_prefills_element_wise_work_runs_in_parallel_and_a_decode_steps_serially():
    """The functions only a prefill calls are marked (`compiler.passes.prefill_rows`); ParallelFallback
    runs a marked element-wise function of symbolic rows in parallel, an unmarked one (a decode
    step's rows: one a stream) serially; the marked one still computes the same."""
    import torch

    from hla_tvm.compiler import prepare, to_relax
    from hla_tvm.models import HLALM
    from hla_tvm.schedule.common import MANY_ROWS

    tgt = resolve_model_target("llvm")
    torch.manual_seed(0)
    mod = prepare(to_relax(HLALM(40, 32, 1, 4, chunk_size=16).eval(), target=tgt), tgt)
    marked = {gv.name_hint for gv in mod.get_global_vars()
              if isinstance(mod[gv], tvm.tirx.PrimFunc) and MANY_ROWS in (mod[gv].attrs or {})}
    assert marked and all(gv.name_hint in mod["prefill"].script() for gv in
                          mod.get_global_vars() if gv.name_hint in marked)
    assert not any(name in mod["decode"].script() for name in marked)
    rows = te.var("rows", "int64")
    a = te.placeholder((rows, 64), name="a")
    out = te.compute((rows, 64), lambda i, j: a[i, j] * te.sigmoid(a[i, j]), name="out")
    func = te.create_prim_func([a, out]).with_attr("global_symbol", "main")
    for attrs, parallel in (({}, False), ({MANY_ROWS: True}, True)):
        sch = ParallelFallback().apply(func.with_attrs(attrs) if attrs else func, tgt, False)
        assert ("T.parallel" in sch.mod.script()) == parallel
    with tgt:
        lib = tvm.compile(sch.mod, target=tgt)
    x = RNG.standard_normal((37, 64)).astype(np.float32)
    got = tvm.runtime.tensor(np.zeros((37, 64), np.float32))
    lib["main"](tvm.runtime.tensor(x), got)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(got.numpy(), x64 / (1 + np.exp(-x64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lanes, elem_bytes", [(4, 4), (8, 4), (16, 4), (8, 8), (16, 2)])
@pytest.mark.parametrize("rows, cols", [(64, 64), (32, 128), (128, 128), (16, 16)])
def test_chunk_gemm_tile_stays_on_the_stack(lanes, elem_bytes, rows, cols):
    """The chunk products' register tile stays under TVM's stack limit (1 kB): a tile of 1 kB
    or more comes from the workspace allocator, where LLVM stored every accumulator after each
    multiply-add (AVX-512's 8 x 32 float tile: the chunk kernels ran 1.8-2x slower)."""
    from hla_tvm.schedule.steps.cpu.chunk_gemm import STACK_BYTES, tile

    shape = tile(rows, cols, lanes, elem_bytes)
    assert shape is not None
    r, c = shape
    assert rows % r == 0 and cols % c == 0 and c % lanes == 0
    assert r * c * elem_bytes < STACK_BYTES == 1024


@pytest.mark.parametrize("name,group,batch", [("int4", 32, 1), ("int4", 32, 3),
                                              ("int8", None, 2), ("int8", 32, 1),
                                              ("int8", 32, 5)])
def test_group_matvec_with_its_epilogue(name, group, batch):
    """A decode step's product with packed weights in panels, the scales out of each group's
    sum (`quant.kernels.group_matvec`, `GroupMatvec`), plus a residual add, for a symbolic
    batch: against float64 numpy with the dequantized weights."""
    from hla_tvm.compiler.passes.pack_weights import panel_width
    from hla_tvm.quant.kernels import matmul
    from hla_tvm.quant.panels import to_panels
    from hla_tvm.quant.scheme import dequantize, quantize, scheme
    from hla_tvm.schedule.rules.cpu.group_matvec import GroupMatvec

    k, n = 96, 256
    sch = scheme(name, group)
    p = panel_width(n, resolve_model_target("llvm"))
    b = te.var("b", "int64")
    x = te.placeholder(_i64(b, 1, k), name="x")
    rows = k // 2 if name == "int4" else k
    q = te.placeholder(_i64(n // p, rows, p), "uint8" if name == "int4" else "int8", name="q")
    groups = k // sch.group(k)
    s = te.placeholder(_i64(groups, n), name="s")
    res = te.placeholder(_i64(b, 1, n), name="res")
    mm = matmul(x, q, s, sch=sch, k=k, n=n, group=sch.group(k), panel=p, grouped=True)
    out = te.compute(mm.shape, lambda *i: mm[i] + res[i], name="add")
    func = te.create_prim_func([x, q, s, res, out])
    plain = tvm.s_tir.Schedule(func)
    names = {plain.get(blk).name_hint for blk in plain.get_child_blocks(plain.get_sblock("root"))}
    assert "group_partial" in names and "group_scaled" in names   # the grouped form
    w = RNG.standard_normal((k, n)).astype(np.float32) * 0.1
    packed = quantize(sch, w)
    tgt = resolve_model_target("llvm")
    rule = GroupMatvec().apply(func.with_attr("global_symbol", "main"), tgt, False)
    assert rule is not None, "the rule declined the function"
    # an int4 group's sum runs by row pairs, unrolled (one byte load feeds both nibbles); the
    # sums of a symbolic batch run two entries at a time (the tile's rows, unrolled)
    script = rule.mod.script()
    assert bool(re.search(r"v_k = T.axis.reduce\(\d+, \w+ \* 2 \+ \w+\)", script)) == \
        (name == "int4")
    assert "for ax0 in T.unroll(T.int64(2))" in script
    with tgt:
        lib = tvm.compile(rule.mod, target=tgt)
    xs = RNG.standard_normal((batch, 1, k)).astype(np.float32)
    rs = RNG.standard_normal((batch, 1, n)).astype(np.float32)
    got = tvm.runtime.tensor(np.zeros((batch, 1, n), np.float32))
    lib["main"](*[tvm.runtime.tensor(a) for a in (xs, to_panels(packed["q"], p),
                                                   packed["scale"], rs)], got)
    want = xs.astype(np.float64) @ dequantize(sch, packed).astype(np.float64) + rs
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)

