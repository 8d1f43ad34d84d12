"""The x86 CPU's own features: the host target built from what the CPU reports (not only from its
model's name), the features a module records and its loader checks, and the products on AMX
tiles (`quant.amx`, bf16 modules), checked against float64 where this CPU has AMX (skipped with
the reason elsewhere)."""
import numpy as np
import pytest
import torch

from hla_tvm.runtime import cpu_features

pytestmark = pytest.mark.skipif(not cpu_features.is_x86_host(), reason="an x86-64 machine")


def _has_amx():
    return {"amx-tile", "amx-bf16"} <= (cpu_features.host_features() or set())


needs_amx = pytest.mark.skipif(not _has_amx(), reason="this CPU has no AMX-BF16 "
                               "(grep amx_bf16 /proc/cpuinfo)")


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


@needs_amx
@pytest.mark.parametrize("m", [1, 31, 32, 77])
@pytest.mark.parametrize("k,n,panel", [(32, 32, 32), (96, 128, 64), (64, 256, 128)])
def test_amx_product_matches_float64(m, k, n, panel):
    """out = bf16(x) @ W on AMX tiles for row counts below, at and past one 32-row block, K of
    one or several steps, one or several column blocks and panels: against numpy's float64
    product of the same bfloat16 values (exact products, float32 sums: 1e-6)."""
    import tvm

    from hla_tvm.quant import amx
    from hla_tvm.quant.panels import stored
    from hla_tvm.quant.scheme import dequantize, quantize, scheme
    from hla_tvm.target import host_target

    sch = scheme("bf16")
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed = quantize(sch, rng.standard_normal((k, n)).astype(np.float32))
    lib = tvm.compile(tvm.IRModule({"f": amx.matmul_func(k, n, panel, "f")}),
                      target=host_target())
    out = tvm.runtime.tensor(np.full((m, n), np.nan, np.float32))
    scratch = tvm.runtime.tensor(np.zeros(((m + 31) // 32 * 32, k), np.uint16))
    lib["f"](tvm.runtime.tensor(x), tvm.runtime.tensor(stored(sch, packed["q"], panel)), out,
             scratch)
    want = _bf16(x) @ dequantize(sch, packed).astype(np.float64)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


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
