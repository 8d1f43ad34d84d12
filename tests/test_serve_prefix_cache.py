"""The server's prefix-state cache: a prompt that starts with tokens served before resumes from
the state after them (cached at each prefill piece's end, at the prompt's end and at each
answer's end) and prefills only the rest, giving the tokens a cold prefill gives (greedy:
the single-sequence loop's; seeded: the same request's when nothing was cached). The cache
itself: exact hits only, the longest prefix, least recently used entries evicted by bytes."""
import numpy as np
import pytest

from test_serve_api import start_server, stop_server
from test_serve_choices import post

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.xdist_group("serve")
FAST = {"test_the_cache_finds_the_longest_exact_prefix"}


def test_the_cache_finds_the_longest_exact_prefix():
    from hla_tvm.serve.prefix_cache import PrefixCache

    state = lambda v: [np.full((1, 4), v, np.float32)]   # noqa: E731
    cache = PrefixCache(1 << 20)
    cache.put([1, 2, 3], state(3), np.zeros(5))
    cache.put([1, 2, 3, 4, 5], state(5))   # (no logits: an answer's end)
    length, got, logits = cache.longest([1, 2, 3, 4, 5, 6])
    assert length == 5 and got[0][0, 0] == 5 and logits is None
    got[0][:] = 0   # a copy: the cached state is unchanged
    assert cache.longest([1, 2, 3, 4, 5, 7])[1][0][0, 0] == 5
    assert cache.longest([1, 2, 3, 4, 5])[0] == 3   # all of it only with its logits
    assert cache.longest([1, 2, 3, 4, 5], need_logits=False)[0] == 5
    assert cache.longest([1, 2, 9]) is None and cache.longest([2, 1, 3, 4]) is None
    assert (cache.hits, cache.misses, cache.tokens_saved) == (4, 2, 18)
    small = PrefixCache(2 * (16 + 12))   # two entries of a 16-byte state and 3 ids
    for i in range(3):
        small.put([i, i, i], state(i))
    assert small.longest([0, 0, 0, 1]) is None   # (evicted by the third)
    small.longest([1, 1, 1, 1])   # (used: [2, 2, 2] is now the least recently used)
    small.put([7, 7, 7], state(7))
    assert small.longest([2, 2, 2, 1]) is None
    assert small.longest([1, 1, 1, 1])[0] == 3 and small.bytes <= small.max_bytes
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


@pytest.fixture(scope="module")
def served(compiled_lm):
    from hla_tvm.runtime import load

    path = compiled_lm("bytes", vocab_size=256, vocab="bytes")[1]
    proc, url = start_server(path, "--max-streams", "2", "--prefill-piece", "16",
                             "--name", "model", "--prefix-cache-mb", "16")
    yield url, load(path, threads=1)
    stop_server(proc)


def _cached(answer):
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prompts_resume_from_cached_prefixes(served):
    from hla_tvm.runtime.generate import generate

    url, model = served
    greedy = lambda text, n: bytes(generate(model, list(text.encode()), n)[0]).decode(  # noqa
        "utf-8", "replace")
    first = "class Tree:\n    def __init__(self, left, right):\n"   # 50 bytes: 3 pieces
    body = {"max_tokens": 10, "temperature": 0}
    a = post(url, dict(body, prompt=first))
    assert _cached(a) == 0 and a["choices"][0]["text"] == greedy(first, 10)
    # the same prompt: its whole state and last logits were cached
    again = post(url, dict(body, prompt=first))
    assert _cached(again) == len(first) and again["choices"][0]["text"] == greedy(first, 10)
    # a longer prompt resumes at the end of the first, at any token position
    longer = first + "        self.left = left\n"
    b = post(url, dict(body, prompt=longer))
    assert _cached(b) == len(first) and b["choices"][0]["text"] == greedy(longer, 10)
    # a follow-up after the answer (a chat's next turn) resumes after the answer's tokens
    # (as ids: the answer's bytes need not be whole UTF-8 characters)
    follow = list(first.encode()) + a["choices"][0]["token_ids"] + list(b"\n# next\n")
    c = post(url, dict(body, prompt=follow))
    assert _cached(c) == len(first) + 9
    assert c["choices"][0]["token_ids"] == generate(model, follow, 10)[0]
    # a prompt sharing only part of a piece resumes at the last piece end inside it
    branch = first[:40] + "X" * 10
    d = post(url, dict(body, prompt=branch))
    assert _cached(d) == 32 and d["choices"][0]["text"] == greedy(branch, 10)
    # seeded sampling: cold and resumed give the same text
    seeded = {"max_tokens": 12, "temperature": 1.5, "seed": 3, "prompt": "while x:" * 6}
    cold, warm = post(url, seeded), post(url, seeded)
    assert _cached(cold) == 0 and _cached(warm) == 48
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"]
    page = httpx.get(url + "/metrics", timeout=10).text
    hits = [line for line in page.splitlines() if line.startswith("hla_tvm_prefix_cache_hits ")]
    assert float(hits[0].split()[1]) >= 5
