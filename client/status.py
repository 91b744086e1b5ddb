"""What a namespace looks like in Redis right now, for people (`maskroll status`, `maskroll dead-letters`).

Read-only, except `drop_dead_letters` and `requeue_dead_letters`. Everything is gathered with bounded
reads: XLEN and XINFO GROUPS per partition, the newest `window` dead letters per partition, one SCAN of
the heartbeat keys. The result is plain data (JSON-ready dicts and lists); `maskroll.app.status` prints it.

A stream's backlog: consumed entries are acked *and deleted* (`streams.ack_and_delete`), so XLEN counts
the entries not yet consumed, of which the group's `pending` were delivered and not acked yet, and the
rest (`waiting`) were delivered to no consumer.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from maskroll.proto.redis_conn import transaction
from maskroll.proto.run_record import read_run
from maskroll.proto.streams import (
    F_JOB,
    F_RECORD,
    REPLICA_GROUP,
    REWARD_GROUP,
    TRAINER_GROUP,
    PartitionKeys,
    StreamKeys,
)

from .replicas import live_replicas, namespaces_with_replicas

__all__ = [
    "drop_dead_letters",
    "list_dead_letters",
    "namespace_keys",
    "namespace_status",
    "requeue_dead_letters",
]

DEAD_LETTER_WINDOW = 1000  # dead letters read per partition for the counts by reason


async def namespace_keys(r: aioredis.Redis, namespace: str, cluster: bool = False) -> StreamKeys:
    """The namespace's keys with the partition count it recorded (`StreamKeys.layout`; 1 if none)."""
    recorded = await r.get(StreamKeys(namespace).layout)
    return StreamKeys(namespace, int(recorded or 1), cluster)


async def _stream(r: aioredis.Redis, stream: str, group: str) -> dict:
    length = int(await r.xlen(stream))
    pending = 0
    if length:
        try:
            groups = await r.xinfo_groups(stream)
        except ResponseError:  # no such key (deleted meanwhile)
            groups = []
        for g in groups:
            name = g.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == group:
                pending = int(g.get("pending") or 0)
    return {"stream": stream, "length": length, "pending": pending, "waiting": max(0, length - pending)}


def _age_s(entry_id: bytes | str, now: float) -> float:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return max(0.0, now - int(text.split("-")[0]) / 1000)


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


_JOB_ID = re.compile(r"^job \S+ ")
_HEX_ID = re.compile(r"\b[0-9a-f]{16,}\b")


def reason_class(reason: str) -> str:
    """A dead letter's reason with its entry-specific ids left out (`job <id> dead-lettered: ...`, run
    ids), so that letters set aside for the same cause count together."""
    return _HEX_ID.sub("<id>", _JOB_ID.sub("job <id> ", reason))[:200]


async def namespace_status(r: aioredis.Redis, keys: StreamKeys, *, window: int = DEAD_LETTER_WINDOW) -> dict:
    """The namespace's run, live replicas, backlog per partition (prompts for the replica group,
    rollouts for the trainer group), and dead letters (total, and by reason over the newest `window`
    per partition). When no replica is live, `namespaces_with_replicas` says where replicas are."""
    now = time.time()
    run = await read_run(r, keys)
    reps = await live_replicas(r, keys)
    replicas = []
    for rep in reps:
        ttl_ms = await r.pttl(keys.replica(rep.replica_id))
        replicas.append(
            {
                "replica_id": rep.replica_id,
                "address": rep.address,
                "engine": rep.engine,
                "model": rep.model,
                "policy_version": rep.policy_version,
                "active_jobs": rep.active_jobs,
                "run_id": rep.extra.get("run_id", ""),
                "pulls": rep.pulls,
                "in_flight": int(rep.extra.get("in_flight", 0)),
                "tokens_per_s": float(rep.extra.get("tokens_per_s", 0.0)),
                "heartbeat_expires_in_s": round(ttl_ms / 1000, 1) if ttl_ms and ttl_ms > 0 else None,
            }
        )
    partitions, reasons, dead_total, dead_read = [], Counter(), 0, 0
    for part in keys.parts:
        dead_len = int(await r.xlen(part.dead_letters))
        dead_total += dead_len
        entries = await r.xrevrange(part.dead_letters, count=window) if dead_len else []
        dead_read += len(entries)
        reasons.update(reason_class(_text(f.get(b"reason", b""))) for _, f in entries)
        partitions.append(
            {
                "index": part.index,
                "prompts": await _stream(r, part.prompts, REPLICA_GROUP),
                "rollouts": await _stream(r, part.rollouts, TRAINER_GROUP),
                "finished": await _stream(r, part.finished, REWARD_GROUP),  # the reward stage's input
                "dead_letters": dead_len,
            }
        )

    def total(which: str) -> dict:
        return {k: sum(p[which][k] for p in partitions) for k in ("length", "pending", "waiting")}

    out = {
        "namespace": keys.namespace,
        "partitions": keys.partitions,
        "run": None,
        "replicas": replicas,
        "prompts": total("prompts"),
        "rollouts": total("rollouts"),
        "finished": total("finished"),
        "reward_workers": await reward_workers(r, keys),
        "by_partition": partitions,
        "dead_letters": {
            "total": dead_total,
            "read": dead_read,
            "by_reason": dict(reasons.most_common()),
        },
    }
    if run is not None:
        out["run"] = {
            "run_id": run.run_id,
            "version": run.version,
            "checkpoint": run.checkpoint,
            "started_by": run.started_by,
            "started_at": run.started_at,
            "updated_at": run.updated_at,
            "updated_ago_s": round(max(0.0, now - (run.updated_at or run.started_at)), 1),
        }
    if not replicas:
        out["namespaces_with_replicas"] = await namespaces_with_replicas(r)
    return out


async def reward_workers(r: aioredis.Redis, keys: StreamKeys) -> list[dict]:
    """The reward stage's live workers (maskroll.stages: their heartbeat JSON, counters included)."""
    out = []
    async for key in r.scan_iter(match=keys.rewarder_pattern, count=100):
        raw = await r.get(key)
        if raw is not None:  # None: expired between SCAN and GET
            out.append(json.loads(raw))
    return sorted(out, key=lambda w: w.get("worker_id", ""))


def _handle(keys: StreamKeys, part: PartitionKeys, entry_id: str) -> str:
    return entry_id if keys.partitions == 1 else f"{part.index}/{entry_id}"


async def list_dead_letters(r: aioredis.Redis, keys: StreamKeys, limit: int = 50) -> list[dict]:
    """The newest `limit` dead letters over every partition, newest first: {id (the partition first
    when there are several: "p/<entry id>"), partition, stream (where the entry was), entry (its id
    there), reason, age_s}."""
    now, out = time.time(), []
    for part in keys.parts:
        for entry_id, f in await r.xrevrange(part.dead_letters, count=limit):
            eid = _text(entry_id)
            out.append(
                {
                    "id": _handle(keys, part, eid),
                    "partition": part.index,
                    "stream": _text(f.get(b"stream", b"")),
                    "entry": _text(f.get(b"id", b"")),
                    "reason": _text(f.get(b"reason", b"")),
                    "age_s": round(_age_s(eid, now), 1),
                    "_ms": tuple(int(x) for x in eid.split("-")),
                }
            )
    out.sort(key=lambda d: d.pop("_ms"), reverse=True)
    return out[:limit]


async def drop_dead_letters(r: aioredis.Redis, keys: StreamKeys, letters: list[dict]) -> int:
    """Delete the dead letters listed (as `list_dead_letters` returns them); returns how many were."""
    by_part: dict[int, list[str]] = {}
    for d in letters:
        by_part.setdefault(int(d["partition"]), []).append(d["id"].rpartition("/")[2])
    dropped = 0
    for index, ids in by_part.items():
        dropped += int(await r.xdel(keys.part(index).dead_letters, *ids))
    return dropped


async def requeue_dead_letters(r: aioredis.Redis, keys: StreamKeys, letters: list[dict]) -> dict[str, str]:
    """Put the dead letters listed (as `list_dead_letters` returns them) back on the stream they came
    from — a prompt job for the replicas, a record for the trainer or the reward stage — as a new entry,
    deleting each letter in the same transaction. {id: "requeued" | why not}: a letter of a stream that is
    not its partition's prompt, finished or rollout stream, or whose payload is gone, stays.
    A record refused for what it is (another run, a version ahead) is refused again: requeue what failed
    for a passing reason (a replica's engine died, a reward function timed out)."""
    out = {}
    for d in letters:
        part = keys.part(int(d["partition"]))
        letter_id = d["id"].rpartition("/")[2]
        # a record the reward stage could not score goes back to its finished stream, to be scored again
        field = {part.prompts: F_JOB, part.rollouts: F_RECORD, part.finished: F_RECORD}.get(d["stream"])
        if field is None:
            out[d["id"]] = f"not requeued: {d['stream']!r} is not a stream of this namespace"
            continue
        got = await r.xrange(part.dead_letters, letter_id, letter_id)
        payload = got[0][1].get(b"payload", b"") if got else b""
        if not payload:
            out[d["id"]] = "not requeued: the letter (or its payload) is gone"
            continue
        pipe = transaction(r)
        pipe.xadd(d["stream"], {field: payload})
        pipe.xdel(part.dead_letters, letter_id)
        await pipe.execute()
        out[d["id"]] = "requeued"
    return out
