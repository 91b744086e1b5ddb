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

import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from maskroll.proto.heartbeat import ReplicaInfo, decode_heartbeat
from maskroll.proto.streams import StreamKeys

__all__ = [
    "BroadcastError",
    "ReplicaInfo",
    "ReplicaWeights",
    "live_replicas",
    "namespaces_with_replicas",
    "replicas_elsewhere",
]

# Every namespace's heartbeat keys, in both layouts (StreamKeys.replica: "maskroll:<ns>:replica:<id>",
# "maskroll:{<ns>}:replica:<id>"); braces are not special in Redis's glob patterns.
ALL_REPLICAS_PATTERN = "maskroll:*:replica:*"


class BroadcastError(RuntimeError):
    """A policy version no live replica loaded (none alive included). `results` is per replica."""

    def __init__(self, version: int, results: dict[str, str], namespace: str = "") -> None:
        self.version, self.results = version, dict(results)
        self.failed = {r: e for r, e in results.items() if e not in ("ok", "unchanged", "adopted")}
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
    """What a replica serves: the run of its weights ("" = none yet: its starting weights) and version;
    on its starting weights, their fingerprint (proto/weights_fingerprint.py; "" when unknown).
    dtype: the dtype it holds the weights in (GetInfo's: "bfloat16", ...; "" when unknown). Compared by
    run and version only."""

    run_id: str
    version: int
    fingerprint: str = field(default="", compare=False)
    dtype: str = field(default="", compare=False)


async def live_replicas(r: aioredis.Redis, keys: StreamKeys) -> list[ReplicaInfo]:
    """Replicas of the namespace whose heartbeat key has not expired, sorted by replica id."""
    out = []
    async for key in r.scan_iter(match=keys.replica_pattern, count=100):
        raw = await r.get(key)
        if raw is None:  # expired between SCAN and GET
            continue
        out.append(decode_heartbeat(raw))
    return sorted(out, key=lambda rep: rep.replica_id)


def _namespace_of(key: bytes | str) -> str | None:
    """The namespace of a heartbeat key (either layout), None for a key that only matched the pattern."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    rest = text.removeprefix("maskroll:")
    if rest.startswith("{"):
        ns, sep, tail = rest[1:].partition("}")
        return ns if sep and tail.startswith(":replica:") else None
    ns, sep, _ = rest.partition(":replica:")
    return ns if sep and ns else None


async def namespaces_with_replicas(
    r: aioredis.Redis, *, max_keys: int = 10_000, max_seconds: float = 2.0
) -> dict[str, int]:
    """{namespace: live replicas} over every namespace of this Redis, from the heartbeat keys (one SCAN
    of the whole keyspace for the pattern, stopped after `max_keys` matches or `max_seconds`: a bounded
    look for "where are my replicas?", not a registry)."""
    out: dict[str, int] = {}
    seen, deadline = 0, time.monotonic() + max_seconds
    # TYPE string: heartbeats only, not a stream whose name happens to match (`<rollouts>:replica:x`)
    async for key in r.scan_iter(match=ALL_REPLICAS_PATTERN, count=1000, _type="string"):
        ns = _namespace_of(key)
        if ns is not None:
            out[ns] = out.get(ns, 0) + 1
        seen += 1
        if seen >= max_keys or time.monotonic() > deadline:
            break
    return dict(sorted(out.items()))


def replicas_elsewhere(namespace: str, by_namespace: dict[str, int]) -> str:
    """Where the replicas of this Redis are, when `namespace` has too few: one sentence for a message."""
    others = {ns: n for ns, n in by_namespace.items() if ns != namespace}
    if not others:
        return "no namespace on this Redis has live replicas"
    shown = ", ".join(f"{ns!r} ({n})" for ns, n in list(others.items())[:10])
    more = f" and {len(others) - 10} more" if len(others) > 10 else ""
    return f"namespaces with live replicas on this Redis: {shown}{more} (a wrong --namespace?)"
