"""The one place where exceptions become gRPC status codes (STYLE.md §7).

Server code raises the typed errors below (or lets anything else propagate); `rpc_boundary` wraps each
servicer method, translates the exception into a status with a message naming the offending field, and
reports the outcome to the metrics. Every message a client sees passes through `redact` (a Redis URL's
password never leaves the process). `asyncio.CancelledError` (and `GeneratorExit`, how grpc closes an
abandoned stream) is recorded and re-raised, never swallowed: cancellation is how an abandoned stream
aborts its engine request.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable

import grpc

from maskroll.proto.redis_conn import redact
from maskroll.proto.wire import WireError

from ..engines.contract import EngineDead

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error the client caused or must know about; `code` names a grpc.StatusCode."""

    code = "INTERNAL"


class InvalidArgument(ServiceError, ValueError):
    """A request field is invalid; the message starts with the field's name."""

    code = "INVALID_ARGUMENT"


class PermissionDenied(ServiceError):
    code = "PERMISSION_DENIED"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class Unimplemented(ServiceError):
    code = "UNIMPLEMENTED"


class AlreadyExists(ServiceError):
    code = "ALREADY_EXISTS"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class ResourceExhausted(ServiceError):
    """A replica's own limit is full (resident LoRA adapters: --max-loras), not the request's fault."""

    code = "RESOURCE_EXHAUSTED"


# A status's message travels in a trailer, and gRPC refuses metadata over 16 KiB (the client then sees
# RESOURCE_EXHAUSTED instead of the real error): a message quoting a long client string is cut to this.
MAX_MESSAGE_CHARS = 2000
SHOWN_CHARS = 64  # how much of a client's string a message quotes


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A client's string as a message quotes it: its repr, cut after `limit` characters (with its length),
    so that neither an error nor a log line echoes megabytes back."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def message_of(text: str) -> str:
    """A message as a client may see it: credentials redacted (linear time, see redis_conn.redact),
    cut to MAX_MESSAGE_CHARS, and valid UTF-8 (a lone surrogate a client sent is escaped)."""
    text = redact(text)
    if len(text) > MAX_MESSAGE_CHARS:  # the head and the tail: the reason often follows a quoted string
        head, tail = MAX_MESSAGE_CHARS * 2 // 3, MAX_MESSAGE_CHARS // 3 - 40
        cut = len(text) - head - tail
        text = f"{text[:head]} ...({cut} characters cut)... {text[-tail:]}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a client sees for `exc`. Unknown exceptions are INTERNAL (and logged by the caller)."""
    if isinstance(exc, ServiceError):
        return grpc.StatusCode[exc.code], message_of(str(exc))
    if isinstance(exc, WireError):  # a payload that does not decode: the client sent it
        return grpc.StatusCode.INVALID_ARGUMENT, message_of(str(exc))
    if isinstance(exc, EngineDead):  # this replica cannot serve; another one can
        return grpc.StatusCode.UNAVAILABLE, message_of(str(exc))
    return grpc.StatusCode.INTERNAL, message_of(f"internal error: {type(exc).__name__}: {exc}")


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
                t0, code = time.perf_counter(), "OK"
                try:
                    async for item in fn(self, request, context):
                        yield item
                except (asyncio.CancelledError, GeneratorExit):
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
                    self.observe_rpc(method, code, time.perf_counter() - t0)

            return stream

        @functools.wraps(fn)
        async def unary(self, request, context):
            t0, code = time.perf_counter(), "OK"
            try:
                return await fn(self, request, context)
            except asyncio.CancelledError:
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
                self.observe_rpc(method, code, time.perf_counter() - t0)

        return unary

    return decorate


def _code_name(context) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
