"""The OpenAI-compatible HTTP API over an `engine.Engine` (FastAPI; uvicorn runs it, see
`cli/serve.py`):

    POST /v1/completions   prompt -> completion, whole or streamed (server-sent events)
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok", ...} (no key needed)
    GET  /metrics          Prometheus text (`metrics.Metrics`)

A completion takes `prompt` (text for models with text: byte-level, or compiled with a
tokenizer; a list of token ids for any model),
`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, `stream` (with
`stream_options.include_usage`), and the extension `session`: {"resume": name} continues a saved
stream and saves it back, {"fork": name} continues a copy, {"save": name} keeps the final state.
Responses and streamed chunks are OpenAI's `text_completion` objects (each choice also carries
`token_ids`); errors are OpenAI's {"error": {"message", "type", "param", "code"}} with a 4xx
status: 400 bad input, 401 a missing or wrong key (with --api-key), 404 an unknown model or
session, 429 busy (with Retry-After)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import socket
import threading
import time
import uuid
from typing import Literal, Optional, Union

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from .engine import Engine, QueueFull, Request
from .metrics import Metrics
from .sessions import UnknownSession, check_name

Number = Union[StrictInt, StrictFloat]


class SessionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resume: Optional[StrictStr] = None
    fork: Optional[StrictStr] = None
    save: Optional[StrictStr] = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions (OpenAI's fields this server implements; the others
    OpenAI defines are accepted at their neutral values only)."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[StrictStr] = None
    prompt: Union[StrictStr, list[StrictInt]] = ""
    max_tokens: StrictInt = 16
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    session: Optional[SessionSpec] = None
    n: Literal[1] = 1
    best_of: Literal[1] = 1
    echo: Literal[False] = False
    logprobs: Literal[None] = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    suffix: Literal[None] = None
    user: Optional[StrictStr] = None
    logit_bias: Optional[dict] = Field(default=None, max_length=0)


class APIError(Exception):
    """An error answered as OpenAI answers it: `status`, message, type, param, code."""

    def __init__(self, status, message, *, type_="invalid_request_error", param=None,
                 code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.headers = headers or {}

    def response(self):
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=self.headers)


class Relay:
    """Events from the engine's thread to the requests' asyncio queues on `loop`, with one
    wake-up of the loop per batch of events (not one per token and stream)."""

    def __init__(self, loop):
        self.loop, self.pending, self.scheduled = loop, [], False
        self.lock = threading.Lock()

    def send(self, queue, event):
        with self.lock:
            self.pending.append((queue, event))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self):
        with self.lock:
            batch, self.pending, self.scheduled = self.pending, [], False
        for queue, event in batch:
            queue.put_nowait(event)


def _validation_error(err):
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()) if not isinstance(x, int)) or None
    if first.get("type") == "extra_forbidden":
        msg = f"unknown field {loc!r}"
    else:
        msg = f"{loc}: {first.get('msg')}" if loc else first.get("msg")
        if first.get("type", "").startswith("literal_"):
            msg = f"{loc}: this server supports only {first.get('ctx', {}).get('expected')}"
    return APIError(400, msg, param=loc)


def create_app(model, *, model_name=None, max_streams=64, max_queue=None, sessions=None,
               api_key=None, max_prompt=8192, prefill_piece=256, shutdown_timeout=10.0):
    """The FastAPI application serving `model` (a CPU `runtime.CompiledModel`); its engine
    starts and stops with the application (lifespan)."""
    name = model_name or os.path.splitext(os.path.basename(model.path))[0]
    engine = Engine(model, max_streams=max_streams, max_queue=max_queue,
                    prefill_piece=prefill_piece, sessions=sessions)
    metrics = Metrics(engine)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.relay = Relay(asyncio.get_running_loop())
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop,
                                                             shutdown_timeout)

    app = FastAPI(title="hla-tvm serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics, app.state.relay = engine, metrics, None
    server = f"{socket.gethostname()}:{os.getpid()}"   # (which replica answered)

    @app.exception_handler(APIError)
    async def _api_error(request, err):
        metrics.errors.labels(str(err.status)).inc()
        return err.response()

    def authorized(request: HTTPRequest):
        """401 unless the request carries the key (with --api-key)."""
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer "
                               "KEY')", type_="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        active, prefilling, waiting = engine.counts()
        return {"status": "ok", "model": name, "server": server, "active_streams": active,
                "prefilling": prefilling, "queued": waiting}

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics_page():
        body, kind = metrics.text()
        return Response(body, media_type=kind)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "hla_tvm"}]}

    def parse(body):
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = CompletionRequest.model_validate(data)
        except ValidationError as err:
            raise _validation_error(err) from None
        if req.model is not None and req.model != name:
            raise APIError(404, f"model {req.model!r} is not served here (this server serves "
                           f"{name!r})", param="model", code="model_not_found")
        if isinstance(req.prompt, str):
            if model.text is None:
                raise APIError(400, "this model takes prompts as lists of token ids (it is not "
                               "byte-level and was compiled without a tokenizer)",
                               param="prompt")
            ids = model.text.encode(req.prompt)
        else:
            ids = req.prompt
            bad = [t for t in ids if not 0 <= t < (model.vocab_size or 2 ** 63)]
            if bad:
                raise APIError(400, f"prompt token ids must lie in [0, {model.vocab_size}), "
                               f"got {bad[0]}", param="prompt")
        if len(ids) > max_prompt:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                           f"{max_prompt}", param="prompt", code="context_length_exceeded")
        spec = req.session or SessionSpec()
        if (spec.resume or spec.fork or spec.save) and sessions is None:
            raise APIError(400, "this server keeps no sessions (start it with --sessions DIR)",
                           param="session")
        if not ids and not (spec.resume or spec.fork):
            raise APIError(400, "prompt must not be empty", param="prompt")
        for key in ("resume", "fork", "save"):
            value = getattr(spec, key)
            if value is not None:
                try:
                    check_name(value, f"session.{key}")
                except ValueError as err:
                    raise APIError(400, str(err), param=f"session.{key}") from None
        if spec.resume and spec.fork:
            raise APIError(400, "give one of session.resume and session.fork",
                           param="session")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4:
            raise APIError(400, "stop takes at most 4 strings", param="stop")
        seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(4), "little")
        try:
            return req, Request(ids, req.max_tokens, temperature=req.temperature,
                                top_k=req.top_k, top_p=req.top_p, seed=seed, stop=stop,
                                resume=spec.resume, fork=spec.fork, save=spec.save)
        except ValueError as err:
            param = str(err).split(" ")[0]
            raise APIError(400, str(err), param=param) from None

    def run_error(err):
        if isinstance(err, UnknownSession):
            return APIError(404, str(err), param="session", code="session_not_found")
        if isinstance(err, ValueError):
            return APIError(400, str(err), param="session" if "session" in str(err) else None)
        return APIError(500, f"the engine failed: {err}", type_="server_error")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(http: HTTPRequest):
        body, req = parse(await http.body())
        if getattr(http.app.state, "relay", None) is None:   # (a host that runs no lifespan)
            http.app.state.relay = Relay(asyncio.get_running_loop())
            engine.start()
        events, relay = asyncio.Queue(), http.app.state.relay
        req.on_event = lambda ev: relay.send(events, ev)
        try:
            engine.submit(req)
        except QueueFull as err:
            raise APIError(429, f"the server is busy: {err}; retry later",
                           type_="rate_limit_error", code="busy",
                           headers={"Retry-After": "1"}) from None
        cid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, reason=None, ids=()):
            return {"id": cid, "object": "text_completion", "created": now, "model": name,
                    "choices": [{"text": text, "index": 0, "logprobs": None,
                                 "finish_reason": reason, "token_ids": list(ids)}]}

        # a streamed text chunk is this template around its text and ids (json.dumps of the
        # whole chunk per token was a tenth of a stream's serving time)
        head, tail = json.dumps(chunk("\0", None, [0])).split('"\\u0000"')
        head = "data: " + head
        middle, tail = tail.split("[0]")
        tail += "\n\n"

        def text_event(text, ids):
            return f"{head}{json.dumps(text)}{middle}[{', '.join(map(str, ids))}]{tail}"

        async def watch():
            """Cancel the request when its client goes away (before a stream starts, and
            for a whole answer; a stream's response is cancelled by the server itself)."""
            while not await http.is_disconnected():
                await asyncio.sleep(0.25)
            engine.cancel(req)

        async def next_event():
            """The engine's next event, the client watched meanwhile (`watch`)."""
            watcher = asyncio.ensure_future(watch())
            try:
                return await events.get()
            finally:
                watcher.cancel()

        first = await next_event()
        if first["type"] == "error":
            raise run_error(first["error"])
        if not body.stream:
            parts, ids, ev = [], [], first
            watcher = asyncio.ensure_future(watch())
            try:
                while ev["type"] == "text":
                    parts.append(ev["text"])
                    ids += ev["ids"]
                    ev = await events.get()
            finally:
                watcher.cancel()
            text = "".join(parts)
            if ev["type"] == "error":
                raise run_error(ev["error"])
            out = chunk(text, ev["finish_reason"], ids)
            out["usage"] = ev["usage"]
            return JSONResponse(out, headers={"X-HLA-TVM-Server": server})

        usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            ev = first
            try:
                while True:
                    # the text events waiting now go out as one chunk (a client that reads
                    # slower than the engine writes gets fewer, larger chunks)
                    text, ids = "", []
                    while ev["type"] == "text":
                        text, ids = text + ev["text"], ids + ev["ids"]
                        if events.empty():
                            break
                        ev = events.get_nowait()
                    if ids:
                        yield text_event(text, ids)
                    if ev["type"] == "done":
                        yield f"data: {json.dumps(chunk('', ev['finish_reason']))}\n\n"
                        if usage:
                            last = chunk("")
                            last["choices"], last["usage"] = [], ev["usage"]
                            yield f"data: {json.dumps(last)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    if ev["type"] == "error":
                        err = run_error(ev["error"])
                        yield "data: " + json.dumps({"error": {
                            "message": err.message, "type": err.type, "param": err.param,
                            "code": err.code}}) + "\n\n"
                        return
                    ev = await events.get()
            finally:
                engine.cancel(req)   # (a no-op once it is done; frees the slot when not)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-HLA-TVM-Server": server})

    return app
