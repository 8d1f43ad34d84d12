"""Every file the package reads, truncated or with flipped bytes: a clear ValueError naming the
file (or, where the damage hit bytes that carry no data, exactly the original content), never a
crash and never a silently different model. Kernel-cache entries are rebuilt instead."""
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from conftest import make_qkv, rel_err, sealed_without_note

from hla_tvm import build, hla, onnx as hla_onnx
from hla_tvm.compiler import compile as compile_model
from hla_tvm.models import HLALM
from hla_tvm.models.hlalm import weights_digest
from hla_tvm.ops.hla2 import reference as hla2
from hla_tvm.runtime import load

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_bad_checkpoint_config_names_the_key",
    "test_checkpoint_digest_catches_a_changed_weight",
    "test_damaged_state_file_is_refused",
    "test_state_file_with_nan_or_flat_entry_names_the_entry",
    "test_damaged_compiled_module_is_refused_without_a_crash[flip]",
    "test_module_metadata_reads_without_loading",
}

VOCAB = 40
SEEDS = range(6)


@pytest.fixture(scope="module")
def files(tmp_path_factory, compiled_lm):
    """A checkpoint, its compiled module, its ONNX export and a saved state."""
    model, lib = compiled_lm("hla2")
    folder = tmp_path_factory.mktemp("good")
    model.save(folder / "model.pt")
    shutil.copyfile(lib, folder / "model.so")
    hla_onnx.export(model, folder / "model.onnx")
    m = load(folder / "model.so")
    _, state = m.prefill(np.arange(9).reshape(1, 9), m.init_state(1))
    m.save_state(state, folder / "state.npz")
    return model, folder


def _damaged(src, dst, how, seed, *, count=16, start=0):
    data = bytearray(src.read_bytes())
    if how == "truncate":
        cut = [4096, len(data) // 2, len(data) - 1][seed % 3]
        data = data[:cut]
    else:
        rng = random.Random(seed)
        for _ in range(count):
            data[rng.randrange(start, len(data))] ^= 1 << rng.randrange(8)
    # a new file (inode) replaces dst: rewriting a library in place under a process that has
    # it mapped kills that process, whatever the library (what `cp` over a loaded .so does)
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, dst)
    return dst


def _refused_or_same(src, tmp_path, read, same):
    """read() every truncated and flipped copy of src: a ValueError naming the copy, or content
    for which same(content) holds (the damage hit bytes that carry nothing, such as padding)."""
    for how in ("truncate", "flip"):
        for s in SEEDS:
            path = _damaged(src, tmp_path / f"{how}{s}{src.suffix}", how, s)
            try:
                got = read(path)
            except ValueError as err:
                assert str(path) in str(err)
                assert "weights_only" not in str(err)
                continue
            assert same(got), path


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_compiled_module_is_refused_without_a_crash(files, tmp_path, how):
    """Run in a child process: a truncated library mapped by the loader used to die of SIGBUS."""
    _, folder = files
    paths = [_damaged(folder / "model.so", tmp_path / f"m{s}.so", how, s, count=64)
             for s in SEEDS]
    code = textwrap.dedent(f"""
        import numpy as np
        from hla_tvm.runtime import load
        for p in {[str(p) for p in paths]!r}:
            try:
                m = load(p)
            except ValueError as err:
                assert p in str(err), err
                print("refused", err)
                continue
            raise SystemExit(f"{{p}} loaded")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("refused") == len(paths)


def test_module_metadata_reads_without_loading(files, tmp_path):
    from hla_tvm.runtime import libfile, read_meta

    lib = files[1] / "model.so"
    assert read_meta(lib) == load(lib).meta   # the library's note: its own metadata
    data = lib.read_bytes()
    image = len(data) - libfile.TRAILER
    # a library without a note (the trailer right after the image): not known to be a model,
    # so refused before it is loaded (loading runs a library's code)
    old = sealed_without_note(lib, tmp_path / "old.so")
    for call in (read_meta, load):
        with pytest.raises(ValueError, match="old.so: not an hla_tvm compiled model"):
            call(old)
    # a note recording more bytes than the file holds: refused, naming the file
    bad = tmp_path / "bad.so"
    bad.write_bytes(data[:image - 16] + (1 << 40).to_bytes(8, "little") + libfile.NOTE)
    libfile.seal(bad)
    with pytest.raises(ValueError, match="bad.so: the compiled module's note is malformed"):
        read_meta(bad)


def test_damaged_checkpoint_is_refused(files, tmp_path):
    model, folder = files
    want = model.state_dict()
    _refused_or_same(folder / "model.pt", tmp_path, HLALM.load, lambda got: all(
        torch.equal(got.state_dict()[n], w) for n, w in want.items()))


def test_checkpoint_digest_catches_a_changed_weight(files, tmp_path):
    model, folder = files
    blob = torch.load(folder / "model.pt", weights_only=True)
    blob["weights"]["embed.weight"][3, 4] += 491.0
    torch.save(blob, tmp_path / "edited.pt")
    with pytest.raises(ValueError, match="do not match the digest"):
        HLALM.load(tmp_path / "edited.pt")


@pytest.mark.parametrize("key, value, match", [
    ("vocab_size", None, "config key 'vocab_size' is missing"),
    ("n_heads", "4", "config key 'n_heads' must be int"),
    ("masked", 1, "config key 'masked' must be bool"),
    ("colour", "red", "unknown config key 'colour'"),
    ("order", 5, "does not describe an HLALM"),
])
def test_bad_checkpoint_config_names_the_key(files, tmp_path, key, value, match):
    _, folder = files
    blob = torch.load(folder / "model.pt", weights_only=True)
    if value is None:
        del blob["config"][key]
    else:
        blob["config"][key] = value
    blob["digest"] = weights_digest(blob["config"], blob["weights"])   # a consistent file
    torch.save(blob, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=match):
        HLALM.load(tmp_path / "bad.pt")


def test_garbage_checkpoint_gives_no_unpickling_advice(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"\x80\x04junk" * 50)
    torch.save({"x": torch.nn.Linear(2, 2)}, tmp_path / "module.pt")
    for name in ("junk.pt", "module.pt"):
        with pytest.raises(ValueError, match="not") as err:
            HLALM.load(tmp_path / name)
        assert "weights_only" not in str(err.value)


def test_damaged_onnx_is_refused(files, tmp_path):
    _, folder = files
    tokens = np.array([[1, 2, 3, 4]])
    want = hla_onnx.session(folder / "model.onnx").run(None, {"tokens": tokens})[0]
    _refused_or_same(folder / "model.onnx", tmp_path, hla_onnx.session,
                     lambda sess: np.array_equal(sess.run(None, {"tokens": tokens})[0], want))
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        hla_onnx.compile(_damaged(folder / "model.onnx", tmp_path / "t.onnx", "truncate", 1),
                         out=tmp_path / "x.so")


def test_damaged_state_file_is_refused(files, tmp_path):
    _, folder = files
    m = load(folder / "model.so")
    want = [x.copy() for x in m.load_state(folder / "state.npz")]
    _refused_or_same(folder / "state.npz", tmp_path, m.load_state, lambda got: all(
        np.array_equal(a, b) for a, b in zip(got, want)))


def test_state_file_with_nan_or_flat_entry_names_the_entry(files, tmp_path):
    _, folder = files
    m = load(folder / "model.so")
    arrays = dict(np.load(folder / "state.npz"))
    nan = dict(arrays)
    nan["layer1.G"] = nan["layer1.G"].copy()
    nan["layer1.G"][0, 1, 2, 3] = np.nan
    np.savez(tmp_path / "nan.npz", **nan)
    with pytest.raises(ValueError, match=r"layer1\.G holds non-finite"):
        m.load_state(tmp_path / "nan.npz")
    for name in ("layer0.S", "layer1.C"):
        flat = dict(arrays)
        flat[name] = flat[name].reshape(-1)
        np.savez(tmp_path / "flat.npz", **flat)
        with pytest.raises(ValueError, match=rf"state entry {name} must have shape \[(B|1), "
                                             r"4, 8, 8\], got \[\d+\]"):
            m.load_state(tmp_path / "flat.npz")


CASES = [("truncate", 0), ("truncate", 2), ("flip", 0), ("flip", 1), ("foreign", 0)]


@pytest.mark.parametrize("how, seed", CASES)
def test_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch, how, seed):
    """A cache file cut short, flipped, or holding a kernel built with other options (under this
    entry's name) is rebuilt with a warning; later calls give the right answer."""
    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(tmp_path))
    q, k, v = make_qkv(1, 2, 40, 8, 4, seed=3, dtype=torch.float32)
    want = hla2.quadratic(*(x.double() for x in (q, k, v)))
    build.clear_memory_cache()
    try:
        assert rel_err(hla(q, k, v, chunk_size=16), want) <= 1e-4
        (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("hla2_prefill-")]
        if how == "foreign":   # a kernel compiled with other options under this entry's name
            hla(q, k, v, chunk_size=16, normalize=True)
            other = [p for p in tmp_path.iterdir() if p.name.startswith("hla2_prefill-")
                     and p != entry][0]
            _damaged(other, entry, "flip", 0, count=0)
        else:
            _damaged(entry, entry, how, seed, count=64)
        build.clear_memory_cache()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = hla(q, k, v, chunk_size=16)
        assert any("rebuilding unreadable cached kernel" in str(w.message) for w in caught)
        assert rel_err(got, want) <= 1e-4
        assert rel_err(hla(q, k, v, chunk_size=16), want) <= 1e-4
    finally:
        build.clear_memory_cache()


def test_module_compiled_again_to_the_same_path_is_reloaded(tmp_path):
    """The dynamic loader returns a library already loaded under a path even after the file
    changed; loading must give the new module, not the old one."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 11))
    for seed, cfg in enumerate([dict(), dict(decay=0.9)]):
        torch.manual_seed(seed)
        model = HLALM(VOCAB, 32, 1, 4, chunk_size=16, **cfg).eval()
        compile_model(model, out=tmp_path / "same.so")
        m = load(tmp_path / "same.so")
        logits, _ = m.prefill(tokens, m.init_state(2))
        with torch.no_grad():
            ref, _ = model(torch.as_tensor(tokens))
        assert rel_err(torch.from_numpy(logits), ref) <= 1e-4, cfg
    assert sorted(os.listdir(tmp_path)) == ["same.so"]   # no aliases left behind


def test_the_export_apps_refuse_damaged_or_foreign_modules_without_a_crash(files, tmp_path,
                                                                           cpp_app):
    """export/'s script and C++ app check a module as `hla_tvm.runtime.libfile` does before the
    loader maps it (truncated: SIGBUS; flipped bytes: silently wrong tokens) and refuse a module for
    another architecture or a name TVM cannot load, each with one line naming the file."""
    _, folder = files
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "export", "python", "generate.py")
    paths = [_damaged(folder / "model.so", tmp_path / f"{how}{s}.so", how, s, count=64)
             for how in ("truncate", "flip") for s in SEEDS[:3]]
    from hla_tvm.runtime.libfile import ELF_MACHINES, host_machine_code

    other = 62 if host_machine_code() == 183 else 183   # x86_64 on aarch64, else aarch64
    foreign = bytearray((folder / "model.so").read_bytes())
    foreign[18:20] = other.to_bytes(2, "little")
    (tmp_path / "arm.so").write_bytes(bytes(foreign))
    shutil.copyfile(folder / "model.so", tmp_path / "model")
    cases = [(p, "corrupt|checksum trailer") for p in paths] + \
        [(tmp_path / "arm.so", f"compiled for {ELF_MACHINES[other]}, this machine is"),
         (tmp_path / "model", "must end in .so"), (tmp_path / "none.so", "cannot read it")]
    for path, want in cases:
        for cmd in ([sys.executable, script], [cpp_app]):
            run = subprocess.run(cmd + [str(path), "--prompt", "1,2", "--steps", "2"],
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode in (1, 2) and not run.stdout, (cmd, path, run.returncode)
            line = run.stderr.strip().splitlines()[-1]
            assert str(path.name) in line and re.search(want, line), (cmd, line)
    # the runtime loads a module whatever its name ends in (through a name it then removes)
    before = set(os.listdir(tmp_path))
    m = load(tmp_path / "model")
    assert m.decode(np.array([3]), m.init_state(1))[0].shape == (1, VOCAB)
    assert set(os.listdir(tmp_path)) == before


def test_state_file_keeps_its_name_and_other_numpy_files_are_refused(files, tmp_path):
    """save_state writes the name it is given (numpy would add .npz), load_state reads it back;
    a single array or a pickle is no state file."""
    _, folder = files
    m = load(folder / "model.so")
    _, state = m.prefill(np.arange(5).reshape(1, 5), m.init_state(1))
    m.save_state(state, tmp_path / "state")
    assert sorted(os.listdir(tmp_path)) == ["state"]
    with pytest.raises(ValueError, match="does not exist or is not writable"):
        m.save_state(state, tmp_path / "no" / "state")
    with pytest.raises(ValueError, match="is a folder"):
        m.save_state(state, tmp_path)
    back = m.load_state(tmp_path / "state")
    assert all(np.array_equal(a, b) for a, b in zip(state, back))
    np.save(tmp_path / "one.npy", np.zeros(3))
    np.save(tmp_path / "obj.npy", np.array([{1: 2}], dtype=object))
    (tmp_path / "code.py").write_text("print(1)\n")
    for name in ("one.npy", "obj.npy", "code.py"):
        with pytest.raises(ValueError, match="not a state file written by save_state") as err:
            m.load_state(tmp_path / name)
        assert "allow_pickle" not in str(err.value)
