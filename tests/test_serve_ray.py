"""`hla_tvm.serve.ray_deployment` on a local Ray instance: two replicas behind Ray Serve's HTTP
proxy, sharing one sessions folder; a session saved through one replica continues through the
other exactly as the uninterrupted stream does (the batch-1 loop, `runtime.generate`)."""
import socket

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve")]


@pytest.fixture(scope="module")
def module_path(compiled_lm):
    return compiled_lm("bytes", vocab_size=256, vocab="bytes")[1]


def test_two_replicas_share_sessions(module_path, tmp_path):
    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate
    from hla_tvm.serve.ray_deployment import application

    whole = bytes(generate(load(module_path, threads=1), list(b"import os\n"), 12)[0]).decode(
        "utf-8", "replace")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(module_path, num_replicas=2, sessions=tmp_path / "sessions",
                              num_cpus=0.5), route_prefix="/")
        url = f"http://127.0.0.1:{port}/v1/completions"
        first = httpx.post(url, timeout=120, json={"prompt": "import os\n", "max_tokens": 5,
                                                   "temperature": 0,
                                                   "session": {"save": "chat"}})
        assert first.status_code == 200, first.text
        saved_by = first.headers["x-hla-tvm-server"]
        seen = set()
        for _ in range(40):   # the proxy picks a replica: fork until the other one answers
            r = httpx.post(url, timeout=120, json={"max_tokens": 7, "temperature": 0,
                                                   "session": {"fork": "chat"}})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-hla-tvm-server"])
            assert first.json()["choices"][0]["text"] + r.json()["choices"][0]["text"] == whole
            if r.headers["x-hla-tvm-server"] != saved_by:
                break
        assert seen - {saved_by}, f"every request went to {saved_by}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_replicas_from_the_command(module_path, tmp_path):
    """`hla-tvm serve MODULE --replicas 2`: Ray Serve replicas on a local Ray instance behind
    one port, the same greedy text as the batch-1 loop, answers from both replicas, and
    SIGTERM stops it (exit 0)."""
    import signal
    import subprocess
    import sys
    import time

    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate

    want = bytes(generate(load(module_path, threads=1), list(b"def f():\n"), 8)[0]).decode(
        "utf-8", "replace")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hla_tvm", "serve", str(module_path),
                             "--replicas", "2", "--port", str(port), "--name", "model",
                             "--sessions", str(tmp_path / "sessions")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # (the first replica answers /health while the second may still be loading the module:
        # requests go on until both have answered, or for 120 s)
        servers = set()
        until = time.monotonic() + 120
        while time.monotonic() < until:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "model", "prompt": "def f():\n", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            servers.add(r.headers["x-hla-tvm-server"])
            if len(servers) == 2:
                break
        assert len(servers) == 2, servers
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 0
