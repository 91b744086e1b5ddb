"""The Redis connection policy shared by trainers (client) and replicas (server): one retry rule, one error.

`connect()` builds every Redis client maskroll uses, with redis-py's `Retry` + exponential backoff
(STYLE.md §8). `REDIS_DOWN` names what counts as "Redis unreachable"; past the retry budget,
`call()` turns it into `QueueUnavailable` naming the URL, so a trainer sees one plain error instead of
a socket exception from deep inside redis-py. A URL carries the Redis password: every message that
names one goes through `redact` first (replicas also pass their log lines through it). Knows nothing of
streams, jobs or records.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

# The client retries only these itself (a dropped or slow socket); the wider set below is what still
# reaches the caller once that budget is spent, whichever layer raised it.
RETRY_ON = (RedisConnectionError, RedisTimeoutError)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


# scheme://user:password@ -> scheme://user:***@ ; and a password given as a URL query parameter.
# Greedy up to the last "@" before the path: a password may hold an unencoded "@".
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):[^/\s]*@")
_QUERY_PASSWORD = re.compile(r"([?&](?:password|pass|passwd)=)[^&\s'\"]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***; the rest (host, port, db) kept,
    since that is what an operator needs to find the unreachable server."""
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO.sub(r"\1:***@", text))


class QueueUnavailable(ConnectionError):
    """Redis stayed unreachable through the whole retry budget."""


def connect(url: str, *, retries: int = 10, socket_timeout: float = 10.0) -> aioredis.Redis:
    """A Redis client with an explicit retry rule: connection errors and timeouts, exponential backoff
    capped at 2 s, `retries` attempts (≈ 15 s in all by default). TLS and passwords come from the URL
    (rediss://, redis://:password@host)."""
    return aioredis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=list(RETRY_ON),
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        health_check_interval=30,
    )


async def call(aw: Awaitable[T], url: str) -> T:
    """Await one Redis call (already retried inside the client, see `connect`); past the budget, raise
    QueueUnavailable naming `url`."""
    try:
        return await aw
    except QueueUnavailable:
        raise  # already translated by a nested call(); it is an OSError too
    except REDIS_DOWN as e:
        raise QueueUnavailable(redact(f"Redis at {url} unreachable after the retry budget: {e}")) from e
