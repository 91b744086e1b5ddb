"""A `maskroll serve` process on this machine for the demo, the benchmarks, the examples and the tests:
started by command line, ready when it says so, stopped by PID.

`LocalReplica` runs `python -m maskroll.app.cli serve <args>` (this package imports no server code: the
replica is another process, reached only through what it prints and its ports), sends its stdout and
stderr to one log file — never to a pipe nobody reads, which would stall a chatty replica — and waits
for the line the replica prints once it serves:

    maskroll serve: ready on <host:port> (...; metrics http://<host:port>/metrics; http <url>)

From it come `address` (gRPC), `port`, `metrics` (host:port, or None) and `http_url` (or None). A
replica that exits first, or is not ready in time, raises ReplicaStartError with the end of its log.
Only the process started here is ever signalled: SIGTERM (the replica drains), then SIGKILL once the
timeout has passed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

READY_PREFIX = "maskroll serve: ready on "
_METRICS = re.compile(r"metrics http://(\S+)/metrics")
_HTTP = re.compile(r"; http (\S+)\)\s*$")


class ReplicaStartError(RuntimeError):
    """The replica exited before it was ready, or was not ready in time; the message ends with its log."""


class LocalReplica:
    """`with LocalReplica(["--model", d, "--port", "0"]) as r: r.address` — one replica process that only
    this object controls. `start()` and `wait_ready()` separately start several before waiting for any."""

    def __init__(
        self,
        args: Sequence[str | os.PathLike],
        *,
        env: Mapping[str, str] | None = None,
        inherit_env: bool = True,
        log: str | os.PathLike | None = None,
        name: str = "replica",
        own_session: bool = False,
        ready_timeout: float = 300.0,
    ) -> None:
        """args: `maskroll serve` flags. env: variables set for the replica, over this process's own
        environment (inherit_env=False: the whole environment). log: file for its stdout and stderr
        (default: a temporary file, removed by stop()). own_session: start it in its own session, so a
        terminal's Ctrl-C reaches only the caller, which then stops it. ready_timeout: how long `with`
        waits for the ready line."""
        self.args = [os.fspath(a) for a in args]
        self.env = dict(env or {})
        self.inherit_env = inherit_env
        self.log_path = Path(log) if log is not None else None
        self._own_log = log is None
        self.name = name
        self.own_session = own_session
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.ready_line: str | None = None
        self.address: str | None = None
        self.metrics: str | None = None
        self.http_url: str | None = None
        self._read_pos, self._partial = 0, b""

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "maskroll.app.cli", "serve", *self.args]

    @property
    def pid(self) -> int:
        return self._started().pid

    @property
    def port(self) -> int:
        if self.address is None:
            raise RuntimeError(f"{self.name} is not ready: no address yet (call wait_ready)")
        return int(self.address.rsplit(":", 1)[1])

    def start(self) -> LocalReplica:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} was already started (pid {self.proc.pid})")
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"maskroll-{self.name.replace(' ', '-')}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env} if self.inherit_env else dict(self.env)
        with open(self.log_path, "wb") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=self.own_session,
            )
        return self

    def wait_ready(self, timeout: float | None = None, poll_s: float = 0.2) -> LocalReplica:
        """Block until the ready line appears in the log (timeout: default `ready_timeout`)."""
        proc = self._started()
        if self.ready_line is not None:
            return self
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while (line := self._find_ready()) is None:
            if proc.poll() is not None:
                raise ReplicaStartError(
                    f"{self.name} exited with {proc.returncode} before it was ready{self._log_hint()}:\n"
                    f"{self.tail()}"
                )
            if time.monotonic() >= deadline:
                raise ReplicaStartError(
                    f"{self.name} not ready after {timeout:g} s{self._log_hint()}:\n{self.tail()}"
                )
            time.sleep(poll_s)
        self.ready_line = line
        self.address = line[len(READY_PREFIX) :].split()[0]
        found = _METRICS.search(line)
        self.metrics = found.group(1) if found else None
        found = _HTTP.search(line)
        self.http_url = found.group(1) if found else None
        return self

    def _log_hint(self) -> str:
        return "" if self._own_log else f" (log {self.log_path})"  # a temporary log goes with stop()

    def _find_ready(self) -> str | None:
        with open(self.log_path, "rb") as f:
            f.seek(self._read_pos)
            new = f.read()
        self._read_pos += len(new)
        *lines, self._partial = (self._partial + new).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r")
            if line.startswith(READY_PREFIX):
                return line
        return None

    def log_text(self) -> str:
        """Everything the replica has written so far (stdout and stderr)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        return self.log_text()[-chars:]

    def poll(self) -> int | None:
        return self._started().poll()

    def terminate(self) -> None:
        """SIGTERM (the replica drains, then exits), without waiting."""
        proc = self._started()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def kill(self) -> int:
        """SIGKILL now, the replica and the processes it started (vLLM's engine core and workers, which a
        killed `maskroll serve` cannot stop and which would keep their gigabytes); the exit status."""
        return kill_tree(self._started())

    def wait(self, timeout: float | None = None) -> int:
        return self._started().wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` s; its exit status (None if it was
        never started). A temporary log is removed."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = self.kill()
        self._remove_own_log()
        return code

    def _remove_own_log(self) -> None:
        if self._own_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started (call start)")
        return self.proc

    def __enter__(self) -> LocalReplica:
        if self.proc is None:
            self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_all(replicas: Iterable[LocalReplica], timeout: float = 300.0) -> None:
    """Wait until every replica is ready, all within one `timeout` (they start in parallel)."""
    deadline = time.monotonic() + timeout
    for r in replicas:
        r.wait_ready(max(0.0, deadline - time.monotonic()))


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (Linux: /proc/<pid>/task/*/children; elsewhere none)."""
    found, todo = [], [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:  # the task exited meanwhile
                continue
            found += kids
            todo += kids
    return found


def kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL `proc` and every process it started (collected first: once it is dead they are orphans,
    re-parented away from it); its exit status. Only descendants of a process we started are signalled."""
    if proc.poll() is None:
        family = descendants(proc.pid)
        proc.kill()
        for pid in family:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(pid, signal.SIGKILL)
    return proc.wait()


def stop_all(replicas: Iterable[LocalReplica], timeout: float = 30.0) -> list[int | None]:
    """Stop several replicas: SIGTERM to each first, so they drain in parallel, then wait for each until
    `timeout` s have passed since, killing what is left. A KeyboardInterrupt while waiting (a second
    Ctrl-C) kills the rest at once and is raised again once none is left running: a replica is never
    orphaned. Returns the exit statuses, in order (None for one never started)."""
    reps = list(replicas)
    for r in reps:
        if r.proc is not None:
            r.terminate()
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    interrupted = False
    for r in reps:
        if r.proc is None:
            codes.append(None)
            continue
        try:
            codes.append(r.wait(0 if interrupted else max(0.0, deadline - time.monotonic())))
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            interrupted = interrupted or isinstance(e, KeyboardInterrupt)
            codes.append(r.kill())
        r._remove_own_log()
    if interrupted:
        raise KeyboardInterrupt
    return codes
