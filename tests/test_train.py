"""`hla-tvm train`: the corpus split, that training learns and repeats from a seed, and the files
it writes (checkpoint, JSON curve, PNG)."""
import json
import os
import struct
import zlib

import pytest
import torch

from hla_tvm import train
from hla_tvm.cli import main
from hla_tvm.models import HLALM


def _names(want_val, count):
    """File names whose crc32 puts them in (want_val=True) or out of the validation split."""
    out, i = [], 0
    while len(out) < count:
        name = f"m{i}.py"
        if (zlib.crc32(name.encode()) % train.VAL_MODULUS == 0) == want_val:
            out.append(name)
        i += 1
    return out


def test_corpus_split_is_by_path_and_skips_site_packages(tmp_path):
    val, trn = _names(True, 1), _names(False, 2)
    for name in val + trn:
        (tmp_path / name).write_text(f"# {name}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / trn[0]).write_text("# never read\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    t, v = train.stdlib_corpus(str(tmp_path))
    assert bytes(v.numpy()) == f"# {val[0]}\n\n".encode()
    assert bytes(t.numpy()) == b"".join(f"# {n}\n\n".encode() for n in sorted(trn))
    with pytest.raises(ValueError, match="too few"):
        train.stdlib_corpus(str(tmp_path / "site-packages"))


def _tiny():
    torch.manual_seed(0)
    return HLALM(256, 16, 1, 1, chunk_size=16, vocab="bytes")


def test_training_learns_and_repeats_from_a_seed():
    data = torch.frombuffer(bytearray(b"def f(x):\n    return x + 1\n" * 200), dtype=torch.uint8)
    runs = []
    for _ in range(2):
        model = _tiny()
        hist = train.fit(model, data, data, steps=40, batch=4, seq_len=32, lr=1e-2, warmup=5,
                         eval_every=20, eval_batches=2, progress=False)
        runs.append((model, hist))
    (m1, h1), (m2, h2) = runs
    # the same batches and starting weights; PyTorch's CPU kernels (threads, vector code that
    # depends on alignment) promise no bitwise repeatability, so equal up to rounding (a 2-core
    # Xeon gave 7.896685228 vs 7.896685916 at step 2)
    assert len(h1["train_bpb"]) == len(h2["train_bpb"]) == 40
    torch.testing.assert_close(torch.tensor(h1["train_bpb"]), torch.tensor(h2["train_bpb"]),
                               rtol=1e-4, atol=0)
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    first, last = h1["val"][0][1], h1["val"][-1][1]
    assert first > 7.0 and last < 0.5 * first, h1["val"]   # a repeated line is learned


def _png_size(path):
    blob = open(path, "rb").read()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", blob[16:24])


def test_train_command_writes_checkpoint_curve_and_png(tmp_path, capsys):
    out = str(tmp_path / "m.pt")
    assert main(["train", "-o", out, "--steps", "2", "--batch", "2", "--seq-len", "32",
                 "--d-model", "16", "--layers", "1", "--heads", "1", "--quiet"]) == 0
    model = HLALM.load(out)
    assert model.config["vocab"] == "bytes" and model.config["d_model"] == 16
    curve = json.load(open(str(tmp_path / "m.json")))
    assert curve["attention"] == "hla" and len(curve["train_bpb"]) == 2
    assert curve["val"][-1][0] == 2 and 0 < curve["val"][-1][1] < 9
    printed = capsys.readouterr().out
    assert "bits/byte" in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:   # no plot, and the line says how to get one
        assert not os.path.exists(tmp_path / "m.png") and "pip install matplotlib" in printed
    else:   # matplotlib's plot, with axes, ticks and a legend
        assert _png_size(str(tmp_path / "m.png")) == (640, 360)
    # the softmax baseline writes its curve only
    base = str(tmp_path / "b.pt")
    assert main(["train", "-o", base, "--attention", "softmax", "--steps", "2", "--batch", "2",
                 "--seq-len", "32", "--d-model", "16", "--layers", "1", "--heads", "1",
                 "--quiet"]) == 0
    assert not os.path.exists(base) and json.load(open(str(tmp_path / "b.json")))["attention"] \
        == "softmax"


def test_train_refuses_bad_arguments_before_training(tmp_path, capsys):
    assert main(["train", "-o", str(tmp_path / "m.pt"), "--d-model", "30", "--heads", "4",
                 "--steps", "1"]) == 2
    assert "--heads 4 must divide --d-model 30" in capsys.readouterr().err
    assert main(["train", "-o", str(tmp_path / "no" / "m.pt"), "--steps", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    for flag in ("--seconds", "--lr"):
        with pytest.raises(SystemExit):
            main(["train", flag, "0"])
        assert "must be a finite number > 0" in capsys.readouterr().err


def test_byte_vocab_config_is_checked():
    with pytest.raises(ValueError, match="vocab_size=256"):
        HLALM(100, 16, 1, 1, vocab="bytes")
    with pytest.raises(ValueError, match="vocab must be one of"):
        HLALM(256, 16, 1, 1, vocab="words")


def test_default_decay_spreads_over_the_heads(tmp_path):
    assert train.spread_decay(2) == train.SHIPPED_CONFIG["decay"] == [0.8, 0.98]
    assert train.spread_decay(1) == [0.9368]
    four = train.spread_decay(4)
    assert four[0] == 0.8 and four[-1] == 0.98 and four == sorted(four)
    with pytest.raises(ValueError, match="--decay needs one value or one per head"):
        train.run(str(tmp_path / "m.pt"), steps=1, n_heads=4, d_model=16, decay=[0.9, 0.9])
