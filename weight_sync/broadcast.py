"""Moving a policy version onto the live replicas of a queue's namespace (docs/architecture.md flow 4).

The queue is taken for its replica registry (`replicas()`, the heartbeat keys), its run (id and
namespace), the replicas' gRPC credentials (`replica_auth`) and `record_version`, which records each
version in the run record and makes it the trainer's policy version before any replica loads it:

- `broadcast_weights`: record the version (a checkpoint directory), then UpdateWeights on every replica;
- `push_weights`: record the version ("stream"), then PushWeights — the tensors in the call; with a
  `delta`, the replicas serving its base are sent the delta, the others (and any that refused the delta)
  the full version;
- `sync_replicas`: make every replica serve the run's current version (after a resume, or a join);
- `replica_weights`: what each replica serves now (GetInfo).

Each exists twice: `*_async(queue: AsyncRolloutQueue, ...)`, and the blocking form taking a
`RolloutQueue`, which runs the async one on the queue's own event loop (`RolloutQueue.run_on_loop`).
One replica failing never stops the others: results are per replica ({replica_id: "ok" | "unchanged" |
"adopted" (a new run's version 0 that a replica already held: its starting weights are the trainer's
model) | "<ErrorType>: <message>"}), and `BroadcastError` (maskroll.client) is raised when none loaded it.
Below them, the per-replica calls on a list of replicas (`update_each`, `push_each`, `weights_of_each`,
`collective_update`) need no queue. Only this module of the trainer side calls the replicas' weight
RPCs; grpc is loaded when they are called.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from maskroll.client import BroadcastError, ReplicaInfo, ReplicaWeights
from maskroll.proto.tensor_push import CollectiveSpec, WeightsManifest

if TYPE_CHECKING:
    from maskroll.client import AsyncRolloutQueue, RolloutClient, RolloutQueue

log = logging.getLogger("maskroll.queue")

T = TypeVar("T")
SERVING = ("ok", "unchanged", "adopted")  # results of a replica that serves the version afterwards
Chunks = Callable[[], Iterable[tuple[int, int, bytes | memoryview]]]

# ---- per replica, on a list of replicas -------------------------------------------------------------


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
    from maskroll.client import RolloutClient  # grpc only when replicas are called

    async def one(i: int, rep: ReplicaInfo) -> T | str:
        try:
            async with RolloutClient(rep.address, token=token, tls=tls, root_certs=root_certs) as c:
                return await call(i, c)
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    results = await asyncio.gather(*(one(i, rep) for i, rep in enumerate(replicas)))
    return {rep.replica_id: res for rep, res in zip(replicas, results, strict=True)}


async def update_each(
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
    """UpdateWeights(version of run `run_id`) on every replica concurrently, each bounded by `timeout` s."""

    async def call(_: int, c: RolloutClient) -> str:
        await asyncio.wait_for(c.update_weights(version, checkpoint_dir, run_id=run_id), timeout)
        return "ok"

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)


async def weights_of_each(
    replicas: Sequence[ReplicaInfo],
    *,
    timeout: float = 10.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
    adapter_namespace: str | None = None,
) -> dict[str, ReplicaWeights | str]:
    """GetInfo on every replica concurrently: {replica_id: ReplicaWeights | "<ErrorType>: <message>"}.
    adapter_namespace: what each serves for that namespace's LoRA run instead (its current adapter's run
    and version, in GetInfo's adapters; ReplicaWeights("", 0) when it has none: the base)."""

    async def call(_: int, c: RolloutClient) -> ReplicaWeights:
        info = await asyncio.wait_for(c.info(), timeout)
        if adapter_namespace is not None:
            current = [a for a in info.adapters if a.namespace == adapter_namespace]
            return ReplicaWeights(current[0].run_id, current[0].version) if current else ReplicaWeights("", 0)
        return ReplicaWeights(info.run_id, info.policy_version, info.weights_fingerprint, info.dtype)

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)


async def adopt_each(
    replicas: Sequence[ReplicaInfo],
    fingerprint: str,
    *,
    run_id: str,
    timeout: float = 10.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
) -> dict[str, str]:
    """UpdateWeights(AdoptSource) on every replica concurrently: their starting weights, fingerprinted
    `fingerprint`, become version 0 of run `run_id` without a byte sent."""

    async def call(_: int, c: RolloutClient) -> str:
        await asyncio.wait_for(c.adopt_weights(fingerprint, run_id=run_id), timeout)
        return "ok"

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)


def adoptable(w: object, fingerprint: str) -> bool:
    """A replica (its ReplicaWeights) can adopt a new run's version 0: it serves its starting weights and
    they are the trainer's model (equal, known fingerprints)."""
    return (
        isinstance(w, ReplicaWeights)
        and not w.run_id
        and w.version == 0
        and bool(fingerprint)
        and w.fingerprint == fingerprint
    )


async def push_each(
    replicas: Sequence[ReplicaInfo],
    manifest: WeightsManifest,
    chunks: Chunks,
    *,
    timeout: float = 120.0,
    token: str | None = None,
    tls: bool = False,
    root_certs: bytes | None = None,
) -> dict[str, str]:
    """PushWeights(manifest, then `chunks()`) to every replica concurrently, each bounded by `timeout` s
    (sending and loading). `chunks` is called once per replica and yields (tensor index, offset, bytes)
    in manifest order; each replica reads at its own pace, so a slow or dead one never holds back the
    others."""
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
    rendezvous or receive until the trainer broadcasts)."""
    from maskroll.proto import wire

    if len(specs) != len(replicas):
        raise ValueError(f"{len(specs)} collective specs for {len(replicas)} replicas")

    async def call(i: int, c: RolloutClient) -> str:
        request = wire.collective_request(version, specs[i], run_id)
        await asyncio.wait_for(c._unary(c._rollout().UpdateWeights, request, timeout), timeout + 5.0)
        return "ok"

    return await _each(replicas, call, token=token, tls=tls, root_certs=root_certs)


# ---- the replicas of a queue's namespace ----------------------------------------------------------


async def replica_weights_async(
    queue: AsyncRolloutQueue, timeout: float = 10.0
) -> dict[str, ReplicaWeights | str]:
    """What each live replica serves now, asked over gRPC (GetInfo): {replica_id: ReplicaWeights(run_id,
    version) | "<error>"}."""
    return await weights_of_each(await queue.replicas(), timeout=timeout, **queue.replica_auth)


async def broadcast_weights_async(
    queue: AsyncRolloutQueue, version: int, checkpoint_dir: str, timeout: float = 120.0
) -> dict[str, str]:
    """Publish `version` of the queue's run: record it (with `checkpoint_dir`) as the run's latest, make
    it the trainer's policy version, then UpdateWeights on every live replica concurrently, each
    bounded by `timeout`. Returns {replica_id: "ok" | "unchanged" | error} and logs the replicas left
    behind; raises BroadcastError when no live replica loaded it (none alive included),
    RunSuperseded when another trainer started a new run, ValueError when `version` does not move the
    run forward (0 may be published while the run is at 0: its starting weights)."""
    await queue.record_version(version, str(checkpoint_dir))
    return await _load_everywhere(queue, version, str(checkpoint_dir), timeout, skip_current=version == 0)


async def sync_replicas_async(queue: AsyncRolloutQueue, timeout: float = 120.0) -> dict[str, str]:
    """Make every live replica serve the run's current version (after a resume, or when replicas joined
    or were restarted): those already serving it are left alone ("unchanged"), the others load the
    run's recorded checkpoint — a replica serving another run reloads. Raises BroadcastError when no
    live replica serves it afterwards; ValueError when the run has published nothing yet."""
    await queue.open()
    run = queue.run
    if not run.checkpoint:
        raise ValueError(
            f"run {run.run_id} has published no weights yet (version {run.version}, no checkpoint): "
            "publish its starting weights first (CheckpointPublisher.start(model))"
        )
    return await _load_everywhere(queue, run.version, run.checkpoint, timeout, skip_current=True)


async def push_weights_async(
    queue: AsyncRolloutQueue,
    version: int,
    manifest: WeightsManifest,
    chunks: Chunks,
    timeout: float = 120.0,
    *,
    record: str | None = "stream",
    fingerprint: str = "",
    delta: tuple[WeightsManifest, Chunks] | None = None,
    sent: dict[str, str] | None = None,
) -> dict[str, str]:
    """Publish `version` with the tensors in the call (PushWeights: no shared filesystem), to every
    live replica concurrently, each bounded by `timeout`; `chunks()` yields (tensor index, offset,
    bytes) in `manifest` order and is called once per replica. `record` is what the run record's
    `checkpoint` says (how a replica that joins later gets this version, docs/records.md "Runs").
    record=None re-sends the run's current version to the live replicas that do not serve it (joined
    or restarted since) and records nothing; it raises nothing when every replica is current.
    fingerprint (version 0): the trainer's model's; replicas whose starting weights have it adopt the
    version instead of receiving it. Results and errors as `broadcast_weights`. A LoRA adapter
    (`manifest.adapter`) is pushed for the queue's namespace (`manifest.namespace`): a replica serves
    it when its current adapter of that namespace is this version of the run (GetInfo's adapters).
    delta: (manifest, chunks) of the same version as a delta on `manifest.base_version` of the run
    (weight_sync/delta.py): sent to the replicas that serve that base (GetInfo), the full version to the
    others and to every replica that refused the delta (a digest that did not match, a restart between
    the two calls), so none is ever left behind by it. `sent` is filled with {replica_id: "delta" |
    "full"} of each replica pushed."""
    await queue.open()
    if record is not None:
        await queue.record_version(version, record)
    manifest = replace(manifest, version=int(version), run_id=queue.run_id)
    if manifest.adapter is not None:
        manifest = replace(manifest, namespace=manifest.namespace or queue.namespace)
    adapter_ns = manifest.namespace if manifest.adapter is not None else None

    sent = {} if sent is None else sent

    async def send(reps: list[ReplicaInfo]) -> dict[str, str]:
        if delta is None:
            sent.update({rep.replica_id: "full" for rep in reps})
            return await push_each(reps, manifest, chunks, timeout=timeout, **queue.replica_auth)
        return await _send_delta(queue, reps, manifest, chunks, delta, timeout, sent)

    if record is None:
        return await _load_everywhere(
            queue,
            version,
            "",
            timeout,
            skip_current=True,
            send=send,
            quiet=True,
            fingerprint=fingerprint,
            adapter_namespace=adapter_ns,
        )
    return await _load_everywhere(
        queue,
        version,
        "",
        timeout,
        skip_current=version == 0,
        send=send,
        fingerprint=fingerprint,
        adapter_namespace=adapter_ns,
    )


async def _send_delta(
    queue: AsyncRolloutQueue,
    reps: list[ReplicaInfo],
    manifest: WeightsManifest,
    chunks: Chunks,
    delta: tuple[WeightsManifest, Chunks],
    timeout: float,
    sent: dict[str, str],
) -> dict[str, str]:
    """push_weights_async's delta: the delta where its base is served, the full version elsewhere and as
    the fallback of every refused delta."""
    auth = queue.replica_auth
    patch = replace(delta[0], version=manifest.version, run_id=manifest.run_id)
    serving = await weights_of_each(reps, timeout=min(timeout, 10.0), **auth)
    base = ReplicaWeights(manifest.run_id, int(patch.base_version))
    on_base = [rep for rep in reps if serving.get(rep.replica_id) == base]
    rest = [rep for rep in reps if rep not in on_base]
    patched, whole = await asyncio.gather(
        push_each(on_base, patch, delta[1], timeout=timeout, **auth),
        push_each(rest, manifest, chunks, timeout=timeout, **auth),
    )
    sent.update({rep.replica_id: "delta" for rep in on_base} | {rep.replica_id: "full" for rep in rest})
    refused = [rep for rep in on_base if patched[rep.replica_id] not in SERVING]
    if refused:
        log.warning(
            "policy version %d: the delta was refused by %s; sending them the full version",
            manifest.version,
            {rep.replica_id: patched[rep.replica_id] for rep in refused},
        )
        patched.update(await push_each(refused, manifest, chunks, timeout=timeout, **auth))
        sent.update({rep.replica_id: "full" for rep in refused})
    return {**patched, **whole}


async def adopt_replicas_async(
    queue: AsyncRolloutQueue, fingerprint: str, timeout: float = 10.0
) -> dict[str, str]:
    """A new run's version 0 on the live replicas that already hold it: those on their starting weights
    whose fingerprint is `fingerprint` (the trainer's model's) adopt it, no bytes sent. {replica_id: "ok" |
    error} of the replicas asked; the others are the caller's to load."""
    await queue.open()
    reps = await queue.replicas()
    serving = await weights_of_each(reps, timeout=timeout, **queue.replica_auth)
    same = [rep for rep in reps if adoptable(serving.get(rep.replica_id), fingerprint)]
    return await adopt_each(same, fingerprint, run_id=queue.run_id, timeout=timeout, **queue.replica_auth)


async def _load_everywhere(
    queue: AsyncRolloutQueue,
    version: int,
    checkpoint_dir: str,
    timeout: float,
    *,
    skip_current: bool,
    send: Callable[[list[ReplicaInfo]], Awaitable[dict[str, str]]] | None = None,
    quiet: bool = False,
    fingerprint: str = "",
    adapter_namespace: str | None = None,
) -> dict[str, str]:
    """`version` onto every live replica of `queue` (UpdateWeights of `checkpoint_dir`, or `send`).
    skip_current: replicas already serving this version of the run are left alone ("unchanged": a
    replica would refuse it as "not greater"). quiet: a catch-up (PushWeights of the current
    version): no live replica, or every one current, is not an error. fingerprint (version 0 only): the
    trainer's model's; replicas on starting weights of that fingerprint adopt version 0 instead
    ("adopted": no bytes sent). adapter_namespace: a LoRA adapter's push; "serving the version" is
    then that namespace's current adapter (weights_of_each)."""
    reps = await queue.replicas()
    auth, run_id = queue.replica_auth, queue.run_id
    results: dict[str, str] = {}
    if skip_current:
        serving = await weights_of_each(
            reps, timeout=min(timeout, 10.0), adapter_namespace=adapter_namespace, **auth
        )
        current = {r for r, w in serving.items() if w == ReplicaWeights(run_id, version)}
        results = {r: "unchanged" for r in current}
        reps = [rep for rep in reps if rep.replica_id not in current]
        if version == 0 and fingerprint:
            same = [rep for rep in reps if adoptable(serving.get(rep.replica_id), fingerprint)]
            adopted = await adopt_each(same, fingerprint, run_id=run_id, timeout=min(timeout, 10.0), **auth)
            results.update({r: "adopted" for r, e in adopted.items() if e == "ok"})
            reps = [rep for rep in reps if results.get(rep.replica_id) != "adopted"]
    if send is not None:
        results.update(await send(reps))
    else:
        results.update(
            await update_each(reps, version, checkpoint_dir, run_id=run_id, timeout=timeout, **auth)
        )
    failed = {r: e for r, e in results.items() if e not in SERVING}
    if quiet and (not results or not failed):
        return dict(sorted(results.items()))
    if not results or len(failed) == len(results):
        raise BroadcastError(version, results, queue.namespace)
    if failed:
        log.warning("policy version %d of run %s: replicas behind: %s", version, run_id, failed)
    return dict(sorted(results.items()))


# ---- the same, blocking, for a RolloutQueue ---------------------------------------------------------


def _blocking(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """`fn(queue.aio, ...)` run on the RolloutQueue's event loop: the same parameters and docstring."""

    @functools.wraps(fn)
    def run(queue: RolloutQueue, *args: Any, **kwargs: Any) -> T:
        return queue.run_on_loop(fn(queue.aio, *args, **kwargs))

    run.__name__ = run.__qualname__ = fn.__name__.removesuffix("_async")
    return run


replica_weights = _blocking(replica_weights_async)
broadcast_weights = _blocking(broadcast_weights_async)
sync_replicas = _blocking(sync_replicas_async)
push_weights = _blocking(push_weights_async)
adopt_replicas = _blocking(adopt_replicas_async)
