"""The native JSON API: the gRPC service's unary and streaming calls as JSON, on the replica's core.

    GET    /v1/info       GetInfo                              ┐ the JSON image of the proto, protobuf's
    POST   /v1/weights    UpdateWeights                        │ JSON mapping (arrays are base64 of the
    POST   /v1/generate   Generate: chunks as NDJSON,          │ packed bytes): a body parses as the
                          or SSE (Accept: text/event-stream)   │ gRPC request, converts as it does
    POST   /v1/score      Score: one JSON response             ┘ (proto.wire), and calls the same core

Same rules and answers as the gRPC calls, since both convert to the same domain objects and call the same
core (generation/serving.py, weights/updates.py); an error's status follows its gRPC code (errors.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format

from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb

from ..errors import InvalidArgument
from .boundary import NDJSON, SSE, boundary, front_of, read_json, started, stream, unless_disconnected
from .errors import OPTIONS
from .openai import protocol

router = APIRouter()

NATIVE_FIELDS = {n: n for n in pb.GenerateRequest.DESCRIPTOR.fields_by_name} | {
    f"options.{n}": f"options.{n}" for n in OPTIONS
}
WEIGHTS_FIELDS = {n: n for n in pb.UpdateWeightsRequest.DESCRIPTOR.fields_by_name}
SCORE_FIELDS = {n: n for n in pb.ScoreRequest.DESCRIPTOR.fields_by_name}


def parse(body: object, message):
    """`message` filled from a JSON body by protobuf's JSON mapping; 400 naming the message otherwise."""
    try:
        return json_format.ParseDict(body or {}, message)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"the body is not a {message.DESCRIPTOR.name} in JSON: {exc}") from None


def to_json(message) -> dict:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


@router.get("/v1/info")
@boundary("http:GetInfo")
async def info(request: Request) -> Response:
    return JSONResponse(to_json(wire.info_to_pb(front_of(request).core.info())))


@router.post("/v1/weights")
@boundary("http:UpdateWeights", WEIGHTS_FIELDS)
async def update_weights(request: Request) -> Response:
    update = wire.update_from_pb(parse(await read_json(request), pb.UpdateWeightsRequest()))
    result = await front_of(request).core.updates.update(update)
    return JSONResponse(to_json(wire.update_result_to_pb(result)))


@router.post("/v1/generate")
@boundary("http:Generate", NATIVE_FIELDS)
async def generate(request: Request) -> Response:
    serving = front_of(request).core.serving
    serving.check()  # before the body is read: a draining replica refuses it as it is
    served = wire.generate_from_pb(parse(await read_json(request), pb.GenerateRequest()))
    sse = SSE in request.headers.get("accept", "")

    async def events() -> AsyncIterator[str]:
        async with contextlib.aclosing(serving.generate(served)) as chunks:
            async for chunk in chunks:
                message = to_json(wire.chunk_to_pb(chunk, record_arrays=served.include_record_arrays))
                yield protocol.sse(message) if sse else protocol.dumps(message) + "\n"

    events_ = await started(events())
    return stream(request, "http:Generate", events_, SSE if sse else NDJSON, sse, NATIVE_FIELDS)


@router.post("/v1/score")
@boundary("http:Score", SCORE_FIELDS)
async def score(request: Request) -> Response:
    serving = front_of(request).core.serving
    serving.check()
    req = parse(await read_json(request), pb.ScoreRequest())
    result = await unless_disconnected(request, serving.score(wire.score_from_pb(req), req.namespace))
    return JSONResponse(to_json(wire.score_result_to_pb(result)))
