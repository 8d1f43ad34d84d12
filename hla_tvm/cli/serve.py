"""`hla-tvm serve`: an OpenAI-compatible HTTP server (uvicorn) over a compiled module, with
continuous batching and sessions (`hla_tvm.serve`)."""
from __future__ import annotations

import os
import signal
import threading

from .args import positive

DESCRIPTION = (
    "Serve a compiled module over HTTP with OpenAI's completions API: POST /v1/completions "
    "(streamed with \"stream\": true), GET /v1/models, /health and /metrics (Prometheus). All "
    "streams advance together, one token each per decode step, and new prompts are prefilled "
    "in pieces between steps. With --sessions DIR a request may save its stream's state "
    "(\"session\": {\"save\": NAME}) and later continue it without re-reading the text "
    "({\"resume\": NAME}) or branch it ({\"fork\": NAME}). Byte-level models and models "
    "compiled with --tokenizer take text prompts, others lists of token ids. Stop with Ctrl-C "
    "or SIGTERM: running streams get --shutdown-timeout seconds to finish. Needs the serve "
    "extra: pip install 'hla_tvm[serve]'.")


def add_arguments(p):
    """The command's options."""
    p.add_argument("module", help="a library written by `hla-tvm compile` (for a CPU)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; mind --api-key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--max-streams", type=positive, default=64,
                   help="streams advanced together (state slots); more requests wait")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests that may wait for a slot before the server answers 429 "
                        "(default: --max-streams)")
    p.add_argument("--sessions", default=None, metavar="DIR",
                   help="folder of saved sessions (created if missing; replicas may share it); "
                        "without it requests cannot save or resume sessions")
    p.add_argument("--max-sessions", type=positive, default=1000,
                   help="sessions kept; the least recently used go first")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $HLA_TVM_API_KEY; "
                        "none: no key)")
    p.add_argument("--threads", type=positive, default=None,
                   help="CPU threads for the kernels (default: chosen per kind of call)")
    p.add_argument("--max-prompt", type=positive, default=8192,
                   help="longest prompt in tokens")
    p.add_argument("--prefill-piece", type=positive, default=256,
                   help="prompt tokens prefilled between two decode steps (bounds how long a "
                        "new prompt holds up the running streams)")
    p.add_argument("--name", default=None,
                   help="the model's name in the API (default: the module's file name)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running streams get to finish on SIGTERM or Ctrl-C")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")


def main(args):
    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as err:
        raise ValueError(f"hla-tvm serve needs the serve extra ({err.name} is missing): "
                         "pip install 'hla_tvm[serve]'") from None
    from ..runtime import load
    from ..serve.sessions import SessionStore

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("HLA_TVM_API_KEY")
    model = load(args.module, threads=args.threads)
    store = SessionStore(args.sessions, model, max_count=args.max_sessions) \
        if args.sessions else None
    app = create_app(model, model_name=args.name, max_streams=args.max_streams,
                     max_queue=args.max_queue, sessions=store, api_key=api_key,
                     max_prompt=args.max_prompt, prefill_piece=args.prefill_piece,
                     shutdown_timeout=args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 2)
    _server_class()(config, app.state.engine, args.shutdown_timeout).run()
    return 0


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

