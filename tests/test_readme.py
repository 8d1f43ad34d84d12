"""Every Python snippet of the README and of docs/usage.md runs as written, in order, each file's
in a fresh process (each snippet's names are its own or an earlier snippet's of the same file:
nothing undefined)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # (beyond the fast subset: conftest.py)

ROOT = Path(__file__).resolve().parents[1]
FILES = (ROOT / "README.md", ROOT / "docs" / "usage.md")


def snippets(path=None):
    """The ```python snippets of `path` (None: of every file in FILES, in order)."""
    return [code for f in ([path] if path else FILES)
            for code in re.findall(r"```python\n(.*?)```", f.read_text(), flags=re.S)]


def test_readme_has_the_snippets_it_documents():
    text = "\n".join(snippets())
    for name in ("hla_tvm.hla(", "hla_tvm.compile(", "load(", "m.prefill(", "m.decode(",
                 "hla_onnx.export(", "hla_onnx.compile("):
        assert name in text


@pytest.mark.parametrize("path", FILES, ids=lambda f: f.name)
def test_readme_snippets_run_as_written(tmp_path, path):
    parts = []
    for i, code in enumerate(snippets(path)):
        parts.append(f"print('--- snippet {i}', flush=True)\n{code}")
    script = tmp_path / "readme_snippets.py"
    script.write_text("\n".join(parts))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900, env=dict(os.environ))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.count("--- snippet") == len(snippets(path))
