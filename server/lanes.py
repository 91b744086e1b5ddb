"""The namespaces one replica serves, a `Lane` each: `--namespace`, and with `--lora-namespaces` the further
LoRA runs on the same base (docs/lora.md "Several runs, one fleet").

A lane is one namespace's share of the replica's wiring: its key layout (its own partition count), the
publisher of its records, its puller (jobs sampled with that namespace's adapter), its registry heartbeat
(the run and version *that namespace* is served: `served`), and its join at start-up. What the lanes
share — the engine, the gRPC and HTTP front ends, the Redis connection, `pull_concurrency` — stays in
server/app.py. A replica without `--lora-namespaces` has one lane, wired exactly as before lanes existed.
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
class Lane:
    namespace: str
    keys: StreamKeys  # the namespace's layout (partitions, cluster)
    publisher: RolloutPublisher
    primary: bool  # --namespace (full weights may serve it), not one of --lora-namespaces
    label: str = ""  # appended to log lines and reasons: "" with one lane, " (namespace 'b')" with several
    puller: PromptPuller | None = None
    puller_task: asyncio.Task | None = None  # started once the lane has joined its run
    announce_task: asyncio.Task | None = None  # the registry heartbeat without a puller
    join_task: asyncio.Task | None = None  # retrying the join while the run record is invalid
    not_ready: str | None = None  # why this namespace cannot serve yet (joining; an invalid run record)

    def served(self, core) -> tuple[str, int]:
        """(run id, version) that samples this namespace's jobs (`core`: the replica's core.ReplicaCore):
        its run's current adapter; without one, for --namespace the weights the replica serves (its run
        and policy version, as ever), for a further namespace the base ("", 0)."""
        found = core.adapters.served(self.namespace)
        if found is not None:
            return found
        return core.updates.weights_served if self.primary else ("", 0)


async def open_lanes(config: ServerConfig, redis, cluster: bool, metrics: Metrics) -> list[Lane]:
    """A lane per namespace served, --namespace first. --namespace's layout is --partitions; a further
    namespace's is the partition count its trainer recorded (`StreamKeys.layout`), else --partitions
    (then recorded by its puller: a trainer that wants another count is told by `check_layout`)."""
    names = (config.namespace, *config.lora_namespaces)
    lanes = []
    for ns in names:
        partitions = config.partitions
        if ns != config.namespace:
            partitions = int(await redis.get(StreamKeys(ns).layout) or partitions)
        keys = StreamKeys(ns, partitions, cluster)
        if cluster:
            log.info("Redis Cluster detected: namespace %r in %d partitions", ns, keys.partitions)
        publisher = RolloutPublisher(
            redis,
            keys.rollouts,
            max_len=config.rollout_stream_max_len,
            wait_timeout_s=config.publish_wait_s,
            metrics=metrics,
            keys=keys,
        )
        label = f" (namespace {ns!r})" if len(names) > 1 else ""
        lanes.append(Lane(ns, keys, publisher, primary=ns == config.namespace, label=label))
    return lanes


def not_ready(lanes: list[Lane]) -> str | None:
    """The replica's reason not to serve (Generate refused, health NOT_SERVING), or None once every
    namespace has joined: the one reason when every lane has the same (starting, a single namespace),
    else each namespace's."""
    reasons: dict[str, list[str]] = {}
    for lane in lanes:
        if lane.not_ready:
            reasons.setdefault(lane.not_ready, []).append(lane.namespace)
    if not reasons:
        return None
    if len(reasons) == 1 and len(next(iter(reasons.values()))) == len(lanes):
        return next(iter(reasons))
    return "; ".join(f"namespace {', '.join(map(repr, nss))}: {why}" for why, nss in reasons.items())
