"""Limits below the ASGI app, on uvicorn's HTTP protocol (subclassed: `guarded(base, ...)` is
what `cli/serve.py` gives uvicorn as its `http` class). uvicorn closes a connection only when it
stays idle after an answer (its keep-alive timeout): one that sends half a request, or nothing,
stays open, and httptools reads a request head of any size. Here:

- request time: a connection must send a whole request (head and body) within
  `request_timeout` seconds of opening or of its previous answer; else it gets 408 (when part
  of a request came) and is closed;
- head size: a request head (request line and headers) over `max_head` bytes gets 431 and the
  connection is closed (its bytes are counted as they arrive, before the parser reads them);
- open connections: a connection opened while `max_connections` are open gets 503 (with
  Retry-After) to its request, except `GET /health`, and is closed after it; it has
  `BUSY_GRACE` seconds to send that request;
- stalled readers: an answer the client reads nothing of for `request_timeout` seconds (the
  socket's buffers full) is cut: the connection is aborted, and the app cancels the stream;
- an answer given before its request's body came whole (413, 401): on a connection kept
  open uvicorn reads the rest of the body and drops it (the request time bounds it); one
  that closes (the client asked it, or a 408/431) first stops writing and reads what still
  comes for `LINGER` seconds, up to `LINGER_BYTES` (a close with unread bytes resets the
  connection, and the client would lose its answer);
- uvicorn's own 400 for a malformed request is OpenAI's error JSON too.

Each refusal is reported as `report(kind)`: the HTTP status as a string, or "stalled"."""
from __future__ import annotations

import json
import math

MAX_HEAD = 64 * 1024
BUSY_GRACE = 2.0
LINGER = 2.0                  # seconds a closing connection reads (and drops) what still comes
LINGER_BYTES = 16 * 2 ** 20   # and at most this many bytes
PHRASES = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
           503: "Service Unavailable"}


def error_body(message, type_="invalid_request_error", code=None):
    """OpenAI's error JSON, as bytes."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


def raw_error(status, message, type_="invalid_request_error", code=None, headers=()):
    """A whole HTTP/1.1 error answer that closes the connection, as bytes."""
    body = error_body(message, type_, code)
    head = [f"HTTP/1.1 {status} {PHRASES[status]}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Transport:
    """The connection's transport as uvicorn sees it: close() lingers (`Guarded._close`)."""

    def __init__(self, transport, protocol):
        self._real, self._protocol, self._closing = transport, protocol, False

    def __getattr__(self, name):
        return getattr(self._real, name)

    def close(self):
        if not self._closing:
            self._closing = True
            self._protocol._close()

    def is_closing(self):
        return self._closing or self._real.is_closing()


def busy_app(app, report, max_connections):
    """The ASGI app of a connection opened beyond the cap: its request's body is read (and
    dropped), then 503 and the connection closes; a `GET /health` is answered by `app`
    (the connection still closes after it)."""

    async def busy(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def closing(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []),
                                                 (b"connection", b"close")])
            await send(message)
        if scope.get("path") == "/health" and scope.get("method") in ("GET", "HEAD"):
            return await app(scope, receive, closing)
        while True:   # (answered before its body is read, a client may miss the answer)
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        report("503")
        body = error_body(f"the server has {max_connections} connections open, its limit "
                          "(--max-connections); retry later", "rate_limit_error",
                          "too_many_connections")
        await closing({"type": "http.response.start", "status": 503,
                       "headers": [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode()),
                                   (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
    return busy


def guarded(base, *, request_timeout=30.0, max_connections=None, max_head=MAX_HEAD,
            report=None):
    """A subclass of uvicorn's HTTP protocol class `base` (`HttpToolsProtocol`, or
    `H11Protocol`, whose parser has its own head limit) with the limits above;
    `request_timeout` in seconds (inf: none), `max_connections` (None: no cap), `max_head`
    bytes."""
    if not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout!r}")
    report = report or (lambda kind: None)
    parser_hooks = hasattr(base, "on_message_begin") and hasattr(base, "on_headers_complete")

    class Guarded(base):
        def connection_made(self, transport):
            self._timer = self._stall = self._linger = None
            self._in_head, self._head, self._since, self._lost = False, 0, 0, False
            self._real = transport
            super().connection_made(_Transport(transport, self))
            over = max_connections is not None and len(self.connections) > max_connections
            if over:
                self.app = busy_app(self.app, report, max_connections)
            self._arm(min(request_timeout, BUSY_GRACE) if over else request_timeout)

        def connection_lost(self, exc):
            self._lost = True
            for timer in (self._timer, self._stall, self._linger):
                if timer is not None:
                    timer.cancel()
            self._timer = self._stall = self._linger = None
            super().connection_lost(exc)

        # --- closing ----------------------------------------------------------------------
        def _close(self):
            """Close; when the client may still be sending (a head or body not all in), stop
            writing and drop what comes for LINGER seconds first."""
            cycle = self.cycle
            sending = self._in_head or (cycle is not None and cycle.more_body
                                        and not cycle.disconnected)
            if self._lost or not sending or not self._real.can_write_eof():
                self._real.close()
                return
            self._disarm()
            self._real.write_eof()
            self._real.resume_reading()
            self._linger = self.loop.call_later(LINGER, self._real.close)
            self._since = 0

        # --- request time -----------------------------------------------------------------
        def _arm(self, seconds):
            self._disarm()
            self._since = 0
            if math.isfinite(seconds):
                self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self):
            self._timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and \
                    (not cycle.more_body or cycle.response_started):
                return   # a whole request, being answered (armed again after its answer)
            started = self._in_head if parser_hooks else self._since > 0
            if started or (cycle is not None and not cycle.response_complete):
                report("408")
                self.transport.write(raw_error(
                    408, f"the request did not come whole within {request_timeout:g} s "
                    "(--request-timeout)", code="request_timeout"))
            self.transport.close()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(request_timeout)

        # --- head size --------------------------------------------------------------------
        if parser_hooks:   # (httptools reads a head of any size; h11 has its own limit)
            def on_message_begin(self):
                self._in_head, self._head = True, 0
                super().on_message_begin()

            def on_headers_complete(self):
                self._in_head = False
                super().on_headers_complete()

        def data_received(self, data):
            self._since += len(data)
            if self._linger is not None:   # (closing: dropped)
                if self._since > LINGER_BYTES:
                    self._real.close()
                return
            if parser_hooks and self._head_over(data):
                self._too_large()
                return
            super().data_received(data)
            if self._in_head and not self.transport.is_closing():
                self._head += len(data)
                if self._head > max_head:
                    self._too_large()

        def _head_over(self, data):
            """Whether the head being read, or one that starts in `data`, passes max_head
            with `data`'s bytes up to the head's end: counted before the parser reads them
            (counted after, a head that came whole in one read was already complete)."""
            cycle = self.cycle
            if not self._in_head and cycle is not None and cycle.more_body:
                return False   # (a request's body comes first)
            end = data.find(b"\r\n\r\n")
            if (self._head if self._in_head else 0) + (end + 4 if end >= 0 else len(data)) \
                    <= max_head:
                return False
            self._in_head = end < 0   # (more of it to come: the close lingers)
            return True

        def _too_large(self):
            report("431")
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(raw_error(
                    431, f"the request head is larger than {max_head} bytes",
                    code="request_header_too_large"))
            self.transport.close()

        def send_400_response(self, msg):
            report("400")
            self.transport.write(raw_error(400, f"not a valid HTTP request ({msg})"))
            self.transport.close()

        # --- stalled readers --------------------------------------------------------------
        def pause_writing(self):
            super().pause_writing()
            if self._stall is None and math.isfinite(request_timeout):
                self._stall = self.loop.call_later(request_timeout, self._stalled)

        def resume_writing(self):
            super().resume_writing()
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _stalled(self):
            self._stall = None
            report("stalled")
            self._real.abort()   # (close would wait for the unread bytes to go)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
