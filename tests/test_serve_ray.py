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
