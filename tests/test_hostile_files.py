"""Files made to hurt: tuning records that crashed TVM's reader (a null in a trace, a module
node that contains itself, lists nested 100,000 deep), state files that declare gigabytes, and
a prompt file that never ends. Each is refused with one line naming the file: no crash (the
crash cases run in a child process), no unbounded allocation or read."""
import base64
import copy
import json
import lzma
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

from hla_tvm.schedule.tuning import records

# the fast subset: each kind of hostile file once (the records' crash cases in children and the
# compile's refusal of them: slow)
FAST = {
    "test_records_are_read_apart_once",
    "test_state_entry_declaring_trillions_of_elements_is_refused",
    "test_state_file_bomb_is_refused_before_its_data_is_read",
    "test_run_refuses_a_prompt_file_without_end",
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "schedules", "llvm-znver4-2c")


def _shipped(name):
    with open(os.path.join(SHIPPED, name + records.PACKED), "rb") as f:
        return lzma.decompress(f.read()).splitlines(keepends=True)


def _encode(graph):
    """A workload's module as meta_schedule writes it: base64 of length (8 bytes) + JSON."""
    text = json.dumps(graph, indent=2).encode()
    return base64.b64encode(len(text).to_bytes(8, "little") + text).decode()


def _folder(where, workloads=None, tunings=None):
    """A plain records folder: the shipped znver4 records with their first workload line
    and first record line replaced where given."""
    w, r = _shipped(records.FILES[0]), _shipped(records.FILES[1])
    if workloads is not None:
        w[0] = workloads + b"\n"
    if tunings is not None:
        r[0] = tunings + b"\n"
    where.mkdir()
    (where / records.FILES[0]).write_bytes(b"".join(w))
    (where / records.FILES[1]).write_bytes(b"".join(r))
    return where


def _hostile(tmp_path):
    """{name: (folder, file the refusal names)} of records that crashed (or recursed in) the
    reader before they were checked."""
    record = json.loads(_shipped(records.FILES[1])[0])
    workload = json.loads(_shipped(records.FILES[0])[0])
    raw = base64.b64decode(workload[1])
    graph = json.loads(raw[8:])
    array = next(i for i, n in enumerate(graph["nodes"]) if n["type"] == "ffi.Array")
    var = next(i for i, n in enumerate(graph["nodes"]) if n["type"] == "ir.Var")
    none = next(i for i, n in enumerate(graph["nodes"]) if n["type"] == "None")

    def trace(edit):
        r = copy.deepcopy(record)
        edit(r[1][0][0])   # (the trace's instructions)
        return json.dumps(r).encode()

    def module(edit):
        g = copy.deepcopy(graph)
        edit(g["nodes"])
        return json.dumps([workload[0], _encode(g)]).encode()

    deep = b"[" * 100_000 + b"]" * 100_000
    cases = {
        "null_attr": {"tunings": trace(lambda t: t[0].__setitem__(2, ["root", None]))},
        "null_instruction": {"tunings": trace(lambda t: t.__setitem__(0, None))},
        "self_node": {"workloads": module(lambda n: n[array]["data"].append(array))},
        "node_out_of_range": {"workloads": module(lambda n: n[array]["data"].append(10**6))},
        "deep_record": {"tunings": deep},
        "deep_module": {"workloads": json.dumps([workload[0], base64.b64encode(
            len(deep).to_bytes(8, "little") + deep).decode()]).encode()},
        # no check here follows every IR field: read apart, TVM's SIGSEGV is a refusal
        "null_field": {"workloads": module(lambda n: n[var]["data"].__setitem__("ty", none))},
    }
    out = {}
    for name, edit in cases.items():
        folder = _folder(tmp_path / name, **edit)
        out[name] = (folder, folder / records.FILES[0 if "workloads" in edit else 1])
    return out


def test_hostile_records_are_refused_without_a_crash(tmp_path):
    """In a child process: each hostile folder refused with one line naming its file and
    line (exit 0 for all, where TVM's reader died of SIGSEGV or Python raised RecursionError);
    the shipped records still load."""
    cases = _hostile(tmp_path)
    good = _folder(tmp_path / "good")
    code = textwrap.dedent(f"""
        from hla_tvm.schedule.tuning import records
        for name, folder in {[(n, str(f)) for n, (f, _) in cases.items()]!r}:
            try:
                records.load(folder)
            except ValueError as err:
                print(name, "refused", str(err).replace(chr(10), " | "))
                continue
            raise SystemExit(name + " loaded")
        print("good", len(records.load({str(good)!r}).get_all_tuning_records()))
    """)
    env = dict(os.environ, HLA_TVM_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env=env, check=False)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-3000:])
    lines = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines())
    assert lines.pop("good") == "20"
    assert sorted(lines) == sorted(cases)
    for name, (_, file) in cases.items():
        assert lines[name].startswith(f"refused {file}:1: "), (name, lines[name])
        assert "|" not in lines[name], lines[name]   # one line
    assert "nested more than" in lines["deep_record"] and "nested more than" in \
        lines["deep_module"]
    assert "contains itself" in lines["self_node"]
    assert "null" in lines["null_attr"] and "crashes" in lines["null_field"]


def test_records_are_read_apart_once(tmp_path, monkeypatch):
    """The child's verdict on records read without fault is kept in the cache (by content and
    TVM version): the next process reads them without a child."""
    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(tmp_path / "cache"))
    good = str(_folder(tmp_path / "good"))
    assert len(records.load(good).get_all_tuning_records()) == 20
    assert len(os.listdir(tmp_path / "cache" / records.CHECKED)) == 1
    records._VERDICTS.clear()
    records._DATABASES.clear()

    def no_child(*args):
        raise AssertionError("read apart again")

    monkeypatch.setattr(records, "_read_in_child", no_child)
    assert len(records.load(good).get_all_tuning_records()) == 20
    from hla_tvm.runtime import cache

    assert [k for _, k in cache.entries()] == ["checked"]   # the cache's own (clear removes it)


def test_compile_refuses_hostile_records_in_one_line(tmp_path):
    """`hla-tvm compile --schedules DIR`, and the automatic folder under the cache: exit 2, one
    line naming the file (they died of SIGSEGV)."""
    import torch

    from hla_tvm.models import HLALM
    from hla_tvm.target import resolve

    torch.manual_seed(0)
    HLALM(40, 16, 1, 2, chunk_size=16).save(tmp_path / "ck.pt")
    cases = _hostile(tmp_path)
    folder, file = cases["null_attr"]
    auto = tmp_path / "cache" / "schedules" / records.target_folder(resolve(None))
    auto.parent.mkdir(parents=True)
    self_node, self_file = cases["self_node"]
    os.rename(self_node, auto)
    env = dict(os.environ, HLA_TVM_CACHE_DIR=str(tmp_path / "cache"))
    for extra, named in ((["--schedules", str(folder)], str(file)),
                         ([], str(auto / self_file.name))):
        run = subprocess.run([sys.executable, "-m", "hla_tvm", "compile",
                              str(tmp_path / "ck.pt"), "-o", str(tmp_path / "m.so"), *extra],
                             capture_output=True, text=True, timeout=600, env=env,
                             check=False)
        err = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(err) == 1, (run.returncode, run.stderr[-3000:])
        assert named + ":1: " in err[0], err[0]
    assert not (tmp_path / "m.so").exists()


# --- state files -------------------------------------------------------------------------------
def _npy_header(shape, dtype="<f4"):
    """A .npy (version 1.0) header declaring an array of `shape` and `dtype`."""
    import io

    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False,
                                             "shape": tuple(shape)})
    return f.getvalue()


def _state_with(src, dst, name, header, zeros=0, *, deflate=False):
    """A copy of the state file `src` whose entry `name` is `header` followed by `zeros` zero
    bytes (deflated where asked), written in pieces (the test allocates none of it)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            if info.filename != name + ".npy":
                out.writestr(info, z.read(info))
                continue
            entry = zipfile.ZipInfo(info.filename)
            entry.compress_type = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            with out.open(entry, "w", force_zip64=True) as f:
                f.write(header)
                piece = bytes(1 << 20)
                while zeros > 0:
                    f.write(piece[:zeros])
                    zeros -= len(piece)
    return dst


@pytest.fixture(scope="module")
def state_file(compiled_lm, tmp_path_factory):
    """(compiled module's path, a state file it saved, the name, shape and dtype of its first
    entry)."""
    from hla_tvm.runtime import load

    _, lib = compiled_lm("hla2")
    m = load(lib)
    path = tmp_path_factory.mktemp("state") / "state.npz"
    m.save_state(m.init_state(1), path)
    return lib, path, m.state_spec[0]


def test_state_entry_declaring_trillions_of_elements_is_refused(state_file, tmp_path):
    """A declared shape of 10^13 elements, wrong (flat) or right but for a batch the file does
    not hold: ValueError naming the file and the entry, not MemoryError; through the server's
    session store too."""
    from hla_tvm.runtime import load
    from hla_tvm.serve.sessions import SUFFIX, SessionStore

    lib, src, (name, shape, _) = state_file
    m = load(lib)
    per = int(np.prod(shape))
    for declared in ([10**13], [10**13 // per, *shape]):
        bad = _state_with(src, tmp_path / "bad.npz", name, _npy_header(declared))
        with pytest.raises(ValueError, match=rf"bad.npz: .*{name}") as err:
            m.load_state(bad)
        assert len(str(err.value).splitlines()) == 1
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    os.replace(bad, sessions / ("s" + SUFFIX))
    with pytest.raises(ValueError, match=rf"session 's' is not usable: .*{name}"):
        SessionStore(sessions, m).load("s")
    # a session holds one stream: a well-formed state of batch 2 is no session
    m.save_state(m.init_state(2), sessions / ("two" + SUFFIX))
    assert len(m.load_state(sessions / ("two" + SUFFIX))[0]) == 2
    with pytest.raises(ValueError, match=rf"session 'two' is not usable: state entry {name} "
                                         r"must have shape \[1, "):
        SessionStore(sessions, m).load("two")


def test_state_file_bomb_is_refused_before_its_data_is_read(state_file, tmp_path):
    """An entry whose deflated zeros expand to 128 MB (the file: about 130 KB), declared so
    (a wrong shape) or declared as the right shape with the rest beyond it: refused naming the
    file and entry, and the peak memory of the process (a child, its peak reset before the
    call) grows by far less than the entry."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak memory")
    lib, src, (name, shape, _) = state_file
    big = 128 << 20
    declared = _state_with(src, tmp_path / "declared.npz", name, _npy_header([big // 4]), big,
                           deflate=True)
    beyond = _state_with(src, tmp_path / "beyond.npz", name, _npy_header([1, *shape]), big,
                         deflate=True)
    assert os.path.getsize(declared) < 1 << 20
    code = textwrap.dedent(f"""
        from hla_tvm.runtime import load

        def peak():   # KiB: the high-water mark that clear_refs resets (ru_maxrss, seen
            # here with TVM's threads, was not reset)
            with open("/proc/self/status") as f:
                return int(next(x for x in f if x.startswith("VmHWM:")).split()[1])

        m = load({str(lib)!r})
        m.load_state({str(src)!r})   # (warm: what a good file costs)
        for path in ({str(declared)!r}, {str(beyond)!r}):
            with open("/proc/self/clear_refs", "w") as f:   # (the peak back to the RSS now)
                f.write("5")
            before = peak()
            try:
                m.load_state(path)
                raise SystemExit(path + " loaded")
            except ValueError as err:
                print(peak() - before, str(err).replace(chr(10), " | "))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2
    for line, path in zip(lines, (declared, beyond)):
        grew_kb, message = line.split(" ", 1)
        assert message.startswith(f"{path}: ") and name in message and "|" not in message
        assert int(grew_kb) < 16 << 10, line   # KiB: under 16 MB of the 128 MB


# --- prompt files ------------------------------------------------------------------------------
def test_run_refuses_a_prompt_file_without_end(tmp_path):
    """`run --prompt-file /dev/zero` read without limit; now at most --max-prompt-bytes (64 MiB
    by default) are read, and a longer file is one line naming it, exit 2."""
    for extra, path in (([], "/dev/zero"), (["--max-prompt-bytes", "10"], tmp_path / "p.txt")):
        (tmp_path / "p.txt").write_text("x" * 11)
        run = subprocess.run([sys.executable, "-m", "hla_tvm", "run", str(tmp_path / "m.so"),
                              "--prompt-file", str(path), *extra],
                             capture_output=True, text=True, timeout=120, check=False)
        err = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(err) == 1, (run.returncode, run.stderr[-2000:])
        assert f"--prompt-file {path} holds more than" in err[0], err[0]
