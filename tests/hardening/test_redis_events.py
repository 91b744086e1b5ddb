"""Redis flushed, replaced by an empty one, sabotaged or gone, under a running `maskroll serve --pull`
replica: the replica recovers by itself, its health says NOT_SERVING while it cannot pull (within a
few seconds), and no message or log line carries the Redis password.

Regressions of issue 11: after FLUSHALL (or a new Redis without the AOF) the puller exited on NOGROUP
without a log line and the replica took no more jobs while health said SERVING; the error raised when
Redis was unreachable contained the URL with its password.

The cases run in order on one Redis and one replica of their own (each leaves both working).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis
from hardening_fixtures import PROMPT, Serve, wait_for

from maskroll.local.redis_server import LocalRedis
from maskroll.proto import wire
from maskroll.proto.records import PromptJob, SamplingOptions
from maskroll.proto.redis_conn import QueueUnavailable, call, connect
from maskroll.proto.streams import F_JOB, F_RECORD, StreamKeys

pytestmark = pytest.mark.slow
PASSWORD = "events-pw-9f8e7d"
KEYS = StreamKeys("events")
OPTS = SamplingOptions(max_tokens=3, logprobs_k=2, ignore_eos=True)
# The puller notices an unanswered Redis call after 5 s; the health monitor polls every 0.5 s.
NOTICE_S = 8.0


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedis(password=PASSWORD, appendonly=False) as r:  # no AOF: a restart comes back empty
        yield r


@pytest.fixture(scope="module")
def replica(model_dir, redis_server, tmp_path_factory):
    log = tmp_path_factory.mktemp("events") / "serve.log"
    s = Serve(
        model_dir, log, "--namespace", "events", "--pull", "--replica-id", "ev-1", "--claim-idle-s", "1",
        "--heartbeat-ttl-s", "3", env={"MASKROLL_REDIS_URL": redis_server.url},
    )  # fmt: skip
    yield s
    s.stop()
    assert PASSWORD not in s.log_text(), "the Redis password reached the replica's log"


def _raw(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url, socket_timeout=5)


def job_is_served(redis_server, timeout: float = 30) -> float:
    """Submit one job (raw) and wait for its record; returns the seconds it took."""
    r = _raw(redis_server)
    job = PromptJob(job_id=uuid.uuid4().hex, prompt_ids=PROMPT, options=OPTS)
    t0 = time.monotonic()
    r.xadd(KEYS.prompts, {F_JOB: wire.job_to_pb(job).SerializeToString()})

    def arrived():
        for _, fields in r.xrange(KEYS.rollouts):
            if F_RECORD in fields and wire.decode_record(fields[F_RECORD]).job_id == job.job_id:
                return True
        return False

    wait_for(arrived, timeout, f"job {job.job_id} to be served")
    r.close()
    return time.monotonic() - t0


def test_flushall_recreates_the_group_and_the_replica_serves_on(replica, redis_server):
    job_is_served(redis_server)
    _raw(redis_server).flushall()
    took = job_is_served(redis_server)
    assert "consumer group 'replicas' on maskroll:events:prompts is gone" in replica.log_text()
    assert replica.health() == "SERVING"
    print(f"first job after FLUSHALL served in {took:.1f} s")


def test_a_new_empty_redis_on_the_same_address_is_picked_up(replica, redis_server):
    redis_server.restart()  # appendonly=False: it comes back with nothing, no group, no streams
    took = job_is_served(redis_server, timeout=60)
    replica.wait_health("SERVING", timeout=20)
    print(f"first job after an empty Redis came back served in {took:.1f} s")


def test_a_sabotaged_prompt_stream_is_not_serving_until_repaired(replica, redis_server):
    """The prompt stream replaced by a string key: XREADGROUP fails with WRONGTYPE, which no group
    recreation fixes. The puller exits with the error (logged), health turns NOT_SERVING, and it is
    restarted with backoff until the key is a stream again."""
    r = _raw(redis_server)
    r.delete(KEYS.prompts)
    r.set(KEYS.prompts, "sabotage")
    took = replica.wait_health("NOT_SERVING", timeout=NOTICE_S)
    assert "prompt puller exited with an error; restarting" in replica.log_text()
    assert "WRONGTYPE" in replica.log_text()
    r.delete(KEYS.prompts)
    back = replica.wait_health("SERVING", timeout=40)  # the backoff doubles: 1, 2, 4, ... s
    job_is_served(redis_server)
    print(f"sabotage: NOT_SERVING after {took:.1f} s, SERVING {back:.1f} s after the repair")


def test_redis_unreachable_is_not_serving_and_never_leaks_the_password(replica, redis_server):
    redis_server.stop()
    try:
        took = replica.wait_health("NOT_SERVING", timeout=NOTICE_S)

        async def client_side() -> str:
            r = connect(redis_server.url, retries=1)
            try:
                with pytest.raises(QueueUnavailable) as err:
                    await call(r.ping(), redis_server.url)
            finally:
                await r.aclose()
            return str(err.value)

        message = asyncio.run(client_side())
        assert PASSWORD not in message and f"redis://:***@127.0.0.1:{redis_server.port}/0" in message
        wait_for(lambda: "is unreachable" in replica.log_text(), 30, "the replica to log the outage")
    finally:
        redis_server.start()
    back = replica.wait_health("SERVING", timeout=30)
    job_is_served(redis_server, timeout=60)
    assert PASSWORD not in replica.log_text()
    print(f"Redis down: NOT_SERVING after {took:.1f} s; SERVING {back:.1f} s after it returned")
