"""The console script: help text, cache listing, bench on a small shape (the demo: in
test_shipped_model.py)."""
import time

import pytest

from hla_tvm.cli import main

# the tests of the fast subset (`-m "not slow"`; conftest.py marks the others slow)
FAST = {
    "test_help_lists_commands",
    "test_expected_errors_are_one_line_with_exit_code_2",
    "test_every_command_explains_its_flags",
    "test_output_cut_short_by_a_pipe_is_not_an_error",
    "test_version_and_module_entry_point",
    "test_cache_lists_folder",
    "test_cache_sizes_skip_files_gone_meanwhile",
    "test_a_self_timed_case_counts_its_own_seconds_over_at_most_its_calls",
    "test_cache_after_clear_says_empty",
    "test_the_target_is_checked_before_any_model_work",
    "test_debug_shows_the_traceback",
    "test_run_refuses_non_positive_steps",
    "test_unknown_options_are_named_by_the_command_and_a_file_is_no_cache",
}

def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "bench", "cache"):
        assert cmd in out


def test_bench_decode_and_prefill_print_tables_and_json(capsys, tmp_path):
    import json

    assert main(["bench", "decode", "--heads", "2", "--dk", "8", "--repeat", "1",
                 "--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    for case in ("tvm ", "tvm_hla", "torch ", "torch_compile", "state_copy"):
        assert case in out
    report = json.loads((tmp_path / "d.json").read_text())
    assert report["mode"] == "decode" and set(report["machine"]) == {"cpu", "cores", "isa"}
    assert set(report["results"]["tvm"]) == {"median_s", "min_s", "runs", "busy_runs"}
    assert main(["bench", "prefill", "--seq", "128", "--heads", "2", "--dk", "8",
                 "--chunk-size", "16", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for case in ("tvm ", "torch ", "torch_compile", "torch_sdpa", "onnxruntime", "sgemm",
                 "GFLOP/s"):
        assert case in out
    assert main(["bench", "prefill", "--op", "hla3", "--seq", "40", "--heads", "4",
                 "--kv-heads", "2", "--dk", "8", "--chunk-size", "16", "--repeat", "1"]) == 0
    assert "H=4 Hkv=2" in capsys.readouterr().out
    _fails_in_one_line(capsys, ["bench", "--heads", "4", "--kv-heads", "3"],
                       "kv_heads=3 must divide heads=4")


def test_bench_says_when_it_timed_a_busy_process(capsys, monkeypatch):
    """A timed run that started before the process went idle (settle gave up after 1 s) is
    counted and named under the table, not passed over."""
    from hla_tvm.bench import timing

    assert "note:" not in capsys.readouterr().out
    monkeypatch.setattr(timing, "settle", lambda: False)
    assert main(["bench", "decode", "--heads", "2", "--dk", "8", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: tvm 2 of 2, " in out and "threads still working after waiting 1 s" in out


def test_a_self_timed_case_counts_its_own_seconds_over_at_most_its_calls(monkeypatch):
    """A mixed case's slow `before` runs once per counted call, at most `max_calls` a round,
    and only the call itself is timed."""
    from hla_tvm.bench import timing

    monkeypatch.setattr(timing, "settle", lambda: True)
    ran = {"before": 0, "fn": 0, "plain": 0}

    def before():
        ran["before"] += 1
        time.sleep(0.02)

    def fn():
        ran["fn"] += 1

    def plain():
        ran["plain"] += 1

    times = timing.measure_rounds({"mixed": timing.SelfTimed(before, fn, max_calls=3),
                                   "plain": plain}, runs=2, number=50)
    # two warm-up calls each, then 2 rounds of 3 (mixed) and of 50 (plain) calls
    assert ran == {"before": 2 + 2 * 3, "fn": 2 + 2 * 3, "plain": 2 + 2 * 50}
    assert len(times["mixed"]) == 2 and all(t < 0.02 for t in times["mixed"])


def test_cache_sizes_skip_files_gone_meanwhile(tmp_path, monkeypatch):
    """Another process's write in progress or load link may vanish while the cache is listed
    (the test run's workers share one cache): it counts 0 bytes, not an error."""
    from hla_tvm.runtime import cache

    (tmp_path / "a.so").write_bytes(b"x" * 10)
    assert cache.size(tmp_path / "gone.so") == 0
    real = cache.os.walk
    monkeypatch.setattr(cache.os, "walk",
                        lambda p: [(d, ds, [*fs, "gone"]) for d, ds, fs in real(p)])
    assert cache.size(tmp_path) == 10


def test_cache_lists_folder(capsys):
    assert main(["cache"]) == 0
    assert "hla_tvm_cache" in capsys.readouterr().out


def _fails_in_one_line(capsys, argv, *needles):
    """An expected error: exit code 2, one line on stderr naming the problem, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_expected_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(b"junk" * 100)
    (tmp_path / "junk.so").write_bytes(b"\x7fELF" + b"\0" * 200)
    _fails_in_one_line(capsys, ["run", str(tmp_path / "missing.so"), "--prompt-ids", "1"],
                       "hla-tvm run: error:", "missing.so")
    _fails_in_one_line(capsys, ["run", str(tmp_path / "junk.so"), "--prompt-ids", "1"],
                       "junk.so")
    _fails_in_one_line(capsys, ["compile", str(tmp_path / "junk.pt")], "junk.pt",
                       "not an HLALM checkpoint")
    _fails_in_one_line(capsys, ["export-onnx", str(tmp_path / "missing.pt")], "missing.pt")
    _fails_in_one_line(capsys, ["compile", str(tmp_path / "junk.pt"), "--target", "nope"],
                       "target='nope'")
    _fails_in_one_line(capsys, ["compile", str(tmp_path / "junk.pt"), "--target",
                                '{"kind": "llvm", "mcpu": "notacpu"}'], "notacpu")
    _fails_in_one_line(capsys, ["compile", str(tmp_path / "junk.pt"), "--target", "{oops"],
                       "not valid JSON")
    _fails_in_one_line(capsys, ["run", str(tmp_path / "junk.so"), "--prompt-ids", "1,x"],
                       "--prompt-ids")
    # the output path is checked before any work; run's options before the prompt is echoed
    _fails_in_one_line(capsys, ["compile", str(tmp_path / "junk.pt"), "-o",
                                str(tmp_path / "no" / "m.so")], "does not exist")
    _fails_in_one_line(capsys, ["compile", str(tmp_path / "junk.pt"), "-o", str(tmp_path)],
                       "is a folder")
    _fails_in_one_line(capsys, ["export-onnx", str(tmp_path / "junk.pt"), "-o",
                                str(tmp_path / "no" / "m.onnx")], "does not exist")
    _fails_in_one_line(capsys, ["run", str(tmp_path / "junk.so"), "--prompt-ids", "1",
                                "--prompt", "a"], "not --prompt and --prompt-ids")
    _fails_in_one_line(capsys, ["run", str(tmp_path / "junk.so"), "--prompt-ids", "1,,2"],
                       "--prompt-ids must be comma-separated integers")
    _fails_in_one_line(capsys, ["run", str(tmp_path / "junk.so"), "--prompt-file",
                                str(tmp_path / "none.txt")], "--prompt-file", "none.txt")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    _fails_in_one_line(capsys, ["run", str(tmp_path / "junk.so"), "--prompt-file",
                                str(tmp_path / "bad.txt")], "not valid UTF-8")
    for opt, value in (("--seed", "-1"), ("--temperature", "nan"), ("--top-k", "-2")):
        _fails_in_one_line(capsys, ["run", str(tmp_path / "junk.so"), "--prompt", "hi", opt,
                                    value], opt)


def test_the_target_is_checked_before_any_model_work(tmp_path, capsys):
    """A bad target is reported even though the checkpoint does not exist: it came first."""
    err = _fails_in_one_line(capsys, ["compile", str(tmp_path / "nothing.pt"), "--target",
                                      "cuda -arch=sm_90"], "target=")
    assert "nothing.pt" not in err


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["run", str(tmp_path / "missing.so"), "--prompt-ids", "1", "--debug"])


@pytest.mark.parametrize("steps", ["0", "-3", "x"])
def test_run_refuses_non_positive_steps(tmp_path, capsys, steps):
    with pytest.raises(SystemExit) as e:
        main(["run", str(tmp_path / "m.so"), "--prompt-ids", "1", "--steps", steps])
    assert e.value.code == 2
    assert "--steps: must be a positive integer" in capsys.readouterr().err


def test_cache_after_clear_says_empty(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / f"hla2_decode-{'a' * 24}.so").write_bytes(b"x")
    assert main(["cache", "--clear"]) == 0
    assert "1 compiled kernel modules" in capsys.readouterr().out
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "empty" in out and "hla2_decode" not in out


@pytest.mark.parametrize("command", ["demo", "bench", "compile", "export-onnx", "run", "cache",
                                     "train", "bundle", "tune"])
def test_every_command_explains_its_flags(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--debug" in out
    if command == "bench":
        for flag in ("--batch", "--heads", "--seq", "--dk", "--dv", "--op", "--decay",
                     "--chunk-size", "--repeat", "--json"):
            assert flag in out
        assert "(default: 8192)" in out and "(default: 5)" in out


def test_output_cut_short_by_a_pipe_is_not_an_error(tmp_path):
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    cache.mkdir()
    for i in range(2000):
        (cache / f"k{i}.so").write_bytes(b"x")
    run = subprocess.run(f"{sys.executable} -m hla_tvm.cli cache | head -1", shell=True,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HLA_TVM_CACHE_DIR=str(cache)))
    assert "error" not in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_version_and_module_entry_point(capsys):
    import subprocess
    import sys

    from hla_tvm import __version__

    run = subprocess.run([sys.executable, "-m", "hla_tvm", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"hla-tvm {__version__}"
    with pytest.raises(SystemExit) as e:   # alternatives, not both
        main(["export-onnx", "m.pt", "--decode", "--from-state"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_unknown_options_are_named_by_the_command_and_a_file_is_no_cache(tmp_path, capsys,
                                                                         monkeypatch):
    with pytest.raises(SystemExit) as e:
        main(["run", "x.so", "--words", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "hla-tvm run: error: unrecognized arguments: --words hi" in err
    assert "usage: hla-tvm run" in err
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(tmp_path / "f"))
    _fails_in_one_line(capsys, ["cache"], "HLA_TVM_CACHE_DIR=", "is a file")


def test_bench_model_compares_schemes_and_peers_in_one_table(capsys, tmp_path):
    """`bench model`: the compiled module per scheme, PyTorch, torch.compile, ONNX Runtime
    float32 and 4-bit (MatMulNBits), the weight-read floors, in one table and JSON."""
    import json

    assert main(["bench", "model", "--preset", "tiny", "--quantize", "float32,int4",
                 "--prompt", "32", "--repeat", "1", "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "m.json").read_text())
    cases = set(report["results"])
    assert {"tvm float32", "tvm int4", "torch", "torch.compile", "onnxruntime",
            "onnxruntime int4", "floor float32", "floor int4"} <= cases, (cases, out)
    assert report["notes"] == []
    from hla_tvm.bench.model import has_bf16_units

    # where the CPU multiplies bfloat16, PyTorch's bfloat16 autocast is a peer too
    assert ({"torch bf16", "torch.compile bf16"} <= cases) == has_bf16_units()
    for case in ("tvm float32", "tvm int4", "torch", "onnxruntime int4"):
        row = report["results"][case]
        assert row["decode_tokens_s"] > 0 and row["prefill_tokens_s"] > 0 and case in out
    sizes = report["sizes"]
    assert sizes["tvm int4"]["weight_bytes"] * 4 < sizes["tvm float32"]["weight_bytes"]
    # each peer's thread counts (the faster of one and all), named in the table
    peers = {line.split(":")[0] for line in report["threads"]}
    assert {"torch", "torch.compile", "onnxruntime"} <= peers, report["threads"]
    assert "peers' fastest thread counts" in out and "other_load_cores" in report
    _fails_in_one_line(capsys, ["bench", "model", "--quantize", "int3"], "--quantize takes")
    _fails_in_one_line(capsys, ["bench", "decode", "x.pt"], "applies to `bench model`")


def test_cache_lists_each_model_with_its_shape_scheme_and_target(tmp_path, monkeypatch, capsys,
                                                                compiled_lm):
    """`hla-tvm cache` names what each cached compiled model is (read from its library's
    metadata, nothing loaded); a damaged one is listed as unreadable."""
    import shutil

    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    shutil.copy(compiled_lm("bytes", vocab_size=256, vocab="bytes")[1],
                models / f"demo-{'a' * 20}.so")
    (models / f"demo-{'b' * 20}.so").write_bytes(b"\x7fELF junk")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "a" * 20 in x)
    assert "d_model 32, n_layers 2, n_heads 4, vocab_size 256; float32; for llvm" in line
    assert "unreadable" in next(x for x in out.splitlines() if "b" * 20 in x)
