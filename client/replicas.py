"""The replica registry, and the plain types that describe replicas' weights (docs/architecture.md flow 4).

A pull-mode replica keeps a heartbeat key under the run's namespace (`maskroll.proto.heartbeat`: its
address, engine, model and policy version, written with a TTL by the replica's puller): the live
replicas are those whose key has not expired (`live_replicas`). Moving weights onto them — UpdateWeights,
PushWeights, the NCCL control calls, GetInfo — is the trainer's weights package
(`maskroll.weight_sync.broadcast`), which reports with `ReplicaWeights` and raises `BroadcastError`:
they are defined here, as plain types, so that `maskroll.client` exports them without importing
weight_sync. Needs no grpc; knows nothing of jobs, records or batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from maskroll.proto.heartbeat import ReplicaInfo, decode_heartbeat
from maskroll.proto.streams import StreamKeys

__all__ = ["BroadcastError", "ReplicaInfo", "ReplicaWeights", "live_replicas"]


class BroadcastError(RuntimeError):
    """A policy version no live replica loaded (none alive included). `results` is per replica."""

    def __init__(self, version: int, results: dict[str, str], namespace: str = "") -> None:
        self.version, self.results = version, dict(results)
        self.failed = {r: e for r, e in results.items() if e not in ("ok", "unchanged")}
        where = f" in namespace {namespace!r}" if namespace else ""
        if results:
            detail = "; ".join(f"{r}: {e}" for r, e in sorted(self.failed.items()))
            message = (
                f"policy version {version} was loaded by none of the {len(results)} live replicas{where} "
                f"({detail})"
            )
        else:
            message = f"policy version {version} reached no replica: 0 live replicas{where}"
        super().__init__(message)


@dataclass(frozen=True)
class ReplicaWeights:
    """What a replica serves: the run of its weights ("" = none yet: its starting weights) and version."""

    run_id: str
    version: int


async def live_replicas(r: aioredis.Redis, keys: StreamKeys) -> list[ReplicaInfo]:
    """Replicas of the namespace whose heartbeat key has not expired, sorted by replica id."""
    out = []
    async for key in r.scan_iter(match=keys.replica_pattern, count=100):
        raw = await r.get(key)
        if raw is None:  # expired between SCAN and GET
            continue
        out.append(decode_heartbeat(raw))
    return sorted(out, key=lambda rep: rep.replica_id)
