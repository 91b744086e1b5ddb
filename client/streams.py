"""The Redis Streams layout and primitives shared by replicas (server) and trainers (client).

Owns the key names, the stream-entry fields, the consumer groups and the three operations both sides
perform on a stream: create a group (`ensure_group`), consume an entry (`ack_and_delete`) and set aside
one nobody can decode (`dead_letter`). Knows nothing of what the payloads mean or of retries (the
caller's client carries the retry rule, see redis_conn.py).

One namespace per training run. Entries carry protobuf bytes (proto/maskroll/v1/rollout.proto):
prompt stream  {"job": PromptJob}
rollout stream {"r": RolloutRecord} or {"job_error": PromptJob, "reason": text} when a job cannot run
dead letters   {"stream", "id", "reason", "payload"} for entries no consumer could decode
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

log = logging.getLogger("maskroll.streams")

REPLICA_GROUP = "replicas"  # one consumer group on the prompt stream for all replicas
TRAINER_GROUP = "trainers"  # one consumer group on the rollout stream for the trainer(s)

F_JOB = b"job"
F_RECORD = b"r"
F_JOB_ERROR = b"job_error"
F_REASON = b"reason"


@dataclass(frozen=True)
class StreamKeys:
    """The Redis key names of one namespace (one training run), all under `maskroll:<namespace>:`."""

    namespace: str

    def _k(self, *parts: str) -> str:
        return ":".join(("maskroll", self.namespace, *parts))

    @property
    def prompts(self) -> str:
        """Prompt jobs, trainers → replicas (consumer group REPLICA_GROUP)."""
        return self._k("prompts")

    @property
    def rollouts(self) -> str:
        """Finished records and job failures, replicas → trainers (consumer group TRAINER_GROUP)."""
        return self._k("rollouts")

    @property
    def dead_letters(self) -> str:
        """Entries no consumer could decode, kept for inspection (never consumed)."""
        return self._k("dead")

    def replica(self, replica_id: str) -> str:
        """Heartbeat key of one replica (JSON with its address; expires when the replica stops)."""
        return self._k("replica", replica_id)

    @property
    def replica_pattern(self) -> str:
        """SCAN pattern matching every replica heartbeat key of the namespace."""
        return self._k("replica", "*")

    @property
    def done(self) -> str:
        """Sorted set of acked rollout ids scored by ack time: a later duplicate (a reclaimed, regenerated
        job) is skipped. One ZADD per ack and one ZMSCORE per read, whatever the batch size."""
        return self._k("done")


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    """Create the consumer group from the start of the stream; an existing group is fine (BUSYGROUP)."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def ack_and_delete(pipe, stream: str, group: str, *entry_ids: bytes) -> None:
    """Queue XACK + XDEL on a pipeline: a consumed entry leaves the stream, so XLEN is the backlog."""
    pipe.xack(stream, group, *entry_ids)
    pipe.xdel(stream, *entry_ids)


async def dead_letter(
    r: aioredis.Redis, keys: StreamKeys, stream: str, group: str, entry_id: bytes, fields: dict, reason: str
) -> None:
    """Move an entry no consumer can decode to the dead-letter stream, atomically with its ack."""
    log.warning("dead-lettering %s entry %s: %s", stream, entry_id, reason)
    payload = b"".join(fields.values()) if fields else b""
    pipe = r.pipeline(transaction=True)
    pipe.xadd(
        keys.dead_letters, {b"stream": stream, b"id": entry_id, b"reason": reason[:500], b"payload": payload}
    )
    ack_and_delete(pipe, stream, group, entry_id)
    await pipe.execute()
