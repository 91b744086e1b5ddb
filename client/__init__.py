"""maskroll.client: the SDK a trainer uses to reach rollout replicas (gRPC) and the rollout queue (Redis).

Owns the generated wire code, `RolloutClient`, `RolloutQueue` and plain-numpy records. It never imports
torch or vllm: a trainer on any framework can use it. The gRPC client is loaded on first access, so
`from maskroll.client import RolloutRecord` works without grpc installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .records import RecordAssembler, RolloutChunk, RolloutRecord, SamplingOptions, Semantics

if TYPE_CHECKING:
    from .rollout_client import RolloutClient, RolloutError, SyncRolloutClient
    from .wire_rpc import ServerInfo, WeightsUpdateResult

_LAZY = {
    "RolloutClient": "rollout_client",
    "SyncRolloutClient": "rollout_client",
    "RolloutError": "rollout_client",
    "ServerInfo": "wire_rpc",
    "WeightsUpdateResult": "wire_rpc",
}

__all__ = [
    "RecordAssembler",
    "RolloutChunk",
    "RolloutClient",
    "RolloutError",
    "RolloutRecord",
    "SamplingOptions",
    "Semantics",
    "ServerInfo",
    "SyncRolloutClient",
    "WeightsUpdateResult",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
