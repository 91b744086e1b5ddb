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

    @property
    def weights_fingerprint(self) -> str:
        """Which weights it serves (proto/weights_fingerprint.py); "" from a replica that does not say."""
        return str(self.extra.get("weights_fingerprint", ""))

    @property
    def pulls(self) -> bool:
        """Takes prompt jobs (a heartbeat without the field is from a puller: only pullers wrote one)."""
        return bool(self.extra.get("pull", True))


def encode_heartbeat(
    replica_id: str,
    *,
    address: str,
    engine: str = "",
    model: str = "",
    policy_version: int = 0,
    active_jobs: int = 0,
    pull: bool = True,
    run_id: str = "",
    weights_fingerprint: str = "",
    in_flight: int = 0,
    tokens_per_s: float = 0.0,
) -> str:
    """pull: the replica takes prompt jobs; False: it only publishes what its front ends produce (HTTP
    sessions, Generate with a rollout stream) and is registered so that trainers push it weights.
    run_id: the run of the weights it serves; weights_fingerprint: which weights (GetInfo's);
    in_flight: generations running; tokens_per_s: since the
    previous heartbeat (for `maskroll status`)."""
    return json.dumps(
        {
            "replica_id": replica_id,
            "address": address,
            "engine": engine,
            "model": model,
            "policy_version": int(policy_version),
            "active_jobs": int(active_jobs),
            "pull": bool(pull),
            "run_id": run_id,
            "weights_fingerprint": weights_fingerprint,
            "in_flight": int(in_flight),
            "tokens_per_s": round(float(tokens_per_s), 1),
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
