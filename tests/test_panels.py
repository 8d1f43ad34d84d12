"""Weights stored in panels on CPUs (`quant.panels`, `compiler.passes.pack_weights`): each value at its
panel, row and column; a compiled model's products reading float32 panels, a tied table stored
once, an untied table kept as rows; the module against float64 PyTorch; an int8 / int4 model's
decode products grouped (`group_matvec`), its prefill products plain."""
import numpy as np
import pytest
import torch
from conftest import rel_err

from hla_tvm.quant.panels import from_panels, to_panels

FAST = {
    "test_each_value_sits_at_its_panel_row_and_column",
    "test_products_read_float32_panels_and_a_tied_table_is_stored_once[True]",
    "test_products_read_float32_panels_and_a_tied_table_is_stored_once[False]",
    "test_a_quantized_models_decode_products_are_grouped_and_its_prefill_products_plain[int8]",
    "test_a_quantized_models_decode_products_are_grouped_and_its_prefill_products_plain[int4]",
}


def test_each_value_sits_at_its_panel_row_and_column():
    q = np.arange(6 * 256, dtype=np.int64).reshape(6, 256)
    panels = to_panels(q, 128)
    assert panels.shape == (2, 6, 128) and panels.flags.c_contiguous
    for r in range(6):
        for n in range(256):
            assert panels[n // 128, r, n % 128] == q[r, n]
    np.testing.assert_array_equal(from_panels(panels), q)
    assert to_panels(q, None) is q
    with pytest.raises(ValueError, match="N = 100 columns do not split into panels of 128"):
        to_panels(q[:, :100], 128)


def _constants(mod):
    """Shapes and dtypes of the distinct Relax constants (by value: TVM stores equal constants
    once) `mod`'s Relax functions pass to calls."""
    import tvm
    from tvm import relax

    found = {}

    def seen(expr):
        if isinstance(expr, tvm.ir.expr.Constant):
            data = expr.value.numpy()
            found[data.tobytes() + repr(data.shape).encode()] = (data.shape, str(data.dtype))
        elif isinstance(expr, relax.Tuple):
            for field in expr.fields:
                seen(field)
        elif isinstance(expr, relax.Call):
            for arg in expr.args:
                seen(arg)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for block in func.body.blocks:
                for binding in block.bindings:
                    seen(binding.value)
    return list(found.values())


def stored_weights(model):
    """The [N, K] shapes of an HLALM's projection weights as a compiled module stores them: the
    weights of the products of one input concatenated along N (`compiler.passes.parallel_products`),
    an untied head's own."""
    out = []
    for block in model.blocks:
        a, m = block.attn, block.mlp
        for group in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate, m.up), (m.down,)):
            out.append(torch.Size([sum(x.weight.shape[0] for x in group),
                                   group[0].weight.shape[1]]))
    if model.head is not None:
        out.append(model.head.weight.shape)
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_products_read_float32_panels_and_a_tied_table_is_stored_once(tied):
    from hla_tvm.compiler import prepare, to_relax
    from hla_tvm.compiler.passes.pack_weights import panel_width
    from hla_tvm.models import HLALM
    from hla_tvm.target import resolve

    torch.manual_seed(0)
    model = HLALM(256, 64, 1, 4, chunk_size=16, mlp_hidden=192, tie_embeddings=tied).eval()
    target = resolve("llvm")
    consts = _constants(prepare(to_relax(model, target=target), target))
    p = panel_width(256, target)
    assert p in (64, 128)   # the one-row tile's width for N = 256: 128 on AVX-512, 64 below
    panels = [s for s, d in consts if len(s) == 3 and d == "float32"]
    # every product's weight W [K, N] (nn.Linear's [N, K], and the head) as [N / P, K, P]; the
    # products of one input as one weight (`compiler.passes.parallel_products`): q, k, v and gate, up
    weights = stored_weights(model)
    if tied:
        weights.append(model.embed.weight.shape)   # the head reads the table: N = vocab
    for n, k in weights:
        width = panel_width(n, target)
        assert (n // width, k, width) in panels, (n, k, panels)
    assert len(panels) == len(weights), panels
    # no 2-D float32 weight is left beside them but an untied table, read by its rows
    left = [s for s, d in consts if len(s) == 2 and d == "float32" and s[0] * s[1] >= 64 * 64]
    assert left == ([] if tied else [(256, 64)]), left
    heads = [s for s in panels if s == (256 // p, 64, p)]
    assert len(heads) == 1   # tied: the head and the table are one stored tensor


def test_untied_float32_module_equals_float64_pytorch(tmp_path):
    """An untied head read from panels, the table by its rows: prefill and decode against the
    model in float64."""
    from hla_tvm import runtime
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM

    torch.manual_seed(2)
    model = HLALM(256, 64, 2, 4, chunk_size=16, mlp_hidden=256, tie_embeddings=False).eval()
    path = compile_model(model, out=tmp_path / "m.so", schedules="default")
    mod = runtime.load(path)
    tokens = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = model.double()(tokens, None)
    state = mod.init_state(2)
    got = torch.from_numpy(np.asarray(mod.prefill(tokens[:, :40].numpy(), state)[0]))
    assert rel_err(got, want[:, :40]) <= 1e-4
    step = torch.from_numpy(np.asarray(mod.decode(tokens[:, 40].numpy(), state)[0]))
    assert rel_err(step, want[:, 40]) <= 1e-4


def test_gpu_targets_keep_float32_weights_as_they_are():
    """For a CUDA target (compiled here, no GPU needed) float32 products keep Relax's matmul
    and the [K, N] weights the model gives them: nothing is stored in panels."""
    from hla_tvm.compiler import prepare, to_relax
    from hla_tvm.models import HLALM
    from hla_tvm.target import resolve

    model = HLALM(256, 64, 1, 4, chunk_size=16, mlp_hidden=192).eval()
    target = resolve({"kind": "cuda", "arch": "sm_90"})
    mod = prepare(to_relax(model, target=target), target)
    consts = _constants(mod)
    assert not [s for s, d in consts if len(s) == 3 and d == "float32"], consts
    assert (256, 64) in [tuple(s) for s, _ in consts]   # the table, read by lookup and head
    assert not [gv for gv in mod.get_global_vars() if "stored_" in gv.name_hint]


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_quantized_models_decode_products_are_grouped_and_its_prefill_products_plain(name):
    """With int8 / int4 weights in panels, for a CPU without integer dot products (Zen 3: the
    VNNI ones, `quant.vnni`, are in tests/test_cpu_isa.py), every product a decode step calls
    is a `group_matvec` (the scales out of each group's sum) and every product of prefill a
    dequantizing `matmul`."""
    from tvm import relax

    from hla_tvm.compiler import prepare, to_relax
    from hla_tvm.models import HLALM
    from hla_tvm.quant.kernels import GROUP_PARTIAL
    from hla_tvm.quant.scheme import scheme
    from hla_tvm.target import resolve

    model = HLALM(256, 64, 2, 4, chunk_size=16, mlp_hidden=192).eval()
    target = resolve({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "znver3"})
    mod, _ = prepare(to_relax(model, target=target), target, scheme(name, 32))

    def products(entry):
        """(grouped, plain) counts of the product kernels `entry` calls: kernels holding a
        GROUP_PARTIAL block, and kernels holding a "matmul" block."""
        found = []

        def visit(expr):
            if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == \
                    "relax.call_tir":
                script = mod[expr.args[0]].script()
                found.append((f'sblock("{GROUP_PARTIAL}"' in script, 'sblock("matmul"' in script))

        relax.analysis.post_order_visit(mod[entry], visit)
        return sum(g for g, _ in found), sum(m for _, m in found)

    linears = len(stored_weights(model))
    assert products("decode") == (linears + 1, 0)   # the layers' products and the head
    assert products("prefill") == (0, linears + 1)


@pytest.mark.parametrize("name", [None, "bf16"])
@pytest.mark.parametrize("k,n,panel", [(24, 16, 16), (64, 96, 32), (768, 256, 128)])
def test_one_stream_product_matches_float64(name, k, n, panel):
    """`quant.matvec` (a decode step of one stream, float32 or bf16 weights in panels, with
    prefetch) against numpy's float64 product of the same weights and activations (bf16:
    both rounded to bfloat16), one or several panels and steps."""
    import tvm

    from hla_tvm.quant import matvec
    from hla_tvm.quant.panels import stored
    from hla_tvm.quant.scheme import activations, dequantize, quantize, scheme
    from hla_tvm.target import resolve

    sch = scheme(name) if name else None
    tgt = resolve("llvm")
    from hla_tvm.schedule.rules.cpu.matmul_tiles import vector_lanes

    lanes = vector_lanes(tgt)
    if not matvec.fits(sch, k, n, panel, lanes):
        pytest.skip(f"a panel of {panel} does not hold whole vectors of {lanes} lanes")
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((1, k)).astype(np.float32)
    if sch is None:
        q, wd, xa = stored(None, w, panel), w, x
    else:
        packed = quantize(sch, w)
        q, wd, xa = stored(sch, packed["q"], panel), dequantize(sch, packed), activations(sch, x)
    lib = tvm.compile(tvm.IRModule({"f": matvec.matvec_func(sch, k, n, panel, lanes, "f")}),
                      target=tgt)
    out = tvm.runtime.tensor(np.full((1, n), np.nan, np.float32))
    lib["f"](tvm.runtime.tensor(x), tvm.runtime.tensor(q), out)
    want = xa.astype(np.float64) @ wd.astype(np.float64)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", [None, "bf16"])
def test_one_streams_step_takes_the_matvec_and_a_batch_the_tiles(name):
    """A float32 / bf16 model for a CPU: the one-stream decode entry's products are
    `quant.matvec` kernels, the batch's decode entry keeps the scheduled products."""
    from hla_tvm.compiler import prepare, target_entries, to_relax
    from hla_tvm.models import HLALM
    from hla_tvm.quant.scheme import scheme
    from hla_tvm.target import resolve

    model = HLALM(256, 64, 2, 4, chunk_size=16, mlp_hidden=192).eval()
    target = resolve("llvm")
    mod = target_entries(to_relax(model, target=target), target)
    mod = prepare(mod, target, scheme(name)) if name else prepare(mod, target)
    mod = mod[0] if isinstance(mod, tuple) else mod
    one, batch = mod["decode_1"].script(), mod["decode"].script()
    tag = f"{name or 'float32'}_matvec_"
    assert tag in one and tag not in batch
