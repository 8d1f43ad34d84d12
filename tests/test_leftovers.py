"""What interrupted commands leave and what the README promises as one-line errors:
temporaries of a session save killed midway and of a compile stopped by SIGTERM,
swept or removed; a full disk, a prompt id beyond int64, a tokenizer id beyond the
vocabulary, ONNX files TVM's importer refuses, each one line naming the file; a module whose
metadata note was edited; float16 outputs beyond float16's range (documented). Kills and
signals run in child processes."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hla_tvm.runtime import libfile, paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a TVM executable made in seconds, for the tests of writing a library (in a child's script)
TINY = textwrap.dedent("""
    import tvm
    from tvm import te

    a = te.placeholder((4,), name="a")
    b = te.compute((4,), lambda i: a[i] + 1.0, name="b")
    tiny = tvm.compile(tvm.IRModule({"add": te.create_prim_func([a, b]).with_attr(
        "global_symbol", "add")}), target="llvm")
""")


def _child(script, *args, env=None, **kw):
    """Run the Python `script` in a child process (the repository on its path)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **(env or {})}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _temporaries(folder):
    return sorted(p for p in os.listdir(folder) if p.startswith(paths.TMP_PREFIX))


def _age(path, seconds):
    old = time.time() - seconds
    os.utime(path, (old, old))


# --- leftovers ---------------------------------------------------------------------------------
def test_sweep_removes_stale_temporaries_only(tmp_path):
    """Stale (untouched for STALE_S) unlocked temporaries go, files and folders; a fresh one, one
    a running write holds (its lock), a link and other names stay."""
    stale, fresh, held = (tmp_path / (paths.TMP_PREFIX + n) for n in ("stale", "fresh", "held"))
    folder = tmp_path / (paths.TMP_PREFIX + "objects")
    folder.mkdir()
    (folder / "lib0.o").write_bytes(b"o" * 100)
    for p in (stale, fresh, held):
        p.write_bytes(b"x" * 10)
    other = tmp_path / "model.so"
    other.write_bytes(b"keep")
    link = tmp_path / (paths.TMP_PREFIX + "link")
    link.symlink_to(other)
    for p in (stale, held, folder, other):
        _age(p, paths.STALE_S + 60)
    os.utime(link, (time.time() - 1e4,) * 2, follow_symlinks=False)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # (as `replacing_path` holds its temporary)
        removed = paths.sweep(tmp_path)
    finally:
        os.close(fd)
    assert sorted(os.path.basename(p) for p, _ in removed) == \
        [paths.TMP_PREFIX + "objects", paths.TMP_PREFIX + "stale"]
    assert dict(removed)[str(folder)] == 100
    assert _temporaries(tmp_path) == sorted(paths.TMP_PREFIX + n for n in ("fresh", "held",
                                                                           "link"))
    assert other.read_bytes() == b"keep"


def test_writes_hold_their_temporaries_and_sweep_their_folder(tmp_path):
    """A write in progress is locked against a sweep (`sweep` with age 0 keeps it), and a write
    sweeps the stale temporaries of its folder first."""
    left = tmp_path / (paths.TMP_PREFIX + "killed")
    left.write_bytes(b"half")
    _age(left, paths.STALE_S + 60)
    paths._SWEPT.pop(str(tmp_path), None)
    with paths.replacing(tmp_path / "out.json", "w") as f:
        assert not left.exists()
        f.write("{}")
        assert [p for p, _ in paths.sweep(tmp_path, age=0)] == []
        assert len(_temporaries(tmp_path)) == 1
    assert _temporaries(tmp_path) == [] and (tmp_path / "out.json").read_text() == "{}"


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, zipfile
    from hla_tvm.runtime import load
    from hla_tvm.serve.sessions import SessionStore

    m = load(sys.argv[1], threads=1)
    store = SessionStore(sys.argv[2], m)
    opened = zipfile.ZipFile.open
    def open_and_die(self, name, mode="r", **kw):   # killed between two entries
        if mode == "w" and not name.startswith(m.state_spec[0][0]):
            os.kill(os.getpid(), signal.SIGKILL)
        return opened(self, name, mode, **kw)
    zipfile.ZipFile.open = open_and_die
    store.save("s1", m.init_state(1))
""")


def test_a_session_save_killed_midway_is_swept_and_counted(compiled_lm, tmp_path):
    from hla_tvm.runtime import load
    from hla_tvm.serve.sessions import SessionStore

    _, lib = compiled_lm("hla2")
    folder = tmp_path / "sessions"
    child = _child(KILLED_SAVE, lib, folder)
    child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL
    left = _temporaries(folder)
    assert len(left) == 1 and os.path.getsize(folder / left[0]) > 0
    m = load(lib, threads=1)
    # a fresh temporary may be another replica's save in progress: kept, and counted
    store = SessionStore(folder, m)
    assert _temporaries(folder) == left
    store.save("a", m.init_state(1))
    one = os.path.getsize(store.path("a"))
    pending = os.path.getsize(folder / left[0])
    store = SessionStore(folder, m, max_bytes=2 * one + pending // 2)
    store.save("b", m.init_state(1))
    assert store.names() == ["b"]   # (a and b fit; with the temporary's bytes, a went)
    # once stale, it goes when the folder is opened
    _age(folder / left[0], paths.STALE_S + 60)
    SessionStore(folder, m)
    assert _temporaries(folder) == []


STOPPED_COMPILE = TINY + textwrap.dedent("""
    import sys, time
    import hla_tvm.compiler, hla_tvm.models.source
    from hla_tvm.cli import main
    from hla_tvm.runtime import libfile

    class Slow:   # a module whose export takes a while (a large model's code and weights)
        mod = tiny.mod
        def export_library(self, name, **kw):
            tiny.export_library(name, **kw)
            print("exporting", flush=True)
            time.sleep(2)

    hla_tvm.models.source.load = lambda path: __import__("torch").nn.Linear(1, 1)
    hla_tvm.compiler.compile = lambda model, *, out, **kw: libfile.export(Slow(), out)
    sys.exit(main(["compile", sys.argv[1], "-o", sys.argv[2]]))
""")


def test_compile_stopped_by_sigterm_removes_its_temporaries(tmp_path):
    """SIGTERM while the library is written: the export ends, then the command stops with one
    line and exit code 143, its temporary file and object folder removed."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "model.pt").write_bytes(b"")
    child = _child(STOPPED_COMPILE, tmp_path / "model.pt", out / "model.so",
                   env={"TMPDIR": str(tmp_path)})
    assert child.stdout.readline().strip().startswith("compiling")
    assert child.stdout.readline().strip() == "exporting"
    assert _temporaries(out)   # (the library, and the object files where TVM put them)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 143, err
    assert err.strip() == "hla-tvm compile: stopped by SIGTERM (its unfinished files removed)"
    assert os.listdir(out) == [] and [p for p in os.listdir(tmp_path) if p.startswith("tmp")] \
        == []


# --- one-line errors ---------------------------------------------------------------------------
FULL_DISK = TINY + textwrap.dedent("""
    import sys
    import hla_tvm.compiler, hla_tvm.models.source
    from hla_tvm.cli import main
    from hla_tvm.runtime import libfile

    hla_tvm.models.source.load = lambda path: __import__("torch").nn.Linear(1, 1)
    hla_tvm.compiler.compile = lambda model, *, out, **kw: libfile.export(tiny, out)
    sys.exit(main(["compile", sys.argv[1], "-o", sys.argv[2]]))
""")


def _full_disk_compile(tmp_path, out, env=None):
    (tmp_path / "model.pt").write_bytes(b"")
    return _child(FULL_DISK, tmp_path / "model.pt", out, env=env)


def test_disk_full_when_linking_is_one_line(tmp_path):
    """The linker finding no room (its message, as ld prints it on ENOSPC): an OSError naming
    the output, one line and exit code 2, no temporaries left."""
    ld = tmp_path / "ld-on-a-full-disk"
    ld.write_text("#!/bin/sh\necho '/usr/bin/ld: final link failed: No space left on device'\n"
                  "exit 1\n")
    ld.chmod(0o755)
    out = tmp_path / "out" / "model.so"
    out.parent.mkdir()
    child = _full_disk_compile(tmp_path, out, env={"CXX": str(ld)})
    _, err = child.communicate(timeout=120)
    assert child.returncode == 2, err
    assert err.count("\n") == 1 and "No space left on device" in err and str(out) in err, err
    assert os.listdir(out.parent) == []


def test_disk_full_for_the_object_files_is_one_line(tmp_path):
    """A filesystem without room for the object files (LLVM ends the process with exit 1 when
    it cannot write them; TMPDIR there too): refused before they are written, in one line
    naming the output, nothing left on that disk."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a mount namespace (unshare -rm) for a small tmpfs")
    out = tmp_path / "disk" / "model.so"
    out.parent.mkdir()
    (tmp_path / "model.pt").write_bytes(b"")
    script = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", {str(out.parent)!r}],
                       check=True)
        code = subprocess.run([sys.executable, "-c", {FULL_DISK!r}, *sys.argv[1:]],
                              env={{**__import__("os").environ, "TMPDIR": {str(out.parent)!r}}}
                              ).returncode
        print(sorted(__import__("os").listdir({str(out.parent)!r})), flush=True)
        sys.exit(code)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(["unshare", "-rm", sys.executable, "-c", script,
                          str(tmp_path / "model.pt"), str(out)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "No space left on device" in run.stderr, run.stderr
    assert "MB needed" in run.stderr and str(out) in run.stderr
    assert run.stdout.splitlines()[-1] == "[]"   # (nothing left on that disk)


def test_prompt_ids_beyond_int64_are_one_line(compiled_lm, capsys):
    from hla_tvm.cli import main

    _, lib = compiled_lm("hla2")
    for ids, shown in (("99999999999999999999999", "99999999999999999999999"),
                       ("1,-99999999999999999999999", "-99999999999999999999999")):
        assert main(["run", str(lib), "--prompt-ids", ids]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"must lie in [0, 40), got {shown}" in err, err


def test_tokenizer_ids_beyond_the_vocabulary_are_refused(tmp_path):
    """Three entries, one with id 1000: the count fits a vocabulary of 40, the id does not."""
    tokenizers = pytest.importorskip("tokenizers")
    from hla_tvm.runtime.text import TOKENIZER, codec, read_tokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "c": 1000},
                                                           unk_token="a"))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match=r"tokenizer .*tokenizer.json gives token 'c' the id "
                                         r"1000, beyond the model's vocabulary of 40 ids"):
        read_tokenizer(path, 40)
    assert read_tokenizer(path, 1001)
    with pytest.raises(ValueError, match="the tokenizer kept in this module gives token 'c'"):
        codec({TOKENIZER: path.read_text(), "vocab_size": 40})   # (compiled before the check)


def _lm_model(edit):
    """An ONNX language model (int64 tokens [B, T] -> embedding rows -> logits: the interface
    `hla_tvm.onnx.compile` reads) with `edit` applied to its graph."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.zeros((8, 4), np.float32), "table")
    head = numpy_helper.from_array(np.zeros((4, 8), np.float32), "head")
    nodes = [helper.make_node("Gather", ["table", "tokens"], ["x"]),
             helper.make_node("MatMul", ["x", "head"], ["logits"])]
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["B", "T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", 8])],
        [table, head])
    edit(graph)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_onnx_refusals_name_the_file(tmp_path, capfd):
    import onnx

    from hla_tvm.cli import main
    from hla_tvm.onnx.importer import lm_module

    def raw_data(g):
        g.initializer[0].raw_data = g.initializer[0].raw_data[:-4]

    def reshape_by_a_tensor(g):
        from onnx import helper
        g.node.append(helper.make_node("Reshape", ["logits", "x"], ["y"]))
        g.output[0].name = "y"

    cases = {
        "unknown_op": (lambda g: setattr(g.node[1], "op_type", "FooBar"), NotImplementedError,
                       "FooBar"),
        "short_data": (raw_data, ValueError, "cannot reshape array of size 31"),
        "undefined_input": (lambda g: g.node[1].input.__setitem__(1, "nope"), ValueError,
                            r"no node, input or initializer defines \('nope'\)"),
        "bad_reshape": (reshape_by_a_tensor, ValueError, r"\(at a Reshape node\)"),
    }
    for name, (edit, cls, match) in cases.items():
        path = tmp_path / f"{name}.onnx"
        onnx.save(_lm_model(edit), path)
        with pytest.raises(cls, match=rf"^{path}: TVM's ONNX importer refused it.*{match}"):
            lm_module(path)
        capfd.readouterr()
        assert main(["compile", str(path), "-o", str(tmp_path / "x.so")]) == 2
        out, err = capfd.readouterr()
        assert err.count("\n") == 1 and str(path) in err, err   # (nothing TVM printed)
        assert "Error converting" not in out


# --- disclosure --------------------------------------------------------------------------------
def test_a_module_whose_note_was_edited_is_refused(compiled_lm, tmp_path):
    """The note (read before loading) must be the metadata compiled into the library."""
    from hla_tvm.runtime import load, read_meta

    _, lib = compiled_lm("hla2")
    data = open(lib, "rb").read()
    image = len(data) - libfile.TRAILER
    size = int.from_bytes(data[image - 16:image - 8], "little")
    meta = json.loads(data[image - 16 - size:image - 16])
    meta["max_batch"] = 4   # (any edit: the trailer recomputed, the file whole)
    note = json.dumps(meta).encode()
    edited = tmp_path / "edited.so"
    edited.write_bytes(data[:image - 16 - size] + note + len(note).to_bytes(8, "little")
                       + libfile.NOTE)
    libfile.seal(edited)
    assert read_meta(edited)["max_batch"] == 4   # (a whole sealed file: the note reads)
    with pytest.raises(ValueError, match=rf"^{edited}: its metadata note does not match the "
                                         "metadata compiled into the library"):
        load(edited)
    assert load(lib).meta == read_meta(lib)


def test_float16_outputs_overflow_in_the_final_rounding_as_documented():
    """The state stays float32 and finite; an output is inf exactly where its float32 value is
    beyond float16's range, in both backends; docs/usage.md's Operators section says so."""
    import torch

    import hla_tvm

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) * 10 for _ in range(3))
    half = [x.half() for x in (q, k, v)]
    want = hla_tvm.hla(*[x.float() for x in half], backend="torch")
    beyond = want.abs() > 65504
    assert 0 < int(beyond.sum()) < want.numel()
    for backend in ("torch", "tvm"):
        o, state = hla_tvm.hla(*half, backend=backend, return_state=True)
        assert o.dtype == torch.float16
        assert all(s.dtype == torch.float32 and torch.isfinite(s).all() for s in state.values())
        assert torch.equal(torch.isinf(o), beyond), backend
    usage = open(os.path.join(ROOT, "docs", "usage.md")).read()
    assert "beyond ±65,504 comes back as `inf`" in usage
