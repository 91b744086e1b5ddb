"""The namespaces one replica serves, a `ServedNamespace` each: `--namespace`, and with `--lora-namespaces`
the further LoRA runs on the same base (docs/lora.md "Several runs, one fleet").

A ServedNamespace is one namespace's share of the replica's wiring: its key layout (its own partition
count), the publisher of its records, its puller (jobs sampled with that namespace's adapter), its registry
heartbeat (the run and version *that namespace* is served: `weights_served`), and its join at start-up.
What the namespaces share — the engine, the gRPC and HTTP front ends, the Redis connection,
`pull_concurrency` — stays in server/app.py. A replica without `--lora-namespaces` has one, wired exactly
as before several were served.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from maskroll.proto.streams import StreamKeys

from .config import ServerConfig
from .metrics import Metrics
from .pull.publisher import RolloutPublisher
from .pull.puller import PromptPuller

log = logging.getLogger(__name__)


@dataclass
class ServedNamespace:
    namespace: str
    keys: StreamKeys  # the namespace's layout (partitions, cluster)
    publisher: RolloutPublisher
    primary: bool  # --namespace (full weights may serve it), not one of --lora-namespaces
    label: str = (
        ""  # appended to log lines and reasons: "" with one namespace, " (namespace 'b')" with several
    )
    puller: PromptPuller | None = None
    puller_task: asyncio.Task | None = None  # started once the namespace has joined its run
    announce_task: asyncio.Task | None = None  # the registry heartbeat without a puller
    join_task: asyncio.Task | None = None  # retrying the join while the run record is invalid
    not_ready: str | None = None  # why this namespace cannot serve yet (joining; an invalid run record)

    def weights_served(self, core) -> tuple[str, int]:
        """(run id, version) that samples this namespace's jobs (`core`: the replica's core.ReplicaCore):
        its run's current adapter; without one, for --namespace the weights the replica serves (its run
        and policy version, as ever), for a further namespace the base ("", 0)."""
        found = core.adapters.served(self.namespace)
        if found is not None:
            return found
        return core.updates.weights_served if self.primary else ("", 0)


async def open_namespaces(
    config: ServerConfig, redis, cluster: bool, metrics: Metrics
) -> list[ServedNamespace]:
    """A ServedNamespace each,  --namespace first. --namespace's layout is --partitions; a further
    namespace's is the partition count its trainer recorded (`StreamKeys.layout`), else --partitions
    (then recorded by its puller: a trainer that wants another count is told by `check_layout`)."""
    names = (config.namespace, *config.lora_namespaces)
    served = []
    for name in names:
        partitions = config.partitions
        if name != config.namespace:
            partitions = int(await redis.get(StreamKeys(name).layout) or partitions)
        keys = StreamKeys(name, partitions, cluster)
        if cluster:
            log.info("Redis Cluster detected: namespace %r in %d partitions", name, keys.partitions)
        publisher = RolloutPublisher(
            redis,
            keys.rollouts,
            max_len=config.rollout_stream_max_len,
            wait_timeout_s=config.publish_wait_s,
            metrics=metrics,
            keys=keys,
        )
        label = f" (namespace {name!r})" if len(names) > 1 else ""
        served.append(ServedNamespace(name, keys, publisher, primary=name == config.namespace, label=label))
    return served


def not_ready(namespaces: list[ServedNamespace]) -> str | None:
    """The replica's reason not to serve (Generate refused, health NOT_SERVING), or None once every
    namespace has joined: the one reason when every namespace has the same (starting, a single namespace),
    else each namespace's."""
    reasons: dict[str, list[str]] = {}
    for ns in namespaces:
        if ns.not_ready:
            reasons.setdefault(ns.not_ready, []).append(ns.namespace)
    if not reasons:
        return None
    if len(reasons) == 1 and len(next(iter(reasons.values()))) == len(namespaces):
        return next(iter(reasons))
    return "; ".join(f"namespace {', '.join(map(repr, nss))}: {why}" for why, nss in reasons.items())
