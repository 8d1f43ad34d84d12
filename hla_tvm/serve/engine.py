"""Continuous batching over one compiled module: `Engine` advances every active stream by one
token per step (one decode call over the `runtime.state_pool.StatePool`), prefills new requests
in pieces between steps (a long prompt holds the running streams up by one piece at most), and
lets streams join at a step boundary and leave when done (max_tokens, a stop string, the client
gone). Each stream samples with its own temperature, top-k, top-p, logit rules (penalties,
bias: `logit_rules`) and seeded generator (`runtime.generate.pick_rows`), so its tokens do not
depend on the streams beside it.

    engine = Engine(model, max_streams=64, sessions=SessionStore(...))
    engine.start()
    req = Request(prompt_ids, max_tokens=64, on_event=callback)   # callback(event dict)
    engine.submit(req)      # QueueFull when max_streams run and max_queue wait
    engine.cancel(req)      # its slot is freed at the next step
    engine.stop(timeout)    # finish or cancel what runs, then end the thread

Events, from the engine's thread: {"type": "text", "text", "ids", "choice"}, then one
{"type": "done", "finish_reason": "length"|"stop"|"cancelled", "usage", "choice"} per choice, or
{"type": "error", "error": exc}. With `logprobs=k` text events also carry "logprobs": [(id,
logprob, {id: logprob of the k most likely})] for their ids (`logprobs.scores`); with `echo` the
first one is {"type": "echo", "ids": the prompt, "logprobs": the prompt's, the first (id, None,
None)}, sent once before the choices' text. `n` choices share one prefill: its state is copied
into n rows of the pool, each choice drawing with its own generator (choice 0 from `seed`,
choice i from [seed, i]).
Sessions: a request may start from a saved state (`resume` or `fork`) and save its final state
(`save`; `resume` saves back under its name); the state keeps every token the stream was given
or chose, the last chosen one as pending (fed first when the session continues)."""
from __future__ import annotations

import collections
import math
import threading
import time

import numpy as np

from ..runtime.generate import check_sampling, pick_rows
from ..runtime.state_pool import StatePool
from .logit_rules import LogitRules, adjusted, check as check_rules
from .logprobs import MAX_TOP, scores


class QueueFull(RuntimeError):
    """Every stream slot is taken and the waiting queue is full: try again later."""


class Request:
    """One completion: `prompt` token ids (may be empty when a session supplies a pending
    token), sampling parameters, `stop` strings, session names and the event callback."""

    def __init__(self, prompt, max_tokens, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 stop=(), resume=None, fork=None, save=None, on_event=None, logprobs=None,
                 echo=False, n=1, min_tokens=0, presence_penalty=0.0, frequency_penalty=0.0,
                 repetition_penalty=1.0, logit_bias=None):
        check_sampling(temperature, top_k, seed, top_p)
        check_rules(presence_penalty, frequency_penalty, repetition_penalty, logit_bias)
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or \
                not 0 <= min_tokens <= max(max_tokens, 0):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens], got "
                             f"{min_tokens!r}")
        self.min_tokens = min_tokens
        # (the logit rules' fields, built into `rules` for the model's vocabulary at start)
        self.rule_fields = dict(presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty, logit_bias=logit_bias)
        self.rules = None
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0 \
                or (max_tokens == 0 and not echo):
            raise ValueError(f"max_tokens must be a positive int (0 only with echo), got "
                             f"{max_tokens!r}")
        if resume is not None and fork is not None:
            raise ValueError("give one of session resume and fork, not both")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(
                logprobs, int) or not 0 <= logprobs <= MAX_TOP):
            raise ValueError(f"logprobs must be an int in [0, {MAX_TOP}], got {logprobs!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if n > 1 and (resume or fork or save):
            raise ValueError("session: a request with n > 1 choices keeps no session")
        self.logprobs, self.echo, self.n, self.choice = logprobs, bool(echo), n, 0
        self.forks = []   # choices 1 .. n-1 (`Engine._fork`)
        self.echoed = None   # the prompt's log-probability entries, while it is prefilled
        self.cached = None   # the prompt's last logits, where its whole state was cached
        self.resumed_at = 0  # prompt tokens whose state came from the prefix cache
        self.prompt = [int(t) for t in prompt]
        self.max_tokens, self.temperature, self.top_k, self.top_p = \
            max_tokens, float(temperature), top_k, float(top_p)
        self.seed, self.stop = seed, [s for s in stop if s]
        self.resume, self.fork, self.save = resume, fork, save if save is not None else resume
        self.on_event = on_event or (lambda event: None)
        self.cancelled = False
        # engine-side progress
        self.rng = np.random.default_rng(seed)
        self.state = self.todo = self.decode_text = None
        self.row = None            # its pool row while active (Engine.active[row] is it)
        self.last = None           # the token chosen last (not fed yet)
        self.ids, self.held = [], ""     # chosen ids; text not sent yet
        self.hold = max((len(s) - 1 for s in self.stop), default=0)
        self.prompt_tokens = 0

    def emit(self, event):
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 - a client's callback must not stop the engine
            self.cancelled = True


class Engine:
    """The batching loop over `model` (a CPU `CompiledModel`) on a thread of its own.

    max_streams: streams advanced together (the pool's rows; prefilling ones count);
    max_queue: requests that may wait for a slot (None: max_streams); prefill_piece: prompt
    tokens prefilled between two decode steps; sessions: a `SessionStore` or None; metrics:
    a `metrics.Metrics` or None; prefix_cache: a `prefix_cache.PrefixCache` or None (then a
    prompt resumes from the state of its longest prefix cached, and the states at each
    prefill piece's end and at each answer's end are cached). A model with text
    (`runtime.text`: byte-level, or compiled with a tokenizer) gives text; for others each
    token's text is its id and a space."""

    def __init__(self, model, *, max_streams=64, max_queue=None, prefill_piece=256,
                 sessions=None, metrics=None, prefix_cache=None):
        self.model = model
        self.prefix_cache = prefix_cache
        self.pool = StatePool(model, max_streams)
        self.max_streams = max_streams
        self.max_queue = max_streams if max_queue is None else max_queue
        self.piece = prefill_piece
        self.sessions, self.metrics = sessions, metrics
        self.waiting = collections.deque()
        self.joining = collections.deque()     # prefilling, with their own batch-1 states
        self.active = []                      # by pool row: active[i].row == i
        self._cv = threading.Condition()
        self._stop = False
        self._thread = None
        self.step_seconds = 0.0

    # --- the caller's side -----------------------------------------------------------------
    def start(self):
        """Start the engine's thread (once; later calls do nothing)."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hla-tvm-engine",
                                                daemon=True)
                self._thread.start()
        return self

    def submit(self, *reqs):
        """Queue the requests, all or none (QueueFull)."""
        with self._cv:
            if self._stop:
                raise QueueFull("the server is shutting down")
            held = len(self.active) + len(self.joining) + len(self.waiting)
            if held + len(reqs) > self.max_streams + self.max_queue:
                raise QueueFull(f"all {self.max_streams} streams are busy and "
                                f"{len(self.waiting)} requests wait")
            self.waiting.extend(reqs)
            self._cv.notify()

    def cancel(self, req):
        for choice in [req] + req.forks:
            choice.cancelled = True
        with self._cv:
            self._cv.notify()

    def stop(self, timeout=10.0):
        """Stop taking requests, let the running ones go on for up to `timeout` seconds (inf:
        until they end, which max_tokens bounds), then cancel what is left and end the
        thread."""
        if not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        with self._cv:
            self._stop = True
            for req in self.waiting:
                req.cancelled = True
            self._cv.notify()
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        for req in list(self.active) + list(self.joining):
            req.cancelled = True
        with self._cv:
            self._cv.notify()
        if self._thread is not None:
            left = deadline - time.monotonic() + 1.0
            # (timeout=inf: join without one; threading cannot wait an infinite time)
            self._thread.join(timeout=max(1.0, left) if math.isfinite(left) else None)

    def busy(self):
        return bool(self.active or self.joining or self.waiting)

    def counts(self):
        """(active streams, prefilling, waiting)."""
        return len(self.active), len(self.joining), len(self.waiting)

    # --- the engine's thread ----------------------------------------------------------------
    def _loop(self):
        while True:
            with self._cv:
                while not (self.waiting or self.joining or self.active or self._stop):
                    self._cv.wait()
                if self._stop and not self.busy():
                    return
                self._admit()
            self._drop_cancelled()
            if self.joining:
                self._prefill_piece(self.joining[0])
            if self.active:
                self._step()

    def _admit(self):
        # (a request takes a slot for each of its choices from the start)
        while self.waiting and len(self.active) + sum(r.n for r in self.joining) + \
                min(self.waiting[0].n, self.max_streams) <= self.max_streams:
            req = self.waiting.popleft()
            if req.cancelled:
                self._finish(req, "cancelled")
                continue
            try:
                self._start(req)
            except Exception as err:  # noqa: BLE001 - reported to its client
                req.emit({"type": "error", "error": err})
                continue
            self.joining.append(req)

    def _start(self, req):
        """The request's first state and the tokens it must feed."""
        name = req.resume or req.fork
        pending = []
        if name is not None:
            req.state, pending = self.sessions.load(name)
        else:
            req.state = self.model.init_state(1)
        req.todo = pending + req.prompt
        if self._caches(req) and not req.echo:   # (an echo scores every prompt token)
            hit = self.prefix_cache.longest(req.prompt)
            if hit is not None:
                length, req.state, req.cached = hit
                req.todo = req.prompt[length:]
                req.resumed_at = length
        if not req.todo and req.cached is None:
            raise ValueError("prompt must not be empty (a session continues from its pending "
                             "token; this one has none)")
        req.prompt_tokens = len(req.prompt)
        req.decode_text = self.model.text.decoder() if self.model.text else None
        if LogitRules.wanted(**req.rule_fields):
            req.rules = LogitRules(self.model.vocab_size, pending + req.prompt,
                                   **req.rule_fields)
        # an echo's log-probabilities: the rows before each prompt token (the first has none)
        req.skip = len(pending)   # tokens fed before the prompt
        req.echoed = [(req.prompt[0], None, None)] if req.echo and req.prompt and \
            not pending else []
        req.before = None   # logits of the token before the piece (the last piece's last)

    def _prefill_piece(self, req):
        if req.cancelled:
            self.joining.remove(req)
            self._finish(req, "cancelled")
            return
        try:
            if req.todo:
                fed = len(req.prompt) + req.skip - len(req.todo)   # tokens fed before it
                piece, req.todo = req.todo[:self.piece], req.todo[self.piece:]
                scored = req.echo and req.logprobs is not None
                logits, req.state = self.model.prefill(np.array([piece], np.int64), req.state,
                                                       logits="all" if scored else "last")
                if scored:
                    self._score_prompt(req, logits[0], piece, fed)
                    logits = logits[:, -1]
                if self._caches(req):   # (each piece's end: a later prompt may resume there)
                    self.prefix_cache.put(req.prompt[:fed + len(piece)], req.state, logits[0])
                if req.todo:
                    return
            else:   # (the whole prompt was cached, with the logits of its last token)
                logits = req.cached[None]
            self.joining.popleft()
            if req.echo:
                req.emit({"type": "echo", "ids": req.prompt, "logprobs": req.echoed})
                req.echoed = None
            if req.max_tokens == 0:
                self._finish(req, "length")
                return
            choices = self._fork(req)
            toks = pick_rows(adjusted(np.repeat(logits, len(choices), axis=0),
                                      [c.rules for c in choices]),
                             [c.temperature for c in choices], [c.top_k for c in choices],
                             [c.top_p for c in choices], [c.rng for c in choices])
            for choice, tok, entry in zip(choices, toks, self._scores(choices, logits, toks)):
                if self._choose(choice, tok, entry):
                    self._finish(choice)
                    continue
                choice.row = self.pool.add(req.state)
                self.active.append(choice)
            req.state = None
        except Exception as err:  # noqa: BLE001 - reported to its client
            if req in self.joining:
                self.joining.remove(req)
            req.emit({"type": "error", "error": err})

    def _score_prompt(self, req, rows, piece, fed):
        """Add the log-probabilities of the prompt tokens in `piece` (after `fed` tokens of the
        request, a session's pending ones first) under the logits `rows` [T, vocab] of the
        piece to `req.echoed`: the row before piece[i] is rows[i - 1], or for i = 0 the last
        row of the piece before."""
        rows = np.asarray(rows)
        if req.before is None:
            prev, shift = rows[:-1], 1
        else:
            prev, shift = np.concatenate([req.before[None], rows[:-1]]), 0
        at = [i for i in range(shift, len(piece)) if fed + i >= max(req.skip, 1)]
        req.echoed += scores(prev[[i - shift for i in at]], [piece[i] for i in at],
                             req.logprobs)
        req.before = rows[-1]

    def _caches(self, req):
        """Whether `req`'s states go to and come from the prefix cache: a cache is kept and
        the request starts from its prompt (not a session's state)."""
        return self.prefix_cache is not None and req.resume is None and req.fork is None

    def _fork(self, req):
        """The request's n choices: itself and n - 1 copies, each with its own generator."""
        for i in range(1, req.n):
            choice = Request(req.prompt, req.max_tokens, temperature=req.temperature,
                             top_k=req.top_k, top_p=req.top_p, seed=req.seed, stop=req.stop,
                             on_event=req.on_event, logprobs=req.logprobs,
                             min_tokens=req.min_tokens, **req.rule_fields)
            choice.choice, choice.rng = i, np.random.default_rng([req.seed, i])
            choice.rules = req.rules.copy() if req.rules is not None else None
            choice.decode_text = self.model.text.decoder() if self.model.text else None
            choice.prompt_tokens, choice.cancelled = req.prompt_tokens, req.cancelled
            req.forks.append(choice)
        return [req] + req.forks

    @staticmethod
    def _scores(choices, logits, toks):
        """Each choice's log-probability entry of its token `toks[i]` under `logits` [1 or
        len(choices), vocab] (None for a choice that asks none)."""
        rows = np.asarray(logits)
        out = [None] * len(choices)
        for k in {c.logprobs for c in choices if c.logprobs is not None}:
            at = [i for i, c in enumerate(choices) if c.logprobs == k]
            picked = rows[[i if len(rows) > 1 else 0 for i in at]]
            for i, entry in zip(at, scores(picked, [toks[i] for i in at], k)):
                out[i] = entry
        return out

    def _step(self):
        t0 = time.perf_counter()
        tokens = np.array([r.last for r in self.active], np.int64)
        logits = self.pool.decode(tokens)
        self.step_seconds = time.perf_counter() - t0
        act = self.active
        chosen = pick_rows(adjusted(logits, [r.rules for r in act]),
                           [r.temperature for r in act], [r.top_k for r in act],
                           [r.top_p for r in act], [r.rng for r in act])
        entries = self._scores(act, logits, chosen)
        done = [r for r, tok, e in zip(act, chosen, entries) if self._choose(r, tok, e)]
        for req in done:
            self._leave(req)
            self._finish(req)
        if self.metrics is not None:
            self.metrics.step(self.step_seconds, len(tokens))

    def _choose(self, req, tok, entry=None):
        """Take `tok` as the request's next token and send its text (with its log-probability
        `entry` where the request asks for them); True when the request is done (its finish
        reason set). Text that could be the start of a stop string is held back until it is
        not."""
        req.last = tok
        req.ids.append(tok)
        if req.rules is not None:
            req.rules.took(tok)
        held = req.held + (req.decode_text([tok]) if req.decode_text else f"{tok} ")
        reason = None
        if req.stop and len(req.ids) >= req.min_tokens:
            found = [at for at in (held.find(s) for s in req.stop) if at >= 0]
            if found:
                held, reason = held[:min(found)], "stop"
        if reason is None and len(req.ids) >= req.max_tokens:
            reason = "length"
            if req.decode_text:
                held += req.decode_text([], final=True)
        # (before min_tokens all text goes out: a stop string is looked for in later text)
        cut = len(held) if reason is not None or len(req.ids) < req.min_tokens else \
            max(0, len(held) - req.hold)
        req.held = held[cut:]
        event = {"type": "text", "text": held[:cut], "ids": [tok], "choice": req.choice}
        if entry is not None:
            event["logprobs"] = [entry]
        req.emit(event)
        req.finish_reason = reason
        return reason is not None

    def _leave(self, req):
        """Take `req` out of the batch (its state kept on `req` when it saves a session); the
        pool moves the last row's state into req's row, and the list its stream likewise."""
        kept = req.finish_reason != "cancelled" and (req.save is not None or self._caches(req))
        state = self.pool.get(req.row) if kept else None
        if req.save is not None and kept:
            req.state = state
        if self._caches(req) and kept:
            # (the state has fed the prompt and every chosen token but the last: a follow-up
            # prompt, such as a chat's next turn, resumes after the answer)
            self.prefix_cache.put(req.prompt + req.ids[:-1], state)
        moved = self.pool.remove(req.row)
        last = self.active.pop()
        if moved is not None:
            last.row = req.row
            self.active[req.row] = last
        req.row = None

    def _drop_cancelled(self):
        for req in [r for r in self.active if r.cancelled]:
            req.finish_reason = "cancelled"
            self._leave(req)
            self._finish(req, "cancelled")

    def _finish(self, req, reason=None):
        reason = reason or req.finish_reason
        usage = {"prompt_tokens": req.prompt_tokens, "completion_tokens": len(req.ids),
                 "total_tokens": req.prompt_tokens + len(req.ids),
                 "prompt_tokens_details": {"cached_tokens": req.resumed_at}}
        if req.save is not None and reason != "cancelled" and req.state is not None:
            try:
                self.sessions.save(req.save, req.state, pending=[req.last])
            except Exception as err:  # noqa: BLE001 - reported to its client
                req.emit({"type": "error", "error": err})
                return
        req.state = None
        if self.metrics is not None:
            self.metrics.finished(reason, len(req.ids))
        req.emit({"type": "done", "finish_reason": reason, "usage": usage,
                  "choice": req.choice})
