"""Agent sessions fleet-wide: their state between turns, the one-call-at-a-time lease and the finish marker,
in the namespace's Redis, so that any replica of the namespace serves a session's next turn or finish.

Three keys per session, in partition 0's slot (`proto.streams.PartitionKeys.session*`, the slot of the
rollout stream the record goes to):

- state (hash `h` header, `r` record in progress, `seq` turns saved; `state`'s codec): written
  after every turn, expiring `ttl_s` (session_idle_s) after it — the same bound as a session in memory;
- lease (string: the owner's random token, SET NX PX `lease_s`): held by the one call running on the
  session anywhere in the fleet, renewed every lease_s / 3 while it runs, released by compare-and-delete.
  A replica that dies mid-call leaves it to expire: the session is busy (409) for at most lease_s;
- done (hash: the finished record and its stream): a finish retried on any replica answers from it.

Every write is fenced by the lease inside one Lua script (the write happens only while the writer still
holds it), so a call whose lease expired (a replica stalled past lease_s) can never overwrite the turn
another replica recorded since. The finish is one script too: lease check, XADD of the record, the done
marker and the deletion of the state, all or nothing — a crash before it leaves the session open (a
retried finish publishes), a crash after it leaves the marker (a retried finish answers without
publishing). Knows nothing of HTTP, engines or the OpenAI calls.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from maskroll.proto.streams import F_RECORD, PartitionKeys

from ...errors import AlreadyExists, InvalidArgument
from .state import decode_state, encode_state
from .trajectory import Session

log = logging.getLogger(__name__)

# How long a lease outlives its holder: the time a session stays busy (409) after its replica died
# mid-call. Renewed every LEASE_S / 3, so a call survives two missed renewals (a Redis hiccup).
LEASE_S = 15.0
# A state larger than this is refused (the call answers 400): max_session_tokens bounds the record, this
# bounds what the header adds (a conversation's text; 16 + 8·K bytes a token put 32k tokens at 5 MB).
MAX_STATE_BYTES = 64 << 20

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease, state, done. ARGV: owner, header, record, seq (this save's), ttl ms. 1 = saved; 0 = the
# lease is not ours; -1 = the stored state is not the one this turn followed (seq - 1).
_SAVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local seq = tonumber(redis.call('HGET', KEYS[2], 'seq') or '0')
if seq ~= tonumber(ARGV[4]) - 1 then return -1 end
redis.call('HSET', KEYS[2], 'h', ARGV[2], 'r', ARGV[3], 'seq', ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('DEL', KEYS[3])
return 1
"""
# KEYS: lease, state, done. ARGV: owner, ttl ms. A deleted session leaves a tombstone in `done` (no
# record), so that a replica still holding a copy does not bring it back (SessionRedis.status).
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('DEL', KEYS[2]) == 0 then return 0 end
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'deleted', '1')
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 1
"""
# KEYS: lease, state, done, stream. ARGV: owner, record, stream name, ttl ms, publish (1/0), field.
# 1 = published and marked; 0 = the lease is not ours (nothing written).
_FINISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[5] == '1' then redis.call('XADD', KEYS[4], '*', ARGV[6], ARGV[2]) end
redis.call('HSET', KEYS[3], 'r', ARGV[2], 'stream', ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
redis.call('DEL', KEYS[2])
return 1
"""


class LeaseLost(RuntimeError):
    """The lease expired while its call ran (its replica stalled past lease_s) and may be another's now,
    or the stored state is not the one the call started from: either way its write is refused."""


class Lease:
    """One call's hold on a session, fleet-wide: renewed while held, released once (compare-and-delete)."""

    def __init__(self, redis: aioredis.Redis, key: str, token: str, lease_s: float) -> None:
        self.redis, self.key, self.token, self.lease_s = redis, key, token, lease_s
        self.lost = False
        self._renewer: asyncio.Task | None = asyncio.create_task(self._renew(), name=f"lease:{key}")

    async def _renew(self) -> None:
        ms = int(self.lease_s * 1000)
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                if not await self.redis.eval(_RENEW, 1, self.key, self.token, ms):
                    self.lost = True  # the fenced writes will refuse; nothing more to renew
                    return
            except Exception as exc:  # a missed renewal: the next may succeed before the expiry
                log.warning("renewing %s failed: %s: %s", self.key, type(exc).__name__, exc)

    def _stop(self) -> None:
        task, self._renewer = self._renewer, None
        if task is not None:
            task.cancel()

    async def release(self) -> bool:
        """Give the lease up (only if still ours); whether it was. Idempotent; Redis errors are logged:
        the lease then expires by itself."""
        if self._renewer is None:
            return False
        self._stop()
        try:
            return bool(await self.redis.eval(_RELEASE, 1, self.key, self.token))
        except Exception as exc:
            log.warning("releasing %s failed (it expires in %g s): %s", self.key, self.lease_s, exc)
            return False

    def close(self) -> None:
        """Release from synchronous code (a response given up): scheduled on the running loop, or left to
        expire when there is none (a garbage-collected call)."""
        if self._renewer is None:
            return
        try:
            asyncio.get_running_loop().create_task(self.release())
        except RuntimeError:
            self._stop()


class SessionRedis:
    """The namespace's sessions in Redis (see the module docstring). ttl_s: how long a session's state
    and its finish answer live after their last write."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: PartitionKeys,
        *,
        ttl_s: float,
        lease_s: float = LEASE_S,
        cluster: bool = False,
    ) -> None:
        self.redis, self.keys, self.lease_s, self.cluster = redis, keys, lease_s, cluster
        self.ttl_ms = max(1, int(ttl_s * 1000))

    async def lease(self, session_id: str) -> Lease:
        """Take the session's lease, or AlreadyExists (409) while any replica's call holds it."""
        key, token = self.keys.session_lease(session_id), secrets.token_hex(16)
        if not await self.redis.set(key, token, nx=True, px=int(self.lease_s * 1000)):
            raise AlreadyExists(
                f"session {session_id!r} has a call running (on this or another replica); a session's "
                "calls take turns"
            )
        return Lease(self.redis, key, token, self.lease_s)

    async def seq(self, session_id: str) -> int:
        """Turns saved of the session's open episode; 0 when none is stored (new, finished or expired)."""
        return int(await self.redis.hget(self.keys.session(session_id), "seq") or 0)

    async def status(self, session_id: str) -> tuple[int, bool]:
        """(seq, ended): the turns saved of the open episode (0: none stored) and whether its last episode
        ended here (finished or deleted: a copy a replica still holds is stale). Neither means a new
        session, or one Redis lost (restarted without persistence) or expired."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.session(session_id), "seq")
        pipe.exists(self.keys.session_done(session_id))
        seq, ended = await pipe.execute()
        return int(seq or 0), bool(ended)

    async def load(self, session_id: str) -> Session | None:
        """The stored session (its `seq` set), or None."""
        got = await self.redis.hmget(self.keys.session(session_id), ["h", "r", "seq"])
        if got[0] is None:
            return None
        s = decode_state(got[0], got[1])
        s.seq = int(got[2])
        return s

    async def save(self, lease: Lease, s: Session) -> None:
        """Store `s` after its latest turn (fenced by `lease`); s.seq counts the save. LeaseLost when the
        lease is no longer ours or the stored state moved on without us (a writer that lost its turn)."""
        header, record = encode_state(s)
        if len(header) + len(record) > MAX_STATE_BYTES:
            raise InvalidArgument(
                f"session {s.id!r}'s state is {len(header) + len(record)} bytes; at most {MAX_STATE_BYTES} "
                "(finish it, or start a new session)"
            )
        k = self.keys
        keys = (lease.key, k.session(s.id), k.session_done(s.id))
        got = await self.redis.eval(_SAVE, 3, *keys, lease.token, header, record, s.seq + 1, self.ttl_ms)
        if got == 0:
            raise LeaseLost(f"session {s.id!r}: the call's lease expired before its turn was saved")
        if got == -1:
            raise LeaseLost(f"session {s.id!r}: the stored state is not the one this turn followed")
        s.seq += 1

    async def finished(self, session_id: str) -> tuple[bytes, str] | None:
        """(encoded record, stream) of the session's finished episode, while its marker lives (not of a
        deleted one)."""
        got = await self.redis.hmget(self.keys.session_done(session_id), ["r", "stream"])
        return None if got[0] is None else (got[0], got[1].decode())

    async def finish(
        self, lease: Lease, session_id: str, record: bytes, stream: str, *, max_len: int, wait_s: float
    ) -> bool:
        """Publish `record` to `stream` and mark the session finished, atomically (one script), waiting up
        to `wait_s` for room (at most `max_len` unconsumed entries, or Redis out of memory). True when
        published; False when the lease is not ours (nothing written); TimeoutError past wait_s."""
        k = self.keys
        # On a Redis Cluster a script's keys share a slot: a stream outside partition 0's (another
        # partition's finished stream) is published first, then marked — the one window where a crash
        # between the two would let a retried finish publish again (the trainer dedupes by rollout id).
        apart = self.cluster and _slot_tag(stream) != _slot_tag(k.rollouts)
        keys = (lease.key, k.session(session_id), k.session_done(session_id), k.rollouts if apart else stream)
        deadline = time.monotonic() + wait_s
        while True:
            if await self.redis.xlen(stream) < max_len:
                try:
                    if apart:
                        if lease.lost:
                            return False
                        await self.redis.xadd(stream, {F_RECORD: record})
                    got = await self.redis.eval(
                        _FINISH,
                        4,
                        *keys,
                        lease.token,
                        record,
                        stream,
                        self.ttl_ms,
                        "0" if apart else "1",
                        F_RECORD,
                    )
                    return bool(got)
                except ResponseError as e:
                    if "OOM" not in str(e):
                        raise
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rollout stream {stream} stayed full for {wait_s:g} s")
            await asyncio.sleep(0.25)

    async def delete(self, lease: Lease, session_id: str) -> bool:
        """Drop the session's state, leaving a tombstone (fenced by `lease`); whether a state existed.
        LeaseLost when the lease is no longer ours."""
        k = self.keys
        keys = (lease.key, k.session(session_id), k.session_done(session_id))
        got = await self.redis.eval(_DELETE, 3, *keys, lease.token, self.ttl_ms)
        if got == -1:
            raise LeaseLost(f"session {session_id!r}: the delete's lease expired")
        return bool(got)


def _slot_tag(key: str) -> str:
    """The part of `key` Redis Cluster hashes: its first non-empty {...} hash tag, else the whole key."""
    a = key.find("{")
    if a < 0:
        return key
    b = key.find("}", a + 1)
    return key[a + 1 : b] if b > a + 1 else key
