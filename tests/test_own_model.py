"""A user's own architecture (docs/usage.md's "Your own model" example, taken from it as
written) compiled and exported from the command line as module:factory, against PyTorch."""
import numpy as np
import pytest
import torch
from conftest import rel_err
from test_readme import snippets

from hla_tvm.cli import main

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)


def _example():
    return next(b for b in snippets() if "class TinyLM" in b)


def test_module_factory_compiles_and_exports_from_the_command_line(tmp_path, monkeypatch,
                                                                   capsys):
    from hla_tvm import onnx as hla_onnx, runtime

    (tmp_path / "mymodel.py").write_text(_example())
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "mymodel:make_model", "-o", "tiny.so"]) == 0
    assert main(["export-onnx", "mymodel:make_model", "-o", "tiny.onnx"]) == 0
    ns = {}
    exec(_example(), ns)   # the same model in PyTorch
    model = ns["make_model"]()
    tokens = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = model(tokens, None)
    m = runtime.load(tmp_path / "tiny.so")
    assert m.vocab_size == 64
    got = m.prefill(tokens.numpy(), m.init_state(2))[0]
    assert rel_err(torch.from_numpy(got), want) <= 1e-4
    onnx_out = hla_onnx.session(tmp_path / "tiny.onnx").run(None, {"tokens": tokens.numpy()})[0]
    assert np.abs(onnx_out - want.numpy()).max() <= 1e-4 * float(want.abs().max())
    capsys.readouterr()
    assert main(["compile", "mymodel:no_such_factory", "-o", "x.so"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mymodel has no no_such_factory" in err, err
    assert main(["compile", "nosuchmodule:make", "-o", "x.so"]) == 2
    assert "cannot import nosuchmodule" in capsys.readouterr().err
