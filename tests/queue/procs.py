"""`maskroll serve --pull` replica processes for the queue tests (test_replicas.py, test_run_lifecycle.py).

Only the processes started here are ever signalled. With `log_dir`, each replica writes its output to
`<log_dir>/<name>.log` (a test can read what it logged); otherwise to a pipe read until it is ready.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Replicas:
    """`maskroll serve --pull` subprocesses of one namespace, on one Redis."""

    def __init__(self, model_dir, url: str, namespace: str, log_dir: Path | None = None) -> None:
        self.model_dir, self.url, self.namespace, self.log_dir = model_dir, url, namespace, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *extra: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": self.url}
        cmd = [sys.executable, "-m", "maskroll.app.cli", "serve", "--model", str(self.model_dir)]
        cmd += ["--engine", "torch", "--port", "0", "--threads", "1", "--namespace", self.namespace]
        cmd += ["--pull", "--replica-id", name, "--claim-idle-s", "2", "--heartbeat-ttl-s", "3"]
        cmd += ["--pull-concurrency", "4", "--drain-timeout-s", "5", *extra]
        out = subprocess.PIPE
        if self.log_dir is not None:
            out = open(self.log(name), "w")  # noqa: SIM115 - the child holds it; closed below
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        if self.log_dir is not None:
            out.close()

    def log(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.log"

    def wait_ready(self, timeout: float = 120.0) -> None:
        for name, p in self.procs.items():
            deadline = time.monotonic() + timeout
            while not self._said_ready(name, p):
                if p.poll() is not None:
                    raise RuntimeError(f"replica {name} exited with {p.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {name} not ready after {timeout} s")

    def _said_ready(self, name: str, p: subprocess.Popen) -> bool:
        if self.log_dir is None:
            return "ready on" in p.stdout.readline()
        time.sleep(0.2)
        return "ready on" in self.log(name).read_text(errors="replace")

    def kill9(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop_all(self) -> dict[str, int]:
        codes = {}
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
        return codes
