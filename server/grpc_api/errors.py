"""The one place where exceptions become gRPC status codes (STYLE.md §7).

Server code raises the replica's typed errors (server/errors.py) or lets anything else propagate;
`rpc_boundary` wraps each servicer method, translates the exception into a status — the code and the
client-visible message of `errors.code_of`, so the HTTP front end answers the same — and reports the
outcome to the metrics. `asyncio.CancelledError` (and `GeneratorExit`, how grpc closes an abandoned
stream) is recorded and re-raised, never swallowed: cancellation is how an abandoned stream aborts its
engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from ..errors import code_of

log = logging.getLogger(__name__)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a client sees for `exc`. Unknown exceptions are INTERNAL (and logged by the caller)."""
    code, message = code_of(exc)
    return grpc.StatusCode[code], message


def status_of(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """`to_status`, logging the unknown exceptions (INTERNAL) with their traceback, once."""
    code, message = to_status(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    return code, message


# Called with (method, status code name, seconds) when an RPC ends, however it ends.
Observer = Callable[[str, str, float], None]


def rpc_boundary(method: str) -> Callable:
    """Decorate a servicer method (coroutine or async generator) taking (self, request, context).
    The servicer provides `observe_rpc: Observer`."""

    def decorate(fn: Callable) -> Callable:
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream(self, request, context):
                async with _boundary(method, context, self.observe_rpc):
                    async for item in fn(self, request, context):
                        yield item

            return stream

        @functools.wraps(fn)
        async def unary(self, request, context):
            async with _boundary(method, context, self.observe_rpc):
                return await fn(self, request, context)

        return unary

    return decorate


@contextlib.asynccontextmanager
async def _boundary(method: str, context, observe: Observer) -> AsyncIterator[None]:
    """One RPC's outcome: an exception becomes its status (context.abort raises AbortError, which
    propagates), cancellation is recorded and re-raised, and the metrics hear how it ended."""
    t0, code = time.perf_counter(), "OK"
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: grpc closing an abandoned stream
        code = "CANCELLED"
        raise
    except grpc.aio.AbortError:
        code = _code_name(context)
        raise
    except Exception as exc:
        status, message = status_of(method, exc)
        code = status.name
        await context.abort(status, message)
    finally:
        observe(method, code, time.perf_counter() - t0)


def _code_name(context) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
