"""The one place where exceptions become HTTP statuses and OpenAI's error JSON (errors.py's HTTP twin).

The HTTP front end raises errors.py's typed errors, the few below that only HTTP has, or lets anything
else propagate; `http_error` turns any of them into (status, body). The status follows the gRPC code the
same exception gets on the gRPC side (`errors.to_status`), so both front ends refuse the same input the
same way: INVALID_ARGUMENT → 400, UNAUTHENTICATED → 401, UNAVAILABLE (draining) → 503, unknown → 500.
The body is OpenAI's: {"error": {"message", "type", "param", "code"}}, where `param` names the request
field in the caller's own vocabulary (`top_logprobs` for what the pipeline calls options.logprobs_k).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import grpc

from ..grpc_api.errors import ServiceError, to_status


class NotFound(ServiceError):
    code = "NOT_FOUND"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class PayloadTooLarge(ServiceError):
    code = "RESOURCE_EXHAUSTED"
    http_status = 413


class RetryLater(ServiceError):
    """503 with Retry-After: the replica could not do it now (Redis out of reach, a full stream), but a
    retry of the same call can succeed."""

    code = "UNAVAILABLE"
    retry_after_s = 5


class UnsupportedMediaType(ServiceError):
    code = "INVALID_ARGUMENT"
    http_status = 415


class CrossOrigin(ServiceError):
    code = "PERMISSION_DENIED"


class TooManySessions(ServiceError):
    code = "RESOURCE_EXHAUSTED"
    http_status = 429


class RpcAbort(Exception):
    """A servicer method ended the call with a status (the native JSON API runs the gRPC servicer's
    methods with a context whose abort() raises this)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


STATUS_OF_CODE = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 413,  # the message or request is larger than the replica's limits
    "CANCELLED": 499,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}
# The leading field name of a message ("options.top_p must be ...", "prompt_token_ids[3] = ...").
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)")
OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "logprobs_k",
    "n",
    "seed",
    "stop_token_ids",
    "ignore_eos",
)


def rename_field(message: str, fields: Mapping[str, str]) -> tuple[str | None, str]:
    """(param, message) with the message's leading field spelt as the caller's API names it: `fields`
    maps the names a message may start with (the pipeline's: options.logprobs_k, prompt_token_ids) to
    the request's (top_logprobs, messages). A message that starts with no field: (None, message)."""
    m = _FIELD.match(message)
    if m is None or m.group(1) not in fields:
        return None, message
    name = m.group(1)
    return fields[name], fields[name] + message[len(name) :]


def http_error(exc: BaseException, fields: Mapping[str, str] | None = None) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body for `exc` (the caller logs a 500)."""
    if isinstance(exc, RpcAbort):
        code, message = exc.code, exc.details
    else:
        code, message = to_status(exc)
    status = getattr(exc, "http_status", None) or STATUS_OF_CODE.get(code.name, 500)
    param = None
    if status == 400:
        param, message = rename_field(message, fields or {})
    kind = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.name.lower()}}
