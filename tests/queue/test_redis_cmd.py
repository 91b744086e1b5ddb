"""`maskroll redis`: a Redis on loopback for trying maskroll on one machine — its URL printed, serving,
stopped (redis-server included) by Ctrl-C, and a clear error when the port is taken."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
import redis

from maskroll.local.redis_server import LocalRedis


def _maskroll_redis(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "maskroll.app.cli", "redis", *args]
    # Ctrl-C's default action in the child, whatever this process inherited: a shell that starts pytest
    # in the background (`pytest &` in a script) ignores SIGINT for it, its children inherit that, and a
    # Python started with SIGINT ignored never raises KeyboardInterrupt.
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_default_sigint
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_it_prints_its_url_serves_and_ctrl_c_stops_it():
    proc = _maskroll_redis("--port", "0")
    try:
        line = proc.stdout.readline()
        found = re.search(
            r"ready at (redis://127\.0\.0\.1:\d+/0) \(data deleted on exit\); Ctrl-C stops it", line
        )
        assert found, line
        url = found.group(1)
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "stopping" in out, out
        with pytest.raises(redis.ConnectionError):  # redis-server went with it
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_port_in_use_is_a_clear_error():
    with LocalRedis() as taken:
        proc = _maskroll_redis("--port", str(taken.port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert (
        f"could not start redis-server on 127.0.0.1:{taken.port} (port {taken.port} in use? try --port 0)"
        in out
    )


def test_the_command_is_listed():
    out = subprocess.run(
        [sys.executable, "-m", "maskroll.app.cli", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert re.search(r"^  redis\s+a Redis on 127\.0\.0\.1 for trying maskroll on one machine", out, re.M), out
