"""The x86 CPU's own features: the host target built from what the CPU reports (not only from its
model's name), the features a module records and its loader checks, and the bf16 modules'
prefill products on AMX tiles (`quant.amx`) or VDPBF16PS (`quant.dpbf16`), checked against
float64 where this CPU has them (skipped with the reason elsewhere)."""
import numpy as np
import pytest
import torch

from hla_tvm.runtime import cpu_features

pytestmark = pytest.mark.skipif(not cpu_features.is_x86_host(), reason="an x86-64 machine")
# the fast subset: the kernels against float64 and the host's features (the whole modules on
# each unit and the refusal on a CPU without a feature compile models: slow)
FAST = {
    "test_host_target_has_exactly_the_features_the_cpu_reports",
    "test_a_baseline_module_records_only_baseline_features",
    "test_amx_product_matches_float64",
    "test_vdpbf16ps_product_matches_float64",
    "test_integer_weights_prefill_on_vdpbf16ps",
    "test_integer_weights_prefill_on_amx",
    "test_vnni_product_matches_float64",
    "test_vnni_product_of_a_nan_or_infinity_is_nan",
    "test_weights_in_quads_read_back_as_stored",
    "test_an_integer_module_decodes_on_vnni_and_prefills_without[int4]",
    "test_decode_products_without_prefetch_match_float64",
}


def _has_amx():
    return {"amx-tile", "amx-bf16"} <= (cpu_features.host_features() or set())


needs_amx = pytest.mark.skipif(not _has_amx(), reason="this CPU has no AMX-BF16 "
                               "(grep amx_bf16 /proc/cpuinfo)")
needs_bf16 = pytest.mark.skipif(
    not {"avx512bf16", "avx512f"} <= (cpu_features.host_features() or set()),
    reason="this CPU has no AVX512-BF16 (grep avx512_bf16 /proc/cpuinfo)")


def test_host_target_has_exactly_the_features_the_cpu_reports():
    """Every feature of `cpu_features.X86`: in the host target where /proc/cpuinfo lists it,
    absent where it does not, whatever LLVM's model of the CPU's name holds (a VM's masked
    model: an AMX Xeon reported as rocketlake)."""
    from tvm.target import codegen

    from hla_tvm.target import host_target

    have = cpu_features.host_features()
    if have is None:
        pytest.skip("/proc/cpuinfo is not readable here")
    tgt = host_target()
    for feature in cpu_features.X86.values():
        assert bool(codegen.target_has_features(feature, tgt)) == (feature in have), feature


def _tiny_model():
    from hla_tvm.models import HLALM

    torch.manual_seed(0)
    return HLALM(40, 32, 1, 4, chunk_size=16).eval()


def test_a_module_records_its_features_and_a_cpu_without_one_refuses_it(tmp_path,
                                                                      monkeypatch):
    """The module's metadata lists the features its code may use (`run --info` prints them);
    on a CPU that lacks one, loading is refused in one line naming it, before the library is
    mapped (its code would stop with SIGILL)."""
    from hla_tvm import runtime
    from hla_tvm.cli import main
    from hla_tvm.compiler import compile as compile_model

    path = compile_model(_tiny_model(), out=tmp_path / "m.so")
    meta = runtime.read_meta(path)
    assert "avx2" in meta["cpu_features"] or "avx2" not in cpu_features.host_features()
    assert set(meta["cpu_features"]) <= set(cpu_features.host_features())
    runtime.load(path)   # this CPU has them all
    needed = meta["cpu_features"][-1]
    lacking = frozenset(cpu_features.host_features() - {needed})
    monkeypatch.setattr(cpu_features, "host_features", lambda: lacking)
    with pytest.raises(ValueError) as err:
        runtime.load(path)
    msg = str(err.value)
    assert "\n" not in msg and needed in msg and str(path) in msg and "x86-64" in msg, msg
    assert main(["run", str(path), "--info"]) == 0
    assert main(["run", str(path), "--prompt-ids", "1,2", "--tokens", "2"]) == 2


def test_a_baseline_module_records_only_baseline_features(tmp_path):
    """--target x86-64 (any x86-64 CPU) records none of the AVX features."""
    from hla_tvm.target import cpu_features as target_features, resolve

    assert not {"avx", "avx2", "avx512f"} & set(target_features(resolve("x86-64")))


def _bf16(a):
    from hla_tvm.quant.scheme import activations, scheme

    return activations(scheme("bf16"), a).astype(np.float64)


def _bf16_blocks_check(kind, m, k, n, panel, name="bf16", group=None):
    """out = bf16(x) @ W through the output blocks of `kind` (`quant.amx`, `quant.dpbf16`)
    against numpy's float64 product of the same bfloat16 values (exact products, float32 sums:
    1e-6). `name` int8 / int4: W the scheme's integers in quads with their scales, which the
    kernel dequantizes and rounds to bfloat16 (float32 (u - o) s, then nearest even)."""
    import tvm

    from hla_tvm.quant.panels import stored
    from hla_tvm.quant.scheme import dequantize, quantize, scheme
    from hla_tvm.target import host_target

    sch = scheme(name, group)
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed = quantize(sch, rng.standard_normal((k, n)).astype(np.float32))
    ints = name != "bf16"
    lib = tvm.compile(tvm.IRModule({"f": kind.matmul_func(k, n, panel, "f",
                                                          sch=sch if ints else None)}),
                      target=host_target())
    out = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
    rows = (m + kind.ROWS - 1) // kind.ROWS * kind.ROWS
    scratch = tvm.runtime.tensor(np.zeros((rows, k), np.uint16))
    weights = [tvm.runtime.tensor(stored(sch, packed["q"], panel, in_quads=ints))]
    if ints:
        weights.append(tvm.runtime.tensor(packed["scale"]))
    lib["f"](tvm.runtime.tensor(x), *weights, out, scratch)
    want = _bf16(x) @ _bf16(dequantize(sch, packed).astype(np.float32))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@needs_amx
@pytest.mark.parametrize("m", [1, 31, 32, 77])
@pytest.mark.parametrize("k,n,panel", [(32, 32, 32), (96, 128, 64), (64, 256, 128)])
def test_amx_product_matches_float64(m, k, n, panel):
    """AMX tiles for row counts below, at and past one 32-row block, K of one or several
    steps, one or several column blocks and panels."""
    from hla_tvm.quant import amx

    _bf16_blocks_check(amx, m, k, n, panel)


@needs_bf16
@pytest.mark.parametrize("m", [1, 5, 6, 7, 77])
@pytest.mark.parametrize("k,n,panel", [(16, 64, 64), (96, 128, 64), (64, 256, 128)])
def test_vdpbf16ps_product_matches_float64(m, k, n, panel):
    """VDPBF16PS for row counts below, at and past one 6-row block, K of one conversion vector
    or several, one or several 64-column blocks and panels."""
    from hla_tvm.quant import dpbf16

    _bf16_blocks_check(dpbf16, m, k, n, panel)


@needs_bf16
@pytest.mark.parametrize("name,group", [("int8", None), ("int8", 32), ("int4", 32),
                                        ("int4", 64)])
@pytest.mark.parametrize("m,k,n,panel", [(7, 64, 64, 64), (13, 128, 256, 128)])
def test_integer_weights_prefill_on_vdpbf16ps(name, group, m, k, n, panel):
    """int8 / int4 weights in quads through the VDPBF16PS blocks: each column block's weights
    dequantized to bfloat16 pairs first (`bf16_blocks.dequantized_pairs`), per channel and per
    group, one or several groups and blocks."""
    from hla_tvm.quant import dpbf16

    _bf16_blocks_check(dpbf16, m, k, n, panel, name, group)


@needs_amx
@pytest.mark.parametrize("name,group", [("int8", None), ("int4", 32)])
def test_integer_weights_prefill_on_amx(name, group):
    """int8 / int4 weights in quads through the AMX blocks (as on VDPBF16PS above)."""
    from hla_tvm.quant import amx

    _bf16_blocks_check(amx, 45, 128, 128, 64, name, group)


@needs_amx
def test_a_bf16_module_prefills_on_amx_and_decodes_without():
    """A bf16 model compiled for this CPU: its prefill's products run the AMX kernel, its
    decode step's (one row) the vector ones."""
    from hla_tvm.compiler import prepare, to_relax
    from hla_tvm.quant.scheme import scheme
    from hla_tvm.target import host_target

    tgt = host_target()
    mod, report = prepare(to_relax(_tiny_model(), target=tgt), tgt, scheme("bf16"))
    names = [gv.name_hint for gv in mod.get_global_vars()]
    amx_funcs = [n for n in names if n.startswith("amx_bf16_matmul")]
    assert amx_funcs, names
    text = mod["prefill"].script() if "prefill" in names else ""
    decode = mod["decode"].script()
    assert "amx_bf16_matmul" in text and "amx_bf16_matmul" not in decode


@needs_bf16
def test_a_bf16_module_prefills_on_vdpbf16ps_where_there_is_no_amx(tmp_path):
    """A bf16 model compiled for this CPU without AMX: its prefill's products run the
    VDPBF16PS kernel, its decode step's the vector ones; its prefill and decode match PyTorch
    running the same bfloat16 weights, inputs rounded to bfloat16 (`dequantized_model`; 4e-3
    as in test_quantize.py: a float32 input at a rounding tie rounds either way)."""
    from conftest import rel_err

    from hla_tvm.compiler import compile as compile_model, prepare, to_relax
    from hla_tvm.models import HLALM
    from hla_tvm.quant.scheme import scheme
    from hla_tvm.quant.torch_weights import dequantized_model
    from hla_tvm.runtime import load
    from hla_tvm.target import host_target, resolve

    torch.manual_seed(0)
    model = HLALM(40, 64, 2, 4, chunk_size=16).eval()
    tgt = resolve({"kind": "llvm", "mcpu": "znver4"}) if _has_amx() else host_target()
    mod, _ = prepare(to_relax(model, target=tgt), tgt, scheme("bf16"))
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert any(n.startswith("dpbf16_matmul") for n in names), names
    assert "dpbf16_matmul" in mod["prefill"].script()
    assert "dpbf16_matmul" not in mod["decode"].script()
    if _has_amx():
        return   # (the host's own module prefills on AMX: test_amx_* above)
    m = load(compile_model(model, out=tmp_path / "b.so", quantize="bf16"))
    ref = dequantized_model(model, scheme("bf16"))
    tokens = torch.randint(0, 40, (2, 38), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, _ = ref(tokens, None)
    state = m.init_state(2)
    got = torch.from_numpy(np.asarray(m.prefill(tokens[:, :37].numpy(), state)[0]))
    assert rel_err(got, want[:, :37]) <= 4e-3
    step = torch.from_numpy(np.asarray(m.decode(tokens[:, 37].numpy(), state)[0]))
    assert rel_err(step, want[:, 37]) <= 4e-3


def _vnni_targets():
    """(lanes, target) for each VPDPBUSD width this CPU runs: AVX512-VNNI (the host target),
    AVX-VNNI (a 256-bit target, `alderlake`)."""
    from hla_tvm.quant import vnni
    from hla_tvm.target import host_target, resolve

    have = cpu_features.host_features() or set()
    out = []
    if vnni.lanes(host_target()) == 16:
        out.append((16, host_target()))
    if {"avxvnni", "avx2", "fma", "bmi2"} <= have:
        out.append((8, resolve({"kind": "llvm", "mcpu": "alderlake"})))
    return out


needs_vnni = pytest.mark.skipif(not _vnni_targets(), reason="this CPU has no VNNI "
                                "(grep -E 'avx512_vnni|avx_vnni' /proc/cpuinfo)")


def _vnni_run(name, group, m, k, n, panel, lanes, tgt, x=None, ahead=None):
    """(out of the VNNI product, float64 x @ W, the most they may differ) for a random weight
    under the scheme: the activations' digits (`quant.vnni`) are off by at most
    t / (2 R^(D - 1)) an input, t = max |x| / 127 over its block (max |x| times
    `vnni.precision(D)`), so the product by
    sum_k |W[k, n]| t(block of k) / (2 R^(D - 1)); plus 2e-6 of the largest output for
    float32's sums."""
    import tvm

    from hla_tvm.quant import vnni
    from hla_tvm.quant.panels import stored
    from hla_tvm.quant.scheme import dequantize, quantize, scheme

    sch = scheme(name, group)
    rng = np.random.default_rng(m + k + n)
    if x is None:
        x = rng.standard_normal((m, k)).astype(np.float32)
    packed = quantize(sch, rng.standard_normal((k, n)).astype(np.float32))
    lib = tvm.compile(tvm.IRModule({"f": vnni.matvec_func(sch, k, n, panel, lanes, "f",
                                                           ahead)}), target=tgt)
    out = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
    lib["f"](tvm.runtime.tensor(x), tvm.runtime.tensor(stored(sch, packed["q"], panel, True)),
             tvm.runtime.tensor(packed["scale"]), out)
    w = dequantize(sch, packed).astype(np.float64)
    want = x.astype(np.float64) @ w
    top = np.abs(x.astype(np.float64)).reshape(m, k // vnni.BLOCK, vnni.BLOCK).max(axis=2)
    step = np.repeat(top, vnni.BLOCK, axis=1) * vnni.precision(vnni.DIGITS[name])
    with np.errstate(invalid="ignore"):
        bound = step @ np.abs(w) + 2e-6 * np.abs(want).max()
    return out.numpy(), want, bound


@needs_vnni
@pytest.mark.parametrize("name,group", [("int8", None), ("int8", 32), ("int4", 32),
                                        ("int4", 128)])
@pytest.mark.parametrize("m,k,n,panel", [(1, 128, 32, 32), (3, 256, 256, 128),
                                         (2, 768, 384, 128)])
def test_vnni_product_matches_float64(name, group, m, k, n, panel):
    """x @ W on VPDPBUSD (the activations as 8-bit digits a block, `quant.vnni`: int8 three,
    int4 one) for int8 per channel and grouped, int4 in groups of 32 and 128, one or several
    rows, blocks, panels and parts, at each width this CPU runs: against numpy's float64
    product of the same weights, within the digits' bound (`_vnni_run`; it holds 2e-6 of the
    largest output for float32's sums); int8's three digits are float32's precision (2e-6 alone)."""
    for lanes, tgt in _vnni_targets():
        if panel % lanes or (group or 0) > k:
            continue
        got, want, bound = _vnni_run(name, group, m, k, n, panel, lanes, tgt)
        assert (np.abs(got - want) <= bound).all(), f"{lanes} lanes"
        if name == "int8":
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(),
                                       err_msg=f"{lanes} lanes")
        else:   # (one digit: the bound takes every error of one sign, 6% of the largest
            # output here; they are of either sign, and the product is within 1% of it)
            assert np.abs(got - want).max() < 1e-2 * np.abs(want).max(), f"{lanes} lanes"


@needs_vnni
def test_vnni_product_of_a_nan_or_infinity_is_nan():
    """A row whose activations hold a NaN or an infinity gives NaN in every column (as the float
    path's sums do for NaN), the other rows their products; a row of zeros gives zeros."""
    lanes, tgt = _vnni_targets()[0]
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    x[0, 5], x[1, 40], x[3] = np.nan, np.inf, 0
    got, want, _ = _vnni_run("int8", None, 4, 64, 32, 32, lanes, tgt, x=x)
    assert np.isnan(got[:2]).all()
    np.testing.assert_allclose(got[2], want[2], rtol=0, atol=2e-6 * np.abs(want[2]).max())
    assert (got[3] == 0).all()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_weights_in_quads_read_back_as_stored(name):
    """`panels.quads` round-trips, and the kernels' reader of quads (a prefill's dequantized
    weight, any CPU) gives the scheme's weights: a several-row product against float64."""
    import tvm
    from tvm import te

    from hla_tvm.quant import kernels
    from hla_tvm.quant.panels import from_quads, quads, stored
    from hla_tvm.quant.scheme import dequantize, quantize, scheme

    sch = scheme(name, 32)
    k, n, p = 64, 64, 32
    rng = np.random.default_rng(1)
    packed = quantize(sch, rng.standard_normal((k, n)).astype(np.float32))
    assert (from_quads(name, quads(name, packed["q"])) == packed["q"]).all()
    q = stored(sch, packed["q"], p, True)
    x = te.placeholder((5, k), "float32", name="x")
    qt = te.placeholder(q.shape, "uint32", name="q")
    st = te.placeholder(packed["scale"].shape, "float32", name="s")
    out = kernels.matmul(x, qt, st, sch=sch, k=k, n=n, group=32, panel=p)
    lib = tvm.compile(te.create_prim_func([x, qt, st, out]), target="llvm")
    xv = rng.standard_normal((5, k)).astype(np.float32)
    res = tvm.runtime.tensor(np.zeros((5, n), np.float32))
    lib(tvm.runtime.tensor(xv), tvm.runtime.tensor(q), tvm.runtime.tensor(packed["scale"]), res)
    want = xv.astype(np.float64) @ dequantize(sch, packed).astype(np.float64)
    np.testing.assert_allclose(res.numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


@needs_vnni
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_an_integer_module_decodes_on_vnni_and_prefills_without(name):
    """An int8 / int4 model compiled for this CPU: its decode step's products run the VNNI
    kernel, its prefill's (several rows) the float ones."""
    from hla_tvm.compiler import prepare, to_relax
    from hla_tvm.quant.scheme import scheme
    from hla_tvm.target import host_target

    tgt = host_target()
    mod, _ = prepare(to_relax(_tiny_model(), target=tgt), tgt, scheme(name))
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert any(n.startswith(f"vnni_{name}_matvec") for n in names), names
    assert "vnni_" in mod["decode"].script()
    if "prefill" in names:
        assert "vnni_" not in mod["prefill"].script()


@needs_vnni
def test_decode_products_without_prefetch_match_float64():
    """AMD Zen targets ask no prefetch (`matvec.prefetch_bytes`: their own prefetchers streamed
    the panels faster alone): the VNNI and float32 kernels built so emit no prefetch and give
    the products of those built with it."""
    import tvm

    from hla_tvm.quant import matvec, vnni
    from hla_tvm.quant.panels import to_panels
    from hla_tvm.target import resolve

    assert matvec.prefetch_bytes(resolve({"kind": "llvm", "mcpu": "znver4"})) == 0
    assert matvec.prefetch_bytes(resolve({"kind": "llvm", "mcpu": "sapphirerapids"})) > 0
    assert "prefetch" not in vnni.matvec_func(_scheme("int4"), 256, 256, 128, 16, "f",
                                              0).script()
    lanes, tgt = _vnni_targets()[0]
    for ahead in (0, None):
        for name, group in (("int8", None), ("int4", 32)):
            got, want, bound = _vnni_run(name, group, 2, 256, 256, 128, lanes, tgt,
                                         ahead=ahead)
            assert (np.abs(got - want) <= bound).all(), (name, ahead)
    rng = np.random.default_rng(3)
    w, x = rng.standard_normal((256, 256)).astype(np.float32), \
        rng.standard_normal((1, 256)).astype(np.float32)
    fn = matvec.matvec_func(None, 256, 256, 128, 16, "f", 0)
    assert "prefetch" not in fn.script()
    lib = tvm.compile(tvm.IRModule({"f": fn}), target=tgt)
    out = tvm.runtime.tensor(np.zeros((1, 256), np.float32))
    lib["f"](tvm.runtime.tensor(x), tvm.runtime.tensor(to_panels(w, 128)), out)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=2e-6 * np.abs(want).max())


def _scheme(name):
    from hla_tvm.quant.scheme import scheme

    return scheme(name, 32 if name == "int4" else None)
