"""`hla-tvm serve`: an OpenAI-compatible HTTP server (uvicorn) over a compiled module, with
continuous batching and sessions (`hla_tvm.serve`)."""
from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading

from .args import positive, positive_float

FD_RESERVE = 128   # file descriptors kept for everything but client connections

DESCRIPTION = (
    "Serve a compiled module over HTTP with OpenAI's completions API: POST /v1/completions "
    "(streamed with \"stream\": true), GET /v1/models, /health and /metrics (Prometheus). All "
    "streams advance together, one token each per decode step, and new prompts are prefilled "
    "in pieces between steps. With --sessions DIR a request may save its stream's state "
    "(\"session\": {\"save\": NAME}) and later continue it without re-reading the text "
    "({\"resume\": NAME}) or branch it ({\"fork\": NAME}). Byte-level models and models "
    "compiled with --tokenizer take text prompts, others lists of token ids. Stop with Ctrl-C "
    "or SIGTERM: running streams get --shutdown-timeout seconds to finish. Limits against "
    "hostile or unlucky clients: --max-connections, --request-timeout, --max-body, "
    "--max-tokens, --max-prompt, --max-unread (docs/serving.md, Limits). Needs the serve "
    "extra: pip install 'hla_tvm[serve]'.")


def seconds(text):
    """argparse type: a number of seconds >= 0, or inf (not nan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 or inf, got "
                                         f"{text!r}") from None
    if not value >= 0:   # (nan and negative numbers)
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 or inf, got "
                                         f"{text!r}")
    return value


def add_arguments(p):
    """The command's options."""
    p.add_argument("module", help="a library written by `hla-tvm compile` (for a CPU)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; mind --api-key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--max-streams", type=positive, default=None,
                   help="streams advanced together (state slots); more requests wait "
                        f"(default: {DEFAULT_STREAMS}, or the module's max batch where it was "
                        "compiled with a smaller --max-batch)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait for a slot before the server answers 429 "
                        "(default: --max-streams)")
    p.add_argument("--sessions", default=None, metavar="DIR",
                   help="folder of saved sessions: one you own and can write (created if "
                        "missing; replicas may share it); without it requests cannot save or "
                        "resume sessions")
    p.add_argument("--max-sessions", type=positive, default=1000,
                   help="sessions kept; the least recently used go first")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but a bare "
                        "/health (default: $HLA_TVM_API_KEY; none: no key); printable ASCII, "
                        "no space at either end")
    p.add_argument("--threads", type=positive, default=None,
                   help="CPU threads for the kernels (default: chosen per kind of call)")
    p.add_argument("--max-prompt", type=positive, default=8192,
                   help="longest prompt in tokens (400 above it)")
    p.add_argument("--max-tokens", type=positive, default=4096,
                   help="largest max_tokens a request may ask (400 above it; default 4096: "
                        "HLA models have no context length)")
    p.add_argument("--max-body", type=positive, default=None, metavar="BYTES",
                   help="largest request body (413 above it, refused before it is read "
                        "whole; default 16 bytes per --max-prompt token + 64 KiB)")
    p.add_argument("--max-unread", type=positive, default=1024, metavar="TOKENS",
                   help="tokens a streaming client may leave unread before its stream is cut")
    p.add_argument("--max-connections", type=positive, default=None,
                   help="open connections; one more gets 503 (GET /health still answers) "
                        "(default 1024, fewer where the file descriptor limit is lower)")
    p.add_argument("--request-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                   help="a connection that sends no whole request within this time (from "
                        "opening, or from its previous answer) gets 408 and is closed; a "
                        "client that reads nothing of an answer for this long is cut")
    p.add_argument("--prefill-piece", type=positive, default=256,
                   help="prompt tokens prefilled between two decode steps (bounds how long a "
                        "new prompt holds up the running streams)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja2 chat template (a Hugging Face tokenizer_config.json's "
                        "chat_template, as a file) rendering /v1/chat/completions' messages "
                        "(default: the module's own, kept from the tokenizer_config.json "
                        "beside its tokenizer; else each message as 'role: content' on a "
                        "line, then 'assistant:')")
    p.add_argument("--prefix-cache-mb", type=int, default=256, metavar="MB",
                   help="megabytes of prompt-prefix states kept in memory (least recently used "
                        "go first): a prompt that starts with a prefix served before resumes "
                        "from its state and prefills only the rest (0: no cache)")
    p.add_argument("--replicas", type=positive, default=1,
                   help="serve from N replicas behind Ray Serve's HTTP proxy on a local Ray "
                        "instance, sharing --sessions (needs pip install 'hla_tvm[ray]'); 1: "
                        "one server process")
    p.add_argument("--name", default=None,
                   help="the model's name in the API (default: the module's file name)")
    p.add_argument("--shutdown-timeout", type=seconds, default=10.0,
                   help="seconds running streams get to finish on SIGTERM or Ctrl-C (inf: "
                        "until they end)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")


def read_chat_template(path):
    """The text of the chat template file at `path` (None for None), checked to compile; one
    line naming --chat-template otherwise."""
    if path is None:
        return None
    # the server (the serve extra: FastAPI, uvicorn), Ray (the ray extra) and the runtime are
    # imported once the arguments are parsed: `hla-tvm serve --help` (and `hla-tvm --help`) import
    # this module
    from ..serve.chat import ChatTemplate, TemplateError

    try:
        with open(path, encoding="utf-8") as f:
            source = f.read(1 << 20 + 1)
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template {path}: cannot read it as UTF-8 text "
                         f"({getattr(err, 'strerror', None) or err})") from None
    if len(source) > 1 << 20:
        raise ValueError(f"--chat-template {path}: larger than 1 MiB: not a chat template")
    try:
        ChatTemplate(source)
    except TemplateError as err:
        raise ValueError(f"--chat-template {path}: {err}") from None
    return source


def main(args):
    try:
        import uvicorn

        from ..serve.app import check_api_key, create_app
        from ..serve.guard import guarded
    except ImportError as err:
        raise ValueError(f"hla-tvm serve needs the serve extra ({err.name} is missing): "
                         "pip install 'hla_tvm[serve]'") from None
    from ..runtime import load
    from ..serve.sessions import SessionStore

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0 (0: no cache), got "
                         f"{args.prefix_cache_mb}")
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.api_key is not None:
        api_key = check_api_key(args.api_key, "--api-key")
    else:
        api_key = check_api_key(os.environ.get("HLA_TVM_API_KEY"), "$HLA_TVM_API_KEY")
    if args.sessions:
        check_sessions_folder(args.sessions)
    max_connections = connection_cap(args.max_connections)
    template = read_chat_template(args.chat_template)
    model = load(args.module, threads=args.threads)
    args.max_streams = stream_slots(args.max_streams, model.max_batch)
    check_pool_memory(model, args.max_streams)
    app_options = dict(model_name=args.name, max_streams=args.max_streams,
                       max_queue=args.max_queue, api_key=api_key, max_prompt=args.max_prompt,
                       prefill_piece=args.prefill_piece, shutdown_timeout=args.shutdown_timeout,
                       max_tokens=args.max_tokens, max_body=args.max_body,
                       max_unread=args.max_unread, chat_template=template,
                       prefix_cache_mb=args.prefix_cache_mb)
    if args.replicas > 1:
        return _replicas(args, model, app_options)
    store = SessionStore(args.sessions, model, max_count=args.max_sessions) \
        if args.sessions else None
    try:
        app = create_app(model, sessions=store, **app_options)
    except MemoryError:
        raise ValueError(f"--max-streams {args.max_streams}: the state of that many streams "
                         "does not fit in memory") from None
    metrics = app.state.metrics

    def report(kind):
        if kind == "stalled":
            metrics.cut.inc()
        else:
            metrics.errors.labels(kind).inc()
    base = uvicorn.Config(app).http   # ("auto": httptools where installed, else h11)
    if isinstance(base, str):
        from uvicorn.config import HTTP_PROTOCOLS
        from uvicorn.importer import import_from_string

        base = import_from_string(HTTP_PROTOCOLS.get(base, base))
    protocol = guarded(base, request_timeout=args.request_timeout,
                       max_connections=max_connections, report=report)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=protocol,
                            timeout_keep_alive=min(5, args.request_timeout),
                            timeout_graceful_shutdown=args.shutdown_timeout + 2)
    server = _server_class()(config, app.state.engine, args.shutdown_timeout)
    metrics.connections = lambda: len(server.server_state.connections)
    server.run()
    return 0


def _replicas(args, model, app_options):
    """`--replicas N`: Ray Serve replicas on a local Ray instance (`serve.ray_deployment.run`)."""
    try:
        from ..serve.ray_deployment import run
        import ray.serve  # noqa: F401
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'hla_tvm[ray]'") from None
    if args.max_connections is not None:
        raise ValueError("--max-connections applies to one server; with --replicas Ray "
                         "Serve's proxy takes the connections")
    del model
    run(args.module, host=args.host, port=args.port, num_replicas=args.replicas,
        sessions=args.sessions, max_sessions=args.max_sessions, threads=args.threads or 1,
        **app_options)
    return 0


def check_sessions_folder(folder):
    """Refuse (ValueError) a --sessions folder that is not a folder this user owns and can
    write files in (created when missing)."""
    path = os.path.abspath(folder)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"--sessions {folder}: not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--sessions {folder}: cannot create it ({err.strerror})") from None
    owner = os.stat(path).st_uid
    if owner != os.geteuid():
        raise ValueError(f"--sessions {folder}: the folder belongs to another user (uid "
                         f"{owner}); give a folder of your own")
    try:
        fd, probe = tempfile.mkstemp(prefix=".hla_tvm-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"--sessions {folder}: cannot write files in it "
                         f"({err.strerror})") from None


def connection_cap(wanted):
    """--max-connections: `wanted`, or 1024 when not given; the soft file descriptor limit
    is raised (up to the hard one) to hold that many and FD_RESERVE more. A default is
    lowered to fit; a given value that cannot fit is refused (ValueError)."""
    try:
        import resource
    except ImportError:   # (not on Windows: no limit to check)
        return wanted or 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = (wanted or 1024) + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    room = need if soft == resource.RLIM_INFINITY else soft - FD_RESERVE
    if wanted is None:
        if room < 16:
            raise ValueError(f"the file descriptor limit ({soft}, ulimit -n) leaves no room "
                             "for client connections")
        return min(1024, room)
    if wanted > room:
        raise ValueError(f"--max-connections {wanted} needs {wanted + FD_RESERVE} file "
                         f"descriptors; the limit is {soft} (ulimit -n)")
    return wanted


DEFAULT_STREAMS = 64


def stream_slots(asked, max_batch):
    """The state pool's streams: `asked` (--max-streams; None: DEFAULT_STREAMS, or the module's
    max batch where that is smaller: the demo's module serves as it is), refused in one line
    where the module takes fewer streams."""
    if asked is None:
        return DEFAULT_STREAMS if max_batch is None else min(DEFAULT_STREAMS, max_batch)
    if max_batch is not None and asked > max_batch:
        raise ValueError(f"--max-streams {asked}: this module takes at most {max_batch} streams "
                         f"(compiled with --max-batch {max_batch}); give --max-streams "
                         f"{max_batch} or less, or compile it again with a larger --max-batch")
    return asked


def check_pool_memory(model, streams):
    """Refuse (ValueError) --max-streams whose state pool is larger than this machine's
    memory."""
    from ..runtime.model import state_bytes

    per = state_bytes(model.state_spec)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if per * streams > memory:
        raise ValueError(f"--max-streams {streams} needs {_size(per * streams)} of stream "
                         f"state ({_size(per)} a stream); this machine has {_size(memory)} "
                         "of memory")


def _size(n):
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def _server_class():
    """uvicorn's Server with the engine's graceful stop (made here: uvicorn is an extra)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server; on SIGTERM or Ctrl-C the engine gets `timeout` seconds to finish
        the running streams, then cancels them, so every client gets its stream's end (a
        "cancelled" finish) before the connections close."""

        def __init__(self, config, engine, timeout):
            super().__init__(config)
            self.engine, self.timeout = engine, timeout

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                threading.Thread(target=self.engine.stop, args=(self.timeout,),
                                 daemon=True).start()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and hasattr(self, "_captured_signals"):
                # (uvicorn raises a captured signal again once it has stopped: SIGTERM is how
                # a service manager asks for a clean stop, which exits 0)
                self._captured_signals = [s for s in self._captured_signals
                                          if s != signal.SIGTERM]

    return Server

