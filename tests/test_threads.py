"""What a user holds is safe to share between threads: one loaded model serving several
sequences at once (4 threads x 2,000 decode steps), and the operator function itself; every
thread's results equal a serial run's, token for token and bit for bit."""
import threading

import numpy as np
import pytest
import torch

from conftest import make_qkv, rel_err
from hla_tvm import hla
from hla_tvm.reference import hla2
from hla_tvm.runtime import load

VOCAB, THREADS, STEPS = 40, 4, 2000


@pytest.fixture(scope="module")
def model_path(compiled_lm):
    return compiled_lm("hla2")[1]


def _generate(m, seed, steps):
    """Greedy tokens and every step's logits of one sequence from its own prompt."""
    prompt = np.random.default_rng(seed).integers(0, VOCAB, (1, 5 + seed))
    logits, state = m.prefill(prompt, m.init_state(1))
    tokens, all_logits = [int(logits[0, -1].argmax())], [logits[0, -1]]
    for _ in range(steps):
        logits, state = m.decode(np.array(tokens[-1:]), state)
        tokens.append(int(logits[0].argmax()))
        all_logits.append(logits[0])
    return tokens, np.stack(all_logits)


def _in_threads(fn, n):
    results, errors = [None] * n, []

    def work(i):
        try:
            results[i] = fn(i)
        except BaseException as err:   # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_one_loaded_model_serves_four_threads(model_path):
    m = load(model_path)
    serial = [_generate(m, i, STEPS) for i in range(THREADS)]
    parallel = _in_threads(lambda i: _generate(m, i, STEPS), THREADS)
    for (tok_s, log_s), (tok_p, log_p) in zip(serial, parallel):
        assert tok_p == tok_s
        assert np.array_equal(log_p, log_s)


def test_threads_batched_and_unbatched_on_one_model(model_path):
    """Threads with different batch sizes and prefill lengths interleave on one module."""
    m = load(model_path)

    def run(i):
        tokens = np.random.default_rng(10 + i).integers(0, VOCAB, (1 + i % 3, 7 + 5 * i))
        out = []
        for _ in range(20):
            logits, state = m.prefill(tokens, m.init_state(tokens.shape[0]))
            logits2, _ = m.decode(tokens[:, 0], state)
            out.append((logits, logits2))
        return out

    serial = [run(i) for i in range(THREADS)]
    parallel = _in_threads(run, THREADS)
    for s, p in zip(serial, parallel):
        for (a, b), (c, d) in zip(s, p):
            assert np.array_equal(a, c) and np.array_equal(b, d)


def test_the_operator_from_threads():
    """hla() from several threads at once (kernels compiled on first use by one of them)."""
    inputs = [make_qkv(1, 2, 45 + 7 * i, 8, 4, seed=20 + i, dtype=torch.float32)
              for i in range(THREADS)]

    def run(i):
        q, k, v = inputs[i]
        out, state = hla(q, k, v, chunk_size=16, return_state=True)
        steps = [hla(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], state=state) for _ in range(50)]
        return out, torch.cat(steps, 2)

    parallel = _in_threads(run, THREADS)
    for i, (out, steps) in enumerate(parallel):
        q, k, v = (x.double() for x in inputs[i])
        assert rel_err(out, hla2.quadratic(q, k, v)) <= 1e-4
        serial_out, serial_steps = run(i)
        assert torch.equal(out, serial_out) and torch.equal(steps, serial_steps)
