"""maskroll.server: the rollout replica — config, engines, generation, front ends, pull mode, weights, CLI.

The rooms: `engines/`, `generation/`, `grpc_api/`, `http_api/`, `pull/`, `weights/`; at the top the
replica's config, app (its lifecycle), `maskroll serve` and `maskroll healthcheck`, auth, metrics and
the running requests (drain).

Importing this package is cheap: heavy dependencies (torch, vllm, grpc) are imported by the modules
that need them, so `maskroll --help` and config validation run before any of them load.
"""
