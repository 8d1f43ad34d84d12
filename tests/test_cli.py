"""The console script: help text, demo, cache listing, bench on a small shape."""
import pytest

from hla_tvm.cli import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "bench", "cache"):
        assert cmd in out


def test_demo_checks_against_float64(capsys):
    assert main(["demo", "--length", "70", "--heads", "2", "--head-dim", "8"]) == 0
    assert "OK" in capsys.readouterr().out


def test_bench_prints_ratios(capsys):
    assert main(["bench", "--length", "128", "--heads", "2", "--head-dim", "8",
                 "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill T=128" in out and "decode" in out and "x" in out


def test_cache_lists_folder(capsys):
    assert main(["cache"]) == 0
    assert "hla_tvm_cache" in capsys.readouterr().out
