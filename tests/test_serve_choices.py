"""`hla-tvm serve` for scoring and sampling clients, through HTTP: echo with logprobs (what
lm-evaluation-harness's loglikelihood requests send), max_tokens 0, lists of prompts, the
generated tokens' logprobs whole and streamed, and n choices from one prefill. Log-probabilities
are checked against float64 log-softmax of the module's own logits (`runtime`, prefill of the
whole text), greedy text against the single-sequence loop."""
import numpy as np
import pytest

from test_serve_api import client, start_server, stop_server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.xdist_group("serve")
FAST = {"test_echo_logprobs_are_the_modules"}


@pytest.fixture(scope="module")
def module_path(compiled_lm):
    return compiled_lm("bytes", vocab_size=256, vocab="bytes")[1]


@pytest.fixture(scope="module")
def model(module_path):
    from hla_tvm.runtime import load

    return load(module_path, threads=1)


@pytest.fixture(scope="module")
def server(module_path):
    # (pieces of 16 tokens: a prompt's log-probabilities cross piece boundaries)
    proc, url = start_server(module_path, "--max-streams", "4", "--prefill-piece", "16",
                             "--name", "model")
    yield url
    stop_server(proc)


def log_softmax(model, ids):
    """float64 log-softmax of the module's logits at every position of `ids` [T, vocab]."""
    logits, _ = model.prefill(np.array([ids], np.int64), model.init_state(1))
    rows = np.asarray(logits[0], np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def post(url, body):
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_are_the_modules(server, model):
    """lm-eval's loglikelihood request ({"prompt": ids, "echo": true, "logprobs": 1,
    "max_tokens": 1, "temperature": 0}) for a prompt of 40 tokens (3 prefill pieces): the prompt
    echoed, its first token's logprob null, the others the module's log-softmax within 1e-5,
    top_logprobs the most likely token's, then the generated token (the argmax). A list of
    prompts answers one choice each; max_tokens 0 echoes alone."""
    text = "def main():\n    return sum(range(10)) + 1\n"
    ids = list(text.encode())
    assert len(ids) > 32
    want = log_softmax(model, ids)
    got = post(server, {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1,
                        "temperature": 0})["choices"][0]
    lp = got["logprobs"]
    assert got["text"].startswith(text) and len(got["text"]) == len(text) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids) + 1
    expect = [want[i - 1, ids[i]] for i in range(1, len(ids))] + [want[-1].max()]
    np.testing.assert_allclose(lp["token_logprobs"][1:], expect, rtol=0, atol=1e-5)
    for i, top in enumerate(lp["top_logprobs"][1:], 1):
        assert len(top) == 1 and abs(list(top.values())[0] - want[i - 1].max()) <= 1e-5
    assert lp["tokens"][:4] == ["d", "e", "f", " "] and lp["text_offset"][:3] == [0, 1, 2]
    assert chr(int(want[-1].argmax())) == got["text"][-1]
    # lm-eval's batch: prompts as lists of ids, one choice each, no generated token
    both = post(server, {"prompt": [ids[:20], ids], "echo": True, "logprobs": 0,
                         "max_tokens": 0})
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert both["choices"][0]["text"] == text[:20] and both["choices"][1]["text"] == text
    np.testing.assert_allclose(both["choices"][1]["logprobs"]["token_logprobs"][1:],
                               expect[:-1], rtol=0, atol=1e-5)
    assert both["choices"][1]["logprobs"]["top_logprobs"][1] == {}
    assert both["usage"]["prompt_tokens"] == 20 + len(ids)
    assert both["usage"]["completion_tokens"] == 0


def test_generated_logprobs_whole_and_streamed(server, model):
    """logprobs: 3 on generated tokens (greedy): each the module's log-softmax of the token
    under the text before it, the top 3 in order, the same in the streamed chunks (openai
    client)."""
    c = client(server)
    got = c.completions.create(model="model", prompt="import os\n", max_tokens=8,
                               temperature=0, logprobs=3)
    choice = got.choices[0]
    ids = list(("import os\n" + choice.text).encode())
    want = log_softmax(model, ids)
    start = len("import os\n".encode())
    expect = [want[i - 1, ids[i]] for i in range(start, len(ids))]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, expect, rtol=0, atol=1e-5)
    for i, top in enumerate(choice.logprobs.top_logprobs):
        values = list(top.values())
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert abs(values[0] - want[start + i - 1].max()) <= 1e-5
    chunks = list(c.completions.create(model="model", prompt="import os\n", max_tokens=8,
                                       temperature=0, logprobs=3, stream=True))
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(streamed, choice.logprobs.token_logprobs, rtol=0, atol=0)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text


def test_n_choices_from_one_prefill(server, model):
    """n = 3: three choices, the same three texts for the same seed, choice 0 the text n = 1
    gives for that seed; greedy choices are all the single-sequence loop's text; streamed
    choices carry their index and join to the whole answer's texts."""
    from hla_tvm.runtime.generate import generate

    body = {"prompt": "for i in", "max_tokens": 10, "temperature": 4.0, "seed": 7, "n": 3}
    first = post(server, body)
    again = post(server, body)
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1
    assert post(server, dict(body, n=1))["choices"][0]["text"] == texts[0]
    assert first["usage"]["prompt_tokens"] == 8 and first["usage"]["completion_tokens"] == 30
    greedy = post(server, dict(body, temperature=0, n=2))
    want = bytes(generate(model, list(b"for i in"), 10)[0]).decode("utf-8", "replace")
    assert [c["text"] for c in greedy["choices"]] == [want, want]
    chunks = list(client(server).completions.create(model="model", stream=True, **body))
    joined = ["", "", ""]
    for ch in chunks:
        for part in ch.choices:
            joined[part.index] += part.text
    assert joined == texts


@pytest.mark.parametrize("body,words", [
    ({"prompt": "a", "n": 5}, "n must be an int in [1, 4]"),
    ({"prompt": "a", "logprobs": 6}, "logprobs must be an int in [0, 5]"),
    ({"prompt": "a", "max_tokens": 0}, "0 only with echo"),
    ({"prompt": []}, "must not be empty"),
    ({"prompt": [[1, 2], []]}, "must not be empty"),
    ({"prompt": [[1, 2], [300]]}, "[0, 256)"),
    ({"prompt": "a", "logit_bias": {"300": 1}}, "logit_bias token ids must lie in [0, 256)"),
    ({"prompt": "a", "logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
    ({"prompt": "a", "logit_bias": {"3": 101}}, "[-100, 100]"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty must lie in [-2, 2]"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty must lie in (0, 10]"),
    ({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens must be an int in"),
])
def test_refused_in_one_line(server, body, words):
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_chat_completions_through_the_openai_client(server, model):
    """/v1/chat/completions: the messages rendered by the default template ("role: content"
    lines, then "assistant:"), greedy text the single-sequence loop's on that prompt, whole
    and streamed (the role in the first delta), with logprobs in the chat form; tools are
    refused with OpenAI's error."""
    from hla_tvm.runtime.generate import generate
    from hla_tvm.serve.chat import ChatTemplate

    c = client(server)
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A loop, please."}]
    prompt = ChatTemplate().render(messages)
    assert prompt == "system: You write Python.\nuser: A loop, please.\nassistant:"
    want = bytes(generate(model, list(prompt.encode()), 12)[0]).decode("utf-8", "replace")
    got = c.chat.completions.create(model="model", messages=messages, max_completion_tokens=12,
                                    temperature=0, logprobs=True, top_logprobs=2)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert got.usage.prompt_tokens == len(prompt.encode())
    lps = got.choices[0].logprobs.content
    assert len(lps) == 12 and all(len(e.top_logprobs) == 2 for e in lps)
    assert abs(lps[0].logprob - log_softmax(model, list(prompt.encode()))[-1].max()) <= 1e-5
    chunks = list(c.chat.completions.create(model="model", messages=messages, max_tokens=12,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="tools"):
        c.chat.completions.create(model="model", messages=messages, tools=[{
            "type": "function", "function": {"name": "f", "parameters": {}}}])


def test_tokenizer_endpoints(server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (byte-level: ids are the UTF-8
    bytes)."""
    r = httpx.post(server + "/tokenize", json={"prompt": "héllo", "add_special_tokens": False},
                   timeout=30).json()
    assert r["tokens"] == list("héllo".encode()) and r["count"] == 6
    back = httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": "héllo"}
    info = httpx.get(server + "/tokenizer_info", timeout=30).json()
    assert info["vocab_size"] == 256 and "assistant:" in info["chat_template"]
    bad = httpx.post(server + "/detokenize", json={"tokens": [999]}, timeout=30)
    assert bad.status_code == 400 and "[0, 256)" in bad.json()["error"]["message"]


def test_a_chat_template_that_does_not_compile_is_refused(module_path, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    r = subprocess.run([sys.executable, "-m", "hla_tvm", "serve", str(module_path),
                        "--chat-template", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--chat-template" in r.stderr and "compile" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _greedy_with(model, prompt, steps, adjust):
    """Greedy token ids after `prompt` with each step's float64 logits changed by
    `adjust(row, generated so far)`: the serial loop over the module the server's rules must
    match."""
    logits, state = model.prefill(np.array([prompt], np.int64), model.init_state(1),
                                  logits="last")
    out = []
    for _ in range(steps):
        row = adjust(np.asarray(logits[0], np.float64), out)
        out.append(int(row.argmax()))
        logits, state = model.decode(np.array([out[-1]], np.int64), state)
    return out


def test_penalties_bias_and_min_tokens(server, model):
    """presence/frequency penalties (OpenAI's), repetition_penalty (HF's), logit_bias and
    min_tokens, greedy, against the serial loop applying the same formulas in float64; the
    reported logprobs stay those of the raw logits."""
    prompt = list(b"x = x + x")
    vocab = 256

    def penalised(row, out):
        counts = np.bincount(np.asarray(out, np.int64), minlength=vocab)
        return row - 1.5 * counts - 0.5 * (counts > 0)

    def repeated(row, out):
        seen = np.zeros(vocab, bool)
        seen[prompt + out] = True
        row[seen] = np.where(row[seen] > 0, row[seen] / 1.8, row[seen] * 1.8)
        return row

    base = {"prompt": "x = x + x", "max_tokens": 12, "temperature": 0}
    for fields, adjust in (({"frequency_penalty": 1.5, "presence_penalty": 0.5}, penalised),
                           ({"repetition_penalty": 1.8}, repeated)):
        got = post(server, dict(base, **fields))["choices"][0]["token_ids"]
        assert got == _greedy_with(model, prompt, 12, adjust), fields
        assert got != _greedy_with(model, prompt, 12, lambda row, out: row)
    biased = post(server, dict(base, logit_bias={"65": 100}, logprobs=0))["choices"][0]
    assert biased["text"] == "A" * 12
    raw = log_softmax(model, prompt + [65])[-2]
    assert abs(biased["logprobs"]["token_logprobs"][0] - raw[65]) <= 1e-5
    # min_tokens: a stop string is looked for only in the text after the first min_tokens - 1
    plain = bytes(_greedy_with(model, prompt, 8, lambda row, out: row)).decode()
    stop = plain[0]
    early = post(server, dict(base, max_tokens=8, stop=[stop]))["choices"][0]
    assert early["text"] == "" and early["finish_reason"] == "stop"
    late = post(server, dict(base, max_tokens=8, stop=[stop], min_tokens=4))["choices"][0]
    rest = plain[3:]
    want = plain[:3] + rest.split(stop)[0]
    assert late["text"] == want
    assert late["finish_reason"] == ("stop" if stop in rest else "length")
