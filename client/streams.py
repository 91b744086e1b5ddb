"""The Redis Streams layout and primitives shared by replicas (server) and trainers (client).

Owns the key names, the stream-entry fields, the consumer groups and the three operations both sides
perform on a stream: create a group (`ensure_group`), consume an entry (`ack_and_delete`) and set aside
one nobody can decode (`dead_letter`). Knows nothing of what the payloads mean or of retries (the
caller's client carries the retry rule, see redis_conn.py).

One namespace per training run. Entries carry protobuf bytes (proto/maskroll/v1/rollout.proto):
prompt stream  {"job": PromptJob}
rollout stream {"r": RolloutRecord} or {"job_error": PromptJob, "reason": text} when a job cannot run
dead letters   {"stream", "id", "reason", "payload"} for entries no consumer could decode or use
                (a capped stream: the newest DEAD_LETTER_MAXLEN are kept for inspection)
run            a hash: the training run that owns the namespace (client/runs.py, docs/records.md)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

log = logging.getLogger("maskroll.streams")

REPLICA_GROUP = "replicas"  # one consumer group on the prompt stream for all replicas
TRAINER_GROUP = "trainers"  # one consumer group on the rollout stream for the trainer(s)

# Dead letters are for inspection, never consumed: cap them (approximately, which is O(1) per XADD) so
# that a run's worth of refused records cannot fill Redis.
DEAD_LETTER_MAXLEN = 10_000

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
        """Entries no consumer could decode or use, with the reason, kept for inspection (never consumed)."""
        return self._k("dead")

    @property
    def run(self) -> str:
        """Hash: the training run that owns the namespace — its id and version history (client/runs.py)."""
        return self._k("run")

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
    r: aioredis.Redis,
    keys: StreamKeys,
    stream: str,
    group: str,
    entry_id: bytes,
    fields: dict,
    reason: str,
    *,
    warn: bool = True,
) -> None:
    """Move an entry no consumer can decode or use to the dead-letter stream, atomically with its ack.
    warn=False: the caller reports it (e.g. once for many records of an old run)."""
    if warn:
        log.warning("dead-lettering %s entry %s: %s", stream, entry_id, reason)
    payload = b"".join(fields.values()) if fields else b""
    pipe = r.pipeline(transaction=True)
    pipe.xadd(
        keys.dead_letters,
        {b"stream": stream, b"id": entry_id, b"reason": reason[:500], b"payload": payload},
        maxlen=DEAD_LETTER_MAXLEN,
        approximate=True,
    )
    ack_and_delete(pipe, stream, group, entry_id)
    await pipe.execute()


# ARGV[1]: the group; ARGV[2..]: entry ids, or none for every entry. Deletes those the group has not
# delivered yet (ids after its last-delivered-id: XREADGROUP ">" hands entries out in id order), and
# returns their ids. One script, so no consumer can read an entry between the check and the XDEL.
_DELETE_UNDELIVERED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local last = '0-0'
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, lid
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then lid = g[i + 1] end
  end
  if name == ARGV[1] then last = lid end
end
local function after(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
local deleted = {}
if #ARGV > 1 then
  for i = 2, #ARGV do
    if after(ARGV[i], last) and redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then
      deleted[#deleted + 1] = ARGV[i]
    end
  end
  return deleted
end
local start = '(' .. last
while true do
  local entries = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1000)
  if #entries == 0 then break end
  for _, e in ipairs(entries) do
    redis.call('XDEL', KEYS[1], e[1])
    deleted[#deleted + 1] = e[1]
  end
  start = '(' .. entries[#entries][1]
end
return deleted
"""


async def delete_undelivered(
    r: aioredis.Redis, stream: str, group: str, entry_ids: list[bytes] | None = None
) -> list[bytes]:
    """Delete entries `group` has not delivered to any consumer yet — `entry_ids`, or all of them when
    None — and return the ids deleted. Delivered entries (a consumer started on them) are left alone."""
    if entry_ids is not None and not entry_ids:
        return []
    return await r.eval(_DELETE_UNDELIVERED, 1, stream, group, *(entry_ids or ()))
