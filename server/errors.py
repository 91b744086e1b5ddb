"""The replica's error vocabulary: what any room of server/ raises, with no transport in sight.

Each `ServiceError` names its status as a plain code (`code = "INVALID_ARGUMENT"`: a name of
grpc.StatusCode, which the HTTP front end maps too); `code_of` is the one rule that gives any exception
its code and the message a client may see. The front ends translate at their edge and nowhere else
(STYLE.md §7): grpc_api/errors.py to a gRPC status, http_api/errors.py to an HTTP status and OpenAI's
error JSON — so both refuse the same input with the same code and message. The engine's own error,
`EngineDead`, stays the engine contract's (engines/contract.py, where it is raised); it is no
ServiceError, since nothing may take it for a refusal: this replica cannot serve at all (UNAVAILABLE,
so the client goes elsewhere).

Every message a client sees passes through `message_of` (a Redis URL's password never leaves the
process; a long quoted client string is cut). Imports nothing of grpc or HTTP.
"""

from __future__ import annotations

from maskroll.proto.redaction import redact
from maskroll.proto.wire_base import WireError

from .engines.contract import EngineDead


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


class NotFound(ServiceError):
    code = "NOT_FOUND"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class RetryLater(Unavailable):
    """The replica could not do it now (Redis out of reach, a full stream), but a retry of the same call
    can succeed: UNAVAILABLE, and over HTTP 503 with Retry-After."""

    retry_after_s = 5


class TooManySessions(ResourceExhausted):
    """This replica holds max_sessions agent sessions already (HTTP 429)."""


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
    """A message as a client may see it: credentials redacted (linear time, see proto/redaction.py),
    cut to MAX_MESSAGE_CHARS, and valid UTF-8 (a lone surrogate a client sent is escaped)."""
    text = redact(text)
    if len(text) > MAX_MESSAGE_CHARS:  # the head and the tail: the reason often follows a quoted string
        head, tail = MAX_MESSAGE_CHARS * 2 // 3, MAX_MESSAGE_CHARS // 3 - 40
        cut = len(text) - head - tail
        text = f"{text[:head]} ...({cut} characters cut)... {text[-tail:]}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def code_of(exc: BaseException) -> tuple[str, str]:
    """(code, message) a client sees for `exc`: the code a name of grpc.StatusCode. Unknown exceptions
    are INTERNAL (the front end logs them)."""
    if isinstance(exc, ServiceError):
        return exc.code, message_of(str(exc))
    if isinstance(exc, WireError):  # a payload that does not decode: the client sent it
        return "INVALID_ARGUMENT", message_of(str(exc))
    if isinstance(exc, EngineDead):  # this replica cannot serve; another one can
        return "UNAVAILABLE", message_of(str(exc))
    return "INTERNAL", message_of(f"internal error: {type(exc).__name__}: {exc}")
