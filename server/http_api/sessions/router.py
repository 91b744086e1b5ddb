"""The agent sessions' own routes (a session's turns are OpenAI calls: openai/router.py).

    POST   /v1/sessions/{id}/finish    the session's trajectory → one RolloutRecord (published with Redis)
    DELETE /v1/sessions/{id}           drop the session

Their work is serving.py's `SessionServing`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..boundary import boundary, front_of, read_json

router = APIRouter()


@router.post("/v1/sessions/{session_id}/finish")
@boundary("http:sessions.finish")
async def finish_session(request: Request) -> Response:
    sessions = front_of(request).sessions
    return JSONResponse(await sessions.finish(request.path_params["session_id"], await read_json(request)))


@router.delete("/v1/sessions/{session_id}")
@boundary("http:sessions.delete")
async def delete_session(request: Request) -> Response:
    return JSONResponse(await front_of(request).sessions.delete(request.path_params["session_id"]))
