"""Item 10 of the hardening issue, Redis down: a session's finish answered 500 ("the job stays pending for
redelivery" — not true for a session). It must be 503 with Retry-After, the session kept, so that the
client's retry publishes the episode once Redis is back. A Redis and a replica of its own (the case
stops Redis)."""

from __future__ import annotations

import pytest
import redis
from probe_helpers import HttpServe

from maskroll.local.redis_server import LocalRedis
from maskroll.proto.streams import StreamKeys

pytestmark = pytest.mark.slow
NS = "probe-down"


@pytest.fixture(scope="module")
def down_redis():
    with LocalRedis() as r:
        yield r


@pytest.fixture(scope="module")
def down_replica(model_dir, down_redis, tmp_path_factory):
    log = tmp_path_factory.mktemp("down") / "serve.log"
    s = HttpServe(model_dir, log, "--namespace", NS, env={"MASKROLL_REDIS_URL": down_redis.url})
    s.adopt_run()  # its session records belong to a run
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log_text(), s.log_text()[-5000:]


def test_a_finish_while_redis_is_down_is_503_and_the_retry_publishes(down_replica, down_redis):
    headers = {"x-maskroll-session": "down-1"}
    body = {"model": down_replica.model, "prompt": "Hi", "max_tokens": 2}
    with down_replica.http(timeout=120) as h:
        assert h.post("/v1/completions", json=body, headers=headers).status_code == 200
        down_redis.stop()
        try:
            r = h.post("/v1/sessions/down-1/finish")  # after the client's retry budget (about 15 s)
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) > 0
            assert "Redis is unreachable" in r.json()["error"]["message"], r.text
            down_replica.completion_served()  # what needs no Redis is still served
        finally:
            down_redis.start()
        done = h.post("/v1/sessions/down-1/finish")
    assert done.status_code == 200, done.text
    assert done.json()["published"] and done.json()["num_turns"] == 1
    r = redis.Redis.from_url(down_redis.url)
    assert r.xlen(StreamKeys(NS).rollouts) == 1
    r.close()
