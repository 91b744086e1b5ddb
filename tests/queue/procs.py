"""`maskroll serve --pull` replica processes for the queue tests (test_replicas.py, test_run_lifecycle.py).

Only the processes started here are ever signalled (LocalReplica: by PID). With `log_dir`, each replica
writes its output to `<log_dir>/<name>.log` (a test can read what it logged); otherwise to a temporary
file removed when it stops.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from maskroll.local.replica import LocalReplica, stop_all


class Replicas:
    """`maskroll serve --pull` subprocesses of one namespace, on one Redis."""

    def __init__(self, model_dir, url: str, namespace: str, log_dir: Path | None = None) -> None:
        self.model_dir, self.url, self.namespace, self.log_dir = model_dir, url, namespace, log_dir
        self.replicas: dict[str, LocalReplica] = {}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {name: r.proc for name, r in self.replicas.items()}

    def start(self, name: str, *extra: str) -> None:
        args = ["--model", str(self.model_dir), "--engine", "torch", "--port", "0", "--threads", "1"]
        args += ["--namespace", self.namespace, "--pull", "--replica-id", name, "--claim-idle-s", "2"]
        args += ["--heartbeat-ttl-s", "3", "--pull-concurrency", "4", "--drain-timeout-s", "5", *extra]
        env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": self.url}
        log = self.log(name) if self.log_dir is not None else None
        self.replicas[name] = LocalReplica(args, env=env, log=log, name=f"replica {name}").start()

    def log(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.log"

    def wait_ready(self, timeout: float = 120.0) -> None:
        for r in self.replicas.values():
            r.wait_ready(timeout)

    def kill9(self, name: str) -> None:
        self.replicas[name].proc.send_signal(signal.SIGKILL)
        self.replicas[name].wait()

    def stop_all(self) -> dict[str, int]:
        codes = stop_all(self.replicas.values(), timeout=30)
        return dict(zip(self.replicas, codes, strict=True))
