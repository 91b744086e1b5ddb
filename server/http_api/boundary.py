"""What every HTTP route shares: the boundary, the body's checks, streaming and the client's going away.

    @router.post("/v1/things")
    @boundary("http:things", FIELDS)          # auth, same origin, errors → status + OpenAI JSON, metrics
    async def things(request: Request) -> Response:
        body = await read_json(request)       # JSON only, bounded, no lone surrogates, bounded depth
        front = front_of(request)             # the HttpFrontEnd (server.py): its core, config, metrics

`boundary` is the one place a route's exception becomes a response (errors.http_error: status and
OpenAI's error JSON) and sets `X-Maskroll-Replica` (which replica answered: behind a proxy, where a
session's calls land); a stream that fails after its first byte ends with one error event instead
(`stream`, `started`). Every route but the health checks needs `Authorization: Bearer <token>` when the
replica has one; bodies are limited to max_message_bytes (413), must say they are JSON (Content-Type:
application/json, else 415) and may not nest deeper than MAX_JSON_DEPTH nor hold lone surrogates (400);
a request a browser sends from another origin (its Origin header) is refused (403): a web page cannot
make a replica on the visitor's loopback act without a CORS preflight. A non-streaming call whose client
disconnects is aborted (`unless_disconnected`). The routes themselves live in a module per endpoint
family (native.py, openai/router.py, sessions/router.py, routes.py: health), as module-level routers.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ..errors import InvalidArgument, Unauthenticated
from .errors import OPTIONS, CrossOrigin, PayloadTooLarge, UnsupportedMediaType, http_error
from .openai import protocol

if TYPE_CHECKING:
    from .server import HttpFrontEnd

log = logging.getLogger(__name__)

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# The replica that answered (its --replica-id, percent-encoded), on every route's response.
REPLICA_HEADER = "X-Maskroll-Replica"
T = TypeVar("T")


def front_of(request: Request) -> HttpFrontEnd:
    """The front end serving this request (routes.build_app keeps it in the app's state)."""
    return request.app.state.front


def api_fields(names, **renames: str) -> dict[str, str]:
    """What a message's leading field is called in an API (errors.rename_field): its own request fields,
    the pipeline's options.* by their plain names, and `renames` (dots spelt __)."""
    out = {n: n for n in names} | {f"options.{n}": n for n in OPTIONS}
    return out | {k.replace("__", "."): v for k, v in renames.items()}


def _json_content_type(request: Request) -> None:
    """A request body must say it is JSON. A browser sends text/plain, form and multipart bodies across
    origins without asking first (no CORS preflight): a web page could otherwise make a replica on the
    visitor's loopback load weights or publish a session."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedMediaType(
            f"the request body must be JSON with Content-Type: application/json (got {media or 'none'!r})"
        )


MAX_JSON_DEPTH = 64  # deeper than any request of this API nests (tools' JSON schemas included)
_SCALARS = frozenset({int, float, bool, type(None)})
# JSON's escape of a UTF-16 surrogate (\\ud800-\\udfff), or the raw bytes of one (json.loads decodes a
# body with "surrogatepass"): only a body that has one can hold a lone surrogate.
_SURROGATE = re.compile(rb"\\[uU][dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")


def _check_body(obj: object, body: bytes | bytearray) -> None:
    """What json.loads accepted but no later step takes, refused (400) before anything reads it: lone
    UTF-16 surrogates (JSON's \\ud800 escape), which no tokenizer, template or response encoder takes,
    and nesting deeper than MAX_JSON_DEPTH (templates, pydantic and encoders recurse). Iterative, so a
    deep body cannot overflow the stack here; lists of numbers (prompt ids) are passed over in C."""
    strings = _SURROGATE.search(body) is not None
    stack: list[tuple[object, object, int, tuple | None]] = [(obj, None, 0, None)]
    while stack:
        entry = stack.pop()
        value, _, depth, _ = entry
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidArgument(
                    f"{_path(entry) or 'the request body'}: the text holds a lone surrogate "
                    f"({value[exc.start]!r} at character {exc.start}), which is not valid Unicode"
                ) from None
            continue
        if isinstance(value, dict):
            items = value.items()
            if not strings:
                items = ((k, v) for k, v in items if type(v) in (dict, list))
            children = [(v, k, depth + 1, entry) for k, v in items]
            if strings:
                children += [(k, k, depth + 1, entry) for k in value]
        elif isinstance(value, list):
            types = set(map(type, value))
            if types <= _SCALARS or (types == {str} and (not strings or _encodes("".join(value)))):
                continue  # numbers, or texts that are all valid: nothing to look into one by one
            if types == {str}:  # one of them is not valid text: find it
                bad = next(i for i, v in enumerate(value) if not _encodes(v))
                stack.append((value[bad], bad, depth + 1, entry))
                continue
            children = [
                (v, i, depth + 1, entry)
                for i, v in enumerate(value)
                if type(v) in (dict, list) or (strings and type(v) is str)
            ]
        else:
            continue
        if depth >= MAX_JSON_DEPTH and any(type(c[0]) in (dict, list) for c in children):
            raise InvalidArgument(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        stack.extend(children)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(entry: tuple) -> str:
    """messages[0].content: where a value sits in the body (from its chain of parents)."""
    parts: list[str] = []
    while entry is not None and entry[3] is not None:
        key = entry[1]
        name = str(key)[:40].encode("utf-8", "backslashreplace").decode()
        parts.append(f"[{key}]" if isinstance(key, int) else f".{name}")
        entry = entry[3]
    return "".join(reversed(parts)).lstrip(".")


def _same_origin(request: Request) -> None:
    """A browser names the page that sent a request in Origin: a replica serves no pages, so a request
    from one (a cross-site POST with no body needs no preflight either) is refused. Clients that are not
    browsers send no Origin."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    host = request.headers.get("host", "")
    if origin.lower().partition("://")[2].rstrip("/") != host.lower():
        raise CrossOrigin(
            f"cross-origin requests are refused (Origin {origin[:100]!r}); this replica serves API "
            "clients, not web pages"
        )


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body already read: the server's next ASGI message for
    this request is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (a generation's engine
    requests are aborted: nobody would read the answer, and an agent's retry of a session call would
    meet the orphan's 409 until it ended) and ClientDisconnect raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


def _authorize(request: Request) -> None:
    expected = front_of(request).bearer
    if expected is None:
        return
    given = request.headers.get("authorization", "").encode()
    # Constant time, so response timing does not reveal how much of a guess was right.
    if not hmac.compare_digest(given, expected):
        raise Unauthenticated("missing or invalid bearer token (header 'Authorization: Bearer <token>')")


async def read_json(request: Request) -> object:
    """The request's JSON body (None when it has none), checked: JSON media type, at most
    max_message_bytes, no lone surrogates, no deeper than MAX_JSON_DEPTH."""
    limit = front_of(request).config.max_message_bytes
    if request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers:
        _json_content_type(request)
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"request body of {length} bytes is larger than max_message_bytes {limit}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is larger than max_message_bytes {limit}")
    if not body:
        return None
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise InvalidArgument(f"the request body is not JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    _check_body(obj, body)
    return obj


def boundary(method: str, fields: Mapping[str, str] | None = None, open_: bool = False) -> Callable:
    """A route: authorize (unless `open_`), run, turn any exception into its status and OpenAI error JSON
    (`fields`: the leading field names of messages in the route's own vocabulary), count it."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def route(request: Request) -> Response:
            t0, code = time.perf_counter(), "OK"
            front = front_of(request)
            served_by = front.served_by
            try:
                if request.method not in SAFE_METHODS:
                    _same_origin(request)
                if not open_:
                    _authorize(request)
                response = await fn(request)
                if isinstance(response, StreamingResponse):
                    code = "STREAM"  # the stream reports its own outcome when it ends
                response.headers.update(served_by)
                return response
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except ClientDisconnect:  # gone while sending its body: nobody to answer
                code = "CANCELLED"
                return Response(status_code=499)
            except Exception as exc:
                status, body = http_error(exc, fields)
                code = body["error"]["code"].upper()
                if status >= 500 and status != 503:
                    log.error("%s failed", method, exc_info=exc)
                retry = getattr(exc, "retry_after_s", None)
                headers = {"Retry-After": str(retry)} if retry else {}
                return JSONResponse(body, status_code=status, headers={**headers, **served_by})
            finally:
                if code != "STREAM":
                    front.metrics.rpc_done(method, code, time.perf_counter() - t0)

        return route

    return decorate


def stream(
    request: Request,
    method: str,
    events: AsyncIterator[str],
    media_type: str,
    sse: bool,
    fields: Mapping[str, str] | None = None,
    on_close: Callable[[], None] | None = None,
) -> Response:
    """Stream `events` (already started: its errors so far were answered with a status); a later
    error ends the stream with one error event."""
    metrics = front_of(request).metrics

    async def body() -> AsyncIterator[str]:
        t0, code = time.perf_counter(), "OK"
        try:
            async for event in events:
                yield event
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as exc:
            status, err = http_error(exc, fields)
            code = err["error"]["code"].upper()
            if status >= 500 and status != 503:
                log.error("%s failed mid-stream", method, exc_info=exc)
            yield protocol.sse(err) if sse else protocol.dumps(err) + "\n"
        finally:
            await events.aclose()
            if on_close is not None:
                on_close()
            metrics.rpc_done(method, code, time.perf_counter() - t0)
        if sse:
            yield "data: [DONE]\n\n"

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body(), media_type=media_type, headers=headers)


async def started(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events` with its first item already produced: errors before the first byte get a status."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise

    async def chained() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()

    return chained()
