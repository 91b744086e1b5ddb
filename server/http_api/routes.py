"""The HTTP front end's application: every route family's router, the health routes, unknown paths.

    GET    /healthz      live: 200 while the process serves HTTP (no token needed)
    GET    /readyz       200 when the replica serves (the gRPC health services' rule), else 503
    GET    /metrics      the replica's Prometheus metrics (as on --metrics-port)
    /v1/info, /v1/weights, /v1/generate, /v1/score          native.py: the gRPC service as JSON
    /v1/models, /v1/completions, /v1/chat/completions       openai/router.py: the OpenAI API
    /v1/sessions/{id}/finish, DELETE /v1/sessions/{id}      sessions/router.py: agent sessions

The routers are module-level; each route reaches the replica through `boundary.front_of(request)`, the
HttpFrontEnd this app was built for (server.py). What every route shares (auth, body checks, the error
boundary, streaming) is boundary.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import native
from .boundary import REPLICA_HEADER, boundary, front_of
from .openai import router as openai_router
from .sessions import router as session_router

if TYPE_CHECKING:
    from .server import HttpFrontEnd

health = APIRouter()


def build_app(front: HttpFrontEnd) -> FastAPI:
    app = FastAPI(title="maskroll", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    for router in (health, native.router, openai_router.router, session_router.router):
        app.include_router(router)
    app.add_exception_handler(StarletteHTTPException, _not_routed)
    return app


def served_by(replica_id: str) -> dict[str, str]:
    """Which replica answered, on every route's response: behind a proxy (deploy/, local/proxy.py) the
    client, the tests and an operator see where a session's calls land. Percent-encoded: a header value
    must be latin-1 and the id is free text."""
    return {REPLICA_HEADER: quote(replica_id, safe="")}


@health.get("/healthz")
@boundary("http:healthz", open_=True)
async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "live"})


@health.get("/readyz")
@boundary("http:readyz", open_=True)
async def readyz(request: Request) -> Response:
    # The same rule as the gRPC health services (server/app.py `problems`): they must agree.
    front = front_of(request)
    found = ["draining"] if front.core.running.draining else front.problems()
    if found:
        return JSONResponse({"status": "not ready", "reason": "; ".join(found)}, status_code=503)
    return JSONResponse({"status": "ready"})


@health.get("/metrics")
@boundary("http:metrics")
async def prometheus_metrics(request: Request) -> Response:
    # The replica's Prometheus metrics on the HTTP port too (token as for every route but health), so a
    # replica serving HTTP needs no second port scraped.
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(front_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _not_routed(request: Request, exc: StarletteHTTPException) -> Response:
    # Unknown paths and methods, in the same error shape as everything else.
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code)
