"""`hla-tvm serve`'s API as a Ray Serve application: each replica loads the module and runs its
own engine (`app.create_app`), Ray's HTTP proxy spreads requests over the replicas, and the
replicas share one sessions folder, so a session saved through one replica continues through any
other (the folder must be one they all see: a local path on one machine, a shared file system
across machines).

    from ray import serve
    from hla_tvm.serve.ray_deployment import application
    serve.run(application("model.so", num_replicas=2, sessions="/shared/sessions"))

or from the command line, `hla-tvm serve model.so --replicas 2` (`run`). The connection guard
of a single server (`guard`: --max-connections, --request-timeout) is Ray's proxy's business
here. Needs `ray[serve]` (`pip install 'hla_tvm[ray]'`)."""
from __future__ import annotations

import os
import signal
import threading


def application(module, *, num_replicas=2, sessions=None, max_sessions=1000, threads=1,
                name=None, num_cpus=1.0, **app_options):
    """The bound Ray Serve application serving the compiled `module` (its path, seen by every
    replica) with `num_replicas` replicas of `num_cpus` CPUs each; `app_options` are
    `app.create_app`'s keyword arguments (max_streams, max_queue, api_key, max_prompt,
    prefill_piece, max_tokens, chat_template, prefix_cache_mb, ...), the others `hla-tvm
    serve`'s."""
    # ray (the ray extra) is imported where used; build_app's imports run in each replica (the
    # driver, `run`, loads no module)
    from ray import serve

    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
    module = os.path.abspath(os.fspath(module))
    if not os.path.isfile(module):
        raise FileNotFoundError(f"no compiled module at {module}")
    app_options.setdefault("model_name", name or os.path.splitext(os.path.basename(module))[0])
    options = dict(sessions=os.path.abspath(sessions) if sessions else None,
                   max_sessions=max_sessions, threads=threads, app=app_options)

    @serve.deployment(num_replicas=num_replicas, ray_actor_options={"num_cpus": num_cpus},
                      name="hla_tvm")
    @serve.ingress()
    class HLAServer:
        """One replica: the module loaded, its engine and the HTTP API."""

        def __init__(self, module, options):
            self.module, self.options = module, options

        def __serve_build_asgi_app__(self):
            return build_app(self.module, self.options)

    return HLAServer.bind(module, options)


def build_app(module, options):
    """The FastAPI app of one replica (what `application`'s replicas run)."""
    from ..runtime import load
    from .app import create_app
    from .sessions import SessionStore

    model = load(module, threads=options["threads"])
    store = SessionStore(options["sessions"], model, max_count=options["max_sessions"]) \
        if options["sessions"] else None
    return create_app(model, sessions=store, **options["app"])


def run(module, *, host="127.0.0.1", port=8000, num_replicas=2, **options):
    """Start a local Ray instance and Ray Serve's HTTP proxy on `host`:`port` serving
    `application(module, num_replicas=num_replicas, **options)`, until SIGTERM or Ctrl-C
    (`hla-tvm serve --replicas N`); Ray stops with it."""
    import ray
    from ray import serve

    stop = threading.Event()
    cpus = os.cpu_count() or 1
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=cpus)
    try:
        # (right after ray.init, which puts a handler of its own on SIGTERM that exits with
        # code 15: the replicas answer /health before serve.run returns, so a SIGTERM can come
        # while it runs; Serve's start and run leave ours in place)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(module, num_replicas=num_replicas,
                              num_cpus=max(0.1, cpus / num_replicas), **options),
                  route_prefix="/")
        print(f"serving {os.path.basename(module)} with {num_replicas} Ray Serve replicas at "
              f"http://{host}:{port} (SIGTERM or Ctrl-C stops)", flush=True)
        stop.wait()
    finally:
        # (ray.shutdown ends the replicas with the instance; serve.shutdown first waited 30 s
        # for its controller on a 2-core VM)
        ray.shutdown()
