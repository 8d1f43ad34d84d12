"""The OpenAI-compatible HTTP API over an `engine.Engine` (FastAPI; uvicorn runs it, see
`cli/serve.py`):

    POST /v1/completions   prompt(s) -> completion choices, whole or streamed (server-sent
                           events)
    POST /v1/chat/completions   messages (rendered by a chat template, `chat`) -> the same
    POST /tokenize, /detokenize; GET /tokenizer_info   vLLM's tokenizer endpoints
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok"}; with the key (or without --api-key) also the model,
                           the server (host:pid) and the stream counts
    GET  /metrics          Prometheus text (`metrics.Metrics`)
    GET  /openapi.json     the API's OpenAPI schema (with --api-key: needs the key)

A completion takes `prompt` (text for models with text: byte-level, or compiled with a
tokenizer; a list of token ids for any model; or a list of such prompts, a choice each),
`max_tokens` (0 with `echo`), `temperature`, `top_p`, `top_k`, `seed`, `stop`, `stream` (with
`stream_options.include_usage`), `n` (choices from one prefill), `logprobs` (0-5) and `echo`
(`choices.Choices`, `logprobs`), and the extension `session`: {"resume": name} continues a saved
stream and saves it back, {"fork": name} continues a copy, {"save": name} keeps the final state.
Responses and streamed chunks are OpenAI's `text_completion` objects (each choice also carries
`token_ids`); every error is OpenAI's {"error": {"message", "type", "param", "code"}}, counted
by the error metric: 400 bad input (also a prompt that is not valid Unicode, JSON nested too
deeply, max_tokens above the server's cap), 401 a missing or wrong key (with --api-key), 404 an
unknown model, session or path, 405 a wrong method, 409 a session another request is writing,
413 a body over the limit (refused from its Content-Length, or as soon as its bytes pass the
limit), 429 busy (with Retry-After), 500 a failure of the server. Limits below the app
(connections, request time, header size, readers that stall) are `guard`'s."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import socket
import threading
import time
from typing import Literal, Optional, Union

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..runtime.text import CHAT
from .chat import ChatTemplate, TemplateError, completion_fields
from .choices import ChatFormat, Choices, TextFormat
from .engine import Engine, QueueFull, Request
from .logit_rules import check as check_rules
from .logprobs import MAX_TOP
from .metrics import Metrics
from .prefix_cache import PrefixCache
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
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]] = ""
    max_tokens: Optional[StrictInt] = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    session: Optional[SessionSpec] = None
    n: StrictInt = 1
    best_of: Literal[1] = 1
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = None
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    repetition_penalty: Number = 1.0
    logit_bias: Optional[dict[StrictStr, Number]] = None
    min_tokens: StrictInt = 0
    suffix: Literal[None] = None
    user: Optional[StrictStr] = None


class TokenizeRequest(BaseModel):
    """The body of POST /tokenize (vLLM's fields)."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """The body of POST /detokenize."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


class APIError(Exception):
    """An error answered as OpenAI answers it: `status`, message, type, param, code."""

    def __init__(self, status, message, *, type_="invalid_request_error", param=None,
                 code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.headers = headers or {}

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self):
        # (ASCII JSON: a lone surrogate quoted in a message cannot fail the answer)
        return Response(json.dumps(self.body()), status_code=self.status,
                        headers=self.headers, media_type="application/json")


class Gone(Exception):
    """The client went away before its request was read whole (nothing to answer)."""


class Events(asyncio.Queue):
    """One request's events on the event loop. When `limit` events wait while their reader is
    held up writing (`writing`: a streaming client that reads slower than the engine writes,
    so that the server's send waits for it), the reader is cut: `on_cut()` runs once, a
    {"type": "cut"} event ends what the reader gets, and later events are dropped."""

    def __init__(self, limit=None, on_cut=None):
        super().__init__()
        self.limit, self.on_cut, self.cut, self.writing = limit, on_cut, False, False

    def offer(self, event):
        if self.cut:
            return
        if self.limit is not None and self.writing and self.qsize() >= self.limit:
            self.cut = True
            self.put_nowait({"type": "cut"})
            if self.on_cut is not None:
                self.on_cut()
            return
        self.put_nowait(event)


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
            queue.offer(event)


def _merged(deltas):
    """Text deltas [(index, text, ids, entries, None)] with those of each choice joined, in
    the order of their first."""
    out = {}
    for index, text, ids, entries, _ in deltas:
        if index in out:
            _, t, i, e, _ = out[index]
            out[index] = (index, t + text, i + list(ids), e + list(entries), None)
        else:
            out[index] = (index, text, list(ids), list(entries), None)
    return list(out.values())


def _json_object(body):
    """The JSON object of a request body; APIError 400 for one that is not JSON, nests too
    deeply or is not an object."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, "the request body nests JSON too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _validated(model_type, data):
    """`data` as the pydantic `model_type`; APIError 400 naming the field otherwise."""
    try:
        return model_type.model_validate(data)
    except RecursionError:
        raise APIError(400, "the request body nests JSON too deeply") from None
    except ValidationError as err:
        raise _validation_error(err) from None


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


DEFAULT_MAX_TOKENS = 4096   # HLA models have no context length: a cap on one answer's length
DEFAULT_MAX_UNREAD = 1024
DEFAULT_PREFIX_CACHE_MB = 256


def default_max_body(max_prompt):
    """The default body limit: 16 bytes for each prompt token (a token id and its comma, or a
    token's text escaped in JSON) and 64 KiB for the other fields."""
    return 16 * max_prompt + 65536


def check_api_key(key, what="api_key"):
    """`key` when a client can send it ('Authorization: Bearer KEY': printable ASCII, no space
    at either end, not empty); ValueError naming `what` otherwise (a key no request could
    match would answer every request 401)."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what} is empty: no request could send it (give a key, or none)")
    if key != key.strip():
        raise ValueError(f"{what} starts or ends with white space, which HTTP drops from a "
                         "header: no request could match it")
    bad = next((c for c in key if not " " <= c <= "~"), None)
    if bad is not None:
        raise ValueError(f"{what} holds {bad!r}: an HTTP header carries printable ASCII "
                         "only, so no request could match it")
    return key


def _limit(value, what, *, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def create_app(model, *, model_name=None, max_streams=64, max_queue=None, sessions=None,
               api_key=None, max_prompt=8192, prefill_piece=256, shutdown_timeout=10.0,
               max_tokens=DEFAULT_MAX_TOKENS, max_body=None, max_unread=DEFAULT_MAX_UNREAD,
               chat_template=None, prefix_cache_mb=DEFAULT_PREFIX_CACHE_MB):
    """The FastAPI application serving `model` (a CPU `runtime.CompiledModel`); its engine
    starts and stops with the application (lifespan).

    Limits: `max_prompt` prompt tokens, `max_tokens` the largest max_tokens a request may ask
    (400 above it), `max_body` request body bytes (413 above it; default
    `default_max_body(max_prompt)`), `max_unread` events a streaming client may leave unread
    before its stream is cut (None: no bound). `chat_template`: the Jinja2 source that renders
    /v1/chat/completions' messages (None: the module's, from the tokenizer_config.json it was
    compiled with, else `chat.DEFAULT`). `prefix_cache_mb`: megabytes of
    prefix states kept (`prefix_cache`; 0: none)."""
    api_key = check_api_key(api_key)
    kept = (getattr(model, "meta", None) or {}).get(CHAT) or {}
    try:
        template = ChatTemplate(chat_template or kept.get("template"),
                                bos_token=kept.get("bos_token") or "",
                                eos_token=kept.get("eos_token") or "")
    except TemplateError as err:
        raise ValueError(f"the chat template kept in {model.path} ({err}); give one with "
                         "--chat-template FILE") from None
    max_tokens = _limit(max_tokens, "max_tokens")
    max_body = _limit(default_max_body(max_prompt) if max_body is None else max_body,
                      "max_body")
    max_unread = _limit(max_unread, "max_unread", allow_none=True)
    if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float)) \
            or not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout must be a number of seconds >= 0 (or inf), got "
                         f"{shutdown_timeout!r}")
    name = model_name or os.path.splitext(os.path.basename(model.path))[0]
    if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, int) or \
            prefix_cache_mb < 0:
        raise ValueError(f"prefix_cache_mb must be an int >= 0, got {prefix_cache_mb!r}")
    engine = Engine(model, max_streams=max_streams, max_queue=max_queue,
                    prefill_piece=prefill_piece, sessions=sessions,
                    prefix_cache=PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb else None)
    metrics = Metrics(engine)
    created = int(time.time())
    held, held_lock = set(), threading.Lock()   # sessions a running request writes

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.relay = Relay(asyncio.get_running_loop())
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop,
                                                             shutdown_timeout)

    # (no /docs: its page loads scripts from elsewhere; /openapi.json is served below, behind
    # the key)
    app = FastAPI(title="hla-tvm serve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.metrics, app.state.relay = engine, metrics, None
    server = f"{socket.gethostname()}:{os.getpid()}"   # (which replica answered)

    def answer(err):
        metrics.errors.labels(str(err.status)).inc()
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request, err):
        return answer(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err):
        # (FastAPI's own answers: 404 no such path, 405 a wrong method)
        kind = {401: "authentication_error", 404: "not_found_error"}.get(err.status_code,
                                                                          "invalid_request_error")
        message = {404: f"no such path: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            err.status_code, str(err.detail))
        return answer(APIError(err.status_code, message, type_=kind,
                               headers=dict(err.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(request, err):
        return answer(_validation_error(err))

    @app.exception_handler(Gone)
    async def _gone(request, err):
        return Response(status_code=400)   # (nobody reads it; the guard counted its 408)

    @app.exception_handler(Exception)
    async def _server_error(request, err):
        return answer(APIError(500, f"the server failed: {type(err).__name__}",
                               type_="server_error"))

    def has_key(request):
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode("latin-1", "replace"),
                                   f"Bearer {api_key}".encode())

    def authorized(request: HTTPRequest):
        """401 unless the request carries the key (with --api-key)."""
        if not has_key(request):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer "
                           "KEY')", type_="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health(request: HTTPRequest):
        if not has_key(request):
            return {"status": "ok"}   # (without the key: no names, no counts)
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

    async def small_body(http, model_type):
        """The request body as `model_type`, refused with 400 as `parse` refuses."""
        return _validated(model_type, _json_object(await read_body(http)))

    def has_text(what):
        if model.text is None:
            raise APIError(400, f"{what}: this model has no tokenizer (it takes and gives "
                           "token ids: it is not byte-level and was compiled without one)")

    # vLLM's tokenizer endpoints (lm-evaluation-harness's `tokenizer_backend=remote` reads them)
    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(http: HTTPRequest):
        req = await small_body(http, TokenizeRequest)
        has_text("/tokenize")
        ids = model.text.encode(req.prompt)
        return {"count": len(ids), "max_model_len": max_prompt, "tokens": ids,
                "token_strs": [model.text.token_text(t) for t in ids]
                if req.return_token_strs else None}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(http: HTTPRequest):
        req = await small_body(http, DetokenizeRequest)
        has_text("/detokenize")
        bad = [t for t in req.tokens if not 0 <= t < (model.vocab_size or 2 ** 63)]
        if bad:
            raise APIError(400, f"tokens must lie in [0, {model.vocab_size}), got {bad[0]}",
                           param="tokens")
        return {"prompt": ids_text(req.tokens)}

    @app.get("/tokenizer_info", dependencies=[Depends(authorized)])
    async def tokenizer_info():
        has_text("/tokenizer_info")
        return {"tokenizer_class": "ByteLevel" if model.text.kind == "bytes" else
                "PreTrainedTokenizerFast", "vocab_size": model.vocab_size,
                "model_max_length": max_prompt, "bos_token": kept.get("bos_token"),
                "eos_token": kept.get("eos_token"), "pad_token": None,
                "chat_template": template.source}

    @app.get("/openapi.json", dependencies=[Depends(authorized)], include_in_schema=False)
    async def openapi():
        return JSONResponse(app.openapi())

    async def read_body(http):
        """The request's body, refused with 413 as soon as it is known to pass `max_body`
        bytes: from its Content-Length before any of it is read, else while it streams in
        (chunked)."""
        too_big = APIError(413, f"the request body is larger than this server takes "
                           f"({max_body} bytes; --max-body)", code="request_too_large")
        length = http.headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                raise APIError(400, f"Content-Length must be a number of bytes, got "
                               f"{length!r}")
            if int(length) > max_body:
                raise too_big
        parts, size = [], 0
        try:
            async for part in http.stream():
                size += len(part)
                if size > max_body:
                    raise too_big
                parts.append(part)
        except ClientDisconnect:
            raise Gone() from None
        return b"".join(parts)

    def parse(body, chat=False):
        data = _json_object(body)
        if chat:
            try:
                data = completion_fields(data, template)
            except RecursionError:
                raise APIError(400, "the request body nests JSON too deeply") from None
            except ValidationError as err:
                raise _validation_error(err) from None
            except ValueError as err:   # (a TemplateError too)
                param = "messages" if isinstance(err, TemplateError) else \
                    str(err).split(":")[0]
                raise APIError(400, str(err), param=param) from None
        req = _validated(CompletionRequest, data)
        single = isinstance(req.prompt, str) or all(isinstance(t, int) for t in req.prompt)
        prompts = [req.prompt] if single else req.prompt
        for field, texts in (("prompt", [p for p in prompts if isinstance(p, str)]),
                             ("stop", [req.stop] if isinstance(req.stop, str)
                              else list(req.stop or []))):
            for text in texts:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as err:
                    raise APIError(400, f"{field} is not valid Unicode: it holds a lone "
                                   f"surrogate ({err.object[err.start]!r} at character "
                                   f"{err.start})", param=field) from None
        if req.model is not None and req.model != name:
            raise APIError(404, f"model {req.model!r} is not served here (this server serves "
                           f"{name!r})", param="model", code="model_not_found")
        if req.max_tokens is None:
            req.max_tokens = 16   # (OpenAI's default)
        if req.max_tokens > max_tokens:
            raise APIError(400, f"max_tokens is {req.max_tokens}; this server gives at most "
                           f"{max_tokens} tokens an answer", param="max_tokens")
        if req.max_tokens < 0 or (req.max_tokens == 0 and not req.echo):
            raise APIError(400, f"max_tokens must be a positive int (0 only with echo), got "
                           f"{req.max_tokens}", param="max_tokens")
        if not 1 <= req.n <= max_streams:
            raise APIError(400, f"n must be an int in [1, {max_streams}] (this server's "
                           f"--max-streams), got {req.n}", param="n")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP:
            raise APIError(400, f"logprobs must be an int in [0, {MAX_TOP}], got "
                           f"{req.logprobs}", param="logprobs")
        if not prompts:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        if len(prompts) > engine.max_streams + engine.max_queue:
            raise APIError(400, f"prompt holds {len(prompts)} prompts; this server takes at "
                           f"most {engine.max_streams + engine.max_queue} in one request",
                           param="prompt")
        spec = req.session or SessionSpec()
        if (spec.resume or spec.fork or spec.save) and sessions is None:
            raise APIError(400, "this server keeps no sessions (start it with --sessions DIR)",
                           param="session")
        if (spec.resume or spec.fork or spec.save) and (len(prompts) > 1 or req.n > 1):
            raise APIError(400, "a session continues one stream: give one prompt and n = 1",
                           param="session")
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
        bias = None
        if req.logit_bias:
            try:
                bias = {int(tok): value for tok, value in req.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids (integers as strings)",
                               param="logit_bias") from None
        try:
            check_rules(req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
                        bias, model.vocab_size)
        except ValueError as err:
            raise APIError(400, str(err), param=str(err).split(" ")[0]) from None
        rules = dict(presence_penalty=req.presence_penalty,
                     frequency_penalty=req.frequency_penalty,
                     repetition_penalty=req.repetition_penalty, logit_bias=bias,
                     min_tokens=req.min_tokens)
        out = []
        for prompt in prompts:
            ids = prompt_ids(prompt)
            if not ids and not (spec.resume or spec.fork):
                raise APIError(400, "prompt must not be empty", param="prompt")
            try:
                out.append(Request(ids, req.max_tokens, temperature=req.temperature,
                                   top_k=req.top_k, top_p=req.top_p, seed=seed, stop=stop,
                                   resume=spec.resume, fork=spec.fork, save=spec.save,
                                   logprobs=req.logprobs, echo=req.echo, n=req.n, **rules))
            except ValueError as err:
                param = str(err).split(" ")[0]
                raise APIError(400, str(err), param=param) from None
            out[-1].echo_text = (prompt if isinstance(prompt, str) else ids_text(ids)) \
                if req.echo else None
        return req, out

    def prompt_ids(prompt):
        """The token ids of one prompt (text, or ids checked against the vocabulary)."""
        if isinstance(prompt, str):
            if model.text is None:
                raise APIError(400, "this model takes prompts as lists of token ids (it is not "
                               "byte-level and was compiled without a tokenizer)",
                               param="prompt")
            ids = model.text.encode(prompt)
        else:
            ids = prompt
            bad = [t for t in ids if not 0 <= t < (model.vocab_size or 2 ** 63)]
            if bad:
                raise APIError(400, f"prompt token ids must lie in [0, {model.vocab_size}), "
                               f"got {bad[0]}", param="prompt")
        if len(ids) > max_prompt:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most "
                           f"{max_prompt}", param="prompt", code="context_length_exceeded")
        return ids

    def ids_text(ids):
        """The text of token ids as the stream writes it (`engine.Engine`)."""
        if model.text is None:
            return "".join(f"{t} " for t in ids)
        decode = model.text.decoder()
        return decode(ids) + decode([], final=True)

    def hold(req):
        """Hold the session `req` writes (its save name: a resume saves back) until it ends;
        409 when another running request writes the session it resumes or saves. A fork only
        reads: it is never refused."""
        if req.save is None:
            return None
        with held_lock:
            for key, value in (("resume", req.resume), ("save", req.save)):
                if value is not None and value in held:
                    raise APIError(409, f"session {value!r} is in use: another request that "
                                   "saves it runs now (retry when it ends, or fork it)",
                                   type_="invalid_request_error", param=f"session.{key}",
                                   code="session_busy")
            held.add(req.save)
        return req.save

    def release(name):
        if name is not None:
            with held_lock:
                held.discard(name)

    def run_error(err):
        if isinstance(err, UnknownSession):
            return APIError(404, str(err), param="session", code="session_not_found")
        if isinstance(err, ValueError):
            return APIError(400, str(err), param="session" if "session" in str(err) else None)
        return APIError(500, f"the engine failed: {err}", type_="server_error")

    cut_error = APIError(500, f"the client read too slowly: {max_unread} tokens were waiting "
                         "unread, so the stream was cut (--max-unread)", type_="server_error",
                         code="slow_reader")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(http: HTTPRequest):
        body, reqs = parse(await read_body(http))
        return await answer_choices(http, body, reqs, TextFormat)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(http: HTTPRequest):
        body, reqs = parse(await read_body(http), chat=True)
        return await answer_choices(http, body, reqs, ChatFormat)

    async def answer_choices(http, body, reqs, form):
        """Run the engine requests `reqs` of the request `body` and answer their choices in
        the format `form` (`TextFormat`, `ChatFormat`), whole or streamed."""
        if getattr(http.app.state, "relay", None) is None:   # (a host that runs no lifespan)
            http.app.state.relay = Relay(asyncio.get_running_loop())
            engine.start()
        relay = http.app.state.relay

        def cancel():
            for req in reqs:
                engine.cancel(req)

        def on_cut():
            metrics.cut.inc()
            cancel()
        events = Events(max_unread, on_cut)
        holding = hold(reqs[0])

        def listener(prompt):
            def on_event(ev):
                if ev["type"] not in ("text", "echo"):
                    release(holding)   # (the session is saved: the engine is done with it)
                ev["prompt"] = prompt
                relay.send(events, ev)
            return on_event
        for i, req in enumerate(reqs):
            req.on_event = listener(i)
        try:
            engine.submit(*reqs)
        except QueueFull as err:
            release(holding)
            raise APIError(429, f"the server is busy: {err}; retry later",
                           type_="rate_limit_error", code="busy",
                           headers={"Retry-After": "1"}) from None
        gather = Choices(body.n, [r.echo_text for r in reqs], logprobs=body.logprobs,
                         token_text=model.text.token_text if model.text else
                         (lambda t: f"{t} "))
        fmt = form(gather, name)
        # one prompt, one choice, no log-probabilities: each streamed text chunk is a template
        # around its text and ids (json.dumps of the whole chunk per token was a tenth of a
        # stream's serving time)
        plain = form is TextFormat and len(reqs) == 1 and body.n == 1 and \
            body.logprobs is None and not body.echo
        chunk = fmt.chunk

        if plain:
            head, tail = json.dumps(chunk([(0, "\0", [0], [], None)])).split('"\\u0000"')
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
            cancel()

        async def next_event():
            """The engine's next event, the client watched meanwhile (`watch`)."""
            watcher = asyncio.ensure_future(watch())
            try:
                return await events.get()
            finally:
                watcher.cancel()

        def failure(ev):
            """The APIError of an "error" or "cut" event (the other requests cancelled), or
            None."""
            if ev["type"] not in ("error", "cut"):
                return None
            cancel()
            return run_error(ev["error"]) if ev["type"] == "error" else cut_error

        first = await next_event()
        err = failure(first)
        if err is not None:
            raise err
        if not body.stream:
            ev = first
            watcher = asyncio.ensure_future(watch())
            try:
                while True:
                    err = failure(ev)
                    if err is not None:
                        raise err
                    gather.add(ev["prompt"], ev)
                    if gather.done():
                        break
                    ev = await events.get()
            finally:
                watcher.cancel()
            return JSONResponse(fmt.whole(), headers={"X-HLA-TVM-Server": server})

        usage = bool(body.stream_options and body.stream_options.include_usage)

        async def stream():
            ev = first
            try:
                while True:
                    # the events waiting now go out as one chunk (a client that reads slower
                    # than the engine writes gets fewer, larger chunks)
                    deltas = []
                    while True:
                        err = failure(ev)
                        if err is not None:
                            break
                        deltas += gather.add(ev["prompt"], ev)
                        if gather.done() or events.empty():
                            break
                        ev = events.get_nowait()
                    # (from here until the next event is awaited, the loop runs on only when
                    # a send blocks: events that wait meanwhile wait for a slow reader)
                    events.writing = True
                    texts = [d for d in deltas if d[4] is None]
                    if plain and texts:
                        yield text_event("".join(d[1] for d in texts),
                                         [t for d in texts for t in d[2]])
                    elif texts:
                        yield f"data: {json.dumps(chunk(_merged(texts)))}\n\n"
                    ends = [d for d in deltas if d[4] is not None]
                    if ends:
                        yield f"data: {json.dumps(chunk(ends))}\n\n"
                    if err is not None:
                        yield "data: " + json.dumps(err.body()) + "\n\n"
                        return
                    if gather.done():
                        if usage:
                            last = chunk([])
                            last["usage"] = gather.usage
                            yield f"data: {json.dumps(last)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    events.writing = False
                    ev = await events.get()
            finally:
                cancel()   # (a no-op once it is done; frees the slots when not)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-HLA-TVM-Server": server})

    return app
