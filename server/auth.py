"""Bearer-token authentication for every RPC (a grpc.aio server interceptor) and TLS credentials.

With a token configured, each call must carry the metadata `authorization: Bearer <token>`; otherwise it
ends with UNAUTHENTICATED before the servicer sees it. The standard health service stays open: load
balancers and Kubernetes probes check it without credentials, and it discloses only SERVING /
NOT_SERVING.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

import grpc

OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        token: str,
        open_methods: frozenset[str] = OPEN_METHODS,
        on_denied: Callable[[str], None] | None = None,
    ) -> None:
        """on_denied(method name) is called for each refused call (metrics: refused calls never reach
        the servicer)."""
        self._expected = f"Bearer {token}".encode()
        self._open = open_methods
        self._on_denied = on_denied

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                # Constant time, so response timing does not reveal how much of a guess was right.
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in self._open or self._authorized(details.invocation_metadata):
            return handler
        if self._on_denied is not None:
            self._on_denied(details.method.rpartition("/")[2])
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary / server-streaming) as `handler` that ends the call with
    UNAUTHENTICATED; the kind must match or grpc would misread the call."""
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def deny_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover (an async generator for the streaming kinds)

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
