"""Serving a compiled model to many clients at once (`hla-tvm serve`):

- `engine`: continuous batching over one module (`runtime.state_pool.StatePool`): streams join
  and leave between decode steps, prompts are prefilled in pieces between them;
- `sessions`: named stream states in a folder (resume, fork), least recently used evicted;
- `app`: the OpenAI-compatible HTTP API (FastAPI, server-sent events);
- `metrics`: its Prometheus metrics;
- `ray_deployment`: the same API as a Ray Serve deployment, replicas sharing a sessions folder.

Torch-free: a server needs numpy, the TVM runtime and the `serve` extra (FastAPI, uvicorn,
prometheus_client)."""
