"""The HTTP front end's routes (FastAPI): the native JSON API, the OpenAI-compatible API, agent sessions.

    GET    /healthz                      live: 200 while the process serves HTTP (no token needed)
    GET    /readyz                       200 when the engine serves and the replica is not draining, else 503
    GET    /metrics                      the replica's Prometheus metrics (as on --metrics-port)
    GET    /v1/info                      GetInfo                       ┐ the JSON image of the proto: the
    POST   /v1/weights                   UpdateWeights                 │ gRPC servicer's own methods, with
    POST   /v1/generate                  Generate: chunks as NDJSON,   │ protobuf's JSON mapping (arrays are
                                         or SSE (Accept: text/event-stream)  │ base64 of the packed bytes)
    POST   /v1/score                     Score: one JSON response      ┘
    GET    /v1/models                    the served model
    POST   /v1/completions               OpenAI completions, streaming (SSE) or not
    POST   /v1/chat/completions          OpenAI chat completions, streaming (SSE) or not
    POST   /v1/sessions/{id}/finish      an agent session's trajectory → one RolloutRecord (published)
    DELETE /v1/sessions/{id}             drop a session

A completion call with `X-Maskroll-Session: <id>` (and optionally `X-Maskroll-Group: <group>`) is a turn
of that session (openai_serving, sessions). Every route but the health checks needs `Authorization:
Bearer <token>` when the replica has one; bodies are limited to max_message_bytes (413), must say they
are JSON (Content-Type: application/json, else 415) and may not nest deeper than MAX_JSON_DEPTH nor hold
lone surrogates (400); a request a browser sends from another origin (its Origin header) is refused (403):
a web page cannot make a replica on the visitor's loopback act without a CORS preflight. A non-streaming
call whose client disconnects is aborted (`unless_disconnected`). `boundary` is
the one place a route's exception becomes a response (http_errors: status and OpenAI's error JSON)
and sets `X-Maskroll-Replica` (which replica answered: behind a proxy, where a session's calls land);
a stream that fails after its first byte ends with one error event instead.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf import json_format
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from maskroll.proto._generated import rollout_pb2 as pb

from ..errors import InvalidArgument, Unauthenticated
from . import openai_compat as oa
from .errors import OPTIONS, CrossOrigin, PayloadTooLarge, RpcAbort, UnsupportedMediaType, http_error

if TYPE_CHECKING:
    from .openai_serving import Call
    from .server import HttpFrontEnd

log = logging.getLogger(__name__)

SESSION_HEADER = "x-maskroll-session"
GROUP_HEADER = "x-maskroll-group"
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
# The replica that answered (its --replica-id, percent-encoded), on every route's response.
REPLICA_HEADER = "X-Maskroll-Replica"
T = TypeVar("T")


def _fields(names, **renames: str) -> dict[str, str]:
    """What a message's leading field is called in an API (http_errors.rename_field): its own request
    fields, the pipeline's options.* by their plain names, and `renames` (dots spelt __)."""
    out = {n: n for n in names} | {f"options.{n}": n for n in OPTIONS}
    return out | {k.replace("__", "."): v for k, v in renames.items()}


# How the pipeline's field names read in each API's vocabulary.
CHAT_FIELDS = _fields(
    oa.ChatRequest.model_fields, options__logprobs_k="top_logprobs", prompt_token_ids="messages"
)
COMPLETION_FIELDS = _fields(
    oa.CompletionRequest.model_fields, options__logprobs_k="logprobs", prompt_token_ids="prompt"
)
NATIVE_FIELDS = {n: n for n in pb.GenerateRequest.DESCRIPTOR.fields_by_name} | {
    f"options.{n}": f"options.{n}" for n in OPTIONS
}


class _Context:
    """What the gRPC servicer's methods use of a grpc context: abort(), which raises the status here."""

    async def abort(self, code, details: str):
        raise RpcAbort(code, details)

    def code(self):
        return None


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


def build_app(front: HttpFrontEnd) -> FastAPI:
    app = FastAPI(title="maskroll", docs_url=None, redoc_url=None, openapi_url=None)
    serving, config, metrics = front.serving, front.config, front.metrics
    expected = f"Bearer {config.token}".encode() if config.token else None
    # Which replica answered, on every route's response: behind a proxy (deploy/, local/proxy.py) the
    # client, the tests and an operator see where a session's calls land. Percent-encoded: a header
    # value must be latin-1 and the id is free text.
    served_by = {REPLICA_HEADER: quote(config.replica_id, safe="")}

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        # Constant time, so response timing does not reveal how much of a guess was right.
        if not hmac.compare_digest(given, expected):
            raise Unauthenticated("missing or invalid bearer token (header 'Authorization: Bearer <token>')")

    async def read_json(request: Request) -> object:
        limit = config.max_message_bytes
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
            raise InvalidArgument(
                f"the request body is nested more than {MAX_JSON_DEPTH} levels deep"
            ) from None
        _check_body(obj, body)
        return obj

    def boundary(method: str, fields: dict[str, str] | None = None, open_: bool = False) -> Callable:
        """A route: authorize, run, turn any exception into its status and OpenAI error JSON, count it."""

        def decorate(fn: Callable) -> Callable:
            @functools.wraps(fn)
            async def route(request: Request) -> Response:
                t0, code = time.perf_counter(), "OK"
                try:
                    if request.method not in SAFE_METHODS:
                        _same_origin(request)
                    if not open_:
                        authorize(request)
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
                        metrics.rpc_done(method, code, time.perf_counter() - t0)

            return route

        return decorate

    def stream(
        method: str,
        events: AsyncIterator[str],
        media_type: str,
        sse: bool,
        fields: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> Response:
        """Stream `events` (already started: its errors so far were answered with a status); a later
        error ends the stream with one error event."""

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
                yield oa.sse(err) if sse else oa.dumps(err) + "\n"
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

    # ---- health --------------------------------------------------------------------------------

    @app.get("/healthz")
    @boundary("http:healthz", open_=True)
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "live"})

    @app.get("/readyz")
    @boundary("http:readyz", open_=True)
    async def readyz(request: Request) -> Response:
        # The same rule as the gRPC health services (server/app.py `problems`): they must agree.
        found = ["draining"] if serving.draining else front.problems()
        if found:
            return JSONResponse({"status": "not ready", "reason": "; ".join(found)}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    @boundary("http:metrics")
    async def prometheus_metrics(request: Request) -> Response:
        # The replica's Prometheus metrics on the HTTP port too (token as for every route but health),
        # so a replica serving HTTP needs no second port scraped.
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- native API: the gRPC service as JSON ----------------------------------------------------

    def parse(body: object, message):
        try:
            return json_format.ParseDict(body or {}, message)
        except json_format.ParseError as exc:
            raise InvalidArgument(f"the body is not a {message.DESCRIPTOR.name} in JSON: {exc}") from None

    def to_json(message) -> dict:
        return json_format.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    @app.get("/v1/info")
    @boundary("http:GetInfo")
    async def info(request: Request) -> Response:
        return JSONResponse(to_json(await front.servicer.GetInfo(pb.GetInfoRequest(), _Context())))

    @app.post("/v1/weights")
    @boundary("http:UpdateWeights", {n: n for n in pb.UpdateWeightsRequest.DESCRIPTOR.fields_by_name})
    async def update_weights(request: Request) -> Response:
        req = parse(await read_json(request), pb.UpdateWeightsRequest())
        return JSONResponse(to_json(await front.servicer.UpdateWeights(req, _Context())))

    @app.post("/v1/generate")
    @boundary("http:Generate", NATIVE_FIELDS)
    async def generate(request: Request) -> Response:
        serving.check_serving()
        req = parse(await read_json(request), pb.GenerateRequest())
        sse = SSE in request.headers.get("accept", "")

        async def events() -> AsyncIterator[str]:
            async for chunk in front.servicer.Generate(req, _Context()):
                yield oa.sse(to_json(chunk)) if sse else oa.dumps(to_json(chunk)) + "\n"

        return stream("http:Generate", await started(events()), SSE if sse else NDJSON, sse, NATIVE_FIELDS)

    @app.post("/v1/score")
    @boundary("http:Score", {n: n for n in pb.ScoreRequest.DESCRIPTOR.fields_by_name})
    async def score(request: Request) -> Response:
        serving.check_serving()
        req = parse(await read_json(request), pb.ScoreRequest())
        scored = await unless_disconnected(request, front.servicer.Score(req, _Context()))
        return JSONResponse(to_json(scored))

    # ---- OpenAI-compatible API -------------------------------------------------------------------

    @app.get("/v1/models")
    @boundary("http:models")
    async def models(request: Request) -> Response:
        model = {"id": serving.model_name, "object": "model", "created": 0, "owned_by": "maskroll"}
        model["max_model_len"] = serving.caps.max_model_len
        return JSONResponse({"object": "list", "data": [model]})

    def session_of(request: Request) -> tuple[str, str] | None:
        sid = request.headers.get(SESSION_HEADER)
        if sid is None:
            if request.headers.get(GROUP_HEADER):
                raise InvalidArgument("X-Maskroll-Group needs X-Maskroll-Session")
            return None
        group = request.headers.get(GROUP_HEADER, "")
        if len(group) > 256 or not group.isprintable():
            raise InvalidArgument("X-Maskroll-Group must be at most 256 printable characters")
        return sid, group

    async def respond(
        request: Request, call: Call, req, response_of, stream_of, method: str, fields
    ) -> Response:
        try:
            if req.stream:
                events = await started(stream_of(call, serving.run(call), serving.chat))
                return stream(method, events, SSE, True, fields, on_close=call.close)
            await unless_disconnected(request, serving.collect(call))
            return JSONResponse(response_of(call, serving.chat))
        except BaseException:
            call.close()
            raise

    @app.post("/v1/completions")
    @boundary("http:completions", COMPLETION_FIELDS)
    async def completions(request: Request) -> Response:
        req = oa.parse_request(oa.CompletionRequest, await read_json(request))
        call = await serving.prepare_completion(req, session_of(request))
        return await respond(
            request,
            call,
            req,
            oa.completion_response,
            oa.completion_stream,
            "http:completions",
            COMPLETION_FIELDS,
        )

    @app.post("/v1/chat/completions")
    @boundary("http:chat.completions", CHAT_FIELDS)
    async def chat_completions(request: Request) -> Response:
        req = oa.parse_request(oa.ChatRequest, await read_json(request))
        call = await serving.prepare_chat(req, session_of(request))
        return await respond(
            request, call, req, oa.chat_response, oa.chat_stream, "http:chat.completions", CHAT_FIELDS
        )

    # ---- agent sessions --------------------------------------------------------------------------

    @app.post("/v1/sessions/{session_id}/finish")
    @boundary("http:sessions.finish")
    async def finish_session(request: Request) -> Response:
        answer = await serving.finish_session(request.path_params["session_id"], await read_json(request))
        return JSONResponse(answer)

    @app.delete("/v1/sessions/{session_id}")
    @boundary("http:sessions.delete")
    async def delete_session(request: Request) -> Response:
        return JSONResponse(await serving.delete_session(request.path_params["session_id"]))

    @app.exception_handler(StarletteHTTPException)
    async def not_routed(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown paths and methods, in the same error shape as everything else.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code)

    return app
