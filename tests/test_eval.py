"""`hla-tvm eval`: the bits a model's predictions cost over a text, against the float64 cross
entropy of one PyTorch forward pass over the whole sequence."""
import json
import math

import torch

from hla_tvm.cli import main


def _saved_with_ids(compiled_lm, tmp_path, count, seed):
    """(model, its compiled module, its checkpoint in tmp_path, `count` random token ids also
    written to tmp_path/ids.txt)."""
    model, lib = compiled_lm("hla2")
    ckpt = tmp_path / "model.pt"
    model.save(ckpt)
    ids = torch.randint(0, 40, (count,), generator=torch.Generator().manual_seed(seed))
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids.tolist())))
    return model, lib, ckpt, ids


def _bits(model, ids):
    """Bits per token of `model`'s predictions over `ids`: the float64 cross entropy of one
    forward pass over the whole sequence (on a float64 copy; `model` stays as it was)."""
    import copy

    with torch.no_grad():
        logits, _ = copy.deepcopy(model).double()(ids[None], None)
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[1:]).item() / math.log(2)

def test_bits_per_token_equal_one_forward_pass(compiled_lm, tmp_path, capsys):
    model, lib, ckpt, ids = _saved_with_ids(compiled_lm, tmp_path, 300, seed=5)
    want = _bits(model, ids)
    assert main(["eval", str(ckpt), str(lib), "--file", str(tmp_path / "ids.txt"),
                 "--piece", "7", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "bits/token" in out and "float32 (compiled)" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["tokens"] == 300 and report["unit"] == "bits/token"
    for row in report["models"]:
        assert abs(row["bits"] - want) < 1e-4, row
    assert report["models"][1]["max_logit_diff"] < 1e-3


def test_eval_refuses_ids_beyond_the_vocabulary_in_one_line(compiled_lm, tmp_path, capsys):
    _, lib = compiled_lm("hla2")
    (tmp_path / "ids.txt").write_text("1 2 3 40")
    assert main(["eval", str(lib), "--file", str(tmp_path / "ids.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "token id 40 is not below its vocabulary size 40" \
        in err, err
    (tmp_path / "words.txt").write_text("one two")
    assert main(["eval", str(lib), "--file", str(tmp_path / "words.txt")]) == 2
    assert "whitespace-separated token ids" in capsys.readouterr().err


def test_eval_runs_a_checkpoint_with_a_schemes_weights_in_pytorch(compiled_lm, tmp_path,
                                                                   capsys):
    """--quantize int4: the checkpoint's bits equal the float64 cross entropy of the model with
    its weights packed and unpacked (`quant.torch_weights`, checked against an independent
    quantization in test_quantize.py); a compiled module alone is refused."""
    from hla_tvm.quant import scheme
    from hla_tvm.quant.torch_weights import dequantized_model

    model, lib, ckpt, ids = _saved_with_ids(compiled_lm, tmp_path, 200, seed=6)
    want = _bits(dequantized_model(model, scheme("int4")), ids)
    plain = _bits(model, ids)
    assert abs(want - plain) > 1e-4   # the scheme does change the model
    assert main(["eval", str(ckpt), "--quantize", "int4", "--file", str(tmp_path / "ids.txt"),
                 "--piece", "64", "--json", str(tmp_path / "r.json")]) == 0
    assert "int4 (group 32) (PyTorch)" in capsys.readouterr().out
    row = json.loads((tmp_path / "r.json").read_text())["models"][0]
    assert abs(row["bits"] - want) < 1e-4, (row, want, plain)
    assert main(["eval", str(lib), "--quantize", "int8", "--file",
                 str(tmp_path / "ids.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--quantize applies to checkpoints" in err, err
