"""Stage lines of long work (`progress.Stages`, which `hla_tvm.compile` tells its stages): on
standard error where a person watches (a terminal, or $HLA_TVM_PROGRESS=1), nothing elsewhere."""
from hla_tvm.progress import Stages


def test_stage_lines_with_their_times_only_where_shown(capsys, monkeypatch):
    stages = Stages("compile", show=True)
    stages("exporting")
    stages("scheduling")
    stages.done()
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" ...")[0] for line in err[:2]] == ["compile: exporting",
                                                            "compile: scheduling"]
    assert all(line.endswith(" s") for line in err) and err[2].startswith("compile: done in")
    monkeypatch.delenv("HLA_TVM_PROGRESS", raising=False)
    quiet = Stages("compile")   # (pytest's stderr is not a terminal)
    quiet("exporting")
    quiet.done()
    monkeypatch.setenv("HLA_TVM_PROGRESS", "1")
    Stages("compile")("exporting")
    out = capsys.readouterr()
    assert out.err == "compile: exporting ..." and out.out == ""
    monkeypatch.setenv("HLA_TVM_PROGRESS", "0")
    assert not Stages("compile").show
