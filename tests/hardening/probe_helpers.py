"""Helpers of the probe regressions (test_probe_*.py): a replica with the HTTP front end, the latency of
/healthz measured from a concurrent thread while a bad request is handled, the replica's resident memory,
and a normal request that must still be served afterwards.

Only processes started here are ever signalled (by their Popen object, never by name).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from hardening_fixtures import Serve


class HttpServe(Serve):
    """`maskroll serve --http-port 0` (torch engine, metrics on): its HTTP base URL and process id."""

    def __init__(self, model_dir: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(model_dir, log, "--http-port", "0", *args, env=env)
        self.base = self.replica.http_url
        assert self.base, self.replica.ready_line
        self.pid = self.proc.pid
        self.model = httpx.get(self.base + "/v1/models", timeout=30).json()["data"][0]["id"]

    def http(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=timeout)

    def rss_mb(self) -> float:
        return rss_mb(self.pid)

    def metric(self, name: str) -> float:
        """One unlabelled sample of the replica's /metrics (0 when absent)."""
        text = httpx.get(f"http://{self.metrics}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def completion_served(self, **extra) -> dict:
        """A normal completion: 200 with its tokens."""
        body = {"model": self.model, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True, **extra}
        with self.http() as h:
            r = h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        return r.json()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


class HealthzWatch:
    """`with HealthzWatch(base) as w: <bad request>`; then `w.worst` is the slowest /healthz answer (s)
    seen meanwhile, polled every 50 ms from a thread of its own (the replica's event loop answers it)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.worst = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as h:
            while not self._stop.is_set():
                t0 = time.monotonic()
                r = h.get("/healthz")
                self.worst = max(self.worst, time.monotonic() - t0)
                assert r.status_code == 200
                self.answers += 1
                self._stop.wait(0.05)

    def __enter__(self) -> HealthzWatch:
        self._thread.start()
        time.sleep(0.2)  # a few answers before the bad request
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join(180)
        assert not self._thread.is_alive(), "/healthz did not answer within 180 s"
