"""The replica registry and the weight broadcast (docs/architecture.md flow 4).

A pull-mode replica keeps a heartbeat key under the run's namespace (`maskroll.proto.heartbeat`: its
address, engine, model and policy version, written with a TTL by the replica's puller): the live
replicas are those whose key has not expired. `broadcast_weights` calls UpdateWeights (with the run id)
on each of them over gRPC and `replica_weights` asks each what it serves (GetInfo). This is the only
part of the queue SDK that needs
grpc, and it imports it when weights are pushed, so a trainer that only submits and consumes never loads
it. Knows nothing of jobs, records or batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import redis.asyncio as aioredis

from maskroll.proto.heartbeat import ReplicaInfo, decode_heartbeat
from maskroll.proto.streams import StreamKeys
from maskroll.proto.tensor_push import CollectiveSpec, WeightsManifest

if TYPE_CHECKING:
    from .rollout_client import RolloutClient

T = TypeVar("T")


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


async def _each(
    replicas: Sequence[ReplicaInfo],
    call: Callable[[int, RolloutClient], Awaitable[T]],
    *,
    token: str | None,
    tls: bool,
    root_certs: bytes | None,
) -> dict[str, T | str]:
    """`call(i, client of replica i)` on every replica concurrently; {replica_id: its result or
    "<ErrorType>: <message>"}: one replica failing never stops the others (reported per replica, by
    design)."""
    from .rollout_client import RolloutClient  # grpc only when replicas are called

    async def one(i: int, rep: ReplicaInfo) -> T | str:
        try:
            async with RolloutClient(rep.address, token=token, tls=tls, root_certs=root_certs) as c:
                return await call(i, c)
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    results = await asyncio.gather(*(one(i, rep) for i, rep in enumerate(replicas)))
    return {rep.replica_id: res for rep, res in zip(replicas, results, strict=True)}


async def broadcast_weights(
    replicas: Sequence[ReplicaInfo],
    version: int,
    checkpoint_dir: str,
    *,
    run_id: str = "",
    timeout: float = 120.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
) -> dict[str, str]:
    """UpdateWeights(version of run `run_id`) on every replica concurrently, each bounded by `timeout` s.
    Returns {replica_id: "ok" | "<ErrorType>: <message>"}: one replica failing never stops the others."""

    async def call(_: int, c: RolloutClient) -> str:
        await asyncio.wait_for(c.update_weights(version, checkpoint_dir, run_id=run_id), timeout)
        return "ok"

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)


async def replica_weights(
    replicas: Sequence[ReplicaInfo],
    *,
    timeout: float = 10.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
) -> dict[str, ReplicaWeights | str]:
    """GetInfo on every replica concurrently: {replica_id: ReplicaWeights | "<ErrorType>: <message>"}."""

    async def call(_: int, c: RolloutClient) -> ReplicaWeights:
        info = await asyncio.wait_for(c.info(), timeout)
        return ReplicaWeights(info.run_id, info.policy_version)

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)


async def push_weights(
    replicas: Sequence[ReplicaInfo],
    manifest: WeightsManifest,
    chunks: Callable[[], Iterable[tuple[int, int, bytes | memoryview]]],
    *,
    timeout: float = 120.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
) -> dict[str, str]:
    """PushWeights(manifest, then `chunks()`) to every replica concurrently, each bounded by `timeout` s
    (sending and loading). `chunks` is called once per replica and yields (tensor index, offset, bytes)
    in manifest order; each replica reads at its own pace, so a slow or dead one never holds back the
    others. Returns {replica_id: "ok" | "<ErrorType>: <message>"}."""
    from maskroll.proto import wire

    def messages():
        # Serialized here, each chunk with one copy of the tensor's bytes (wire.push_chunk_bytes); the
        # call has no request serializer, so gRPC sends these bytes as they are.
        yield wire.manifest_to_pb(manifest).SerializeToString()
        for index, offset, data in chunks():
            yield wire.push_chunk_bytes(index, offset, data)

    async def call(_: int, c: RolloutClient) -> str:
        c._rollout()  # opens the channel
        push = c._channel.stream_unary(
            wire.PUSH_WEIGHTS_METHOD, response_deserializer=wire.pb.UpdateWeightsResponse.FromString
        )
        # The deadline bounds the whole call (gRPC cancels it, so the replica drops the half-received
        # push); wait_for is the backstop for a channel that never connects.
        await asyncio.wait_for(c._unary(push, messages(), timeout), timeout + 5.0)
        return "ok"

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)


async def collective_update(
    replicas: Sequence[ReplicaInfo],
    version: int,
    specs: Sequence[CollectiveSpec],
    *,
    run_id: str = "",
    timeout: float = 600.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
) -> dict[str, str]:
    """UpdateWeights(collective spec i) on replica i, all concurrently (each blocks in its NCCL
    rendezvous or receive until the trainer broadcasts). {replica_id: "ok" | "<ErrorType>: <message>"}."""
    from maskroll.proto import wire

    if len(specs) != len(replicas):
        raise ValueError(f"{len(specs)} collective specs for {len(replicas)} replicas")

    async def call(i: int, c: RolloutClient) -> str:
        request = wire.collective_request(version, specs[i], run_id)
        await asyncio.wait_for(c._unary(c._rollout().UpdateWeights, request, timeout), timeout + 5.0)
        return "ok"

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)
