"""Models compiled with a tokenizer (`hla_tvm.compile(..., tokenizer=)`, `hla-tvm compile
--tokenizer`): the tokenizer.json is checked against the vocabulary and kept in the module;
`runtime.text`, `hla-tvm run --prompt` and the server's engine take and give text through it,
the tokens being those the token-id loop gives for the tokenizer's ids."""
import json

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.xdist_group("serve")

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n    y = 0\n" * 20
# a Hugging Face chat template in the tokenizer_config.json beside the tokenizer.json
CHAT = ("{{ bos_token }}{% for m in messages %}### {{ m['role'] | upper }}\n{{ m['content'] }}"
        "\n{% endfor %}{% if add_generation_prompt %}### ASSISTANT\n{% endif %}")


def make_tokenizer(path, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM

    folder = tmp_path_factory.mktemp("tok")
    tok = make_tokenizer(folder / "tokenizer.json", 300)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": CHAT}))
    torch.manual_seed(0)
    model = HLALM(tok.get_vocab_size(), 32, 2, 4, chunk_size=16).eval()
    path = compile_model(model, out=folder / "model.so", tokenizer=folder / "tokenizer.json")
    return tok, path, folder


def test_text_round_trip_and_generation(compiled, capsys):
    from hla_tvm.cli import main
    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate

    tok, path, _ = compiled
    m = load(path)
    ids = m.text.encode("class Point:\n")
    assert ids == tok.encode("class Point:\n").ids
    want_ids, _ = generate(m, ids, 8)
    decode = m.text.decoder()
    assert "".join(decode([i]) for i in want_ids) == tok.decode(want_ids)
    assert main(["run", str(path), "--prompt", "class Point:\n", "--tokens", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "class Point:\n" + tok.decode(want_ids) + "\n"
    assert main(["run", str(path), "--info"]) == 0
    assert "text: a tokenizer" in capsys.readouterr().out


def test_engine_gives_the_tokenizers_text(compiled):
    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate
    from hla_tvm.serve.engine import Engine, Request

    tok, path, _ = compiled
    m = load(path, threads=1)
    prompt = tok.encode("def add(a, b):").ids
    want, _ = generate(m, prompt, 10)
    parts, done = [], []
    engine = Engine(m, max_streams=2).start()
    try:
        engine.submit(Request(prompt, 10, on_event=lambda ev: (parts.append(ev.get("text", "")),
                                                                ev["type"] == "done"
                                                                and done.append(ev))))
        for _ in range(3000):
            if done:
                break
            import time
            time.sleep(0.01)
    finally:
        engine.stop()
    assert done and "".join(parts) == tok.decode(want)


def test_bad_tokenizers_refused(compiled, tmp_path):
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM

    _, _, folder = compiled
    model = HLALM(40, 32, 1, 4, chunk_size=16)
    with pytest.raises(ValueError, match=r"has \d+ tokens; the model.s vocabulary has 40"):
        compile_model(model, out=tmp_path / "m.so", tokenizer=folder / "tokenizer.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        compile_model(model, out=tmp_path / "m.so", tokenizer=tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"version": "1.0"}))
    with pytest.raises(ValueError, match="the `tokenizers` library reads"):
        compile_model(model, out=tmp_path / "m.so", tokenizer=tmp_path / "other.json")
    with pytest.raises(ValueError, match="No such file"):
        compile_model(model, out=tmp_path / "m.so", tokenizer=tmp_path / "none.json")
    assert not (tmp_path / "m.so").exists()


def test_bundle_script_takes_text_through_the_tokenizer(compiled):
    """export/python/generate.py (the bundle's script: no hla_tvm, no TVM Python package)
    reads the tokenizer from the module and writes what `hla-tvm run --prompt` writes."""
    import os
    import subprocess
    import sys

    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate

    tok, path, _ = compiled
    want, _ = generate(load(path), tok.encode("class Point:\n").ids, 8)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "export", "python", "generate.py")
    run = subprocess.run([sys.executable, script, str(path), "--text", "class Point:\n",
                          "--steps", "8", "--temperature", "0"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "class Point:\n" + tok.decode(want) + "\n"


def test_eval_reads_text_through_the_modules_tokenizer(compiled, tmp_path, capsys):
    """`hla-tvm eval --file` on a module with a tokenizer: a UTF-8 text is encoded by it (the
    file had to hold token ids), giving the bits the same ids give as a file of ids."""
    from hla_tvm.cli import main

    tok, path, _ = compiled
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:400])
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, tok.encode(TEXT[:400]).ids)))
    results = []
    for f in (text, ids):
        out = tmp_path / f"{f.stem}.json"
        assert main(["eval", str(path), "--file", str(f), "--json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    assert results[0]["tokens"] == len(tok.encode(TEXT[:400]).ids) == results[1]["tokens"]
    assert results[0]["models"][0]["bits"] == results[1]["models"][0]["bits"]
    capsys.readouterr()


def test_chat_template_kept_in_the_module_renders_chat(compiled):
    """A tokenizer_config.json beside the tokenizer.json gives the module its chat template
    (and bos/eos tokens); the server renders /v1/chat/completions' messages with it, as
    transformers renders `chat_template`, and answers the token-id loop's greedy text."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate
    from hla_tvm.serve.app import create_app

    tok, path, _ = compiled
    m = load(path, threads=1)
    assert m.meta["chat"] == {"template": CHAT, "bos_token": "<s>", "eos_token": "</s>"}
    messages = [{"role": "user", "content": "class Point:"}]
    prompt = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        CHAT).render(messages=messages, add_generation_prompt=True, bos_token="<s>",
                     eos_token="</s>")
    assert prompt == "<s>### USER\nclass Point:\n### ASSISTANT\n"
    ids = tok.encode(prompt).ids
    want, _ = generate(m, ids, 6)
    app = create_app(m, max_streams=2)
    with TestClient(app) as client:
        info = client.get("/tokenizer_info").json()
        assert info["chat_template"] == CHAT and info["eos_token"] == "</s>"
        got = client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 6, "temperature": 0}).json()
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert got["choices"][0]["message"]["content"] == tok.decode(want)
