"""The OpenAI-compatible routes: the served model, completions and chat completions (streaming or not).

    GET    /v1/models              the served model
    POST   /v1/completions         OpenAI completions, streaming (SSE) or not
    POST   /v1/chat/completions    OpenAI chat completions, streaming (SSE) or not

A completion call with `X-Maskroll-Session: <id>` (and optionally `X-Maskroll-Group: <group>`) is a turn
of that agent session (sessions/serving.py). The request's shapes are protocol.py's, its work
serving.py's; an error names the request's field as OpenAI's API calls it (`top_logprobs` for what the
pipeline calls options.logprobs_k).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...errors import InvalidArgument
from ..boundary import SSE, api_fields, boundary, front_of, read_json, started, stream, unless_disconnected
from . import protocol
from .serving import Call

router = APIRouter()

SESSION_HEADER = "x-maskroll-session"
GROUP_HEADER = "x-maskroll-group"
# How the pipeline's field names read in each API's vocabulary.
CHAT_FIELDS = api_fields(
    protocol.ChatRequest.model_fields, options__logprobs_k="top_logprobs", prompt_token_ids="messages"
)
COMPLETION_FIELDS = api_fields(
    protocol.CompletionRequest.model_fields, options__logprobs_k="logprobs", prompt_token_ids="prompt"
)


@router.get("/v1/models")
@boundary("http:models")
async def models(request: Request) -> Response:
    serving = front_of(request).openai
    model = {"id": serving.model_name, "object": "model", "created": 0, "owned_by": "maskroll"}
    model["max_model_len"] = serving.caps.max_model_len
    return JSONResponse({"object": "list", "data": [model]})


@router.post("/v1/completions")
@boundary("http:completions", COMPLETION_FIELDS)
async def completions(request: Request) -> Response:
    req = protocol.parse_request(protocol.CompletionRequest, await read_json(request))
    call = await front_of(request).openai.prepare_completion(req, session_of(request))
    response_of, stream_of = protocol.completion_response, protocol.completion_stream
    return await _respond(request, call, req, response_of, stream_of, "http:completions", COMPLETION_FIELDS)


@router.post("/v1/chat/completions")
@boundary("http:chat.completions", CHAT_FIELDS)
async def chat_completions(request: Request) -> Response:
    req = protocol.parse_request(protocol.ChatRequest, await read_json(request))
    call = await front_of(request).openai.prepare_chat(req, session_of(request))
    response_of, stream_of = protocol.chat_response, protocol.chat_stream
    return await _respond(request, call, req, response_of, stream_of, "http:chat.completions", CHAT_FIELDS)


def session_of(request: Request) -> tuple[str, str] | None:
    """(session id, group id) of a call that is an agent session's turn, or None."""
    sid = request.headers.get(SESSION_HEADER)
    if sid is None:
        if request.headers.get(GROUP_HEADER):
            raise InvalidArgument("X-Maskroll-Group needs X-Maskroll-Session")
        return None
    group = request.headers.get(GROUP_HEADER, "")
    if len(group) > 256 or not group.isprintable():
        raise InvalidArgument("X-Maskroll-Group must be at most 256 printable characters")
    return sid, group


async def _respond(
    request: Request, call: Call, req, response_of, stream_of, method: str, fields: dict[str, str]
) -> Response:
    """Run a prepared call: as SSE events when it streams, else one JSON response once it has ended (a
    client that disconnects first aborts it). The call is closed whatever happens to the response."""
    serving = front_of(request).openai
    try:
        if req.stream:
            events = await started(stream_of(call, serving.run(call), serving.chat))
            return stream(request, method, events, SSE, True, fields, on_close=call.close)
        await unless_disconnected(request, serving.collect(call))
        return JSONResponse(response_of(call, serving.chat))
    except BaseException:
        call.close()
        raise
