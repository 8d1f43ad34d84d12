"""Load on `hla-tvm serve`: concurrent streaming clients, each asking for --tokens tokens, at
each concurrency of --streams; reports aggregate tokens/s, time to first token and inter-token
latency (p50, p99), the server's resident memory and failed requests, with a batch-1 loop over
the same module (`runtime.generate.generate`, what `hla-tvm run` does) as the baseline. Writes
--json and, with matplotlib, --plot (tokens/s and p99 latency against concurrency).

    python benchmarks/serve_load.py MODULE.so --streams 1,8,64,256 --tokens 256

MODULE.so is started as `hla-tvm serve` on a free port (or --url an already running server).
Each client's prompt differs; sampling is seeded, so every run asks for the same work.

--soak SECONDS then runs --soak-workers normal clients (streams, whole answers, disconnects,
malformed requests, sessions) and reports their failures, tokens/s and latency, with the
server's resident memory and open file descriptors sampled every --rss-every seconds. With
--hostile, hostile clients run beside them for the same time (`_hostile`: bodies over
--max-body, connections that send nothing or half a request, lone surrogates and deeply nested
JSON, streams never read or read slowly, concurrent resumes of one session, max_tokens above
the cap); each class's answers are counted, and every 5xx (there must be none):

    python benchmarks/serve_load.py MODULE.so --streams '' --soak 300 --hostile --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import socket
import subprocess
import sys
import time

import numpy as np


def _rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None


def _fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


async def _sample(pid, end, every, out):
    """Append {"t", "rss_mb", "fds"} of process `pid` to `out` every `every` seconds until the
    monotonic time `end` (and once at it)."""
    t0 = time.monotonic()
    while True:
        out.append({"t": round(time.monotonic() - t0, 1), "rss_mb": _rss_mb(pid),
                    "fds": _fds(pid)})
        left = end - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(every, left))


def rss_summary(samples, settle=60.0):
    """RSS over time: the first `settle` seconds' peak against the rest (min, max, last, and
    the slope of a line fitted to it, MB per minute)."""
    samples = [x for x in samples if x["rss_mb"] is not None]
    if not samples:
        return None
    first = [x["rss_mb"] for x in samples if x["t"] <= settle]
    rest = [x for x in samples if x["t"] > settle]
    out = {"start_mb": samples[0]["rss_mb"], "first_minute_max_mb": max(first or [0]),
           "end_mb": samples[-1]["rss_mb"], "samples": len(samples),
           "fds_max": max((x["fds"] or 0) for x in samples), "fds_end": samples[-1]["fds"]}
    if len(rest) >= 2:
        ts = np.array([x["t"] for x in rest])
        mb = np.array([x["rss_mb"] for x in rest])
        out.update(after_min_mb=float(mb.min()), after_max_mb=float(mb.max()),
                   after_slope_mb_per_min=float(np.polyfit(ts / 60, mb, 1)[0]))
    return out


def _prompt(i, length):
    """Client i's prompt: distinct, about `length` bytes (at least its header line)."""
    head = f"# client {i}\ndef f{i}(x):\n"
    body = "    return x * 2 + 1  # a line of code\n" * max(0, (length - len(head)) // 38 + 1)
    return (head + body)[:max(length, len(head))]


async def _client(http, url, i, tokens, stamps, failures, prompt_len=0):
    body = {"prompt": _prompt(i, prompt_len), "max_tokens": tokens, "stream": True,
            "temperature": 0.8, "top_k": 40, "seed": i}
    t0 = time.perf_counter()
    times = []
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                failures.append(f"{r.status_code}")
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    n = len(chunk["choices"][0].get("token_ids", [])) if chunk["choices"] else 0
                    times += [time.perf_counter()] * n
    except Exception as err:  # noqa: BLE001 - counted
        failures.append(type(err).__name__)
        return
    stamps.append((t0, times))


async def _round(url, streams, tokens, prompt_len=0):
    import httpx

    stamps, failures = [], []
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[_client(http, url, i, tokens, stamps, failures, prompt_len)
                               for i in range(streams)])
        wall = time.perf_counter() - t0
    total = sum(len(t) for _, t in stamps)
    ttft = [t[0] - s for s, t in stamps if t]
    itl = np.concatenate([np.diff(t) for _, t in stamps if len(t) > 1] or [np.zeros(1)])
    return {"streams": streams, "tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)) if ttft else None,
            "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)),
            "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)), "failed": len(failures)}


async def _soak(url, seconds, workers, seed=0, hostile=None):
    """`workers` clients for `seconds`, each looping over a random mix: streamed and whole
    completions (16-256 tokens, prompts up to 256 bytes), disconnects after a few chunks,
    malformed requests (must get a 4xx), a session saved then resumed or forked. Returns the
    counts: well-formed requests, their failures, disconnects, 4xx answers, 5xx answers; and
    the well-formed requests' tokens/s and latency (time to first token and between chunks of
    streams, p50/p99; whole answers' time). `hostile`: a coroutine run beside the clients
    (`_hostile`), its result under "hostile"."""
    import httpx

    rnd = random.Random(seed)
    stats = collections.Counter()
    lat = {"ttft": [], "gap": [], "whole": [], "tokens": 0}
    bad_bodies = [b"{not json", b'{"prompt": "a", "max_tokens": "x"}', b'{"prompt": [1, 99999]}',
                  b'{"prompt": "a", "colour": 1}', b'{"prompt": "a", "max_tokens": 0}',
                  b'{"session": {"resume": "no-such-session"}, "prompt": "a"}']
    end = time.monotonic() + seconds

    def status(code, ok=(200,)):
        if code >= 500:
            stats["5xx"] += 1
        stats["ok" if code in ok else f"failed {code}"] += 1

    async def streamed(http, body):
        """A whole stream, timed; True when it ended with [DONE]."""
        t0 = time.perf_counter()
        stamps, last = [], ""
        async with http.stream("POST", url + "/v1/completions",
                               json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        n = len(chunk["choices"][0].get("token_ids", []))
                        if n:
                            stamps.append(time.perf_counter())
                            lat["tokens"] += n
                if line:
                    last = line
        if r.status_code == 200 and last == "data: [DONE]":
            if stamps:
                lat["ttft"].append(stamps[0] - t0)
                lat["gap"] += list(np.diff(stamps))
            return 200
        return r.status_code if r.status_code != 200 else "incomplete"

    async def worker(w, http):
        while time.monotonic() < end:
            roll = rnd.random()
            body = {"prompt": _prompt(rnd.randrange(10 ** 6), rnd.choice((16, 64, 256))),
                    "max_tokens": rnd.randint(16, 256), "temperature": 0.8,
                    "seed": rnd.randrange(10 ** 6)}
            try:
                if roll < 0.1:   # a client that goes away
                    async with http.stream("POST", url + "/v1/completions",
                                           json={**body, "stream": True}) as r:
                        n = 0
                        async for _ in r.aiter_lines():
                            n += 1
                            if n > rnd.randint(1, 20):
                                break
                    if r.status_code >= 500:
                        stats["5xx"] += 1
                    stats["disconnected" if r.status_code == 200
                          else f"failed {r.status_code}"] += 1
                elif roll < 0.15:   # malformed
                    r = await http.post(url + "/v1/completions", content=rnd.choice(bad_bodies))
                    stats["4xx" if 400 <= r.status_code < 500 else "malformed_not_4xx"] += 1
                    if r.status_code >= 500:
                        stats["5xx"] += 1
                elif roll < 0.25:   # a session: saved, then resumed or forked
                    name = f"soak-{w}-{rnd.randrange(50)}"
                    r = await http.post(url + "/v1/completions", json={
                        **body, "session": {"save": name}})
                    status(r.status_code)
                    r = await http.post(url + "/v1/completions", json={
                        "max_tokens": 16, "prompt": "\n", "session": {
                            rnd.choice(("resume", "fork")): name}})
                    # (evicted meanwhile by other workers' sessions: a 404 is right)
                    status(r.status_code, (200, 404))
                else:
                    if rnd.random() < 0.5:
                        code = await streamed(http, body)
                        if code == "incomplete":
                            stats["failed incomplete stream"] += 1
                        else:
                            status(code)
                    else:
                        t0 = time.perf_counter()
                        r = await http.post(url + "/v1/completions", json=body)
                        if r.status_code == 200:
                            lat["whole"].append(time.perf_counter() - t0)
                            lat["tokens"] += r.json()["usage"]["completion_tokens"]
                        status(r.status_code)
            except httpx.HTTPError as err:
                stats[f"failed {type(err).__name__}"] += 1

    async def clients(http):
        """The workers; their wall time (the hostile clients' last waits run on after it)."""
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(w, http) for w in range(workers)])
        return time.perf_counter() - t0

    async with httpx.AsyncClient(timeout=600) as http:
        done = await asyncio.gather(clients(http), *([hostile] if hostile is not None else []))
    wall = done[0]
    out = dict(stats)
    out["5xx"] = stats["5xx"]
    good = stats["ok"]
    bad = sum(v for k, v in stats.items() if k.startswith("failed"))
    out["success_rate"] = good / max(1, good + bad)

    def pct(xs, q):
        return round(1e3 * float(np.percentile(xs, q)), 2) if xs else None
    out["normal"] = {"seconds": wall, "tokens": lat["tokens"],
                     "tokens_per_s": lat["tokens"] / wall,
                     "streams_timed": len(lat["ttft"]), "whole_timed": len(lat["whole"]),
                     "ttft_p50_ms": pct(lat["ttft"], 50), "ttft_p99_ms": pct(lat["ttft"], 99),
                     "gap_p50_ms": pct(lat["gap"], 50), "gap_p99_ms": pct(lat["gap"], 99),
                     "whole_p50_ms": pct(lat["whole"], 50),
                     "whole_p99_ms": pct(lat["whole"], 99)}
    if hostile is not None:
        out["hostile"] = done[-1]
    return out


HOSTILE_CLASSES = ("oversized", "idle", "bad_text", "unread", "slow_read", "resumes",
                   "max_tokens")


def _address(url):
    host, port = url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
    return host, int(port)


async def _connect(url, rcvbuf=None):
    """(reader, writer) of a new TCP connection to `url`'s server; `rcvbuf`: the socket's
    receive buffer (set before connecting, so that the window stays that small)."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, _address(url)),
                               10)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=2 ** 20)


def _raw(method, path, body=b"", headers=(), length=None):
    head = [f"{method} {path} HTTP/1.1", "Host: x", *headers]
    if body or length is not None:
        head.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _answer(reader, timeout):
    """The status of one HTTP answer on `reader` (an int), or how the connection ended before
    a head came: "closed", "reset" or "open" (still open after `timeout` seconds)."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except asyncio.IncompleteReadError as err:
        return "closed" if not err.partial else "closed mid-head"
    except asyncio.TimeoutError:
        return "open"
    except (ConnectionError, asyncio.LimitOverrunError):
        return "reset"
    found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    if found:
        try:
            await asyncio.wait_for(reader.readexactly(int(found.group(1))), timeout)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass
    return int(head.split(b" ", 2)[1])


async def _close(writer):
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 5)
    except (OSError, asyncio.TimeoutError):
        pass


async def _hostile(url, seconds, max_body, *, idle=300, unread=8, request_timeout=30.0,
                   seed=1, pause=0.1):
    """Hostile clients for `seconds` (each class loops until then; every wait is bounded):

    - oversized: bodies over `max_body` (a Content-Length far beyond it with 1 KB sent; a
      chunked body streaming to twice it; a whole body 3 bytes over it), and request heads
      over 64 KiB written at once;
    - idle: `idle` connections at a time, each sending nothing, half a request head, or a head
      and half its body, then waiting for the server to end it (within `request_timeout`);
    - bad_text: a lone surrogate in the prompt or a stop string (escaped "\ud800" in JSON),
      JSON nested 10,000 deep (arrays, objects) and as deep as the body limit allows;
    - unread: `unread` streaming requests (max_tokens 4096) on sockets with a 4 KiB receive
      buffer whose client reads nothing for `request_timeout` + 15 s, then what is left;
    - slow_read: `unread` such streams read 256 bytes every half second (60 s at most);
    - resumes: a session saved, then 4 resumes and a fork of it at once;
    - max_tokens: max_tokens above the server's cap (4097, 10^9, 2^63), streamed or not.

    Returns {class: {outcome: count}}, an outcome being "<what> <status>" (or how the
    connection ended), with "5xx" per class and, for idle, the seconds the server took to end
    a connection (min, max)."""
    import httpx

    end = time.monotonic() + seconds
    rnd = random.Random(seed)
    stats = {name: collections.Counter() for name in HOSTILE_CLASSES}
    closed_after = []

    def note(cls, what, code):
        stats[cls][f"{what} {code}"] += 1
        if isinstance(code, int) and code >= 500:
            stats[cls]["5xx"] += 1

    async def oversized(w, http):
        while time.monotonic() < end:
            kind = rnd.choice(("content-length", "chunked", "whole", "head"))
            try:
                if kind in ("content-length", "head"):
                    reader, writer = await _connect(url)
                    try:
                        if kind == "content-length":
                            writer.write(_raw("POST", "/v1/completions", length=max_body + 1 +
                                              rnd.randrange(10 ** 9)) + b'{"prompt": "' +
                                         b"a" * 1000)
                        else:   # a head over 64 KiB
                            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " +
                                         b"a" * (70 * 1024) + b"\r\n\r\n")
                        await writer.drain()
                        code = await _answer(reader, 15)
                    finally:
                        await _close(writer)
                elif kind == "chunked":   # no Content-Length: refused as it streams in
                    async def chunks():
                        yield b'{"prompt": "'
                        for _ in range(2 * max_body // 16384 + 1):
                            yield b"a" * 16384
                        yield b'"}'
                    code = (await http.post(url + "/v1/completions", content=chunks())
                            ).status_code
                else:
                    body = b'{"prompt": "' + b"a" * (max_body - 11) + b'"}'
                    code = (await http.post(url + "/v1/completions", content=body,
                                            headers={"content-type": "application/json"})
                            ).status_code
            except (OSError, httpx.HTTPError, asyncio.TimeoutError) as err:
                code = type(err).__name__
            note("oversized", kind, code)
            await asyncio.sleep(pause)

    async def idler(i):
        await asyncio.sleep(rnd.uniform(0, 5))   # (spread: the connections come and go)
        while time.monotonic() < end:
            kind = rnd.choice(("nothing", "half head", "half body"))
            try:
                reader, writer = await _connect(url)
            except (OSError, asyncio.TimeoutError) as err:
                note("idle", kind, type(err).__name__)
                await asyncio.sleep(1)
                continue
            t0 = time.monotonic()
            try:
                if kind == "half head":
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                elif kind == "half body":
                    writer.write(_raw("POST", "/v1/completions", length=200) + b'{"prompt":')
                await writer.drain()
                code = await _answer(reader, request_timeout + 15)
                if code != "open":
                    closed_after.append(time.monotonic() - t0)
            except OSError as err:
                code = type(err).__name__
            finally:
                await _close(writer)
            note("idle", kind, code)

    async def bad_text(w, http):
        deep = min(10000, (max_body - 64) // 2)
        as_deep = (max_body - 64) // 2
        bodies = {
            "surrogate prompt": b'{"prompt": "abc\\ud800def", "max_tokens": 4}',
            "surrogate stop": b'{"prompt": "a", "max_tokens": 4, "stop": "x\\udfff"}',
            "surrogate list": b'{"prompt": "a", "stop": ["\\ud800\\ud800", "b"]}',
            "deep arrays": b'{"prompt": ' + b"[" * deep + b"]" * deep + b"}",
            "deep objects": b'{"prompt": ' + b'{"a":' * deep + b"1" + b"}" * deep + b"}",
            "deep to the limit": b"[" * as_deep + b"]" * as_deep,
        }
        while time.monotonic() < end:
            kind = rnd.choice(list(bodies))
            try:
                code = (await http.post(url + "/v1/completions", content=bodies[kind],
                                        headers={"content-type": "application/json"})
                        ).status_code
            except httpx.HTTPError as err:
                code = type(err).__name__
            note("bad_text", kind, code)
            await asyncio.sleep(pause)

    async def stream_unread(i, cls):
        """A stream of 4096 tokens whose client reads nothing for a while (unread), or 256
        bytes each half second (slow_read); the outcome is what it got in the end: a
        slow_reader cut, the whole stream, a stream still going when the client left, or a
        connection closed or reset before the stream's end."""
        await asyncio.sleep(rnd.uniform(0, 5))
        while time.monotonic() < end:
            body = json.dumps({"prompt": _prompt(rnd.randrange(10 ** 6), 64),
                               "max_tokens": 4096, "stream": True, "temperature": 0.8,
                               "seed": rnd.randrange(10 ** 6)}).encode()
            got, how = b"", "open"
            try:
                reader, writer = await _connect(url, rcvbuf=4096)
            except (OSError, asyncio.TimeoutError) as err:
                note(cls, "stream", type(err).__name__)
                await asyncio.sleep(1)
                continue
            try:
                writer.write(_raw("POST", "/v1/completions", body,
                                  ["Content-Type: application/json"]))
                await writer.drain()
                if cls == "unread":
                    await asyncio.sleep(request_timeout + 15)
                    limit = time.monotonic() + 20
                    size, every = 2 ** 20, 0
                else:
                    limit = time.monotonic() + 60
                    size, every = 256, 0.5
                while time.monotonic() < limit:
                    try:
                        part = await asyncio.wait_for(reader.read(size),
                                                      max(0.01, limit - time.monotonic()))
                    except asyncio.TimeoutError:
                        break
                    if not part:
                        how = "closed"
                        break
                    got += part
                    if got.endswith(b"\r\n0\r\n\r\n"):   # (the last chunk)
                        how = "closed"
                        break
                    if every:
                        await asyncio.sleep(every)
            except ConnectionError:
                how = "reset"
            finally:
                await _close(writer)
            status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/") else "no answer"
            what = ("cut (slow_reader)" if b"slow_reader" in got else
                    "whole stream" if b"data: [DONE]" in got else
                    "unfinished when left" if how == "open" else f"{how} before its end")
            note(cls, what, status)

    async def resumes(w, http):
        n = 0
        while time.monotonic() < end:
            n += 1
            name = f"hostile-{w}-{n % 20}"
            try:
                r = await http.post(url + "/v1/completions", json={
                    "prompt": _prompt(n, 32), "max_tokens": 8, "session": {"save": name}})
                note("resumes", "save", r.status_code)
                if r.status_code == 200:
                    rs = await asyncio.gather(*[http.post(url + "/v1/completions", json={
                        "prompt": "\n", "max_tokens": 64, "temperature": 0.8,
                        "session": {kind: name}}) for kind in ("resume",) * 4 + ("fork",)])
                    for kind, r in zip(("resume",) * 4 + ("fork",), rs):
                        note("resumes", kind, r.status_code)
            except httpx.HTTPError as err:
                note("resumes", "request", type(err).__name__)
            await asyncio.sleep(pause)

    async def max_tokens(w, http):
        while time.monotonic() < end:
            value = rnd.choice((4097, 10 ** 9, 2 ** 63))
            stream = rnd.random() < 0.5
            try:
                r = await http.post(url + "/v1/completions", json={
                    "prompt": "a", "max_tokens": value, "stream": stream})
                code = r.status_code
            except httpx.HTTPError as err:
                code = type(err).__name__
            note("max_tokens", f"{value}{' streamed' if stream else ''}", code)
            await asyncio.sleep(pause)

    async with httpx.AsyncClient(timeout=60) as http:
        jobs = [oversized(w, http) for w in range(2)] + [idler(i) for i in range(idle)]
        jobs += [bad_text(w, http) for w in range(2)]
        jobs += [stream_unread(i, "unread") for i in range(unread)]
        jobs += [stream_unread(i, "slow_read") for i in range(unread)]
        jobs += [resumes(w, http) for w in range(2)] + [max_tokens(w, http) for w in range(2)]
        await asyncio.gather(*jobs)
    out = {name: dict(sorted(c.items())) for name, c in stats.items()}
    if closed_after:
        out["idle"]["closed_after_s"] = [round(min(closed_after), 1),
                                         round(max(closed_after), 1)]
    out["5xx"] = sum(c["5xx"] for c in stats.values())
    return out


def _baseline(module, tokens):
    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate

    m = load(module)
    generate(m, list(b"def f(x):\n"), 8)
    _, info = generate(m, list(b"def f(x):\n"), tokens, temperature=0.8, top_k=40, seed=0)
    return info["decode_steps"] / info["decode_s"]


def _start(module, max_streams, threads, sessions=None, extra=()):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hla_tvm", "serve", module, "--port",
                             str(port), "--max-streams", str(max_streams), "--log-level",
                             "warning", *(["--threads", str(threads)] if threads else []),
                             *(["--sessions", sessions, "--max-sessions", "200"]
                               if sessions else []), *extra])
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def server_counts(url):
    """From the server's /metrics: its error answers by status, streams cut, active streams
    and open connections."""
    import httpx

    out = {"errors": {}}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        found = re.match(r'hla_tvm_request_errors_total\{status="(\w+)"\} (\S+)', line)
        if found:
            out["errors"][found.group(1)] = int(float(found.group(2)))
        for name, key in (("hla_tvm_streams_cut_total", "cut"),
                          ("hla_tvm_active_streams", "active_at_end"),
                          ("hla_tvm_open_connections", "open_connections_at_end")):
            if line.startswith(name + " "):
                out[key] = float(line.split()[1])
    return out


def plot(rows, path):
    """A PNG at `path`: aggregate tokens/s and p99 inter-token latency against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["streams"] for r in rows]
    ax.plot(xs, [r["tokens_per_s"] for r in rows], "o-", label="tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["itl_p99_ms"] for r in rows], "s--", color="C1", label="p99 ITL")
    ax2.set_ylabel("p99 inter-token latency (ms)")
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("module", nargs="?", help="a compiled module (started as hla-tvm serve)")
    p.add_argument("--url", help="a running server instead")
    p.add_argument("--streams", default="1,8,64",
                   help="concurrencies, comma-separated ('': no rounds)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="prompt length of each client (bytes of a byte-level model's text)")
    p.add_argument("--soak", type=float, default=0, metavar="SECONDS",
                   help="then a soak of this many seconds: --soak-workers clients mixing "
                        "streams, disconnects, malformed requests and sessions")
    p.add_argument("--soak-workers", type=int, default=32)
    p.add_argument("--hostile", action="store_true",
                   help="hostile clients beside the soak's (with --soak): oversized bodies "
                        "and heads, idle and half-sent connections, surrogates, deep JSON, "
                        "unread and slow streams, concurrent resumes, max_tokens over the cap")
    p.add_argument("--hostile-idle", type=int, default=300,
                   help="idle or half-sent connections open at a time (keep the total under "
                        "the server's --max-connections: beyond it, 503 is the answer)")
    p.add_argument("--hostile-unread", type=int, default=8,
                   help="streams never read, and as many read slowly, at a time")
    p.add_argument("--max-body", type=int, default=None,
                   help="the server's --max-body (default: its default for --max-prompt 8192)")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="the server's --request-timeout")
    p.add_argument("--max-streams", type=int, default=None,
                   help="the server's --max-streams (default: the largest of --streams, "
                        "and --soak-workers + 2 x --hostile-unread + 12 with --hostile)")
    p.add_argument("--rss-every", type=float, default=5.0,
                   help="seconds between samples of the server's RSS during the soak")
    p.add_argument("--threads", type=int, default=None, help="the server's --threads")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",") if x.strip()]
    if not args.module and not args.url:
        p.error("give MODULE or --url")
    if args.hostile and not args.soak:
        p.error("--hostile runs beside a soak: give --soak SECONDS")
    if args.max_body is None:
        from hla_tvm.serve.app import default_max_body

        args.max_body = default_max_body(8192)
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        import tempfile

        sessions = tempfile.mkdtemp(prefix="hla_tvm_soak_") if args.soak else None
        need = max(counts + [args.soak_workers if args.soak else 1])
        if args.hostile:   # (its streams: unread, slow, 2 x 5 resumes and forks, 2 others)
            need = max(need, args.soak_workers + 2 * args.hostile_unread + 12)
        extra = ["--request-timeout", str(args.request_timeout), "--max-body",
                 str(args.max_body)]
        proc, url = _start(args.module, args.max_streams or need, args.threads, sessions, extra)
    rows, base = [], None
    try:
        if counts:
            base = _baseline(args.module, args.tokens) if args.module else None
            if base:
                print(f"batch-1 loop (runtime.generate, as hla-tvm run): {base:.0f} tokens/s")
            print(f"{'streams':>7} {'tok/s':>8} {'x1':>6} {'TTFT p50':>9} {'p99':>7} "
                  f"{'ITL p50':>8} {'p99':>7} {'RSS MB':>7} {'failed':>6}")
        asyncio.run(_round(url, 2, 16))   # warm-up: the engine's first calls are slower
        for n in counts:
            r = asyncio.run(_round(url, n, args.tokens, args.prompt_tokens))
            r["rss_mb"] = _rss_mb(proc.pid) if proc else None
            rows.append(r)
            r["vs_one_stream"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
            rss = f"{r['rss_mb']:.0f}" if r["rss_mb"] else "-"
            print(f"{n:>7} {r['tokens_per_s']:>8.0f} {r['vs_one_stream']:>6.2f} "
                  f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>7.1f} {r['itl_p50_ms']:>8.2f} "
                  f"{r['itl_p99_ms']:>7.2f} {rss:>7} {r['failed']:>6}", flush=True)
        soak = None
        if args.soak:
            rss0 = _rss_mb(proc.pid) if proc else None
            samples = []

            async def soak_run():
                end = time.monotonic() + args.soak
                sampler = asyncio.ensure_future(
                    _sample(proc.pid, end, args.rss_every, samples)) if proc else None
                hostile = _hostile(url, args.soak, args.max_body, idle=args.hostile_idle,
                                   unread=args.hostile_unread,
                                   request_timeout=args.request_timeout) \
                    if args.hostile else None
                try:
                    return await asyncio.wait_for(
                        _soak(url, args.soak, args.soak_workers, hostile=hostile),
                        args.soak + 2 * args.request_timeout + 120)
                finally:
                    if sampler is not None:
                        await sampler
            t0 = time.perf_counter()
            soak = asyncio.run(soak_run())
            soak["seconds"] = time.perf_counter() - t0
            time.sleep(1.0)
            soak["server"] = server_counts(url)
            soak["active_at_end"] = soak["server"].get("active_at_end")
            soak["rss_mb_start"], soak["rss_mb_end"] = rss0, _rss_mb(proc.pid) if proc else None
            soak["rss"] = rss_summary(samples)
            soak["rss_samples"] = samples
            report_soak(soak)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    out = {"module": args.module, "url": url, "tokens": args.tokens, "batch1_loop_tps": base,
           "prompt_tokens": args.prompt_tokens, "rounds": rows, "soak": soak,
           "hostile": args.hostile, "max_body": args.max_body,
           "request_timeout": args.request_timeout, "date": time.strftime("%Y-%m-%d"),
           "cpu": _cpu_name(), "argv": sys.argv[1:] if argv is None else list(argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    if soak and (soak["5xx"] or (soak.get("hostile") or {}).get("5xx")):
        return 1
    return 0


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def report_soak(soak):
    """The soak's figures, readable."""
    n = soak["normal"]
    print(f"soak {soak['seconds']:.0f} s: normal clients {soak.get('ok', 0)} ok, "
          f"{soak.get('disconnected', 0)} disconnects, {soak.get('4xx', 0)} malformed -> 4xx, "
          f"success {100 * soak['success_rate']:.2f}%, 5xx {soak['5xx']}")
    print(f"  {n['tokens_per_s']:.0f} tokens/s; TTFT p50/p99 {n['ttft_p50_ms']}/"
          f"{n['ttft_p99_ms']} ms; between chunks p50/p99 {n['gap_p50_ms']}/{n['gap_p99_ms']} "
          f"ms; whole answers p50/p99 {n['whole_p50_ms']}/{n['whole_p99_ms']} ms")
    failed = {k: v for k, v in soak.items() if k.startswith("failed") or k == "malformed_not_4xx"}
    if failed:
        print("  failures:", failed)
    for cls, counts in (soak.get("hostile") or {}).items():
        if cls != "5xx":
            print(f"  hostile {cls}: {counts}")
    if soak.get("hostile"):
        print(f"  hostile 5xx: {soak['hostile']['5xx']}")
    print(f"  server: {soak['server']}")
    if soak.get("rss"):
        print(f"  RSS: {soak['rss']}")


if __name__ == "__main__":
    sys.exit(main())
