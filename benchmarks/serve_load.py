"""Load on `hla-tvm serve`: concurrent streaming clients, each asking for --tokens tokens, at
each concurrency of --streams; reports aggregate tokens/s, time to first token and inter-token
latency (p50, p99), the server's resident memory and failed requests, with a batch-1 loop over
the same module (`runtime.generate.generate`, what `hla-tvm run` does) as the baseline. Writes
--json and, with matplotlib, --plot (tokens/s and p99 latency against concurrency).

    python benchmarks/serve_load.py MODULE.so --streams 1,8,64,256 --tokens 256

MODULE.so is started as `hla-tvm serve` on a free port (or --url an already running server).
Each client's prompt differs; sampling is seeded, so every run asks for the same work."""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
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


async def _soak(url, seconds, workers, seed=0):
    """`workers` clients for `seconds`, each looping over a random mix: streamed and whole
    completions (16-256 tokens, prompts up to 256 bytes), disconnects after a few chunks,
    malformed requests (must get a 4xx), a session saved then resumed or forked. Returns the
    counts: well-formed requests, their failures, disconnects, 4xx answers."""
    import random

    import httpx

    rnd = random.Random(seed)
    stats = collections.Counter()
    bad_bodies = [b"{not json", b'{"prompt": "a", "max_tokens": "x"}', b'{"prompt": [1, 99999]}',
                  b'{"prompt": "a", "colour": 1}', b'{"prompt": "a", "max_tokens": 0}',
                  b'{"session": {"resume": "no-such-session"}, "prompt": "a"}']
    end = time.monotonic() + seconds

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
                    stats["disconnected"] += 1
                elif roll < 0.15:   # malformed
                    r = await http.post(url + "/v1/completions", content=rnd.choice(bad_bodies))
                    stats["4xx" if 400 <= r.status_code < 500 else "malformed_not_4xx"] += 1
                elif roll < 0.25:   # a session: saved, then resumed or forked
                    name = f"soak-{w}-{rnd.randrange(50)}"
                    r = await http.post(url + "/v1/completions", json={
                        **body, "session": {"save": name}})
                    stats["ok" if r.status_code == 200 else f"failed {r.status_code}"] += 1
                    r = await http.post(url + "/v1/completions", json={
                        "max_tokens": 16, "prompt": "\n", "session": {
                            rnd.choice(("resume", "fork")): name}})
                    # (evicted meanwhile by other workers' sessions: a 404 is right)
                    stats["ok" if r.status_code in (200, 404) else f"failed {r.status_code}"] += 1
                else:
                    stream = rnd.random() < 0.5
                    if stream:
                        async with http.stream("POST", url + "/v1/completions",
                                               json={**body, "stream": True}) as r:
                            text = [line async for line in r.aiter_lines()]
                        good = r.status_code == 200 and text and text[-2] == "data: [DONE]"
                    else:
                        r = await http.post(url + "/v1/completions", json=body)
                        good = r.status_code == 200
                    stats["ok" if good else f"failed {r.status_code}"] += 1
            except httpx.HTTPError as err:
                stats[f"failed {type(err).__name__}"] += 1

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*[worker(w, http) for w in range(workers)])
    return dict(stats)


def _baseline(module, tokens):
    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate

    m = load(module)
    generate(m, list(b"def f(x):\n"), 8)
    _, info = generate(m, list(b"def f(x):\n"), tokens, temperature=0.8, top_k=40, seed=0)
    return info["decode_steps"] / info["decode_s"]


def _start(module, max_streams, threads, sessions=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hla_tvm", "serve", module, "--port",
                             str(port), "--max-streams", str(max_streams), "--log-level",
                             "warning", *(["--threads", str(threads)] if threads else []),
                             *(["--sessions", sessions, "--max-sessions", "200"]
                               if sessions else [])])
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


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
    p.add_argument("--streams", default="1,8,64", help="concurrencies, comma-separated")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="prompt length of each client (bytes of a byte-level model's text)")
    p.add_argument("--soak", type=float, default=0, metavar="SECONDS",
                   help="then a soak of this many seconds: --soak-workers clients mixing "
                        "streams, disconnects, malformed requests and sessions")
    p.add_argument("--soak-workers", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="the server's --threads")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    if not args.module and not args.url:
        p.error("give MODULE or --url")
    proc = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        import tempfile

        sessions = tempfile.mkdtemp(prefix="hla_tvm_soak_") if args.soak else None
        proc, url = _start(args.module, max(max(counts), args.soak_workers if args.soak else 1),
                           args.threads, sessions)
    rows = []
    try:
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
            t0 = time.perf_counter()
            soak = asyncio.run(_soak(url, args.soak, args.soak_workers))
            soak["seconds"] = time.perf_counter() - t0
            import httpx

            time.sleep(1.0)
            page = httpx.get(url + "/metrics", timeout=30).text
            soak["active_at_end"] = next(float(line.split()[1]) for line in page.splitlines()
                                         if line.startswith("hla_tvm_active_streams "))
            soak["rss_mb_start"], soak["rss_mb_end"] = rss0, _rss_mb(proc.pid) if proc else None
            print("soak:", json.dumps(soak))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    out = {"module": args.module, "url": url, "tokens": args.tokens, "batch1_loop_tps": base,
           "prompt_tokens": args.prompt_tokens, "rounds": rows, "soak": soak,
           "date": time.strftime("%Y-%m-%d"), "cpu": os.uname().machine}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
