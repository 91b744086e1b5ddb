"""Helpers of the HTTP front-end tests (conftest.py holds the fixtures): the replica handle and the
token every request carries."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from grpc_fixtures import ServerLoop, replica, server_config

TOKEN = "http-test-token-0123456789"
NAMESPACE = "http-tests"


@dataclass
class Served:
    """A running replica and how to reach it."""

    replica: object  # maskroll.server.app.Replica
    base_url: str  # http://127.0.0.1:<port>
    grpc_address: str
    redis_url: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=TOKEN, max_retries=0, **kwargs)

    def http(self):
        import httpx

        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60)


def make_served(loop: ServerLoop, engine, model_dir: Path, **overrides):
    """Another replica around the shared engine (its own limits); a context manager yielding Served."""

    @contextlib.contextmanager
    def run():
        config = server_config(model_dir, http_port=0, auth_token=TOKEN, **overrides)
        with replica(loop, config, engine) as r:
            yield Served(r, f"http://127.0.0.1:{r.http.port}", r.address)

    return run()
