"""`hla-tvm serve`'s API as a Ray Serve application: each replica loads the module and runs its
own engine (`app.create_app`), Ray's HTTP proxy spreads requests over the replicas, and the
replicas share one sessions folder, so a session saved through one replica continues through any
other (the folder must be one they all see: a local path on one machine, a shared file system
across machines).

    from ray import serve
    from hla_tvm.serve.ray_deployment import application
    serve.run(application("model.so", num_replicas=2, sessions="/shared/sessions"))

Needs `ray[serve]` (`pip install 'hla_tvm[ray]'`)."""
from __future__ import annotations

import os


def application(module, *, num_replicas=2, sessions=None, max_sessions=1000, max_streams=64,
                max_queue=None, api_key=None, threads=1, name=None, max_prompt=8192,
                prefill_piece=256, num_cpus=1.0):
    """The bound Ray Serve application serving the compiled `module` (its path, seen by every
    replica) with `num_replicas` replicas of `num_cpus` CPUs each; the other options are
    `hla-tvm serve`'s."""
    from ray import serve

    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
    module = os.path.abspath(os.fspath(module))
    if not os.path.isfile(module):
        raise FileNotFoundError(f"no compiled module at {module}")
    options = dict(sessions=os.path.abspath(sessions) if sessions else None,
                   max_sessions=max_sessions, max_streams=max_streams, max_queue=max_queue,
                   api_key=api_key, threads=threads,
                   name=name or os.path.splitext(os.path.basename(module))[0],
                   max_prompt=max_prompt, prefill_piece=prefill_piece)

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
    return create_app(model, model_name=options["name"], max_streams=options["max_streams"],
                      max_queue=options["max_queue"], sessions=store,
                      api_key=options["api_key"], max_prompt=options["max_prompt"],
                      prefill_piece=options["prefill_piece"])
