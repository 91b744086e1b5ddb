"""Entries the reader sets aside, and the handles it keeps for entries it has read.

`DeadLetters` moves one rollout-stream entry to its partition's dead-letter stream with the reason
(acked and deleted in the same transaction: streams.dead_letter) and counts it in the queue's stats, by
refusal kind; a read's refusals are reported in one warning (a new run may refuse thousands).
`Handles` names an unacked entry across partitions (entry ids are per stream and may repeat).
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterable

from maskroll.proto.streams import TRAINER_GROUP, PartitionKeys, dead_letter

from .batching import RefusalKind
from .queue_state import QueueState

log = logging.getLogger("maskroll.queue")


class Handles:
    """Stream entries by partition: the handle kept for an unacked entry, and the read rotation."""

    def __init__(self, state: QueueState) -> None:
        self.state = state
        self._turn = random.randrange(state.keys.partitions)  # the partition the next read starts with

    def rotation(self) -> list[PartitionKeys]:
        """The partitions, starting with the next one in turn (so that none is always read last)."""
        parts = self.state.keys.parts
        self._turn = (self._turn + 1) % len(parts)
        return [*parts[self._turn :], *parts[: self._turn]]

    def entry(self, part: int, entry_id: bytes) -> bytes:
        """The handle of a rollout-stream entry kept while it is unacked: its id, prefixed with its
        partition when there are several (entry ids are per stream and may repeat across partitions)."""
        return entry_id if self.state.keys.partitions == 1 else b"%d/%s" % (part, entry_id)

    def split(self, handle: bytes) -> tuple[PartitionKeys, bytes]:
        """(partition keys, stream entry id) of an `entry` handle."""
        keys = self.state.keys
        if keys.partitions == 1:
            return keys.part(0), handle
        part, _, entry_id = handle.partition(b"/")
        return keys.part(int(part)), entry_id

    def by_partition(self, handles: Iterable[bytes]) -> dict[PartitionKeys, list[bytes]]:
        out: dict[PartitionKeys, list[bytes]] = {}
        for handle in handles:
            part, entry_id = self.split(handle)
            out.setdefault(part, []).append(entry_id)
        return out


class DeadLetters:
    """Sets entries aside with their reason; `refused` counts them by kind (for logs and timeouts)."""

    def __init__(self, state: QueueState, handles: Handles) -> None:
        self.state, self.handles = state, handles
        self.refused: Counter[str] = Counter()
        self.last_reason: dict[str, str] = {}  # per kind, the latest refusal's reason (for timeouts)
        self._reported: Counter[str] = Counter()  # what report() has logged of it

    def streams(self) -> str:
        """Where the dead letters are: one stream per partition."""
        return ", ".join(p.dead_letters for p in self.state.keys.parts)

    async def letter(
        self,
        entry_id: bytes,
        fields: dict,
        reason: str,
        kind: RefusalKind | None,
        *,
        warn: bool | None = None,
    ) -> None:
        """Dead-letter one entry (an `entry` handle); `kind` counts it as a refusal of that kind."""
        s = self.state
        part, raw_id = self.handles.split(entry_id)
        await s.call(
            dead_letter(
                s.r,
                part,
                part.rollouts,
                TRAINER_GROUP,
                raw_id,
                fields,
                reason,
                warn=kind == "invalid" if warn is None else warn,  # the others are reported per read
            )
        )
        s.stats.dead_lettered += 1
        if kind is not None:
            setattr(s.stats, kind, getattr(s.stats, kind) + 1)
            self.refused[kind] += 1
            self.last_reason[kind] = reason

    def report(self) -> None:
        """One warning per read for the records refused in it (a new run may refuse thousands)."""
        new = self.refused - self._reported
        if new:
            s = self.state
            log.warning(
                "namespace %r, run %s at version %d: dead-lettered %s (reasons in %s)",
                s.keys.namespace,
                s.require_run().run_id,
                s.policy_version,
                dict(new),
                self.streams(),
            )
            self._reported = Counter(self.refused)
