"""One training run's queue for W data-parallel trainer ranks: rank 0 reads and scatters (issue 21).

Only rank 0 holds a `RolloutQueue`: it reads, runs admission control and the in-flight limit, acks, and
holds the run, the policy version and the replica registry, so those rules hold for the run as a whole
and every rank trains on records that passed one staleness check at one policy version. Each step rank
0 takes one *global* batch of whole GRPO groups (`batch_size` records, as for one process: W ranks take
the step one rank would take on the same records), splits it by groups into W shares balanced by
completion tokens (`batching.split_groups`) and scatters them; after every rank's optimiser step, `ack`
gathers every rank (a collective: all have arrived, so all have stepped) and rank 0 acks the global batch.

Rank 0's consumer name is stable for the namespace (`<namespace>-rank0`, not host and pid), so a rank 0
restarted by an elastic launcher re-reads its own unacked entries at once instead of waiting for
`claim_idle_s`. Records a published version already trained on (the recipe's exactly-once rule,
recipes/grpo.py) are named with `skip_trained` and acked untrained when they come back.

The ranks talk through a `Collective` (objects: records, versions, errors). This module never imports
torch: `maskroll.trainer_adapter.distributed.TorchCollective` is the torch.distributed one,
`SingleRank` (here) the one-rank one. An error on rank 0 (QueueTimeout, RunSuperseded, …) is raised on
every rank — the others would otherwise wait in the next collective forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from maskroll.proto.records import RolloutRecord

from .batching import group_key, split_groups

log = logging.getLogger("maskroll.ranks")

REFILL_S = 2.0  # next_batch(refill=...): seconds between refills while rank 0 waits for a batch

T = TypeVar("T")

# RolloutQueue members that only rank 0 can answer (its queue); elsewhere they raise ValueError.
MAIN_ONLY = frozenset(
    {
        "submit",
        "room",
        "replicas",
        "namespaces_with_replicas",
        "cancel_pending_jobs",
        "record_version",
        "set_policy_version",
        "run",
        "run_id",
        "stats",
        "namespace",
        "consumer",
        "in_flight",
        "max_in_flight",
        "replica_auth",
    }
)


class Collective(Protocol):
    """The control plane between trainer ranks: Python objects, every call a collective (every rank
    calls it, in the same order)."""

    rank: int
    world_size: int

    def broadcast(self, obj: object, src: int = 0) -> object:  # every rank gets src's obj
        ...

    def scatter(self, objs: list | None, src: int = 0) -> object:  # rank i gets objs[i] (objs on src only)
        ...

    def all_gather(self, obj: object) -> list:  # [rank 0's obj, rank 1's, …] on every rank
        ...

    def barrier(self) -> None: ...


class SingleRank:
    """The one-rank Collective (rank 0 of 1), with no torch: a one-process trainer on the same path."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: object, src: int = 0) -> object:
        return obj

    def scatter(self, objs: list | None, src: int = 0) -> object:
        if objs is None or len(objs) != 1:
            raise ValueError(f"scatter on one rank takes one object, got {objs!r}")
        return objs[0]

    def all_gather(self, obj: object) -> list:
        return [obj]

    def barrier(self) -> None:
        return None


class RankFailed(RuntimeError):
    """Rank 0 raised while the other ranks waited on it (the message names its error)."""


def _outcome(fn: Callable[[], T]) -> tuple[str, Any]:
    """("ok", value) or ("error", exception) of fn(): what rank 0 sends the others."""
    try:
        return "ok", fn()
    except Exception as e:  # sent to every rank and re-raised there (see _unwrap): never swallowed
        return "error", e


def _unwrap(outcome: tuple[str, Any], rank: int) -> Any:
    kind, value = outcome
    if kind == "ok":
        return value
    if rank == 0:
        raise value
    raise RankFailed(f"rank 0 failed: {value[0]}: {value[1]}")


def _portable(outcome: tuple[str, Any]) -> tuple[str, Any]:
    """An outcome safe to pickle: an error travels as (type name, message); rank 0 keeps the original."""
    kind, value = outcome
    return outcome if kind == "ok" else ("error", (type(value).__name__, str(value)))


class RankedQueue:
    """One training run's queue for W trainer ranks (rank 0 holds the RolloutQueue); a context manager.

    collective: the ranks (TorchCollective under torchrun; SingleRank for one process). url, namespace,
    queue_kwargs: RolloutQueue's, used on rank 0 only; `batch_size` is the **global** batch in records
    (the same number one process would train on per step; each rank gets about batch_size / W) and must
    hold at least W groups. consumer: rank 0's consumer name (default `<namespace>-rank0`, stable across
    restarts). With one rank it behaves exactly like a RolloutQueue (with that consumer name).

    Collective members (every rank calls them at the same point): construction, `policy_version`,
    `next_batch`, `ack`; `close` is each rank's own. Rank 0 only (ValueError elsewhere): `submit`,
    `room`, `replicas`, the run and its counters, `skip_trained` — every name in MAIN_ONLY, read from
    `queue`.
    """

    def __init__(
        self,
        collective: Collective,
        url: str,
        namespace: str = "default",
        *,
        consumer: str | None = None,
        **queue_kwargs: Any,
    ) -> None:
        self.collective = collective
        self.rank, self.world_size = collective.rank, collective.world_size
        self.queue = None
        self._skip: set[str] = set()
        self._global: list[RolloutRecord] | None = None  # rank 0: the batch the ranks hold now

        def open_queue():
            from .queue import RolloutQueue

            return RolloutQueue(url, namespace, consumer=consumer or f"{namespace}-rank0", **queue_kwargs)

        outcome, sent = None, None
        if self.is_main:
            outcome = _outcome(open_queue)
            self.queue = outcome[1] if outcome[0] == "ok" else None
            sent = ("ok", None) if outcome[0] == "ok" else _portable(outcome)
        # every rank learns whether rank 0 opened it (RunChoiceRequired, Redis away, …)
        status = self.collective.broadcast(sent)
        _unwrap(outcome if self.is_main else status, self.rank)

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that holds the queue."""
        return self.rank == 0

    # ---- collective ------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Rank 0's policy version (its run's), broadcast: the same on every rank. A collective."""
        return int(self.collective.broadcast(self.queue.policy_version if self.is_main else None))

    def next_batch(
        self, timeout: float | None = None, *, refill: Callable[[], object] | None = None
    ) -> list[RolloutRecord]:
        """This rank's share of the next global batch (whole groups, balanced by completion tokens). A
        collective. Rank 0's QueueTimeout / RunSuperseded is raised on rank 0 and, as RankFailed naming
        it, on every other rank. refill: rank 0 calls it every REFILL_S while it waits (a trainer's
        top-up of prompt jobs): records dropped as stale during the wait free in-flight room that only
        a new submit fills — without it a trainer that submits between steps can wait for records no
        job will make (after a restart, the previous life's jobs, unknown to admission, are read first
        and the new ones age). Ignored on the other ranks."""
        if self.is_main:
            outcome = _outcome(lambda: split_groups(self._read(timeout, refill), self.world_size))
            shares = outcome[1] if outcome[0] == "ok" else None
            if shares is not None and any(not s for s in shares):
                groups = len({group_key(r) for s in shares for r in s})
                outcome = (
                    "error",
                    ValueError(
                        f"a batch of {groups} groups cannot give each of {self.world_size} ranks a share: "
                        f"batch_size must hold at least {self.world_size} whole groups"
                    ),
                )
            if outcome[0] == "ok":
                self._global = [rec for share in shares for rec in share]
                payload = [("ok", share) for share in shares]
            else:
                payload = [_portable(outcome)] * self.world_size
            got = self.collective.scatter(payload)
            return _unwrap(outcome if outcome[0] == "error" else got, self.rank)
        return _unwrap(self.collective.scatter(None), self.rank)

    def ack(self, batch: Sequence[RolloutRecord]) -> None:
        """After this rank's optimiser step: wait for every rank (a collective), then rank 0 acks the
        whole global batch (RolloutQueue.ack). Each rank passes the share it trained on; a share that is
        not the one it was given raises on every rank, and nothing is acked."""
        shares = self.collective.all_gather(sorted(rec.rollout_id for rec in batch))
        outcome = None
        if self.is_main:

            def ack_global() -> None:
                held = sorted(rec.rollout_id for rec in self._global or [])
                trained = sorted(rid for share in shares for rid in share)
                if trained != held:
                    raise ValueError(
                        f"the ranks acked {len(trained)} records, not the {len(held)} of the batch they were "
                        "given: each rank must ack exactly its share of the last next_batch()"
                    )
                self.queue.ack(self._global)
                self._global = None

            outcome = _outcome(ack_global)
        status = self.collective.broadcast(_portable(outcome) if self.is_main else None)
        _unwrap(outcome if self.is_main else status, self.rank)

    def close(self, cancel_jobs: bool = False) -> None:
        """Rank 0 closes its queue (cancel_jobs: RolloutQueue.close's); unacked records stay pending for
        rank 0's consumer name, which a restarted rank 0 reads first."""
        if self.queue is not None:
            self.queue.close(cancel_jobs)
            self.queue = None

    def __enter__(self) -> RankedQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- rank 0 ----------------------------------------------------------------------------------

    @property
    def global_batch(self) -> list[RolloutRecord]:
        """Rank 0: every record of the batch the ranks hold now (all shares), until it is acked."""
        self._require_main("global_batch")
        return list(self._global or [])

    def skip_trained(self, rollout_ids: Iterable[str]) -> None:
        """Rank 0: records with these ids were trained on by a version the run has already published
        (a trainer killed between publishing and acking): when they are read again they are acked
        untrained, never handed to a rank."""
        self._require_main("skip_trained")
        self._skip.update(rollout_ids)

    def _wait(self, timeout: float | None, refill: Callable[[], object] | None, **kw) -> list[RolloutRecord]:
        """Rank 0: RolloutQueue.next_batch, calling `refill` every REFILL_S while it waits (what it has
        read meanwhile stays buffered in the queue)."""
        if refill is None:
            return self.queue.next_batch(timeout=timeout, **kw)
        from .reader import QueueTimeout  # redis: loaded with the queue, not with this module

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return self.queue.next_batch(timeout=REFILL_S if left is None else min(REFILL_S, left), **kw)
            except QueueTimeout:
                if left is not None and left <= REFILL_S:
                    raise
            refill()

    def _read(self, timeout: float | None, refill: Callable[[], object] | None) -> list[RolloutRecord]:
        """Rank 0: one global batch, without the records of `skip_trained` (acked as they come back).
        Whole groups stay whole: a trained batch was whole groups."""
        q = self.queue
        size = q.aio.batch_size  # the global batch (the sync facade does not expose it)
        batch = self._wait(timeout, refill)
        while True:
            trained = [rec for rec in batch if rec.rollout_id in self._skip]
            if not trained:
                return batch
            q.ack(trained)
            self._skip.difference_update(rec.rollout_id for rec in trained)
            log.warning(
                "acked %d records a published version already trained on (a restart between publish and "
                "ack), untrained",
                len(trained),
            )
            done = {rec.rollout_id for rec in trained}
            batch = [rec for rec in batch if rec.rollout_id not in done]
            if len(batch) >= size:
                return batch
            batch += self._wait(timeout, refill, at_least=size - len(batch))

    def _require_main(self, name: str) -> None:
        if not self.is_main:
            raise ValueError(
                f"RankedQueue.{name} is rank 0's (it holds the queue); this is rank {self.rank} of "
                f"{self.world_size}"
            )

    def __getattr__(self, name: str) -> Any:
        if name in MAIN_ONLY:
            self._require_main(name)
            return getattr(self.queue, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
