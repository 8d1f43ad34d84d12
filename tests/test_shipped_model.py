"""The shipped byte-level model and what runs it: `hla-tvm demo`, `hla-tvm run --prompt TEXT`,
and `hla-tvm bundle`, whose script runs where neither TVM's Python package nor torch nor
hla_tvm can be imported and whose C++ app builds from the bundle alone. Compiled once (the
demo's cache) for the file's tests."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from hla_tvm import demo
from hla_tvm.cli import main
from hla_tvm.models import HLALM
from hla_tvm.runtime import load
from hla_tvm.runtime.generate import Eager, encode_text, generate
from hla_tvm.target import host_target

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("shipped_model")]
PROMPT = "def read(path):\n    "


@pytest.fixture(scope="module")
def shipped():
    model = HLALM.load(demo.SHIPPED)
    path, _ = demo.compiled_module(model, host_target(), max_batch=demo.STREAMS)   # the demo's
    return model, path


def test_shipped_model_is_small_byte_level_and_better_than_uniform():
    from hla_tvm import train

    size = os.path.getsize(demo.SHIPPED)
    assert size <= 8 * 2 ** 20
    model = HLALM.load(demo.SHIPPED)
    assert model.config["vocab"] == "bytes" and model.config["order"] == 2
    _, val = train.stdlib_corpus()
    gen = torch.Generator().manual_seed(5)
    bpb = train.evaluate(model, [train.windows(val, 8, 256, gen) for _ in range(2)])
    assert bpb < 2.6, bpb   # uniform bytes: 8 bits; the shipped model was 1.93 at release


def test_module_holds_one_copy_of_the_weights(shipped):
    model, path = shipped
    weights = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    # prefill and decode share the constants: weights + code (about 1 MB), not twice the weights
    assert os.path.getsize(path) < weights + 2.5e6, (os.path.getsize(path), weights)


def test_module_takes_its_kernels_from_the_shipped_records(shipped):
    """On a CPU the project ships records for (`schedules/`), the compiled demo model takes
    every HLA kernel from them (a record holds the faster of the tuned and default schedule);
    its projections, which the records do not hold, take the default tiles."""
    from hla_tvm.schedule.tuning import records

    _, path = shipped
    used = load(path).meta["schedules"]
    folder = records.target_folder(host_target())
    if not os.path.isdir(os.path.join(records.package_root(), folder)):
        pytest.skip(f"no shipped records for this CPU ({folder}); schedules/ has "
                    f"{sorted(os.listdir(records.package_root()))}")
    if os.path.isdir(os.path.join(records.user_root(), folder)):
        pytest.skip(f"the user's own records for {folder} come first")
    assert used["records"] == f"shipped:{folder}"
    assert used["default"] and all("matmul" in n for n in used["default"]), used["default"]
    assert len([n for n in used["from_records"] if n.startswith("hla2")]) == 5


def test_compiled_logits_match_float64_pytorch(shipped):
    _, path = shipped
    ids = encode_text(PROMPT)
    exact = Eager(HLALM.load(demo.SHIPPED).double())
    got, _ = generate(load(path), ids, 12)
    assert got == generate(exact, ids, 12)[0]   # the same greedy bytes
    m = load(path)
    seq = np.array([ids + got])
    a, _ = m.prefill(seq, m.init_state(1))
    b, _ = exact.prefill(seq, None)
    err = float(np.abs(a - b).max() / np.abs(b).max())
    assert err < 1e-4, err


def test_demo_streams_text_and_reports_speed(shipped, capsys, monkeypatch):
    assert main(["demo", "--tokens", "24", "--prompt", PROMPT]) == 0
    out, err = capsys.readouterr()
    assert PROMPT in out and "tokens/s" in out and "PyTorch eager" in out and "OK" in out
    assert "compiling" not in err   # the module of the fixture, from the cache
    # timed while other processes kept the machine busy: the comparison says so
    from hla_tvm.runtime import pool

    monkeypatch.setattr(pool.OtherLoad, "BUSY", -1.0)
    assert main(["demo", "--tokens", "8", "--prompt", PROMPT]) == 0
    assert "note: other processes kept" in capsys.readouterr().out


def test_demo_refuses_what_it_cannot_run_before_compiling(capsys):
    assert main(["demo", "--tokens", "1"]) == 2
    assert "tokens must be an int >= 2" in capsys.readouterr().err
    assert main(["demo", "--target", "aarch64"]) == 2
    assert "runs the model on this machine's CPU" in capsys.readouterr().err


def test_run_generates_text_reproducibly(shipped, capsys):
    _, path = shipped
    args = ["run", path, "--prompt", PROMPT, "--tokens", "40", "--temperature", "0.8",
            "--top-k", "20", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith(PROMPT)
    assert main(["run", path, "--text", PROMPT] + args[4:]) == 0   # (the apps' spelling)
    assert capsys.readouterr().out == first
    assert main(args[:-1] + ["4"]) == 0
    assert capsys.readouterr().out != first   # (another seed, another continuation)
    # text samples as the demo does unless told otherwise (greedy repeats one byte)
    assert main(args[:4] + ["--tokens", "40"]) == 0
    default = capsys.readouterr().out
    assert main(args[:4] + ["--tokens", "40", "--temperature", "0.9", "--top-k", "40"]) == 0
    assert capsys.readouterr().out == default
    assert len(set(default[len(PROMPT):])) > 3


def test_run_reads_a_long_prompt_from_a_file_or_stdin(shipped, capsys, tmp_path, monkeypatch):
    """--prompt-file FILE (or - for standard input) gives what --prompt gives; a prompt past
    ECHO_CHARS is echoed by its end, after a marker saying how much was left out."""
    import io

    from hla_tvm.cli import run as run_command

    _, path = shipped
    args = ["--tokens", "8", "--temperature", "0"]
    assert main(["run", path, "--prompt", PROMPT] + args) == 0
    want = capsys.readouterr().out
    (tmp_path / "p.txt").write_text(PROMPT, encoding="utf-8")
    assert main(["run", path, "--prompt-file", str(tmp_path / "p.txt")] + args) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(PROMPT.encode())))
    assert main(["run", path, "--prompt-file", "-"] + args) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr(run_command, "ECHO_CHARS", 10)
    assert main(["run", path, "--prompt", PROMPT] + args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"[... {len(PROMPT) - 10} characters of the prompt ...]" + PROMPT[-10:])
    assert out.endswith(want[len(PROMPT):])


def test_run_prompt_text_needs_a_module_with_text(compiled_lm, capsys):
    _, path = compiled_lm("base")
    assert main(["run", str(path), "--prompt", "def "]) == 2
    assert "needs a model with text (byte-level, or compiled with --tokenizer)" in \
        capsys.readouterr().err
    assert main(["run", str(path)]) == 2
    assert "give --prompt TEXT" in capsys.readouterr().err


BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "hla_tvm", "tvm"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, _Block())
sys.argv = sys.argv[1:]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _greedy_text(path, steps):
    m = load(path)
    tokens, _ = generate(m, encode_text(PROMPT), steps)
    return PROMPT + bytes(tokens).decode("utf-8", errors="replace")


def test_bundle_runs_without_tvm_python_and_builds_the_cpp_app(shipped, tmp_path, capsys):
    _, path = shipped
    out = tmp_path / "bundle"
    assert main(["bundle", path, "-o", str(out)]) == 0
    for f in ("model.so", "generate.py", "README.md", "bundle.json", "cpp/main.cc",
              "runtime/tvm/lib/libtvm_runtime.so", "runtime/tvm_ffi/lib/libtvm_ffi.so"):
        assert (out / f).is_file(), f
    assert main(["bundle", path, "-o", str(out)]) == 2   # not over a non-empty folder
    assert "--force" in capsys.readouterr().err
    assert main(["bundle", str(out / "model.so"), "-o", str(out), "--force"]) == 2
    assert "holds the module itself" in capsys.readouterr().err
    assert (out / "model.so").is_file()
    want = _greedy_text(path, 30)
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_USE_RUNTIME_LIB",
                                                            "TVM_RUNTIME_LIB")}

    def script(*options):
        run = subprocess.run([sys.executable, "-c", BLOCK, str(out / "generate.py"),
                              str(out / "model.so"), "--text", PROMPT, "--steps", "30",
                              *options], capture_output=True, text=True, timeout=300, env=env,
                             cwd=str(out))
        assert run.returncode == 0, run.stderr
        return run.stdout.rstrip("\n")

    assert script("--temperature", "0") == want
    # text is sampled by default, as `hla-tvm run` samples it (the same sampler and seed)
    assert main(["run", path, "--prompt", PROMPT, "--tokens", "30"]) == 0
    assert script() == capsys.readouterr().out.rstrip("\n") != want
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the bundle's C++ app needs cmake and a C++ compiler")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(out / "cpp"), "-B", str(build),
                    f"-DTVM_ROOT={out}/runtime/tvm", f"-DTVM_FFI_ROOT={out}/runtime/tvm_ffi"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    app = subprocess.run([str(build / "hla_tvm_app"), str(out / "model.so"), "--text", PROMPT,
                          "--steps", "30", "--temperature", "0"], capture_output=True,
                         timeout=120)
    assert app.returncode == 0, app.stderr
    assert app.stdout.decode("utf-8", errors="replace").rstrip("\n") == want
    # sampled by default (its own generator: another continuation than greedy), seeded
    sampled = [subprocess.run([str(build / "hla_tvm_app"), str(out / "model.so"), "--text",
                               PROMPT, "--steps", "30"], capture_output=True, timeout=120)
               for _ in range(2)]
    assert sampled[0].returncode == 0 and sampled[0].stdout == sampled[1].stdout
    assert sampled[0].stdout.decode("utf-8", errors="replace").rstrip("\n") != want
