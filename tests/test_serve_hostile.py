"""`hla-tvm serve` against hostile and unlucky clients: connections that send half a
request or nothing, heads and bodies over the limits, more connections than the cap, max_tokens
of 10^9, a streaming client that does not read, error answers outside OpenAI's JSON, two resumes
of one session at once, SIGTERM with --shutdown-timeout inf, start-up options that cannot work,
and the schema behind the key. Socket-level behaviour runs against real servers on 127.0.0.1
(short limits set on the command line); the rest goes through FastAPI's TestClient."""
import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_serve_api import (  # noqa: E402,F401 (fixture)
    module_path,
    sigterm_during_stream,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.xdist_group("serve")
FAST = {"test_cli_refuses_what_cannot_work", "test_help_names_the_limits",
        "test_schema_and_health_behind_the_key"}

TIMEOUT = 2   # --request-timeout of the hostile server, seconds


@pytest.fixture(scope="module")
def hostile(module_path, tmp_path_factory):  # noqa: F811
    proc, url = start_server(module_path, "--request-timeout", str(TIMEOUT),
                             "--max-connections", "6", "--max-prompt", "64",
                             "--max-body", "4096", "--max-tokens", "3000",
                             "--max-unread", "16", "--max-streams", "2", "--max-queue", "2",
                             "--sessions", str(tmp_path_factory.mktemp("sessions")),
                             "--name", "model")
    yield url
    stop_server(proc)


def port(url):
    return int(url.rsplit(":", 1)[1])


def connect(url, rcvbuf=None):
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port(url)))
    return s


def read_all(s, seconds):
    """What the server sends on `s` until it closes it, or b"<open>" appended when it is still
    open after `seconds`."""
    out, deadline = b"", time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            part = s.recv(65536)
            if not part:
                return out
            out += part
    except socket.timeout:
        pass
    except ConnectionResetError:
        return out + b"<reset>"
    return out + b"<open>"


def answer(raw):
    """(status, JSON body) of one raw HTTP answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        return status, body
    return status, json.loads(body)


def request(method, path, body=b"", headers=(), close=False):
    head = [f"{method} {path} HTTP/1.1", "Host: x", *headers]
    if close:
        head.append("Connection: close")
    if body:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def metrics(url):
    """{metric line name with labels: value} of /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def errors(url, status):
    return metrics(url).get(f'hla_tvm_request_errors_total{{status="{status}"}}', 0.0)


def quiet(url, seconds=10):
    """Wait until only the /metrics connection itself is open."""
    deadline = time.monotonic() + seconds
    while metrics(url)["hla_tvm_open_connections"] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)


def is_openai_error(body, status=None):
    err = body["error"]
    return set(err) == {"message", "type", "param", "code"} and err["message"]


def test_half_sent_requests_are_closed(hostile):
    """uvicorn times out only idle keep-alive connections: half a head, half a body, or
    nothing at all stayed open for good. Now: 408 (or a silent close when nothing came)
    within --request-timeout."""
    before = errors(hostile, "408")
    socks = [connect(hostile) for _ in range(3)]
    socks[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    socks[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    t0 = time.monotonic()
    got = [read_all(s, TIMEOUT + 4) for s in socks]
    assert time.monotonic() - t0 < TIMEOUT + 3
    for raw in got[:2]:
        status, body = answer(raw)
        assert status == 408 and body["error"]["code"] == "request_timeout", raw
    assert got[2] == b""
    assert errors(hostile, "408") == before + 2
    for s in socks:
        s.close()


def test_head_over_the_limit_431(hostile):
    """httptools read a head of any size (a 60 MB header took the RSS up 100 MB); now a head
    over 64 KiB gets 431 and the connection closes."""
    s = connect(hostile)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
    try:
        for _ in range(40):   # 40 x 4 KiB: past the 64 KiB limit
            s.sendall(b"a" * 4096)
    except OSError:
        pass   # (closed while sending)
    raw = read_all(s, 5)
    s.close()
    status, body = answer(raw)
    assert status == 431 and is_openai_error(body)


def test_head_in_one_read_over_the_limit_431(hostile):
    """A head over 64 KiB that came in one read was answered (70 and 100 KiB got 200 on
    loopback, found by benchmarks/serve_load.py --hostile): the guard counted a read's bytes
    only after httptools had parsed them, when the head was already complete. Now they are
    counted before: 431. Checked on the protocol with the head in one data_received call, and
    on a server with a head written at once."""
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from hla_tvm.serve.guard import MAX_HEAD, guarded

    class Transport:
        closed = False

        def __init__(self):
            self.out = b""

        def get_extra_info(self, name, default=None):
            return default

        def is_closing(self):
            return self.closed

        def can_write_eof(self):
            return False

        def close(self):
            self.closed = True

        def write(self, data):
            self.out += data

        def pause_reading(self):
            pass

        def resume_reading(self):
            pass

    async def one_read(head):
        config = uvicorn.Config(app=None, log_level="critical")
        config.loaded_app = None
        reports = []
        proto = guarded(HttpToolsProtocol, report=reports.append)(
            config, ServerState(), app_state={}, _loop=asyncio.get_running_loop())
        t = Transport()
        proto.connection_made(t)
        proto.data_received(head)
        proto.connection_lost(None)
        return t, reports
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * MAX_HEAD + b"\r\n\r\n"
    t, reports = asyncio.run(one_read(head))
    assert t.closed and reports == ["431"]
    status, body = answer(t.out)
    assert status == 431 and body["error"]["code"] == "request_header_too_large"

    for kib, want in ((60, 200), (70, 431), (100, 431)):
        s = connect(hostile)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (kib * 1024) +
                  b"\r\nConnection: close\r\n\r\n")
        raw = read_all(s, 5)
        s.close()
        assert answer(raw.replace(b"<open>", b""))[0] == want, (kib, raw[:200])


def test_body_over_the_limit_413_before_it_is_read(hostile):
    """--max-prompt was checked after the whole body was read; now a body over --max-body is
    refused from its Content-Length, before any of it is read, or while it streams in."""
    s = connect(hostile)
    s.sendall(request("POST", "/v1/completions", headers=["Content-Length: 1000000000"]))
    s.sendall(b'{"prompt": "')   # and no more: the answer cannot wait for the body
    raw = read_all(s, 5)
    s.close()
    status, body = answer(raw.replace(b"<open>", b""))
    assert status == 413 and body["error"]["code"] == "request_too_large"

    def chunks():   # chunked: no Content-Length; 100 x 1000 bytes
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 1000
        yield b'"}'
    r = httpx.post(hostile + "/v1/completions", content=chunks(), timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a client that asks to close still gets its answer (the server reads the rest for a
    # moment instead of resetting the connection)
    s = connect(hostile)
    s.sendall(request("POST", "/v1/completions", b"[" * 200000, headers=["Connection: close"]))
    status, _ = answer(read_all(s, 5))
    s.close()
    assert status == 413


def test_max_tokens_cap(hostile):
    r = httpx.post(hostile + "/v1/completions", json={"prompt": "a", "max_tokens": 10 ** 9},
                   timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens" and "3000" in r.json()["error"]["message"]
    r = httpx.post(hostile + "/v1/completions", json={"prompt": "a", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("raw,status", [
    (request("GET", "/no-such-path", close=True), 404),
    (request("DELETE", "/health", close=True), 405),
    (request("POST", "/v1/completions",
             json.dumps({"prompt": "\ud800", "max_tokens": 2}).encode(), close=True), 400),
    (request("POST", "/v1/completions",
             json.dumps({"prompt": "a", "stop": "x\udfff"}).encode(), close=True), 400),
    (request("POST", "/v1/completions", b"[" * 2000 + b"]" * 2000, close=True), 400),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
], ids=["404", "405", "surrogate-prompt", "surrogate-stop", "deep-json", "not-http"])
def test_error_answers_are_openai_json(hostile, raw, status):
    """500 with a plain-text body for a lone surrogate and deeply nested JSON; FastAPI's
    {"detail": ...} for 404/405; uvicorn's plain text for a malformed request. Now each is
    OpenAI's error JSON, counted in the error metric."""
    before = errors(hostile, status)
    s = connect(hostile)
    s.sendall(raw)
    got = read_all(s, 5)
    s.close()
    code, body = answer(got.replace(b"<open>", b""))
    assert code == status and is_openai_error(body), got
    assert errors(hostile, status) == before + 1


def test_connection_cap_503_and_health(hostile):
    """No cap: ~21,000 idle connections ran the server out of file descriptors. Now a
    connection beyond --max-connections (6) gets 503 in OpenAI's JSON, GET /health still
    answers, and the idle ones go after --request-timeout."""
    quiet(hostile)
    before = errors(hostile, "503")
    idle = [connect(hostile) for _ in range(5)]
    time.sleep(0.2)
    assert httpx.get(hostile + "/health", timeout=5).status_code == 200   # 6 open: the cap
    idle.append(connect(hostile))
    time.sleep(0.2)
    s = connect(hostile)
    s.sendall(request("GET", "/v1/models"))
    status, body = answer(read_all(s, 5))
    s.close()
    assert status == 503 and body["error"]["code"] == "too_many_connections"
    r = httpx.get(hostile + "/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    # the idle connections are closed after --request-timeout: requests go through again
    assert all(read_all(c, TIMEOUT + 4) == b"" for c in idle)
    for c in idle:
        c.close()
    assert httpx.get(hostile + "/v1/models", timeout=5).status_code == 200
    assert errors(hostile, "503") == before + 1


def test_slow_reader_is_cut(module_path):  # noqa: F811
    """A streaming client that reads nothing: its events piled up without bound (+32 MB for 10
    clients reading 10 B/s). Now, once --max-unread (16) tokens wait while the server's write
    waits for the client, the stream is cut: its slot is freed, hla_tvm_streams_cut counts it,
    and what the client gets ends with a slow_reader error. (The app is driven through ASGI
    with a send that blocks: on loopback the sockets' buffers take megabytes first, and a
    lagging stream's events merge into fewer, shorter chunks.)"""
    import asyncio

    from hla_tvm.runtime import load
    from hla_tvm.serve.app import create_app

    app = create_app(load(module_path, threads=1), max_unread=16, max_tokens=20000)
    engine, registry = app.state.engine, app.state.metrics.registry
    cuts = lambda: registry.get_sample_value("hla_tvm_streams_cut_total")  # noqa: E731
    body = json.dumps({"prompt": "a", "max_tokens": 20000, "stream": True,
                       "temperature": 0}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
             "query_string": b"", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def scenario():
        sent, reader = [], asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(60)   # (the client stays)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body":
                await reader.wait()   # the client reads nothing until the stream is cut
        task = asyncio.ensure_future(app(scope, receive, send))
        deadline = time.monotonic() + 30
        while not cuts() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        reader.set()
        await asyncio.wait_for(task, 30)
        return sent

    try:
        sent = asyncio.run(scenario())
        assert cuts() == 1
        deadline = time.monotonic() + 10
        while engine.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.busy()   # (its slot is free)
    finally:
        engine.stop(1)
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b'"code": "slow_reader"' in text and b'"finish_reason": "length"' not in text
    assert text.count(b'"token_ids"') <= 3   # (the first chunk, the 16 waiting merged in one)


def test_stalled_reader_is_aborted():
    """A client that reads nothing at all for --request-timeout, while the server has an
    answer to write (the connection's buffers full), is cut: the connection is aborted (a
    close would wait for the client to read)."""
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from hla_tvm.serve.guard import guarded

    class Transport:
        aborted = closed = False

        def get_extra_info(self, name, default=None):
            return default

        def is_closing(self):
            return self.aborted or self.closed

        def abort(self):
            self.aborted = True

        def close(self):
            self.closed = True

        def write(self, data):
            pass

        def pause_reading(self):
            pass

        def resume_reading(self):
            pass

    async def scenario():
        config = uvicorn.Config(app=None, log_level="critical")
        config.loaded_app = None
        reports = []
        proto = guarded(HttpToolsProtocol, request_timeout=0.2, report=reports.append)(
            config, ServerState(), app_state={}, _loop=asyncio.get_running_loop())
        t = Transport()
        proto.connection_made(t)
        proto.pause_writing()   # (the transport's buffer is full)
        await asyncio.sleep(0.5)
        assert t.aborted and reports == ["stalled"]
        t2 = Transport()   # a reader that catches up in time is not cut
        proto2 = guarded(HttpToolsProtocol, request_timeout=0.2, report=reports.append)(
            config, ServerState(), app_state={}, _loop=asyncio.get_running_loop())
        proto2.connection_made(t2)
        proto2.pause_writing()
        await asyncio.sleep(0.05)
        proto2.resume_writing()
        await asyncio.sleep(0.1)
        assert not t2.aborted
        proto.connection_lost(None)
        proto2.connection_lost(None)
    asyncio.run(scenario())


def test_concurrent_resumes_409(module_path, tmp_path):  # noqa: F811
    """Two resumes of one session at once both returned 200 and the session kept only one of
    the continuations. Now the second gets 409 while the first runs; a fork still reads it."""
    from fastapi.testclient import TestClient

    from hla_tvm.runtime import load
    from hla_tvm.serve.app import create_app
    from hla_tvm.serve.sessions import SessionStore

    model = load(module_path, threads=1)
    app = create_app(model, model_name="model", sessions=SessionStore(tmp_path, model))
    engine = app.state.engine
    entered, gate = threading.Event(), threading.Event()
    prefill = engine._prefill_piece

    def held_prefill(req):   # the first resume stops in its prefill until the gate opens
        if req.resume == "s" and not gate.is_set():
            entered.set()
            gate.wait(10)
        return prefill(req)
    engine._prefill_piece = held_prefill
    post = lambda c, body: c.post("/v1/completions", json=body)  # noqa: E731
    with TestClient(app) as c:
        assert post(c, {"prompt": "abc", "max_tokens": 2, "temperature": 0,
                        "session": {"save": "s"}}).status_code == 200
        results = {}
        runs = [threading.Thread(target=lambda k=k, b=b: results.__setitem__(k, post(c, b)))
                for k, b in (("resume", {"max_tokens": 3, "session": {"resume": "s"}}),
                             ("fork", {"max_tokens": 2, "session": {"fork": "s"}}))]
        runs[0].start()
        assert entered.wait(10)
        try:
            for body in ({"max_tokens": 3, "session": {"resume": "s"}},
                         {"prompt": "x", "max_tokens": 3, "session": {"save": "s"}}):
                r = post(c, body)
                assert r.status_code == 409, r.text
                assert r.json()["error"]["code"] == "session_busy"
            runs[1].start()   # (a fork is taken; it runs once the engine goes on)
        finally:
            gate.set()
        for t in runs:
            t.join(30)
        assert results["resume"].status_code == 200 and results["fork"].status_code == 200
        assert post(c, {"max_tokens": 2, "session": {"resume": "s"}}).status_code == 200
        assert 'hla_tvm_request_errors_total{status="409"} 2.0' in c.get("/metrics").text


def test_schema_and_health_behind_the_key(module_path):  # noqa: F811
    """/openapi.json was served without the key and /health named host:pid to anyone. Now the
    schema needs the key and /health without it says {"status": "ok"} only."""
    from fastapi.testclient import TestClient

    from hla_tvm.runtime import load
    from hla_tvm.serve.app import create_app

    app = create_app(load(module_path, threads=1), model_name="model", api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    with TestClient(app) as c:
        r = c.get("/openapi.json")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "/v1/completions" in c.get("/openapi.json", headers=key).json()["paths"]
        assert c.get("/health").json() == {"status": "ok"}
        assert set(c.get("/health", headers=key).json()) >= {"status", "model", "server"}
        r = c.get("/docs", headers=key)
        assert r.status_code == 404 and is_openai_error(r.json())


def test_sigterm_with_infinite_shutdown_timeout_ends(module_path):  # noqa: F811
    """max_tokens 10^9 was accepted, and with --shutdown-timeout inf SIGTERM then waited for it
    for good (and inf made the engine's stop raise). Now max_tokens is capped, and the server
    lets a running stream finish and exits 0."""
    proc, url = start_server(module_path, "--shutdown-timeout", "inf", "--max-tokens", "2000")
    try:
        r = httpx.post(url + "/v1/completions", timeout=10,
                       json={"prompt": "a", "max_tokens": 10 ** 9})
        assert r.status_code == 400
        assert sigterm_during_stream(proc, url, 2000) == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engine_stop_with_infinite_timeout(module_path):  # noqa: F811
    """Engine.stop(inf) raised OverflowError (threading cannot wait an infinite time)."""
    from hla_tvm.runtime import load
    from hla_tvm.serve.engine import Engine

    engine = Engine(load(module_path, threads=1), max_streams=1).start()
    t0 = time.monotonic()
    engine.stop(float("inf"))
    assert time.monotonic() - t0 < 10 and not engine._thread.is_alive()
    with pytest.raises(ValueError, match="seconds"):
        engine.stop(float("nan"))


@pytest.mark.parametrize("args,env,words", [
    (["--max-streams", "1000000000"], None, "of memory"),
    (["--shutdown-timeout", "nan"], None, "seconds >= 0"),
    (["--shutdown-timeout", "-1"], None, "seconds >= 0"),
    (["--sessions", "/proc/self"], None, "--sessions"),
    (["--api-key", "cl\u00e9"], None, "printable ASCII"),
    (["--api-key", " key "], None, "white space"),
    ([], "", "HLA_TVM_API_KEY is empty"),
    (["--max-connections", "100000000"], None, "file descriptors"),
])
def test_cli_refuses_what_cannot_work(module_path, monkeypatch, capsys, args, env,  # noqa: F811
                                      words):
    """Each was a traceback (MemoryError), or accepted and then failing (nan at SIGTERM, every
    request 401, a session folder nobody can write). Now: one line on stderr, exit 2, before
    the server starts."""
    import hla_tvm.cli.serve as serve_cli
    from hla_tvm.cli import main

    def never(*a, **k):
        raise AssertionError("the server started")
    monkeypatch.setattr(serve_cli, "_server_class", lambda: never)
    monkeypatch.delenv("HLA_TVM_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("HLA_TVM_API_KEY", env)
    try:
        code = main(["serve", str(module_path), "--port", "1", *args])
    except SystemExit as exit_:   # (argparse's own refusals)
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    # (one line; argparse puts the command's usage above its own refusals)
    assert code == 2 and err and err[-1].startswith("hla-tvm serve: error:"), err
    assert words in err[-1] and (len(err) == 1 or err[0].startswith("usage:")), err


def test_help_names_the_limits(capsys):
    from hla_tvm.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--max-connections", "--request-timeout", "--max-body", "--max-tokens",
                 "--max-unread", "--max-prompt", "--shutdown-timeout"):
        assert flag in out


def test_a_module_with_a_max_batch_serves_as_it_is(tmp_path, monkeypatch, capsys):
    """A module compiled for at most one stream (the demo's) serves without --max-streams (the
    pool takes its max batch); asking for more streams than it takes is refused in one line
    naming --max-streams and the module's bound (it was init_state's error)."""
    import torch

    import hla_tvm.cli.serve as serve_cli
    from hla_tvm.cli import main
    from hla_tvm.compiler import compile as compile_model
    from hla_tvm.models import HLALM

    torch.manual_seed(0)
    path = compile_model(HLALM(40, 16, 1, 2, chunk_size=16).eval(), out=tmp_path / "one.so",
                         max_batch=1)
    assert serve_cli.stream_slots(None, 1) == 1 and serve_cli.stream_slots(None, None) == 64
    started = []

    class Server:
        def __init__(self, *args, **kwargs):
            started.append(True)

        def run(self):
            pass
    monkeypatch.setattr(serve_cli, "_server_class", lambda: Server)
    monkeypatch.delenv("HLA_TVM_API_KEY", raising=False)
    main(["serve", str(path), "--port", "1"])
    assert started, capsys.readouterr().err
    code = main(["serve", str(path), "--port", "1", "--max-streams", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--max-streams 4" in err[0] and "--max-batch 1" in \
        err[0], err
