"""The Redis connection policy shared by trainers (client) and replicas (server): one retry rule, one error.

`connect()` / `open_redis()` build every Redis client maskroll uses, with redis-py's `Retry` +
exponential backoff (STYLE.md §8). `REDIS_DOWN` names what counts as "Redis unreachable"; past the
retry budget, `call()` turns it into `QueueUnavailable` naming the URL, so a trainer sees one plain
error instead of a socket exception from deep inside redis-py. A URL carries the Redis password: every
message that names one goes through `redact` first (replicas also pass their log lines through it).
Knows nothing of streams, jobs or records.

Redis Cluster: `open_redis()` asks the node the URL names whether it runs in cluster mode (`INFO cluster`)
and then returns redis-py's cluster client, which follows MOVED / ASK itself. What it does not do is wait
out a failover: while a dead master's slots are not yet taken over by its replica (the cluster's
node-timeout, then an election) a command fails fast with a connection error or CLUSTERDOWN. So the
cluster client's single commands go through one more named retry (`CLUSTER_RETRY_ON`, exponential
backoff, `failover_budget_s` in all); its pipelines already retry with backoff inside redis-py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import BasicKeyCommands, HashCommands, SortedSetCommands, StreamCommands
from redis.exceptions import ClusterDownError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .redaction import redact

T = TypeVar("T")

# The client retries only these itself (a dropped or slow socket); the wider set below is what still
# reaches the caller once that budget is spent, whichever layer raised it.
RETRY_ON = (RedisConnectionError, RedisTimeoutError)
# A cluster in failover: the slot's master is unreachable (until its replica is promoted), the cluster
# says CLUSTERDOWN / MASTERDOWN (ClusterDownError covers both) or TRYAGAIN (a slot being migrated).
CLUSTER_RETRY_ON = (*RETRY_ON, ClusterDownError, TryAgainError, SlotNotCoveredError)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, *CLUSTER_RETRY_ON[2:])
# Long enough for Redis's default failover (cluster-node-timeout 15 s, then an election of about a second).
FAILOVER_BUDGET_S = 30.0

log = logging.getLogger("maskroll.redis")


class QueueUnavailable(ConnectionError):
    """Redis stayed unreachable through the whole retry budget."""


# redis-py opens its asyncio streams with asyncio's default 64 KiB buffer limit. A reply past twice that
# (one 1k-token record is ~177 kB, a trainer's read ~10-20 MB) makes the stream pause and resume the
# socket every 64 KiB or so, an epoll_ctl each time: ~7 % of a trainer's consumer CPU (docs/benchmarks.md,
# "Queue"). The limit only says when to stop reading ahead; a reply is read whole either way.
READ_LIMIT = 16 << 20


class Pieces:
    """One bulk-string argument given as the buffers it is made of, in order: a connection of
    `connect` / `connect_cluster` hands them to the socket's write one after the other, as redis-py does
    with any large argument, rather than joined into a value of their own first. A record's payload is
    its header and its arrays (wire.record_pieces): joining them cost a replica a copy of every record
    it published and, by the heap's state, the page faults of a fresh buffer, at 8k tokens a record up
    to over half of its publishing CPU (docs/benchmarks.md, "Queue"). (Python 3.11's asyncio still
    joins a whole write, every command of a MULTI, before the send: one copy, as for any redis-py
    value.) The buffers must not change until the command's reply has come or its connection is
    closed. Plain redis-py clients cannot send one: `sends_pieces` says which can."""

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: list) -> None:
        """pieces: bytes, or any C-contiguous buffer (a numpy array), sent as its bytes."""
        self.pieces = [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in pieces]
        self.nbytes = sum(map(len, self.pieces))

    def __len__(self) -> int:
        return self.nbytes


def _pack_pieces(encoder, args: tuple) -> list:
    """redis-py's pack_command (a RESP array of bulk strings) of `args`, each Pieces argument's buffers
    placed as they are; pack_commands then sends the memoryviews unjoined and joins the small bytes with
    their neighbours, as it does for redis-py's own output."""
    if isinstance(args[0], str):  # a command name given as "CONFIG GET" is two arguments, as in redis-py
        args = (*args[0].encode().split(), *args[1:])
    out: list = []
    buff: list = [b"*%d\r\n" % len(args)]
    for a in args:
        if type(a) is Pieces:
            buff.append(b"$%d\r\n" % a.nbytes)
            out.append(b"".join(buff))
            out += a.pieces
            buff = [b"\r\n"]
        else:
            a = encoder.encode(a)
            buff += (b"$%d\r\n" % len(a), a, b"\r\n")
    out.append(b"".join(buff))
    return out


@functools.cache
def _connection_class(cls: type) -> type:
    """`cls` (a redis-py asyncio connection class) sending `Pieces` arguments and, over TCP or TLS, opening
    its stream with `READ_LIMIT` (a unix socket opens its own)."""

    def pack_command(self, *args) -> list:
        if any(type(a) is Pieces for a in args):
            return _pack_pieces(self.encoder, args)
        return cls.pack_command(self, *args)

    body: dict = {"pack_command": pack_command, "sends_pieces": True}
    if issubclass(cls, aioredis.Connection):

        def _connection_arguments(self):
            return {**cls._connection_arguments(self), "limit": READ_LIMIT}

        body["_connection_arguments"] = _connection_arguments
    return type(cls.__name__, (cls,), body)


def sends_pieces(r: aioredis.Redis | RedisCluster) -> bool:
    """Whether `r`'s connections send `Pieces` arguments (those of `connect` and `connect_cluster` do)."""
    if isinstance(r, RedisCluster):
        cls = r.nodes_manager.connection_kwargs.get("connection_class")
    else:
        cls = r.connection_pool.connection_class
    return bool(getattr(cls, "sends_pieces", False))


def connect(url: str, *, retries: int = 10, socket_timeout: float = 10.0) -> aioredis.Redis:
    """A Redis client with an explicit retry rule: connection errors and timeouts, exponential backoff
    capped at 2 s, `retries` attempts (≈ 15 s in all by default). TLS and passwords come from the URL
    (rediss://, redis://:password@host)."""
    r = aioredis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(RETRY_ON),
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        health_check_interval=30,
    )
    r.connection_pool.connection_class = _connection_class(r.connection_pool.connection_class)
    return r


def connect_cluster(
    url: str, *, retries: int = 10, socket_timeout: float = 10.0, failover_budget_s: float = FAILOVER_BUDGET_S
) -> RedisCluster:
    """redis-py's cluster client for the cluster `url` names one node of (it discovers the others),
    with the same timeouts as `connect` and single commands retried through a failover (see above)."""
    rc = RedisCluster.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        health_check_interval=30,
    )
    # The nodes it discovers are made from these arguments; the startup node (the URL's) exists already.
    kw = rc.nodes_manager.connection_kwargs
    kw["connection_class"] = _connection_class(kw.get("connection_class", aioredis.Connection))
    for node in rc.nodes_manager.startup_nodes.values():  # no connection is open yet: made on first use
        node.connection_class = kw["connection_class"]
    # Every command method of the client ends in this one call; pipelines have their own (which retry).
    rc.execute_command = _failover_retry(rc.execute_command, url, failover_budget_s)
    return rc


def _failover_retry(execute, url: str, budget_s: float):
    """`execute` retried on CLUSTER_RETRY_ON with exponential backoff (50 ms doubling to 1 s) until
    `budget_s` have passed since the first attempt; then the last error propagates. A write whose reply
    was lost may so run twice: as with the single-node retry, the consumers are idempotent (rollout ids)."""

    @functools.wraps(execute)
    async def retried(*args, **kwargs):
        deadline, wait = time.monotonic() + budget_s, 0.05
        while True:
            try:
                return await execute(*args, **kwargs)
            except CLUSTER_RETRY_ON as e:
                if time.monotonic() + wait > deadline:
                    raise
                log.info(
                    "Redis Cluster %s: %s on %s; retrying in %.2f s",
                    redact(url),
                    type(e).__name__,
                    args[0],
                    wait,
                )
                await asyncio.sleep(wait)
                wait = min(2 * wait, 1.0)

    return retried


async def open_redis(
    url: str, *, retries: int = 10, socket_timeout: float = 10.0, failover_budget_s: float = FAILOVER_BUDGET_S
) -> tuple[aioredis.Redis | RedisCluster, bool]:
    """(client, cluster): a cluster client when the node `url` names runs in cluster mode (`INFO
    cluster`), else the single-node client of `connect`. Raises QueueUnavailable when the node cannot be
    reached within the retry budget."""
    r = connect(url, retries=retries, socket_timeout=socket_timeout)
    try:
        info = await call(r.info("cluster"), url)
    except BaseException:
        await r.aclose()
        raise
    if not int(info.get("cluster_enabled", 0)):
        return r, False
    await r.aclose()
    rc = connect_cluster(
        url, retries=retries, socket_timeout=socket_timeout, failover_budget_s=failover_budget_s
    )
    # Discover the cluster now, on this event loop: an unreachable or half-formed cluster is reported
    # here, by the caller that opened it, and no later path can initialise the client from another loop
    # (redis-py 8.1's own cluster transactions did, from a thread per command — RuntimeError, a lock
    # bound to another loop; maskroll runs its transactions as scripts instead, see `transaction`).
    try:
        await call(rc.initialize(), url)
    except BaseException:
        await rc.aclose()
        raise
    return rc, True


# Run queued commands in order, atomically: the script form of MULTI/EXEC. ARGV: for each command its
# argument count, then the command and its arguments. KEYS: the keys they touch (one slot), for routing.
_ATOMIC = """
local out, i = {}, 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  out[#out + 1] = redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return out
"""


class ScriptedTransaction(StreamCommands, SortedSetCommands, HashCommands, BasicKeyCommands):
    """On a Redis Cluster, what `pipeline(transaction=True)` is on one Redis: the same command methods
    queue commands, and `execute()` runs them in one EVAL — atomic, routed to the master of their one
    slot (redis-py refuses keys of several) and retried through a failover like any single command.

    Why not redis-py's own cluster transaction: in redis-py 8.1 every queued command passes through a
    thread and event loop of its own, so publishing one job's 8 records took 80 ms (4.6 ms of CPU) on a
    local cluster against 2.7 ms (1.1 ms) on one Redis. A command's reply comes back as the script
    returns it (bytes, int, list), without redis-py's per-command parsing; a command that fails aborts
    the script there (earlier writes stay, as within EXEC) and raises ResponseError with Redis's text."""

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        self._commands: list[tuple] = []

    def execute_command(self, *args, **options) -> ScriptedTransaction:
        self._commands.append(args)
        return self

    async def execute(self) -> list:
        if not self._commands:
            return []
        keys = list(dict.fromkeys(cmd[1] for cmd in self._commands))  # every command here names its key first
        flat = [x for cmd in self._commands for x in (len(cmd), *cmd)]
        self._commands = []
        return await self._client.eval(_ATOMIC, len(keys), *keys, *flat)


def transaction(r: aioredis.Redis | RedisCluster) -> Pipeline | ScriptedTransaction:
    """A MULTI/EXEC pipeline on one Redis; on a cluster, its scripted equivalent (all keys in one slot)."""
    if isinstance(r, RedisCluster):
        return ScriptedTransaction(r)
    return r.pipeline(transaction=True)


async def call(aw: Awaitable[T], url: str) -> T:
    """Await one Redis call (already retried inside the client, see `connect`); past the budget, raise
    QueueUnavailable naming `url`."""
    try:
        return await aw
    except QueueUnavailable:
        raise  # already translated by a nested call(); it is an OSError too
    except REDIS_DOWN as e:
        raise QueueUnavailable(redact(f"Redis at {url} unreachable after the retry budget: {e}")) from e
