"""The Redis Streams layout and primitives shared by replicas (server) and trainers (client).

Owns the key names, the stream-entry fields, the consumer groups and the operations both sides perform on
a stream: create a group (`ensure_group`), consume an entry (`ack_and_delete`), set aside one nobody can
decode (`dead_letter`); taking, reclaiming and keeping entries as one consumer of a group is
`consumer.py`'s `GroupConsumer` (the prompt puller and the stage workers). Knows nothing of what the
payloads mean or of retries (the caller's client carries the retry rule, see redis_conn.py).

One namespace per training run, split into P partitions (default 1: the original key names); each
partition has its own streams, in one Redis Cluster slot (StreamKeys, docs/scaling.md "Redis Cluster").
Entries carry protobuf bytes (proto/maskroll/v1/rollout.proto):
prompt stream  {"job": PromptJob}
rollout stream {"r": RolloutRecord} or {"job_error": PromptJob, "reason": text} when a job cannot run,
               or {"reward_failed": RolloutRecord, "reason": text}: a record the reward stage
               dead-lettered, so that the trainer closes its group at once
finished stream {"r": RolloutRecord} of jobs scored by a reward stage (maskroll.stages), which publishes
               them, scored, to the rollout stream; job errors pass through unchanged
dead letters   {"stream", "id", "reason", "payload"} for entries no consumer could decode or use
                (a capped stream: the newest DEAD_LETTER_MAXLEN are kept for inspection)
run            a hash: the training run that owns the namespace (client/runs.py, docs/records.md)
session:<id>, session-lease:<id>, session-done:<id>
               an agent session's state, its one-call lease and its finish answer (partition 0;
               server/http_api/session_redis.py)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from .redis_conn import transaction

log = logging.getLogger("maskroll.streams")

REPLICA_GROUP = "replicas"  # one consumer group on the prompt stream for all replicas
TRAINER_GROUP = "trainers"  # one consumer group on the rollout stream for the trainer(s)
REWARD_GROUP = "rewarders"  # one consumer group on the finished stream for the reward workers
TEACHER_GROUP = "teachers"  # ... or for the teacher workers (maskroll teacher): a namespace runs one stage

# Dead letters are for inspection, never consumed: cap them (approximately, which is O(1) per XADD) so
# that a run's worth of refused records cannot fill Redis.
DEAD_LETTER_MAXLEN = 10_000

F_JOB = b"job"
F_RECORD = b"r"
F_JOB_ERROR = b"job_error"
F_REASON = b"reason"
F_REWARD_FAILED = b"reward_failed"


# A namespace may have at most this many partitions (each is a prompt and a rollout stream; a reader
# polls each, so thousands would cost more in idle reads than they spread).
MAX_PARTITIONS = 1024


@dataclass(frozen=True)
class PartitionKeys:
    """The keys of one partition of a namespace: its prompt and rollout streams, dead letters and done
    set. They share one hash tag, so in a Redis Cluster they sit in one slot: a transaction or script
    over them (ack + done marker, dead letter + ack) is allowed there."""

    namespace: str
    index: int
    prefix: str  # "maskroll:<ns>" (the single-node layout) or "maskroll:{<ns>:<index>}"

    @property
    def prompts(self) -> str:
        """Prompt jobs, trainers → replicas (consumer group REPLICA_GROUP)."""
        return f"{self.prefix}:prompts"

    @property
    def rollouts(self) -> str:
        """Finished records and job failures, replicas → trainers (consumer group TRAINER_GROUP). A job's
        records go to the rollout stream of the partition its job came from."""
        return f"{self.prefix}:rollouts"

    @property
    def dead_letters(self) -> str:
        """Entries no consumer could decode or use, with the reason, kept for inspection (never consumed)."""
        return f"{self.prefix}:dead"

    @property
    def done(self) -> str:
        """Sorted set of acked rollout ids scored by ack time: a later duplicate (a reclaimed, regenerated
        job) is skipped. One ZADD per ack and one ZMSCORE per read, whatever the batch size. Per
        partition: a rollout's duplicates come from its job, and a job lives on one partition."""
        return f"{self.prefix}:done"

    @property
    def finished(self) -> str:
        """Finished, unscored records of jobs a reward stage scores, replicas → reward workers (consumer
        group REWARD_GROUP); the trainer's queue names it as the jobs' rollout_stream (reward_stage=True)."""
        return f"{self.prefix}:finished"

    @property
    def scored(self) -> str:
        """Sorted set of rollout ids the reward stage has published, scored by time: a duplicate record
        (a reclaimed, regenerated job) is published to the rollout stream once (`forward`)."""
        return f"{self.prefix}:scored"

    # Agent sessions (server/http_api/session_redis.py) live in partition 0, the slot of the rollout
    # stream their records go to (and of its named streams `<rollouts>:<suffix>`), so that a finish
    # publishes and marks the session finished in one script, also on a Redis Cluster.
    def session(self, session_id: str) -> str:
        """Hash: an open agent session's state between turns (header, record in progress, turn count);
        expires session_idle_s after its last turn."""
        return f"{self.prefix}:session:{session_id}"

    def session_lease(self, session_id: str) -> str:
        """String: the owner token of the one call running on a session, fleet-wide (SET NX PX)."""
        return f"{self.prefix}:session-lease:{session_id}"

    def session_done(self, session_id: str) -> str:
        """Hash: a finished session's answer (its record and stream), so that a finish retried on any
        replica answers the same without publishing again; expires like the session."""
        return f"{self.prefix}:session-done:{session_id}"


@dataclass(frozen=True)
class StreamKeys:
    """The Redis key names of one namespace (one training run).

    partitions = 1 on a single Redis (the default) keeps the original layout, every key under
    `maskroll:<namespace>:`. With several partitions, or on a Redis Cluster, each partition's keys carry
    the hash tag `{<namespace>:<p>}` (one slot per partition, spread over the cluster's masters) and the
    run-level keys (run, replica registry) the tag `{<namespace>}`. The `prompts`, `rollouts`,
    `dead_letters` and `done` properties name partition 0's keys (the only partition by default)."""

    namespace: str
    partitions: int = 1
    cluster: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions={self.partitions}; expected 1..{MAX_PARTITIONS}")
        if self.tagged and ("{" in self.namespace or "}" in self.namespace):
            raise ValueError(f"namespace {self.namespace!r} may not contain braces (Redis Cluster hash tags)")

    @property
    def tagged(self) -> bool:
        """Whether keys carry hash tags (several partitions, or a Redis Cluster)."""
        return self.partitions > 1 or self.cluster

    def part(self, index: int) -> PartitionKeys:
        """The keys of partition `index` (0 ≤ index < partitions)."""
        if not 0 <= index < self.partitions:
            raise IndexError(f"partition {index} of namespace {self.namespace!r} with {self.partitions}")
        prefix = f"maskroll:{{{self.namespace}:{index}}}" if self.tagged else f"maskroll:{self.namespace}"
        return PartitionKeys(self.namespace, index, prefix)

    @property
    def parts(self) -> tuple[PartitionKeys, ...]:
        """Every partition's keys, in index order."""
        return tuple(self.part(i) for i in range(self.partitions))

    def _k(self, *parts: str) -> str:
        ns = f"{{{self.namespace}}}" if self.tagged else self.namespace
        return ":".join(("maskroll", ns, *parts))

    @property
    def prompts(self) -> str:
        """Partition 0's prompt stream (see PartitionKeys)."""
        return self.part(0).prompts

    @property
    def rollouts(self) -> str:
        """Partition 0's rollout stream; also where records go that no job routes (a Generate call's
        `publish`, agent sessions), and the parent of named rollout streams (`<rollouts>:<suffix>`)."""
        return self.part(0).rollouts

    @property
    def dead_letters(self) -> str:
        """Partition 0's dead letters (see PartitionKeys)."""
        return self.part(0).dead_letters

    @property
    def done(self) -> str:
        """Partition 0's done set (see PartitionKeys)."""
        return self.part(0).done

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
        return self._k("replica", "*")  # braces are not special in Redis's glob patterns

    def rewarder(self, worker_id: str) -> str:
        """Heartbeat key of one reward worker (JSON: its counters; expires when the worker stops)."""
        return self._k("rewarder", worker_id)

    @property
    def rewarder_pattern(self) -> str:
        """SCAN pattern matching every reward worker heartbeat key of the namespace."""
        return self._k("rewarder", "*")

    @property
    def layout(self) -> str:
        """String: the namespace's partition count, written by the first trainer or replica, checked by
        the others (`check_layout`). Named the same in every layout, so a mismatch is always found."""
        return f"maskroll:{self.namespace}:partitions"


async def check_layout(r: aioredis.Redis, keys: StreamKeys) -> None:
    """Record the namespace's partition count if none is recorded; raise ValueError naming both counts
    when another is (a trainer and replicas that disagree would never meet on a stream)."""
    await r.set(keys.layout, keys.partitions, nx=True)
    recorded = int(await r.get(keys.layout) or keys.partitions)
    if recorded != keys.partitions:
        raise ValueError(
            f"namespace {keys.namespace!r} has {recorded} partitions in Redis ({keys.layout}) but this "
            f"process was given {keys.partitions}: use partitions={recorded} (`maskroll serve --partitions "
            f"{recorded}`, RolloutQueue(..., partitions={recorded})) or another namespace"
        )


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
    keys: StreamKeys | PartitionKeys,
    stream: str,
    group: str,
    entry_id: bytes,
    fields: dict,
    reason: str,
    *,
    warn: bool = True,
    notify: tuple[str, dict] | None = None,
) -> None:
    """Move an entry no consumer can decode or use to the dead-letter stream of `keys` (the partition
    `stream` belongs to: one slot), atomically with its ack. warn=False: the caller reports it (e.g.
    once for many records of an old run). notify: (stream of the same partition, fields) added in the
    same transaction, to tell the next consumer (the reward stage tells the trainer)."""
    if warn:
        log.warning("dead-lettering %s entry %s: %s", stream, entry_id, reason)
    payload = b"".join(fields.values()) if fields else b""
    pipe = transaction(r)
    pipe.xadd(
        keys.dead_letters,
        {b"stream": stream, b"id": entry_id, b"reason": reason[:500], b"payload": payload},
        maxlen=DEAD_LETTER_MAXLEN,
        approximate=True,
    )
    if notify is not None:
        pipe.xadd(*notify)
    ack_and_delete(pipe, stream, group, entry_id)
    await pipe.execute()


# KEYS: the source stream, the destination stream, the set of ids forwarded. ARGV[1]: the source's group,
# ARGV[2]: the entry id, ARGV[3]: the id to deduplicate by, ARGV[4]: now, ARGV[5]: forget ids older than
# this, ARGV[6..]: the destination entry's fields and values. The ack decides: an entry another consumer
# already acked (it was reclaimed while we worked) is not forwarded again, nor is an id forwarded before.
_FORWARD = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
if redis.call('ZADD', KEYS[3], 'NX', ARGV[4], ARGV[3]) == 0 then return -1 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 6))
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[5])
return 1
"""


async def forward(
    r: aioredis.Redis,
    source: str,
    group: str,
    entry_id: bytes,
    destination: str,
    fields: dict,
    *,
    dedupe: str,
    dedupe_id: str,
    dedupe_ttl_s: float,
) -> int:
    """Consume `entry_id` of `source` (ack and delete, as ack_and_delete) and add `fields` to `destination`,
    in one script — one slot: the three keys must share a partition's hash tag. Returns 1 when forwarded,
    0 when the entry had already been acked (another consumer finished it), -1 when `dedupe_id` was
    forwarded before (kept in the sorted set `dedupe` for `dedupe_ttl_s`): at most once per id."""
    now = time.time()
    args: list = [group, entry_id, dedupe_id, now, now - dedupe_ttl_s]
    for key, value in fields.items():
        args += (key, value)
    return int(await r.eval(_FORWARD, 3, source, destination, dedupe, *args))


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
