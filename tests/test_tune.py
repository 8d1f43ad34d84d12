"""Tuned schedules: `hla-tvm tune MODEL` writes meta_schedule records for a model's kernels and
projections; the model compiled from them and the operator's kernels (the same kernels: records
are found by structure) still equal the float64 model and recurrences; bad records folders give
clear errors, never a crash. (The `--op` path shares `tune.tune` with it, run over RPC in
test_tune_rpc.py; its option parsing is not run here.)"""
import copy
import json
import os
import shutil

import pytest
import torch
from conftest import make_qkv, rel_err

from hla_tvm import decode_, hla
from hla_tvm.cli import main
from hla_tvm.ops.hla3 import reference as hla3
from hla_tvm.schedule.tuning import records
from hla_tvm.target import resolve

# one worker runs this file, so the records below are tuned once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tune_records")]


# one layer, third order, head size 8, chunk 16: its HLA kernels are the operator's at
# dk 8, chunk 16 (the records of a model serve the operator too)
MODEL = dict(vocab_size=40, d_model=16, n_layers=1, n_heads=2, order=3, chunk_size=16)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(model, checkpoint, records folder): `hla-tvm tune CHECKPOINT` of a small third-order
    model, its HLA kernels and projections from a few trials (the one tune of this file)."""
    from hla_tvm.models import HLALM

    folder = tmp_path_factory.mktemp("tuned")
    torch.manual_seed(0)
    model = HLALM(**MODEL).eval()
    model.save(folder / "ck.pt")
    out = folder / "records"
    assert main(["tune", str(folder / "ck.pt"), "--trials", "4", "-o", str(out)]) == 0
    return model, folder / "ck.pt", out


@pytest.fixture(scope="module")
def tuned_dir(tuned):
    return tuned[2]


def test_tune_writes_a_record_for_every_kernel(tuned_dir, capsys):
    from hla_tvm import ops
    from hla_tvm.schedule.tuning import tune

    for name in records.FILES:
        assert (tuned_dir / name).stat().st_size > 0
    db = records.load(str(tuned_dir))
    op = ops.get(3, False)
    kernels = tune.operator_kernels(op, decayed=False, dk=8, dv=8, chunk=16,
                                       dtype=torch.float32,
                                       **op.options(masked=True, normalize=False, eps=1e-6,
                                                    ridge=0.0))
    for name, (func, shapes) in kernels.items():
        before = func.script()
        assert records.tuned(func, shapes, db, resolve(None)) is not None, name
        assert func.script() == before, f"{name}: replaying its record changed the kernel"


def test_kernels_from_records_match_the_serial_recurrence(tuned_dir):
    q, k, v = make_qkv(2, 3, 41, 8, 8, seed=3)
    want, want_st = hla3.serial(q, k, v)
    out, st = hla(q.float(), k.float(), v.float(), order=3, chunk_size=16, return_state=True,
                  schedules=str(tuned_dir))
    assert rel_err(out, want) < 1e-4
    # one more token through the decode kernel built from the records
    q1, k1, v1 = make_qkv(2, 3, 1, 8, 8, seed=4)
    o1 = decode_(q1[:, :, 0].float(), k1[:, :, 0].float(), v1[:, :, 0].float(), st, order=3,
                 schedules=str(tuned_dir))
    want1, _ = hla3.serial(q1, k1, v1, state=want_st)
    assert rel_err(o1, want1[:, :, 0]) < 1e-4


def test_packed_records_hold_the_same_records(tuned_dir, tmp_path):
    """A folder whose files are xz-compressed (`records.pack`, as the shipped folders keep
    them) gives the same record for every workload; `unpack` (which `hla-tvm tune` runs on
    its output folder) writes back the plain files byte for byte; a damaged compressed file is
    refused naming it; and the kernels from the packed records match the serial recurrence."""
    import lzma

    packed = tmp_path / "packed"
    shutil.copytree(tuned_dir, packed, ignore=shutil.ignore_patterns("work"))
    records.pack(str(packed))
    assert sorted(os.listdir(packed)) == sorted(f + records.PACKED for f in records.FILES)
    for name in records.FILES:
        assert lzma.decompress((packed / (name + records.PACKED)).read_bytes()) == \
            (tuned_dir / name).read_bytes()
    plain, db = records.load(str(tuned_dir)), records.load(str(packed))
    mine = plain.get_all_tuning_records()
    assert len(mine) == len(db.get_all_tuning_records()) > 0
    for rec in mine:
        top = db.get_top_k(db.commit_workload(rec.workload.mod), 1)
        assert str(top[0].trace) == str(rec.trace)
    q, k, v = make_qkv(1, 2, 37, 8, 8, seed=5)
    want, _ = hla3.serial(q, k, v)
    out = hla(q.float(), k.float(), v.float(), order=3, chunk_size=16, schedules=str(packed))
    assert rel_err(out, want) < 1e-4
    unpacked = tmp_path / "unpacked"
    shutil.copytree(packed, unpacked)
    records.unpack(str(unpacked))
    for name in records.FILES:
        assert (unpacked / name).read_bytes() == (tuned_dir / name).read_bytes()
    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    f = broken / (records.FILES[1] + records.PACKED)
    f.write_bytes(f.read_bytes()[:-40])
    with pytest.raises(ValueError, match="not a readable xz file"):
        records.load(str(broken))


def test_auto_finds_the_records_of_the_target(tuned_dir, tmp_path, monkeypatch, capsys):
    target = resolve(None)
    folder = tmp_path / "schedules" / records.target_folder(target)
    folder.mkdir(parents=True)
    for name in records.FILES:
        (folder / name).write_bytes((tuned_dir / name).read_bytes())
    monkeypatch.setenv("HLA_TVM_CACHE_DIR", str(tmp_path))
    records.forget()
    try:
        assert records.resolve("auto", target) == str(folder)
        assert records.resolve("default", target) is None
        # the bench then times the tuned kernels beside the default ones
        assert main(["bench", "decode", "--op", "hla3", "--heads", "2", "--dk", "8",
                     "--repeat", "1"]) == 0
        assert "tvm_tuned" in capsys.readouterr().out
    finally:
        records.forget()


def test_bad_records_folders_give_clear_errors(tuned_dir, tmp_path):
    q, k, v = make_qkv(1, 2, 20, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="not a records folder"):
        hla(q, k, v, order=3, schedules=str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="schedules must be"):
        hla(q, k, v, order=3, schedules=3)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "database_workload.json").write_bytes((tuned_dir /
                                                     "database_workload.json").read_bytes())
    text = (tuned_dir / "database_tuning_record.json").read_text()
    (broken / "database_tuning_record.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="database_tuning_record.json"):
        hla(q, k, v, order=3, chunk_size=16, schedules=str(broken))
    # well-formed JSON that is not a meta_schedule database
    (broken / "database_tuning_record.json").write_text(json.dumps({"not": "records"}) + "\n")
    with pytest.raises(ValueError):
        hla(q, k, v, order=3, chunk_size=16, schedules=str(broken))
    assert os.path.isdir(tuned_dir)


def test_records_of_another_cpu_give_a_notice(tuned_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "database_workload.json").write_bytes((tuned_dir /
                                                    "database_workload.json").read_bytes())
    lines = []
    for line in (tuned_dir / "database_tuning_record.json").read_text().splitlines():
        rec = json.loads(line)
        rec[1][2]["mcpu"] = "skylake-avx512" if rec[1][2].get("mcpu") != "skylake-avx512" \
            else "znver4"
        lines.append(json.dumps(rec))
    (other / "database_tuning_record.json").write_text("\n".join(lines) + "\n")
    records.forget()
    with pytest.warns(UserWarning, match="were tuned for"):
        records.find(str(other), resolve(None))
    records.forget()


def test_tuned_model_compiles_with_its_records(tuned, tmp_path, capsys):
    """hla_tvm.compile(schedules=PATH) schedules the model's HLA kernels and projections from
    the records `hla-tvm tune CHECKPOINT` wrote, says so in the module's metadata (`hla-tvm run
    --info`), and still equals the float64 model."""
    import numpy as np

    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.runtime import load

    model, _, out = tuned
    path = compile_model(model, out=tmp_path / "m.so", schedules=str(out))
    m = load(path)
    used = m.meta["schedules"]
    assert used["records"] == str(out) and used["records_sha256"]
    assert used["default"] == []
    assert len([n for n in used["from_records"] if "hla3" in n]) >= 4           # the HLA kernels
    projections = [n for n in used["from_records"] if "matmul" in n]
    assert len(projections) >= 4
    tokens = np.random.default_rng(0).integers(0, 40, (2, 37))
    logits, state = m.prefill(tokens, m.init_state(2))
    with torch.no_grad():
        ref, ref_state = copy.deepcopy(model).double()(torch.as_tensor(tokens))
    assert rel_err(torch.from_numpy(logits), ref) <= 1e-4
    logits, _ = m.decode(tokens[:, 0], state)
    with torch.no_grad():
        ref, _ = copy.deepcopy(model).double()(torch.as_tensor(tokens[:, :1]), ref_state)
    assert rel_err(torch.from_numpy(logits), ref[:, 0]) <= 1e-4
    assert main(["run", str(path), "--info"]) == 0
    out = capsys.readouterr().out
    assert f"from records: {len(used['from_records'])} kernel(s)" in out
    assert "default: 0 kernel(s)" in out


def test_compiled_model_without_records_says_default(tmp_path):
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM
    from hla_tvm.runtime import load

    path = compile_model(HLALM(40, 16, 1, 2, chunk_size=16), out=tmp_path / "m.so",
                         schedules="default")
    used = load(path).meta["schedules"]
    assert used["records"] is None and used["from_records"] == [] and len(used["default"]) >= 4


def test_progress_bar_shows_the_runners_fastest_trial_against_the_trials_asked():
    """The bar's time per kernel is the least of the runner's run times (not their mean), named
    as the runner's, and its total stays the trials asked."""
    from tvm.s_tir import meta_schedule as ms

    from hla_tvm.schedule.tuning.tune import _progress_callback

    class Bar:
        n, total, postfix = 0, 2, ""

        def update(self, k):
            self.n += k

        def set_postfix_str(self, text):
            self.postfix = text

    bar, best, counts = Bar(), {}, {}
    callback = _progress_callback(bar, ["k0", "k1"], best, counts)
    results = [ms.runner.RunnerResult([3e-3, 1e-3, 2e-3], None),
               ms.runner.RunnerResult([5e-3], None), ms.runner.RunnerResult(None, "failed")]
    callback.apply(ms.task_scheduler.TaskScheduler.create("round-robin"), 1, [], [], results)
    assert best == {"k1": 1e-3} and counts == {"k1": 3}
    assert bar.n == 3 and bar.total == 2
    assert bar.postfix == "runner's fastest: k1 1 ms"


def test_the_local_runner_fills_arguments_as_the_final_comparison_does():
    """meta_schedule's runner fills floating-point arguments uniform in [0.9, 1), as `_time`
    does (its own fill, uniform in [1, 10), slowed kernels with an exp); other dtypes keep its
    fill."""
    import numpy as np
    import tvm

    from hla_tvm.schedule.tuning.tune import _alloc_args

    info = [("TENSOR", "float32", [3, 4]), ("TENSOR", "float16", [5]),
            ("TENSOR", "bfloat16", [2, 2]), ("TENSOR", "int32", [4])]
    (args,) = _alloc_args(tvm.cpu(), info, 1)
    for arg, (_, dtype, shape) in zip(args, info):
        assert arg.dtype == dtype and list(arg.shape) == shape
    for arg in args[:3]:
        x = arg.numpy().astype(np.float64)
        assert 0.9 <= x.min() and x.max() <= 1.0


def test_shipped_records_give_no_notice_for_kernels_they_lack(monkeypatch, tmp_path):
    """A kernel without a record in a folder the user tuned is named in a notice; in the
    package's own records (tuned at one shape) it is not: its default schedule is expected."""
    import warnings

    monkeypatch.setattr(records, "tuned", lambda *a: None)
    kernels = {"hla2_chunk_output": (object(), None)}
    shipped = os.path.join(records.package_root(), "llvm-znver4-2c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records.pick(kernels, object(), None, path=shipped)
    with pytest.warns(UserWarning, match="1 kernel.s. without a tuned record"):
        records.pick(kernels, object(), None, path=str(tmp_path))
