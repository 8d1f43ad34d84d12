"""Generation loops over a model with `init_state`, `prefill` and `decode` (a compiled module
from `hla_tvm.runtime.load`, or `Eager`, the PyTorch model behind the same calls), and the
byte-level text vocabulary.

The sampler: greedy at temperature 0, else softmax(logits / temperature) over the `top_k` most
likely tokens (0: all), drawn with numpy's seeded generator, so a seed gives the same
continuation every run. export/python draws the same way; the C++ app draws with its own
generator (std::mt19937_64): its greedy tokens are the same, its sampled ones differ."""
from __future__ import annotations

import codecs
import time

import numpy as np

# how text prompts are sampled unless told otherwise, by `hla-tvm run`, the demo and the
# bundle's programs (greedy decoding of a small byte-level model soon repeats one byte); token
# id prompts decode greedily
TEXT_TEMPERATURE, TEXT_TOP_K = 0.9, 40


def sampling(text, temperature=None, top_k=None):
    """(temperature, top_k) with the defaults filled in: for a text prompt (`text`) sampled at
    TEXT_TEMPERATURE from the TEXT_TOP_K most likely, for token ids greedy."""
    if temperature is None:
        temperature = TEXT_TEMPERATURE if text else 0.0
    if top_k is None:
        top_k = TEXT_TOP_K if text and temperature > 0 else 0
    return temperature, top_k


def encode_text(text):
    """The byte-level token ids of `text` (its UTF-8 bytes)."""
    if not isinstance(text, str):
        raise TypeError(f"prompt must be a string, got {type(text).__name__}")
    if not text:
        raise ValueError("prompt must not be empty")
    return list(text.encode("utf-8"))


def text_decoder():
    """An incremental UTF-8 decoder: decode(byte ids, final=False) -> the text they complete
    (invalid bytes become U+FFFD), so a stream prints whole characters; final=True flushes an
    incomplete last character (as U+FFFD)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return lambda ids, final=False: dec.decode(bytes(ids), final)


def check_sampling(temperature, top_k, seed, top_p=1.0):
    """ValueError naming the argument for a negative or non-finite temperature, a negative
    top_k, a top_p outside (0, 1] or a seed that is not an int."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: all tokens), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or \
            not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def pick(logits, temperature, top_k, rng, top_p=1.0):
    """The next token from `logits` [vocab]: argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the top_k most likely (0: all) and, for
    top_p < 1, to the fewest most likely whose probabilities sum to at least top_p (nucleus)."""
    return pick_rows(np.asarray(logits)[None], [temperature], [top_k], [top_p], [rng])[0]


def pick_rows(logits, temperatures, top_ks, top_ps, rngs):
    """`pick` for each row of `logits` [n, vocab] with its own sampling parameters and
    generator (the same tokens row by row: the sorting and exponentials of all rows at once).
    The draw is numpy's Generator.choice(p=...): the first index whose cumulative probability
    exceeds one uniform number from the row's generator."""
    logits = np.asarray(logits, dtype=np.float64)
    out = logits.argmax(axis=1).tolist()
    sampled = [i for i, t in enumerate(temperatures) if t != 0]
    if not sampled:
        return out
    rows = logits[sampled]
    order = np.argsort(-rows, axis=1, kind="stable")
    ranked = np.take_along_axis(rows, order, axis=1)
    temps = np.array([temperatures[i] for i in sampled], dtype=np.float64)[:, None]
    expo = np.exp((ranked - ranked[:, :1]) / temps)
    for j, i in enumerate(sampled):
        k = top_ks[i] or logits.shape[1]
        p = expo[j, :k] / expo[j, :k].sum()
        if top_ps[i] < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), top_ps[i])) + 1
            p = p[:keep] / p[:keep].sum()
        cdf = p.cumsum()
        cdf /= cdf[-1]
        out[i] = int(order[j, int(cdf.searchsorted(rngs[i].random(), side="right"))])
    return out


def _prompt_array(model, prompt):
    """The prompt's token ids as an int64 array [1, T]; ValueError (as the model's own check
    words it) for an id beyond int64."""
    try:
        return np.array([prompt], dtype=np.int64)
    except OverflowError:
        bad = next((t for t in prompt if isinstance(t, int) and not -2**63 <= t < 2**63), None)
        vocab = getattr(model, "vocab_size", None)
        raise ValueError(f"tokens must lie in [0, {vocab or '2^63'}), got {bad}") from None


def generate(model, prompt, steps, *, temperature=0.0, top_k=0, seed=0, on_token=None,
             keep_logits=False):
    """`steps` token ids following `prompt` (a list of ids) for one sequence. on_token(id) is
    called as each is chosen. Returns (tokens, info) with info {"prefill_s", "decode_s",
    "decode_steps", "logits": [last prompt logits, each decode step's] if keep_logits}."""
    check_sampling(temperature, top_k, seed)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    rng = np.random.default_rng(seed)
    state = model.init_state(1)
    t0 = time.perf_counter()
    logits, state = model.prefill(_prompt_array(model, prompt), state, logits="last")
    last = np.asarray(logits)[0]
    info = {"prefill_s": time.perf_counter() - t0, "decode_s": 0.0, "decode_steps": 0,
            "logits": [last] if keep_logits else None}
    tokens = []
    t0 = time.perf_counter()
    for step in range(steps):
        tok = pick(last, temperature, top_k, rng)
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        if step + 1 < steps:
            logits, state = model.decode(np.array([tok], dtype=np.int64), state)
            last = np.asarray(logits)[0]
            if keep_logits:
                info["logits"].append(last)
    info["decode_s"] = time.perf_counter() - t0
    info["decode_steps"] = steps - 1
    return tokens, info


class Eager:
    """An HLALM in PyTorch eager mode behind the compiled module's calls: init_state(batch),
    prefill(tokens [B, T], state), decode(tokens [B], state), numpy logits out."""

    def __init__(self, model):
        self.model = model.eval()

    def init_state(self, batch):
        return None   # the model starts a fresh sequence from no state

    def prefill(self, tokens, state, logits="all"):
        # torch only for an Eager (PyTorch) model: the runtime runs without torch
        import torch

        with torch.no_grad():
            out, state = self.model(torch.as_tensor(np.asarray(tokens)), state)
        return (out[:, -1] if logits == "last" else out).numpy(), state

    def decode(self, tokens, state):
        logits, state = self.prefill(np.asarray(tokens)[:, None], state)
        return logits[:, 0], state
