"""Start-up regressions of the probe (server items 6, 7 and 11 of the hardening issue), each on a
`maskroll serve` process of its own (torch engine) and the session's private Redis.

6. The run record in Redis was trusted unvalidated: `version = "abc"` made every replica of the namespace
   crash at start with a traceback; `version = 2**70` loaded, said SERVING, then every GetInfo / Generate
   failed INTERNAL. Now the replica starts NOT_SERVING, says why, and joins once the record is valid.
7. gRPC health said SERVING before the replica had joined its run: a joining replica served Generate at
   policy version 0. Now health, /readyz and Generate agree: not ready until joined.
11. Start-up failures ended in raw tracebacks: --metrics-port in use (after gRPC said SERVING), a Redis URL
    of another scheme (after 12-17 s, exit 1), MASKROLL_JOIN_TIMEOUT_S=abc.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import redis
from hardening_fixtures import Serve, raw_generate, request, served, wait_for

from maskroll.local.redis_server import free_port
from maskroll.local.replica import LocalReplica
from maskroll.proto.streams import StreamKeys
from maskroll.server.healthcheck import check

pytestmark = pytest.mark.slow
RUN_ID = "0123456789abcdef0123456789abcdef"


def _run_record(redis_server, namespace: str, **fields: str) -> redis.Redis:
    r = redis.Redis.from_url(redis_server.url)
    key = StreamKeys(namespace).run
    r.delete(key)
    now = repr(time.time())
    r.hset(
        key, mapping={"run_id": RUN_ID, "started_at": now, "updated_at": now, "started_by": "probe", **fields}
    )
    return r


def _health(address: str) -> str:
    answered, status = check(address, timeout=3.0)
    return status if answered else f"no answer: {status}"


@pytest.mark.parametrize("version", ["abc", str(2**70)])
def test_an_invalid_run_record_keeps_the_replica_not_serving_until_it_is_fixed(
    model_dir, weights_root, redis_server, tmp_path, version
):
    ns = f"probe-run-{len(version)}"
    r = _run_record(redis_server, ns, version=version, checkpoint="v1")
    s = Serve(
        model_dir, tmp_path / "serve.log", "--namespace", ns, "--pull", "--http-port", "0",
        "--weights-root", str(weights_root), env={"MASKROLL_REDIS_URL": redis_server.url},
    )  # fmt: skip
    try:
        assert s.health() == "NOT_SERVING"
        ready = httpx.get(s.replica.http_url + "/readyz", timeout=10)
        assert ready.status_code == 503 and "version" in ready.json()["reason"], ready.text
        err = raw_generate(s.address, request(max_tokens=2))
        assert err.code().name == "UNAVAILABLE" and f"maskroll:{ns}:run: version" in err.details(), err
        log = s.log_text()
        assert "cannot join the training run" in log and "Traceback" not in log, log[-3000:]
        r.hset(StreamKeys(ns).run, "version", "1")  # a valid record: joined within a few seconds
        s.wait_health("SERVING", timeout=15)
        assert httpx.get(s.replica.http_url + "/readyz", timeout=10).status_code == 200
        assert served(s.address) == 3
        assert "weights: joined at version 1 of run" in s.log_text()
    finally:
        code = s.stop()
        r.close()
    assert code == 0


def test_a_joining_replica_is_not_serving_until_it_has_joined(model_dir, redis_server, tmp_path):
    ns = "probe-join"
    r = _run_record(redis_server, ns, version="3", checkpoint="stream")  # pushed by a trainer: none here
    port, http_port = free_port(), free_port()
    serve = [
        "--model", str(model_dir), "--engine", "torch", "--threads", "1", "--port", str(port),
        "--http-port", str(http_port), "--metrics-port", "0", "--namespace", ns, "--pull",
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": redis_server.url, "MASKROLL_JOIN_TIMEOUT_S": "5"}
    replica = LocalReplica(serve, env=env, log=tmp_path / "serve.log").start()
    try:
        wait_for(lambda: "waiting up to 5 s for its push" in replica.log_text(), 120, "the join to begin")
        address = f"127.0.0.1:{port}"
        assert _health(address) == "NOT_SERVING"
        ready = httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=10)
        assert ready.status_code == 503 and "joining the training run" in ready.json()["reason"], ready.text
        err = raw_generate(address, request(max_tokens=2))
        assert err.code().name == "UNAVAILABLE" and "not ready" in err.details(), err
        assert replica.poll() is None and replica.ready_line is None
        replica.wait_ready(60)  # the join gives up after 5 s: the replica serves its own weights
        assert _health(address) == "SERVING"
        assert httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=10).status_code == 200
        assert served(address) == 3
    finally:
        code = replica.stop()
        r.close()
    assert code == 0


def _serve(model_dir, *args: str, env: dict[str, str] | None = None, timeout: float = 180):
    base = {k: v for k, v in os.environ.items() if not k.startswith("MASKROLL_")}
    cmd = [sys.executable, "-m", "maskroll.app.cli", "serve", "--model", str(model_dir), "--engine", "torch"]
    cmd += ["--threads", "1", "--port", "0", *args]
    t0 = time.monotonic()
    out = subprocess.run(
        cmd,
        env={**base, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out, time.monotonic() - t0


def test_a_metrics_port_in_use_is_said_plainly_before_anything_serves(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out, _ = _serve(model_dir, "--metrics-port", str(port))
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"maskroll serve: cannot listen on 127.0.0.1:{port} for metrics" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "ready on" not in out.stdout


def test_a_redis_url_of_another_scheme_is_refused_at_once(model_dir):
    out, took = _serve(model_dir, "--redis-url", "http://user:probe-secret@127.0.0.1:1/0")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "redis_url must be redis://" in out.stderr and "scheme 'http'" in out.stderr, out.stderr
    assert "probe-secret" not in out.stderr + out.stdout
    assert took < 30  # configuration only: no engine start, no Redis retry budget


def test_a_join_timeout_that_is_not_a_number_is_refused_at_once(model_dir, redis_server):
    r = _run_record(redis_server, "probe-timeout", version="2", checkpoint="stream")
    env = {"MASKROLL_REDIS_URL": redis_server.url, "MASKROLL_JOIN_TIMEOUT_S": "abc"}
    out, took = _serve(model_dir, "--namespace", "probe-timeout", "--pull", env=env)
    r.close()
    assert out.returncode == 2, out.stderr[-3000:]
    assert "join_timeout_s" in out.stderr and "MASKROLL_JOIN_TIMEOUT_S" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert took < 30
