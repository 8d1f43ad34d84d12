"""`hla_tvm.runtime` is what runs a compiled model without torch and without TVM's compiler:
every module of the package imports, and a compiled model loads, prefills, decodes and saves
its state, in a process where torch cannot be imported and TVM's compiler library is not
loaded."""
import os
import pkgutil
import subprocess
import sys
import textwrap

import numpy as np

import hla_tvm.runtime

BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, _Block())
"""


def test_every_runtime_module_imports_without_torch_or_the_tvm_compiler(compiled_lm, tmp_path):
    _, path = compiled_lm("plain")
    modules = sorted(m.name for m in pkgutil.iter_modules(hla_tvm.runtime.__path__))
    assert {"model", "libfile", "device_code", "generate", "pool", "cache", "paths",
            "state_pool"} <= \
        set(modules)
    code = BLOCK + textwrap.dedent(f"""
        import importlib, numpy as np
        for name in {modules!r}:
            importlib.import_module("hla_tvm.runtime." + name)
        for name in ("engine", "sessions", "metrics", "app"):   # the server: torch-free too
            try:
                importlib.import_module("hla_tvm.serve." + name)
            except ImportError as err:   # (fastapi: the serve extra) torch is what may not
                assert "torch" not in str(err), err
        from hla_tvm.runtime import load
        from hla_tvm.runtime.generate import generate
        m = load({str(path)!r})
        tokens, _ = generate(m, [1, 2, 3], 5)
        logits, state = m.prefill(np.array([[1, 2, 3]]), m.init_state(1))
        m.save_state(state, {str(tmp_path / "s.npz")!r})
        print(len(tokens), logits.shape)
        assert "torch" not in sys.modules, "torch was imported"
        assert "libtvm_compiler" not in open("/proc/self/maps").read(), "compiler loaded"
    """)
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["5", "(1,", "3,", "40)"]
    assert np.load(tmp_path / "s.npz")["layer0.S"].shape[0] == 1
