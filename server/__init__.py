"""maskroll.server: rollout replicas (config, engines, gRPC servicer, Redis publisher, weights, CLI).

Importing this package is cheap: heavy dependencies (torch, vllm, grpc) are imported by the modules
that need them, so `maskroll --help` and config validation run before any of them load.
"""
