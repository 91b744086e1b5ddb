"""Protobuf ⇄ domain conversions of the unary RPCs (UpdateWeights, GetInfo).

Companion of `wire.py`, which converts the records and chunks; these functions belong there and live
apart only because `wire.py` was frozen while the serving code was written. Same rule: protobuf
messages never leave these two modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._proto import rollout_pb2 as pb


@dataclass(frozen=True)
class ServerInfo:
    """What a replica serves and the limits it enforces (GetInfo)."""

    model: str
    engine: str
    engine_version: str
    maskroll_version: str
    policy_version: int
    max_logprobs_k: int
    max_model_len: int
    vocab_size: int
    max_tokens: int
    max_n: int
    logprobs_mode: str
    replica_id: str
    max_message_bytes: int


def info_to_pb(i: ServerInfo) -> pb.ServerInfo:
    return pb.ServerInfo(**i.__dict__)


def info_from_pb(m: pb.ServerInfo) -> ServerInfo:
    return ServerInfo(**{name: getattr(m, name) for name in ServerInfo.__dataclass_fields__})


@dataclass(frozen=True)
class WeightsUpdate:
    """An UpdateWeights request: a checkpoint directory, or (not implemented yet) an NCCL broadcast."""

    version: int
    checkpoint_dir: str | None = None  # set when the source is a checkpoint
    collective: bool = False  # the source is a CollectiveSource


@dataclass(frozen=True)
class WeightsUpdateResult:
    version: int
    load_seconds: float
    paused_requests: int  # in-flight requests that were paused and resumed


def update_request(version: int, checkpoint_dir: str) -> pb.UpdateWeightsRequest:
    return pb.UpdateWeightsRequest(version=version, checkpoint=pb.CheckpointSource(path=checkpoint_dir))


def update_from_pb(m: pb.UpdateWeightsRequest) -> WeightsUpdate:
    source = m.WhichOneof("source")
    return WeightsUpdate(
        version=m.version,
        checkpoint_dir=m.checkpoint.path if source == "checkpoint" else None,
        collective=source == "collective",
    )


def update_result_to_pb(r: WeightsUpdateResult) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(
        version=r.version, load_seconds=r.load_seconds, paused_requests=r.paused_requests
    )


def update_result_from_pb(m: pb.UpdateWeightsResponse) -> WeightsUpdateResult:
    return WeightsUpdateResult(
        version=m.version, load_seconds=m.load_seconds, paused_requests=m.paused_requests
    )
