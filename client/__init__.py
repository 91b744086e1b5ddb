"""maskroll.client: the SDK a trainer uses to reach rollout replicas (gRPC) and the rollout queue (Redis).

Owns `RolloutClient`, `RolloutQueue` and the rules a trainer keeps (admission, whole groups, staleness,
runs, the replica registry), and `RankedQueue`: one run's queue shared by data-parallel trainer ranks.
The contract it shares with the replicas — records, wire code, stream layout, connection policy — is
`maskroll.proto`; its record types are re-exported here. Moving weights onto the replicas is
`maskroll.weight_sync` (it raises this package's `BroadcastError` and reports `ReplicaWeights`). It
never imports torch or vllm: a trainer on any framework can use it. The gRPC client and the Redis queue
are loaded on first access, so `from maskroll.client import RolloutRecord`
needs neither grpc nor redis, and the queue never loads grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maskroll.proto.records import (
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
    from maskroll.proto.redis_conn import QueueUnavailable

    from .admission import QueueFull
    from .batching import group_key, split_groups
    from .queue import AsyncRolloutQueue, RolloutQueue
    from .queue_state import QueueStats
    from .ranks import Collective, RankedQueue, RankFailed, SingleRank
    from .reader import QueueTimeout
    from .replicas import BroadcastError, ReplicaInfo, ReplicaWeights, replicas_elsewhere
    from .rollout_client import RolloutClient, RolloutError, SyncRolloutClient
    from .runs import RunChoiceRequired, RunError, RunInfo, RunNotFound, RunSuperseded

_LAZY = {
    "RolloutClient": "rollout_client",
    "SyncRolloutClient": "rollout_client",
    "RolloutError": "rollout_client",
    "RolloutQueue": "queue",
    "AsyncRolloutQueue": "queue",
    "QueueStats": "queue_state",
    "group_key": "batching",
    "split_groups": "batching",
    "RankedQueue": "ranks",
    "RankFailed": "ranks",
    "SingleRank": "ranks",
    "Collective": "ranks",
    "QueueTimeout": "reader",
    "QueueFull": "admission",
    "QueueUnavailable": "maskroll.proto.redis_conn",
    "ReplicaInfo": "replicas",
    "ReplicaWeights": "replicas",
    "BroadcastError": "replicas",
    "replicas_elsewhere": "replicas",
    "RunInfo": "runs",
    "RunError": "runs",
    "RunChoiceRequired": "runs",
    "RunNotFound": "runs",
    "RunSuperseded": "runs",
}

__all__ = [
    "AsyncRolloutQueue",
    "BroadcastError",
    "Collective",
    "PromptJob",
    "QueueFull",
    "QueueStats",
    "QueueTimeout",
    "QueueUnavailable",
    "RankFailed",
    "RankedQueue",
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
    "SingleRank",
    "SyncRolloutClient",
    "WeightsUpdateResult",
    "group_key",
    "replicas_elsewhere",
    "split_groups",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = _LAZY[name] if "." in _LAZY[name] else f"{__name__}.{_LAZY[name]}"
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
