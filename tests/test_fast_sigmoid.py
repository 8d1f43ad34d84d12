"""A float32 sigmoid legalized through `fast_exp` (`compiler.passes.fast_sigmoid`, as `compiler.legalize`
lowers it on CPUs): against float64, over the whole float32 range, NaN kept; other dtypes and
GPU targets as TVM has them."""
import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax  # noqa: E402

from hla_tvm.compiler import legalize  # noqa: E402
from hla_tvm.compiler.passes.fast_sigmoid import NAME  # noqa: E402
from hla_tvm.target import resolve  # noqa: E402


def _sigmoid_module(n, dtype):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n], dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.sigmoid(x))
        bb.emit_func_output(y)
    return bb.get()


def _run(mod, data):
    target = resolve("llvm")
    ex = tvm.compile(legalize(mod, target), target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(data)).numpy()


def test_float32_sigmoid_through_fast_exp_equals_float64():
    x = np.concatenate([np.linspace(-100, 100, 20001), [-np.inf, np.inf, np.nan, 0.0,
                                                        1e-30, -1e-30, 88.5, -88.5]])
    x = x.astype(np.float32)
    mod = _sigmoid_module(x.size, "float32")
    names = [gv.name_hint for gv in legalize(mod, resolve("llvm")).get_global_vars()]
    assert any(NAME in n for n in names), names
    got = _run(mod, x)
    with np.errstate(over="ignore"):
        want = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    finite = ~np.isnan(x)
    # relative 1e-6 where the value is a normal float32; below that, absolute (fast_exp clamps
    # its argument at 88.4: sigmoid(-100) comes out 4e-39, not 4e-44)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-37)
    assert np.isnan(got[~finite]).all()


def test_other_dtypes_keep_tvms_sigmoid():
    x = np.linspace(-8, 8, 33).astype(np.float64)
    mod = _sigmoid_module(x.size, "float64")
    names = [gv.name_hint for gv in legalize(mod, resolve("llvm")).get_global_vars()]
    assert not any(NAME in n for n in names), names
    np.testing.assert_allclose(_run(mod, x), 1.0 / (1.0 + np.exp(-x)), rtol=1e-12)


def test_gpu_targets_keep_tvms_sigmoid():
    """The rewrite is for CPUs (LLVM's one `expf` call an element): a CUDA module keeps TVM's
    sigmoid (compiled here, no GPU needed)."""
    mod = _sigmoid_module(64, "float32")
    target = resolve({"kind": "cuda", "arch": "sm_90"})
    names = [gv.name_hint for gv in legalize(mod, target).get_global_vars()]
    assert not any(NAME in n for n in names) and any("sigmoid" in n for n in names), names
