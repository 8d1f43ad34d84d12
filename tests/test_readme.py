"""Every Python snippet of the README runs as written, in order, in a fresh process (each
snippet's names are its own or an earlier snippet's: nothing undefined)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)

README = Path(__file__).resolve().parents[1] / "README.md"


def snippets():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_the_snippets_it_documents():
    text = "\n".join(snippets())
    for name in ("hla_tvm.hla(", "hla_tvm.compile(", "load(", "m.prefill(", "m.decode(",
                 "hla_onnx.export(", "hla_onnx.compile("):
        assert name in text


def test_readme_snippets_run_as_written(tmp_path):
    parts = []
    for i, code in enumerate(snippets()):
        parts.append(f"print('--- snippet {i}', flush=True)\n{code}")
    script = tmp_path / "readme_snippets.py"
    script.write_text("\n".join(parts))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900, env=dict(os.environ))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("--- snippet") == len(snippets())
