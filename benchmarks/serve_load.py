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


async def _client(http, url, i, tokens, stamps, failures):
    body = {"prompt": f"# client {i}\ndef f{i}(x):\n", "max_tokens": tokens, "stream": True,
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


async def _round(url, streams, tokens):
    import httpx

    stamps, failures = [], []
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[_client(http, url, i, tokens, stamps, failures)
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


def _baseline(module, tokens):
    from hla_tvm.runtime import load
    from hla_tvm.runtime.generate import generate

    m = load(module)
    generate(m, list(b"def f(x):\n"), 8)
    _, info = generate(m, list(b"def f(x):\n"), tokens, temperature=0.8, top_k=40, seed=0)
    return info["decode_steps"] / info["decode_s"]


def _start(module, max_streams, threads):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hla_tvm", "serve", module, "--port",
                             str(port), "--max-streams", str(max_streams), "--log-level",
                             "warning", *(["--threads", str(threads)] if threads else [])])
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("module", nargs="?", help="a compiled module (started as hla-tvm serve)")
    p.add_argument("--url", help="a running server instead")
    p.add_argument("--streams", default="1,8,64", help="concurrencies, comma-separated")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request")
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
        proc, url = _start(args.module, max(counts), args.threads)
    rows = []
    try:
        base = _baseline(args.module, args.tokens) if args.module else None
        if base:
            print(f"batch-1 loop (runtime.generate, as hla-tvm run): {base:.0f} tokens/s")
        print(f"{'streams':>7} {'tok/s':>8} {'x1':>6} {'TTFT p50':>9} {'p99':>7} "
              f"{'ITL p50':>8} {'p99':>7} {'RSS MB':>7} {'failed':>6}")
        for n in counts:
            r = asyncio.run(_round(url, n, args.tokens))
            r["rss_mb"] = _rss_mb(proc.pid) if proc else None
            rows.append(r)
            r["vs_one_stream"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
            rss = f"{r['rss_mb']:.0f}" if r["rss_mb"] else "-"
            print(f"{n:>7} {r['tokens_per_s']:>8.0f} {r['vs_one_stream']:>6.2f} "
                  f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>7.1f} {r['itl_p50_ms']:>8.2f} "
                  f"{r['itl_p99_ms']:>7.2f} {rss:>7} {r['failed']:>6}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    out = {"module": args.module, "url": url, "tokens": args.tokens, "batch1_loop_tps": base,
           "rounds": rows, "date": time.strftime("%Y-%m-%d"), "cpu": os.uname().machine}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
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
        fig.savefig(args.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
