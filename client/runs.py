"""The training run that owns a namespace: its identity and version history, kept in Redis.

One small hash per namespace, `maskroll:<ns>:run`: its fields and their encoding are the contract both
sides read (`maskroll.proto.run_record`: `RunInfo`, `read_run`; docs/records.md, "Runs").

A trainer either starts a new run (a new id: the namespace's prompt jobs no replica has started are
cancelled, and records of older runs are refused as they arrive) or resumes the current one (the same
id, continuing from `version`). Nothing mixes the two silently: opening a namespace that already has a
run without saying which raises `RunChoiceRequired`. `advance` records each published version
atomically, refusing a version that does not move forward and a trainer whose run was superseded by a
newer one. This module owns what only a trainer does with the run; it knows nothing of records,
batches or replicas.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

import redis.asyncio as aioredis

from maskroll.proto.redis_conn import transaction
from maskroll.proto.run_record import RunInfo, _mapping, _text, read_run
from maskroll.proto.streams import StreamKeys

__all__ = [
    "RunChoiceRequired",
    "RunError",
    "RunInfo",
    "RunMode",
    "RunNotFound",
    "RunSuperseded",
    "advance",
    "open_run",
    "read_run",
]

RunMode = Literal["new", "resume"]


class RunError(RuntimeError):
    """The namespace's run is not the one this trainer may use."""


class RunChoiceRequired(RunError):
    """The namespace already has a run and the trainer said neither run="new" nor run="resume"."""


class RunNotFound(RunError):
    """run="resume" on a namespace with no run to resume."""


class RunSuperseded(RunError):
    """Another trainer started a new run on this namespace: this trainer's run is over."""


def new_run_id() -> str:
    return uuid.uuid4().hex


# Creates the run only if the namespace has none; returns {created, HGETALL}. Atomic, so two trainers
# opening a fresh namespace at once cannot both believe they started it.
_CREATE_IF_ABSENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, redis.call('HGETALL', KEYS[1])} end
redis.call('HSET', KEYS[1], unpack(ARGV))
return {1, redis.call('HGETALL', KEYS[1])}
"""

# ARGV: run_id, version, checkpoint, now. The version must move forward (0 may be re-announced while the
# run is at 0: publishing the starting weights); the run must still be the namespace's.
_ADVANCE = """
local cur = redis.call('HGET', KEYS[1], 'run_id')
if cur ~= ARGV[1] then return {'superseded', cur or ''} end
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local nv = tonumber(ARGV[2])
if nv < v or (nv == v and nv ~= 0) then return {'behind', tostring(v)} end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'checkpoint', ARGV[3], 'updated_at', ARGV[4])
return {'ok', ARGV[2]}
"""


async def open_run(
    r: aioredis.Redis, keys: StreamKeys, mode: RunMode | None, trainer: str
) -> tuple[RunInfo, bool]:
    """(the run this trainer uses, whether it is new). mode None starts a run only on a namespace that
    has none and otherwise raises RunChoiceRequired; "new" replaces the namespace's run; "resume"
    continues it (RunNotFound if there is none)."""
    if mode not in (None, "new", "resume"):
        raise ValueError(
            f"run={mode!r}; expected 'new', 'resume' or None (new only if the namespace has none)"
        )
    if mode == "resume":
        run = await read_run(r, keys)
        if run is None:
            raise RunNotFound(
                f"run='resume' but namespace {keys.namespace!r} has no run to resume; pass run='new'"
            )
        return run, False
    now = time.time()
    fresh = RunInfo(run_id=new_run_id(), started_at=now, updated_at=now, started_by=trainer)
    if mode == "new":
        pipe = transaction(r)
        pipe.delete(keys.run)
        pipe.hset(keys.run, mapping=_mapping(fresh))
        await pipe.execute()
        return fresh, True
    flat = [x for kv in _mapping(fresh).items() for x in kv]
    created, h = await r.eval(_CREATE_IF_ABSENT, 1, keys.run, *flat)
    run = RunInfo.from_hash(dict(zip(h[::2], h[1::2], strict=True)))
    if not created:
        raise RunChoiceRequired(
            f"namespace {keys.namespace!r} already has {run.describe()}. Choose: run='resume' continues it "
            f"from version {run.version}; run='new' starts a new run (the old run's unstarted jobs are "
            "cancelled and its records refused)"
        )
    return run, True


async def advance(r: aioredis.Redis, keys: StreamKeys, run_id: str, version: int, checkpoint: str) -> None:
    """Record `version` (at `checkpoint`) as the run's latest. Raises RunSuperseded if the namespace now
    belongs to another run, ValueError if `version` does not move the run forward."""
    status, detail = await r.eval(
        _ADVANCE, 1, keys.run, run_id, str(int(version)), checkpoint, repr(time.time())
    )
    status, detail = _text(status), _text(detail)
    if status == "superseded":
        current = f"run {detail}" if detail else "no run (its record was deleted)"
        raise RunSuperseded(
            f"namespace {keys.namespace!r} now belongs to {current}, not to this trainer's run {run_id}: "
            "another trainer started a new run; stop this one (or open the queue with run='resume')"
        )
    if status == "behind":
        raise ValueError(
            f"policy version {version} does not move run {run_id} forward: it is at version {detail} "
            "(versions increase by publish; after a restart, open the queue with run='resume')"
        )
