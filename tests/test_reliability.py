"""What a user's own files, folders and models must never cause: a lost input or tuned records,
a crash from a file, a write through a planted link, a library run before it is checked, or a
silent wrong answer (tokens out of range, a state of another model or with NaN, an ONNX body
that computes something else than its node says). The crash tests run in a child process."""
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from hla_tvm.cli import main
from hla_tvm.compiler import compile as compile_model
from hla_tvm.models import HLALM
from hla_tvm.nn import HLAttention
from hla_tvm.runtime import cache, libfile, load, paths

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_token_ids_at_any_address_reach_the_kernels_aligned",
    "test_compile_and_export_refuse_to_overwrite_their_input",
    "test_cache_clear_removes_only_the_caches_own_files",
    "test_the_package_writes_files_through_one_helper",
    "test_onnx_body_that_does_not_match_its_node_is_refused",
    "test_onnx_attributes_of_the_wrong_type_or_value_name_the_node",
    "test_decode_refuses_one_tensor_for_two_state_entries",
    "test_a_sealed_library_that_is_no_model_is_refused_before_it_loads",
    "test_hla_inside_an_exported_forward_says_what_to_use",
    "test_the_cache_helpers_know_their_names",
}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(code, env=None, timeout=600):
    """Run `code` in a fresh Python; (exit code, stdout + stderr)."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, env=env)
    return run.returncode, run.stdout + run.stderr


# --- data loss -------------------------------------------------------------------------------
def test_compile_and_export_refuse_to_overwrite_their_input(tmp_path, capsys):
    torch.manual_seed(0)
    ckpt = tmp_path / "a.pt"
    HLALM(40, 16, 1, 2, chunk_size=16).save(ckpt)
    before = ckpt.read_bytes()
    link = tmp_path / "link.pt"
    link.symlink_to(ckpt)
    for argv in (["compile", str(ckpt), "-o", str(ckpt)],
                 ["export-onnx", str(ckpt), "-o", str(ckpt)],
                 ["compile", str(ckpt), "-o", str(link)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "is the input" in err and "another output path" in err, err
    assert ckpt.read_bytes() == before
    HLALM.load(ckpt)


def test_cache_clear_removes_only_the_caches_own_files(tmp_path, monkeypatch, capsys):
    real = tmp_path / "real"
    real.mkdir()
    kernel = real / f"hla2_prefill-{'0' * 24}.so"
    demo = real / "models" / f"demo-{'1' * 20}.so"
    records = real / "schedules" / "llvm-znver4-2c" / "database_workload.json"
    mine = [real / "notes.txt", real / "models" / "my_model.so", real / "thesis"]
    for f in (kernel, demo, records, *mine):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x")
    link = tmp_path / "link"   # the cache folder through a link: its files are removed
    link.symlink_to(real)
    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(link))
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "tuned records" in out and "not the cache's" in out and "notes.txt" in out
    assert main(["cache", "--clear"]) == 0
    out = capsys.readouterr().out
    assert "1 compiled kernel modules" in out, out
    assert "1 compiled models (of demo and bench model)" in out, out
    assert "kept the tuned records" in out and "--clear --records" in out, out
    assert not kernel.exists() and not demo.exists()
    assert records.exists() and all(f.exists() for f in mine)
    assert main(["cache", "--clear", "--records"]) == 0
    assert "1 tuned records" in capsys.readouterr().out
    assert not records.exists() and all(f.exists() for f in mine)
    assert main(["cache", "--records"]) == 2


# --- crash from a file -----------------------------------------------------------------------
@pytest.mark.parametrize("blank", ["\n", "   \n"])
def test_blank_line_in_tuning_records_is_refused_not_a_crash(tmp_path, blank):
    from hla_tvm.schedule.tuning import records

    shipped = os.path.join(ROOT, "schedules", "llvm-znver3-2c")
    folder = tmp_path / "records"
    shutil.copytree(shipped, folder)
    records.unpack(str(folder))   # (shipped packed; the plain files are the ones read)
    f = folder / "database_tuning_record.json"
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(lines[:1] + [blank] + lines[1:]))
    code, out = _child(f"""
        import torch, hla_tvm
        from hla_tvm.schedule.tuning import records
        try:
            records.load({str(folder)!r})
        except ValueError as err:
            print("refused:", err)
        q = torch.randn(1, 2, 8, 64)
        try:
            hla_tvm.hla(q, q, q, schedules={str(folder)!r})
        except ValueError as err:
            print("refused:", err)
        """)
    assert code == 0, out
    assert out.count("refused:") == 2 and "database_tuning_record.json:2" in out, out
    assert "a blank line" in out


# --- writes that follow no planted link ------------------------------------------------------
def test_writes_replace_a_planted_link_and_never_write_its_target(tmp_path, compiled_lm):
    _, path = compiled_lm("plain")
    m = load(path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    state_path = tmp_path / "state.npz"
    state_path.symlink_to(victim)
    m.save_state(m.init_state(1), state_path)
    assert victim.read_bytes() == b"keep me"
    assert not state_path.is_symlink() and m.load_state(state_path)[0].shape[0] == 1
    # the helper every write goes through: a link at the target is replaced, not followed;
    # a failed write leaves the old file and no temporary one
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    with paths.replacing(target, "w") as f:
        f.write("new")
    assert victim.read_bytes() == b"keep me" and target.read_text() == "new"
    with pytest.raises(RuntimeError):
        with paths.replacing(target, "w") as f:
            f.write("half")
            raise RuntimeError("stop")
    assert target.read_text() == "new"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(paths.TMP_PREFIX)]


# every place in the package that opens a file for writing: each writes a file of its own
# making (a temporary folder, /proc) or sits inside `paths.replacing`/`replacing_path`
WRITE_SITES = {
    ("libfile.py", 'with open(tmp, "ab") as f:'),   # inside replacing_path
    ("libfile.py", 'with open(path, "r+b") as f:'),   # seal: of a file export just wrote
    ("device_code.py", 'with open(src, "w", encoding="utf-8") as f:'),   # a TemporaryDirectory
    ("cuda_emulator.py", 'with open(src, "w") as f:'),   # a TemporaryDirectory
    ("operator.py", 'with open("/proc/self/clear_refs", "w") as f:'),
}


def test_the_package_writes_files_through_one_helper():
    """Every open() for writing is a known site, and no writer gets a path to write itself
    (torch.save, onnx.save, numpy's save) outside `paths.replacing`."""
    found = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "hla_tvm")):
        for name in files:
            if not name.endswith(".py"):
                continue
            text = open(os.path.join(folder, name)).read()
            for line in text.splitlines():
                stripped = line.strip()
                if re.search(r"\bopen\([^)]*[\"'](w|wb|a|ab|r\+b|x|xb)[\"']", stripped):
                    found.add((name, stripped))
                assert not re.search(r"(torch\.save|onnx\.save|np\.savez?)\([^)]*,\s*(str\()?"
                                     r"(path|out|tmp)\b", stripped), (name, stripped)
                assert ".tmp\"" not in stripped and "getpid()}.tmp" not in stripped, \
                    (name, stripped)
    assert found == WRITE_SITES, found ^ WRITE_SITES


# --- silent wrong answers --------------------------------------------------------------------
class UserLM(nn.Module):
    """A user's own model: learned positions (the next position an int64 state entry of its
    own, so a decode step reads its token's position), LayerNorm, GELU, no config."""

    def __init__(self, vocab=50, d=32, heads=2, positions=64):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.norm, self.att = nn.LayerNorm(d), HLAttention(d, heads, chunk_size=16)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab)

    def init_state(self, batch):
        return [self.att.init_state(batch), {"position": torch.zeros(batch, dtype=torch.int64)}]

    def forward(self, tokens, state=None):
        start = torch.zeros(tokens.shape[0], dtype=torch.int64) if state is None else \
            state[1]["position"]
        positions = start[:, None] + torch.arange(tokens.shape[1])
        x = self.emb(tokens) + self.pos(positions % self.pos.num_embeddings)
        y, st = self.att(self.norm(x), None if state is None else state[0])
        x = x + y
        return self.head(x + self.mlp(x)), [st, {"position": start + tokens.shape[1]}]


class ClampedLM(UserLM):
    def forward(self, tokens, state=None):   # a one-sided clamp, as models guard their ids
        return super().forward(tokens.clamp(max=self.emb.num_embeddings - 1), state)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    torch.manual_seed(0)
    model = ClampedLM(vocab=50, positions=16).eval()   # (fewer positions than ids)
    path = tmp_path_factory.mktemp("user") / "user.so"
    compile_model(model, out=path)
    return model, str(path)


def test_a_users_own_model_checks_token_ids(user_module):
    model, path = user_module
    m = load(path)
    assert m.vocab_size == 50   # the embedding's rows, not the positions'
    tokens = np.array([[3, 7, 49, 2, 11]])
    logits, state = m.prefill(tokens, m.init_state(1))
    with torch.no_grad():
        want, _ = model(torch.from_numpy(tokens))
    np.testing.assert_allclose(logits, want.numpy(), rtol=0, atol=1e-4 * float(want.abs().max()))
    # decode steps read their positions from the state (its own int64 entry), as PyTorch
    with torch.no_grad():
        _, st = model(torch.from_numpy(tokens))
    for tok in (4, 9, 1, 30):
        got, state = m.decode(np.array([tok]), state)
        with torch.no_grad():
            want, st = model(torch.tensor([[tok]]), st)
        np.testing.assert_allclose(got, want[:, 0].numpy(), rtol=0,
                                   atol=1e-4 * float(want.abs().max()))
    assert int(np.asarray(state[-1])[0]) == 9   # the module's own count of tokens
    for bad in (1_000_000_000, -5, 50):
        with pytest.raises(ValueError, match=r"tokens must lie in \[0, 50\)"):
            m.decode(np.array([bad]), state)
        with pytest.raises(ValueError, match=r"tokens must lie in \[0, 50\)"):
            m.prefill(np.array([[1, bad]]), m.init_state(1))


def _crafted(tmp_path):
    """An ONNX file whose node says order 3 while the body it carries computes order 2."""
    from hla_tvm.onnx import function as F

    shapes = {"q": [1, 2, 5, 8], "k": [1, 2, 5, 8], "v": [1, 2, 5, 8]}
    model = F.one_node_model(shapes, order=2)
    node = model.graph.node[0]
    next(a for a in node.attribute if a.name == "order").i = 3
    node.overload = "o3a0m1n0"
    model.functions[0].overload = "o3a0m1n0"
    del model.graph.output[1:]   # (o only: third order's state has other shapes)
    path = tmp_path / "crafted.onnx"
    onnx.save(model, path)
    return model, path


def test_onnx_body_that_does_not_match_its_node_is_refused(tmp_path):
    from hla_tvm import onnx as hla_onnx

    model, path = _crafted(tmp_path)
    for call in (lambda: hla_onnx.session(path), lambda: hla_onnx.session(model),
                 lambda: hla_onnx.check(model), lambda: hla_onnx.compile(path),
                 lambda: __import__("hla_tvm.onnx.importer", fromlist=["x"]).load_model(path)):
        with pytest.raises(ValueError, match="function body for overload 'o3a0m1n0' is not the "
                                             "one its attributes define"):
            call()


@pytest.mark.parametrize("attr, value, message", [
    ("eps", "tiny", "attribute 'eps' must be a float, got string"),
    ("order", 2.0, "attribute 'order' must be an int, got float"),
    ("eps", -1e-3, "eps must be a number >= 0"),
    ("eps", float("nan"), "eps must be a number >= 0"),
    ("ridge", -1.0, "ridge must be a number >= 0")])
def test_onnx_attributes_of_the_wrong_type_or_value_name_the_node(attr, value, message):
    from hla_tvm import onnx as hla_onnx
    from hla_tvm.onnx import function as F

    shapes = {"q": [1, 2, 5, 8], "k": [1, 2, 5, 8], "v": [1, 2, 5, 8]}
    model = F.one_node_model(shapes)
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != attr]
    del node.attribute[:]
    node.attribute.extend(kept + [onnx.helper.make_attribute(attr, value)])
    for call in (hla_onnx.to_relax, hla_onnx.check, hla_onnx.session):
        with pytest.raises(ValueError, match=f"HLA node 'hla0'.*{re.escape(message)}"):
            call(model)
    if attr == "eps" and not isinstance(value, str):   # as hla() refuses it
        import hla_tvm

        q = torch.rand(1, 2, 5, 8)
        with pytest.raises(ValueError, match="eps must"):
            hla_tvm.hla(q, q, q, eps=value)


def test_decode_refuses_one_tensor_for_two_state_entries():
    import hla_tvm

    q = torch.randn(1, 2, 16)
    state = hla_tvm.init_state(1, 2, 16)
    state["C"] = state["S"]
    with pytest.raises(ValueError, match=r"state\['C'\] is the same memory as state\['S'\]"):
        hla_tvm.decode_(q, q, q, state)
    state = hla_tvm.init_state(1, 2, 16)
    with pytest.raises(ValueError, match=r"out is the same memory as state\['m'\]"):
        hla_tvm.decode_(q, q, q, state, out=state["m"])


def test_state_of_another_model_or_with_nan_is_refused(compiled_lm, tmp_path):
    _, path = compiled_lm("plain")
    _, other_path = compiled_lm("normalized", normalize=True)   # the same state layout
    m, other = load(path), load(other_path)
    assert m.state_spec == other.state_spec and m.model_digest != other.model_digest
    _, state = m.prefill(np.array([[1, 2, 3]]), m.init_state(1))
    m.save_state(state, tmp_path / "s.npz")
    with pytest.raises(ValueError, match="a state of another model"):
        other.load_state(tmp_path / "s.npz")
    back = other.load_state(tmp_path / "s.npz", other_model=True)   # asked for: the layout fits
    assert all(np.array_equal(a, b) for a, b in zip(back, state))
    # a state passed directly: NaN refused as load_state refuses it; one array for two entries
    bad = [x.copy() for x in state]
    bad[2][...] = np.nan
    with pytest.raises(ValueError, match="layer0.m holds non-finite values"):
        m.decode(np.array([1]), bad)
    same = m.init_state(1)
    same[3] = same[0]
    with pytest.raises(ValueError, match="is the same array as another entry"):
        m.decode(np.array([1]), same)
    # torch tensors are taken (copied in), as numpy arrays of one's own are
    a, _ = m.decode(np.array([4]), [torch.from_numpy(x.copy()) for x in state])
    b, _ = m.decode(np.array([4]), [x.copy() for x in state])
    c, _ = m.decode(np.array([4]), m.copy_state(state))
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_prefill_and_decode_give_numpy_in_and_out(compiled_lm):
    _, path = compiled_lm("plain")
    m = load(path)
    state = m.init_state(2)
    assert all(type(x) is np.ndarray for x in state)
    logits, state = m.prefill(np.array([[1, 2, 3], [4, 5, 6]]), state)
    assert type(logits) is np.ndarray and all(type(x) is np.ndarray for x in state)
    kept = state
    logits, state = m.decode(np.array([1, 2]), state)
    assert type(logits) is np.ndarray and all(type(x) is np.ndarray for x in state)
    assert all(a is b for a, b in zip(kept, state))   # advanced in place, no copies


# --- loading libraries -----------------------------------------------------------------------
CONSTRUCTOR = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(getenv("HLA_TVM_MARKER"), "w");
  if (f) { fputs("ran", f); fclose(f); }
}
"""


def _planted_library(folder, tag=libfile.NO_TAG):
    """A sealed shared library whose constructor writes $HLA_TVM_MARKER when it is loaded."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    src = folder / "planted.c"
    src.write_text("#include <stdlib.h>\n" + CONSTRUCTOR)
    lib = folder / "planted.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    libfile.seal(lib, tag)
    return lib


def test_a_sealed_library_that_is_no_model_is_refused_before_it_loads(tmp_path, monkeypatch):
    lib = _planted_library(tmp_path)
    marker = tmp_path / "marker"
    monkeypatch.setenv("HLA_TVM_MARKER", str(marker))
    for call in (load, lambda p: main(["run", str(p), "--info"]),
                 lambda p: main(["bundle", str(p), "-o", str(tmp_path / "b")])):
        with pytest.raises(ValueError, match="not an hla_tvm compiled model"):
            r = call(lib)
            if r == 2:
                raise ValueError("not an hla_tvm compiled model")
    assert not marker.exists()


def test_a_planted_cache_entry_is_rebuilt_and_the_cache_is_private(tmp_path):
    cache_dir = tmp_path / "cache"
    code = f"""
        import os, warnings, torch, hla_tvm
        from hla_tvm.ops.hla2 import reference as hla2
        os.environ["HLA_TVM_CACHE_DIR"] = {str(cache_dir)!r}
        q = torch.rand(1, 2, 1, 8, dtype=torch.float64).float()
        o = hla_tvm.hla(q, q, q)
        print("mode", oct(os.stat({str(cache_dir)!r}).st_mode & 0o777))
        """
    rc, out = _child(code)
    assert rc == 0 and "mode 0o700" in out, out
    entries = [p for p in os.listdir(cache_dir) if p.endswith(".so")]
    assert len(entries) == 1
    entry = cache_dir / entries[0]
    tag = entry.read_bytes()[-72:-40]   # the spec digest it was sealed with
    planted = _planted_library(tmp_path, tag)
    os.replace(planted, entry)
    rc, out = _child(code.replace("o = hla_tvm.hla(q, q, q)", """
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            o = hla_tvm.hla(q, q, q)
        want = hla2.quadratic(q.double(), q.double(), q.double())
        print("rebuilt", any("rebuilding" in str(w.message) for w in seen),
              float((o.double() - want).abs().max()))"""))
    assert rc == 0 and "rebuilt True" in out, out
    assert float(out.split("rebuilt True ")[1].split()[0]) < 1e-5
    # a cache folder others may write is refused, naming it and the fix
    os.chmod(cache_dir, 0o777)
    rc, out = _child(code)
    assert rc != 0 and "is not private" in out and "chmod 700" in out, out


def test_a_model_in_a_folder_anyone_may_write_is_refused(compiled_lm, tmp_path):
    _, path = compiled_lm("plain")
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    shutil.copy(path, open_folder / "model.so")
    os.chmod(open_folder, 0o777)
    with pytest.raises(ValueError, match="writable by every user"):
        load(open_folder / "model.so")
    os.chmod(open_folder, 0o777 | stat.S_ISVTX)   # sticky, as /tmp: only the owner replaces it
    assert load(open_folder / "model.so").vocab_size == 40


# --- unclear errors --------------------------------------------------------------------------
def test_hla_inside_an_exported_forward_says_what_to_use(tmp_path):
    import hla_tvm

    class Direct(UserLM):
        def forward(self, tokens, state=None):
            x = self.emb(tokens)
            B, T, _ = x.shape
            q = x.view(B, T, 2, 16).transpose(1, 2).contiguous()
            o = hla_tvm.hla(q, q, q)
            return self.head(o.transpose(1, 2).reshape(B, T, 32)), state

    with pytest.raises(TypeError, match="HLAttention or the custom op hla_tvm.nn.hla_op"):
        compile_model(Direct(), out=tmp_path / "d.so")


def test_the_cache_helpers_know_their_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(tmp_path / "c"))
    folder = cache.folder("models")
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700 and os.path.isdir(folder)
    assert cache.entries() == [] and cache.others() == []


def test_token_ids_at_any_address_reach_the_kernels_aligned(compiled_lm):
    """The kernels load 64-byte aligned data with aligned vector instructions; numpy allocates
    16-byte aligned: eight int64 token ids (one AVX-512 vector) at another address crashed a
    decode step (SIGSEGV in the first kernel). Ids at every 8-byte offset give the aligned
    ids' logits (in a child process: a crash fails the test, not the session)."""
    import subprocess
    import sys
    import textwrap

    _, lib = compiled_lm("hla2")
    code = textwrap.dedent(f"""
        import numpy as np
        from hla_tvm.runtime import load
        m = load({str(lib)!r}, threads=1)
        want = None
        for offset in range(0, 64, 8):
            raw = np.zeros(8 * 8 + 64 + offset, dtype=np.uint8)
            start = (-raw.ctypes.data % 64) + offset
            ids = raw[start:start + 64].view(np.int64)
            ids[:] = np.arange(8) * 3
            st = m.init_state(8)
            logits, st = m.decode(ids, st)
            logits, st = m.decode(ids, st)
            want = logits if want is None else want
            assert np.array_equal(logits, want), offset
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr[-2000:]
