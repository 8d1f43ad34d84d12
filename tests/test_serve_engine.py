"""The serving engine (`hla_tvm.serve.engine`) and its state pool, against the single-sequence
loop (`runtime.generate.generate`: prefill, then decode one token at a time, batch 1): a stream's
tokens are the same alone and among 63 others, greedy or seeded; a saved session continues as the
uninterrupted stream does; cancelled and finished streams free their rows."""
import threading
import time

import numpy as np
import pytest

from hla_tvm.runtime import load
from hla_tvm.runtime.generate import generate
from hla_tvm.runtime.state_pool import StatePool
from hla_tvm.serve.engine import Engine, QueueFull, Request
from hla_tvm.serve.sessions import SessionStore, UnknownSession

pytestmark = pytest.mark.xdist_group("serve")


@pytest.fixture(scope="module")
def byte_model(compiled_lm):
    """The byte-level HLALM(256, 32, 2 layers, 4 heads) the server's tests share, loaded."""
    return load(compiled_lm("bytes", vocab_size=256, vocab="bytes")[1], threads=1)


def run_all(engine, requests, timeout=120):
    """Submit `requests` and wait for each one's end: {id(req): (ids, text, finish, usage)}."""
    done, out, lock = threading.Event(), {}, threading.Lock()

    def collector(req):
        parts = []

        def on_event(ev):
            if ev["type"] == "text":
                parts.append(ev["text"])
                return
            with lock:
                out[id(req)] = (list(req.ids), "".join(parts), ev.get("finish_reason"),
                                ev.get("usage"), ev.get("error"))
                if len(out) == len(requests):
                    done.set()
        return on_event

    for r in requests:
        r.on_event = collector(r)
        engine.submit(r)
    assert done.wait(timeout), f"{len(out)} of {len(requests)} requests ended"
    return out


PROMPTS = [f"def f{i}(x):\n    return x * {i}" * (1 + i % 3) for i in range(64)]


def test_greedy_tokens_alone_and_among_63(byte_model):
    ref = [generate(byte_model, list(p.encode()), 12)[0] for p in PROMPTS[:4]]
    engine = Engine(byte_model, max_streams=64, prefill_piece=32).start()
    try:
        alone = run_all(engine, [r := Request(list(PROMPTS[0].encode()), 12)])
        assert alone[id(r)][0] == ref[0]
        reqs = [Request(list(p.encode()), 12) for p in PROMPTS]
        out = run_all(engine, reqs)
    finally:
        engine.stop()
    for i in range(4):
        assert out[id(reqs[i])][0] == ref[i]
    assert all(out[id(r)][2] == "length" and len(out[id(r)][0]) == 12 for r in reqs)
    assert engine.pool.n == 0 and not engine.busy()


def test_seeded_sampling_reproducible(byte_model):
    prompt = list(PROMPTS[5].encode())
    ref = generate(byte_model, prompt, 10, temperature=0.9, top_k=40, seed=7)[0]
    engine = Engine(byte_model, max_streams=16).start()
    try:
        reqs = [Request(prompt, 10, temperature=0.9, top_k=40, seed=7)] + \
            [Request(list(p.encode()), 10, temperature=0.8, seed=i) for i, p in
             enumerate(PROMPTS[:15])]
        first = run_all(engine, reqs)
        again = run_all(engine, [r2 := Request(prompt, 10, temperature=0.9, top_k=40, seed=7)])
        nucleus = run_all(engine, [Request(prompt, 10, temperature=0.9, top_p=0.5, seed=3)
                                   for _ in range(3)])
    finally:
        engine.stop()
    assert first[id(reqs[0])][0] == ref == again[id(r2)][0]
    assert len({tuple(v[0]) for v in nucleus.values()}) == 1


def test_stop_string_ends_and_trims(byte_model):
    prompt = list(PROMPTS[1].encode())
    ids = generate(byte_model, prompt, 16)[0]
    text = bytes(ids).decode("utf-8", "replace")
    stop = text[5:7]
    engine = Engine(byte_model, max_streams=4).start()
    try:
        out = run_all(engine, [r := Request(prompt, 16, stop=[stop])])
    finally:
        engine.stop()
    _, got, finish, usage, _ = out[id(r)]
    assert finish == "stop" and got == text[:text.find(stop)]
    assert usage["completion_tokens"] < 16


def test_session_resume_and_fork_continue_without_reprefill(byte_model, tmp_path):
    prompt = list(PROMPTS[2].encode())
    whole = generate(byte_model, prompt, 10)[0]
    store = SessionStore(tmp_path / "sessions", byte_model, max_count=3)
    engine = Engine(byte_model, max_streams=8, sessions=store).start()
    try:
        out = run_all(engine, [a := Request(prompt, 4, save="s")])
        assert out[id(a)][0] == whole[:4]
        # a fork leaves "s" as it was; a resume continues it and saves it back
        out = run_all(engine, [f1 := Request([], 6, fork="s"), f2 := Request([], 6, fork="s")])
        assert out[id(f1)][0] == out[id(f2)][0] == whole[4:]
        assert out[id(f1)][3]["prompt_tokens"] == 0
        out = run_all(engine, [r := Request([], 3, resume="s")])
        assert out[id(r)][0] == whole[4:7]
        out = run_all(engine, [r := Request([], 3, resume="s")])
        assert out[id(r)][0] == whole[7:10]
        out = run_all(engine, [r := Request([], 3, resume="missing")])
        assert isinstance(out[id(r)][4], UnknownSession)
        for i in range(4):   # beyond max_count: the least recently used goes
            run_all(engine, [Request(prompt, 1, save=f"k{i}")])
        assert len(store.names()) == 3 and "s" not in store.names()
    finally:
        engine.stop()


def test_corrupt_session_refused(byte_model, tmp_path):
    store = SessionStore(tmp_path, byte_model)
    (tmp_path / "bad.state.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="session 'bad' is not usable"):
        store.load("bad")
    with pytest.raises(ValueError, match="session must be a name"):
        store.load("../etc/passwd")


def test_cancel_frees_slot_and_queue_limit(byte_model):
    engine = Engine(byte_model, max_streams=2, max_queue=1).start()
    try:
        ended = []
        long = [Request(list(PROMPTS[3].encode()), 10_000,
                        on_event=lambda ev: ev["type"] == "done" and ended.append(ev))
                for _ in range(2)]
        for r in long:
            engine.submit(r)
        waiting = Request([1, 2, 3], 2)
        engine.submit(waiting)
        with pytest.raises(QueueFull):
            engine.submit(Request([1, 2, 3], 2))
        for r in long:
            engine.cancel(r)
        deadline = time.monotonic() + 30
        while len(ended) < 2 and time.monotonic() < deadline:   # freed at the next step
            time.sleep(0.01)
        assert [ev["finish_reason"] for ev in ended] == ["cancelled", "cancelled"]
        out = run_all(engine, [Request([1, 2, 3], 2)])
        assert list(out.values())[0][2] == "length"
    finally:
        engine.stop(timeout=1)
    assert engine.pool.n == 0 and not engine.busy()


def test_pool_rows_move_when_streams_leave(byte_model):
    pool = StatePool(byte_model, 3)
    states = []
    for t in (5, 6, 7):
        _, st = byte_model.prefill(np.array([[t, t + 1]]), byte_model.init_state(1))
        states.append([np.array(x) for x in st])
        pool.add(st)
    assert pool.remove(0) == 2 and pool.n == 2   # row 2's stream moved into row 0
    for got, want in zip(pool.get(0), states[2]):
        np.testing.assert_array_equal(got, want)
    logits = pool.decode(np.array([1, 2]))
    ref, _ = byte_model.decode(np.array([1]), [x.copy() for x in states[2]])
    np.testing.assert_array_equal(logits[0], ref[0])
    with pytest.raises(ValueError, match="row must be an active row"):
        pool.remove(5)
    with pytest.raises(ValueError, match="tokens must have shape"):
        pool.decode(np.array([1, 2, 3]))
