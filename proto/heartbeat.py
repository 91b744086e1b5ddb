"""The replica heartbeat: what a live replica says about itself under its registry key.

A pull-mode replica writes one JSON object with a TTL (`StreamKeys.replica`, refreshed by
`maskroll.server.pull.puller`); trainers read the live ones (`maskroll.client.replicas.live_replicas`)
to broadcast weights. Both ends use this codec, so the fields are named once. Unknown fields are kept in
`extra` (a newer replica's additions reach an older trainer unharmed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaInfo:
    """One live replica as its last heartbeat described it; `extra` is the whole heartbeat JSON."""

    replica_id: str
    address: str
    engine: str = ""
    model: str = ""
    policy_version: int = 0
    active_jobs: int = 0
    extra: dict = field(default_factory=dict)


def encode_heartbeat(
    replica_id: str,
    *,
    address: str,
    engine: str = "",
    model: str = "",
    policy_version: int = 0,
    active_jobs: int = 0,
) -> str:
    return json.dumps(
        {
            "replica_id": replica_id,
            "address": address,
            "engine": engine,
            "model": model,
            "policy_version": int(policy_version),
            "active_jobs": int(active_jobs),
        }
    )


def decode_heartbeat(raw: bytes | str) -> ReplicaInfo:
    info = json.loads(raw)
    return ReplicaInfo(
        replica_id=info.get("replica_id", ""),
        address=info.get("address", ""),
        engine=info.get("engine", ""),
        model=info.get("model", ""),
        policy_version=int(info.get("policy_version", 0)),
        active_jobs=int(info.get("active_jobs", 0)),
        extra=info,
    )
