"""maskroll.client: the SDK a trainer uses to reach rollout replicas (gRPC) and the rollout queue (Redis).

Owns the generated wire code, `RolloutClient`, `RolloutQueue` and plain-numpy records. It never imports
torch or vllm: a trainer on any framework can use it. The gRPC client and the Redis queue are loaded on
first access, so `from maskroll.client import RolloutRecord` needs neither grpc nor redis, and the queue
needs no grpc until weights are broadcast.

Modules, one concern each: records.py (domain objects), wire.py (protobuf ⇄ records), rollout_client.py
(gRPC to one replica); for the queue: redis_conn.py (connection and retry policy), streams.py (stream
layout and primitives shared with the server), admission.py (in-flight limit), batching.py (whole
groups, dedupe, staleness, refused records), runs.py (the run that owns a namespace), queue.py (the
trainer's queue client) and replicas.py (registry, weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .records import (
    PromptJob,
    RecordAssembler,
    RolloutChunk,
    RolloutRecord,
    SamplingOptions,
    Semantics,
    ServerInfo,
    WeightsUpdateResult,
)

if TYPE_CHECKING:
    from .admission import QueueFull
    from .queue import AsyncRolloutQueue, QueueStats, QueueTimeout, RolloutQueue
    from .redis_conn import QueueUnavailable
    from .replicas import BroadcastError, ReplicaInfo, ReplicaWeights
    from .rollout_client import RolloutClient, RolloutError, SyncRolloutClient
    from .runs import RunChoiceRequired, RunError, RunInfo, RunNotFound, RunSuperseded

_LAZY = {
    "RolloutClient": "rollout_client",
    "SyncRolloutClient": "rollout_client",
    "RolloutError": "rollout_client",
    "RolloutQueue": "queue",
    "AsyncRolloutQueue": "queue",
    "QueueStats": "queue",
    "QueueTimeout": "queue",
    "QueueFull": "admission",
    "QueueUnavailable": "redis_conn",
    "ReplicaInfo": "replicas",
    "ReplicaWeights": "replicas",
    "BroadcastError": "replicas",
    "RunInfo": "runs",
    "RunError": "runs",
    "RunChoiceRequired": "runs",
    "RunNotFound": "runs",
    "RunSuperseded": "runs",
}

__all__ = [
    "AsyncRolloutQueue",
    "BroadcastError",
    "PromptJob",
    "QueueFull",
    "QueueStats",
    "QueueTimeout",
    "QueueUnavailable",
    "RecordAssembler",
    "ReplicaInfo",
    "ReplicaWeights",
    "RolloutChunk",
    "RolloutClient",
    "RolloutError",
    "RolloutQueue",
    "RolloutRecord",
    "RunChoiceRequired",
    "RunError",
    "RunInfo",
    "RunNotFound",
    "RunSuperseded",
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
