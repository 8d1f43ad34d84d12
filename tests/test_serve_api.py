"""`hla-tvm serve` as users run it: a server process on 127.0.0.1 driven by the official
`openai` client (completions whole and streamed, errors as the client raises them) and by raw
HTTP (`httpx`) for the error cases, sessions, the key, the busy answer, a client that goes away
and SIGTERM. Generated text is checked against the single-sequence loop
(`runtime.generate.generate`, batch 1)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import free_port

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.xdist_group("serve")
FAST = {"test_openai_client_whole_and_streamed", "test_raw_http_errors"}


@pytest.fixture(scope="module")
def module_path(compiled_lm):
    return compiled_lm("bytes", vocab_size=256, vocab="bytes")[1]


def start_server(path, *args):
    """(process, base URL) of `hla-tvm serve path *args`, once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hla_tvm", "serve", str(path), "--port",
                             str(port), "--threads", "1", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not answer /health in 60 s")


def sigterm_during_stream(proc, url, max_tokens, headers=None):
    """The finish_reason of a stream of `max_tokens` from the server `proc` at `url` that is
    sent SIGTERM after its first event."""
    import httpx

    with httpx.stream("POST", url + "/v1/completions", timeout=30, headers=headers,
                      json={"prompt": "a", "max_tokens": max_tokens, "stream": True}) as s:
        lines = s.iter_lines()
        next(lines)
        proc.send_signal(signal.SIGTERM)
        tail = [line for line in lines if line]
    return json.loads(tail[-2][6:])["choices"][0]["finish_reason"]


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def server(module_path, tmp_path_factory):
    sessions = tmp_path_factory.mktemp("sessions")
    # (--max-tokens above the streams' 100000 that hold slots for the busy and SIGTERM tests)
    proc, url = start_server(module_path, "--sessions", str(sessions), "--max-streams", "2",
                             "--max-queue", "0", "--max-prompt", "64", "--name", "model",
                             "--max-tokens", "1000000")
    yield url, sessions
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(module_path):
    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate

    model = load(module_path, threads=1)
    return lambda prompt, n: bytes(generate(model, list(prompt.encode()), n)[0]).decode(
        "utf-8", "replace")


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, **kw)


def test_openai_client_whole_and_streamed(server, reference):
    url, _ = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["model"]
    want = reference("def main():\n", 24)
    got = c.completions.create(model="model", prompt="def main():\n", max_tokens=24,
                               temperature=0)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == 12 and got.usage.completion_tokens == 24
    chunks = list(c.completions.create(model="model", prompt="def main():\n", max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24
    seeded = [c.completions.create(model="model", prompt="x = ", max_tokens=12, temperature=0.9,
                                   seed=5).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_openai_client_errors(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="model", prompt="a", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        c.completions.create(model="other", prompt="a", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        c.completions.create(model="model", prompt="a" * 65, max_tokens=2)


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"prompt": "a", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "a", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "a", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": [1, 256]}', 400, "[0, 256)"),
    (b'{"prompt": "a", "colour": 1}', 400, "unknown field 'colour'"),
    (b'{"prompt": "a", "n": 3}', 400, "n must be an int in [1, 2]"),
    (b'{"prompt": ""}', 400, "must not be empty"),
    (b'{"prompt": "a", "session": {"resume": "../x"}}', 400, "session.resume"),
    (b'{"prompt": "a", "session": {"resume": "none-such"}}', 404, "no session"),
])
def test_raw_http_errors(server, body, status, words):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]


def test_sessions_over_http(server, reference):
    url, folder = server
    post = lambda body: httpx.post(url + "/v1/completions", json=body, timeout=60).json()  # noqa
    whole = reference("class A:\n", 12)
    first = post({"prompt": "class A:\n", "max_tokens": 5, "temperature": 0,
                  "session": {"save": "chat"}})
    fork = post({"max_tokens": 7, "temperature": 0, "session": {"fork": "chat"}})
    more = post({"max_tokens": 7, "temperature": 0, "session": {"resume": "chat"}})
    assert first["choices"][0]["text"] + fork["choices"][0]["text"] == whole
    assert more["choices"][0]["text"] == fork["choices"][0]["text"]
    (folder / "junk.state.npz").write_bytes(b"PK\x03\x04 garbage")
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 2,
                                                  "session": {"resume": "junk"}}, timeout=30)
    assert r.status_code == 400 and "not usable" in r.json()["error"]["message"]


def _metric(url, name):
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_busy_429_then_disconnect_frees_slots(server):
    url, _ = server
    body = {"prompt": "while True:", "max_tokens": 100000, "stream": True}
    with httpx.Client(timeout=30) as h1, httpx.Client(timeout=30) as h2:
        with h1.stream("POST", url + "/v1/completions", json=body) as s1, \
                h2.stream("POST", url + "/v1/completions", json=body) as s2:
            lines = [s.iter_lines() for s in (s1, s2)]   # (kept: a dropped one closes)
            for it in lines:
                next(it)   # both streams run
            r = httpx.post(url + "/v1/completions", json={"prompt": "a"}, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert _metric(url, "hla_tvm_active_streams") == 2
    deadline = time.monotonic() + 30   # the clients went away: their slots free at a step
    while _metric(url, "hla_tvm_active_streams") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(url, "hla_tvm_active_streams") == 0
    assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                      timeout=30).status_code == 200


def test_api_key_and_sigterm(module_path):
    proc, url = start_server(module_path, "--api-key", "sekret", "--shutdown-timeout", "1",
                             "--name", "model", "--max-tokens", "1000000")
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").completions.create(model="model", prompt="a")
        got = client(url, api_key="sekret").completions.create(model="model", prompt="a",
                                                               max_tokens=3)
        assert got.usage.completion_tokens == 3
        # a stream that runs when SIGTERM comes ends within --shutdown-timeout; exit code 0
        assert sigterm_during_stream(proc, url, 100000,
                                     {"Authorization": "Bearer sekret"}) == "cancelled"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.path.exists(module_path)


def test_readme_client_snippet(server, capsys):
    """The README's Serve snippet (a ```py block: it needs a server) runs against this one."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = next(c for c in re.findall(r"```py\n(.*?)```", readme, flags=re.S) if "OpenAI(" in c)
    url, folder = server
    exec(code.replace("http://127.0.0.1:8000", url), {})
    assert (folder / "s1.state.npz").exists() and capsys.readouterr().out
