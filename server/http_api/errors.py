"""The one place where exceptions become HTTP statuses and OpenAI's error JSON (grpc_api/errors.py's twin).

The HTTP front end raises the replica's typed errors (server/errors.py), the few below that only HTTP
has, or lets anything else propagate; `http_error` turns any of them into (status, body). The status
follows the code the same exception gets on the gRPC side (`errors.code_of`), so both front ends refuse
the same input the same way: INVALID_ARGUMENT → 400, UNAUTHENTICATED → 401, UNAVAILABLE (draining) →
503, unknown → 500.
The body is OpenAI's: {"error": {"message", "type", "param", "code"}}, where `param` names the request
field in the caller's own vocabulary (`top_logprobs` for what the pipeline calls options.logprobs_k).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import ServiceError, TooManySessions, code_of


class PayloadTooLarge(ServiceError):
    code = "RESOURCE_EXHAUSTED"
    http_status = 413


class UnsupportedMediaType(ServiceError):
    code = "INVALID_ARGUMENT"
    http_status = 415


class CrossOrigin(ServiceError):
    code = "PERMISSION_DENIED"


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
# The replica's errors whose HTTP status is not their code's.
_HTTP_STATUS = {TooManySessions: 429}
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
    code, message = code_of(exc)
    status = getattr(exc, "http_status", None) or _HTTP_STATUS.get(type(exc)) or STATUS_OF_CODE.get(code, 500)
    param = None
    if status == 400:
        param, message = rename_field(message, fields or {})
    kind = _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.lower()}}
