"""The replica registry and the weight broadcast (ARCHITECTURE.md flow 5).

A pull-mode replica keeps a heartbeat key under the run's namespace (JSON with its address, engine,
model and policy version; written with a TTL by server/puller.py): the live replicas are those whose key
has not expired. `broadcast_weights` calls UpdateWeights on each of them over gRPC. This is the only
part of the queue SDK that needs grpc, and it imports it when weights are pushed, so a trainer that
only submits and consumes never loads it. Knows nothing of jobs, records or batches.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from .streams import StreamKeys


@dataclass(frozen=True)
class ReplicaInfo:
    """One live replica as its last heartbeat described it; `extra` is the whole heartbeat JSON."""

    replica_id: str
    address: str
    engine: str = ""
    model: str = ""
    policy_version: int = 0
    extra: dict = field(default_factory=dict)


async def live_replicas(r: aioredis.Redis, keys: StreamKeys) -> list[ReplicaInfo]:
    """Replicas of the namespace whose heartbeat key has not expired, sorted by replica id."""
    out = []
    async for key in r.scan_iter(match=keys.replica_pattern, count=100):
        raw = await r.get(key)
        if raw is None:  # expired between SCAN and GET
            continue
        info = json.loads(raw)
        out.append(
            ReplicaInfo(
                replica_id=info.get("replica_id", ""),
                address=info.get("address", ""),
                engine=info.get("engine", ""),
                model=info.get("model", ""),
                policy_version=int(info.get("policy_version", 0)),
                extra=info,
            )
        )
    return sorted(out, key=lambda rep: rep.replica_id)


async def broadcast_weights(
    replicas: Sequence[ReplicaInfo],
    version: int,
    checkpoint_dir: str,
    *,
    timeout: float = 120.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
) -> dict[str, str]:
    """UpdateWeights on every replica concurrently, each bounded by `timeout` s. Returns
    {replica_id: "ok" | "<ErrorType>: <message>"}: one replica failing never stops the others."""
    from .rollout_client import RolloutClient  # grpc only when weights are pushed

    async def one(rep: ReplicaInfo) -> str:
        try:
            async with RolloutClient(rep.address, token=token, tls=tls, root_certs=root_certs) as c:
                await asyncio.wait_for(c.update_weights(version, checkpoint_dir), timeout)
            return "ok"
        except Exception as e:  # reported per replica, by design
            return f"{type(e).__name__}: {e}"

    results = await asyncio.gather(*(one(rep) for rep in replicas))
    return {rep.replica_id: res for rep, res in zip(replicas, results, strict=True)}
