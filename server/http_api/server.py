"""The HTTP front end's server: uvicorn on the replica's own event loop, beside the gRPC server.

`HttpFrontEnd.create()` loads the model's tokenizer and chat template; `start()` binds the port (0 = a
free one) and serves `routes.build_app` with uvicorn in the running loop, so both front ends share one
core (engine, pipeline, running set, weights), the auth token, the TLS certificate and the limits. The
drain is the replica's (server/app.py): once the core's running set drains, new calls get 503 and
/readyz turns 503 at once; running calls finish for up to the drain timeout, then are aborted
(finish_reason "abort"); then `close()` closes the listener. Agent sessions live in this process's
memory: without Redis, those still open at the end are lost (logged); with Redis, their state after
their last turn is in Redis and any replica of the namespace continues them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Callable

import uvicorn

from ..core import ReplicaCore
from .chat import ChatFormat
from .openai.serving import OpenAIServing
from .routes import build_app, served_by
from .sessions.serving import SessionServing

log = logging.getLogger(__name__)

# The OpenAI responses are built in Python on the event loop (JSON per token, K entries each), holding the
# GIL; the torch engine's decode thread needs the GIL between its torch calls and CPython hands it over
# only every switch interval (5 ms by default), so each decode step could wait that long behind the loop.
# Back-to-back runs (docs/benchmarks.md, "HTTP / OpenAI front end"): HTTP tokens/s went from 0.74-0.75 of
# gRPC's to 0.75-0.84 with 0.5 ms, more when the events cost more Python; gRPC's did not move.
SWITCH_INTERVAL_S = 0.0005
CLOSE_GRACE_S = 2.0  # uvicorn waits this long for open connections before closing them


class _Server(uvicorn.Server):
    # The replica's serve() owns SIGTERM / SIGINT (one drain for both front ends); uvicorn's own
    # handlers would replace them and re-raise the signal when it stops.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpFrontEnd:
    def __init__(self, core: ReplicaCore, chat: ChatFormat) -> None:
        self.core, self.config, self.metrics = core, core.config, core.metrics
        self.sessions = SessionServing(core.config, core.metrics, core.serving.publisher, core.serving.keys)
        self.openai = OpenAIServing(core, chat, self.sessions)
        self.bearer = f"Bearer {core.config.token}".encode() if core.config.token else None
        self.served_by = served_by(core.config.replica_id)
        # Why the replica is not ready (/readyz): server/app.py sets the replica's own rule, which the
        # gRPC health services follow too; by default the core's and the engine's reasons.
        self.problems: Callable[[], list[str]] = lambda: [
            p for p in (core.not_ready, core.engine.failure()) if p
        ]
        self.app = build_app(self)
        self.port: int | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    async def create(cls, core: ReplicaCore) -> HttpFrontEnd:
        # transformers' import and the tokenizer load take seconds: off the event loop.
        chat = await asyncio.to_thread(ChatFormat, core.config.model)
        chat.limit(core.engine.limits.max_model_len)  # texts the context cannot hold are refused untokenized
        return cls(core, chat)

    @property
    def scheme(self) -> str:
        return "https" if self.config.tls_cert else "http"

    async def start(self) -> int:
        """Bind and serve; returns the bound port. OSError when the port cannot be bound."""
        sock = _bind(self.config.host, self.config.http_port or 0)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        c = self.config
        uv = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=str(c.tls_cert) if c.tls_cert else None,
            ssl_keyfile=str(c.tls_key) if c.tls_key else None,
            timeout_graceful_shutdown=int(CLOSE_GRACE_S),
        )
        self._server = _Server(uv)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        while not self._server.started:
            if self._task.done():  # failed during start-up (a bad certificate, say)
                await self._task
                raise OSError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Close the listener once the replica has drained (server/app.py)."""
        store = self.sessions.store
        if len(store) and self.sessions.durable is None:
            log.warning("drain: %d agent sessions were not finished; dropped", len(store))
        await self.stop()

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT connections
        # Accepted connections inherit it (Linux): uvicorn writes a response's head and body separately,
        # and with Nagle the body waited for the client's delayed ACK — 40 ms on every call after the
        # first on a kept-alive connection (bench/sessions.py measured 44 ms for GET /healthz).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
