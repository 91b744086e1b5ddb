"""The one place that converts protobuf messages ⇄ domain objects (STYLE.md §5, §9).

Arrays travel as packed little-endian bytes. Decoding validates lengths and shapes, so a truncated or
foreign payload raises `WireError` instead of producing a record a trainer could misread.
"""

from __future__ import annotations

import math

import numpy as np

from ._proto import rollout_pb2 as pb
from .records import (
    MULTI_TURN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    PromptJob,
    RolloutChunk,
    RolloutRecord,
    SamplingOptions,
    Semantics,
    ServerInfo,
    WeightsUpdate,
    WeightsUpdateResult,
)
from .tensor_push import CollectiveSpec, TensorSpec, WeightsManifest

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")

FINISH_TO_PB = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


class WireError(ValueError):
    """A payload that does not decode to a valid maskroll message."""


def pack(a: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireError(f"{what}: {len(data)} bytes, expected {expected} for shape {shape}")
    # frombuffer is a zero-copy read-only view; astype gives native-endian, writable arrays.
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))


# ---- sampling options -----------------------------------------------------------------------------


def options_to_pb(o: SamplingOptions) -> pb.SamplingOptions:
    msg = pb.SamplingOptions(
        temperature=o.temperature,
        top_p=o.top_p,
        top_k=o.top_k,
        max_tokens=o.max_tokens,
        n=o.n,
        logprobs_k=o.logprobs_k,
        stop_token_ids=list(o.stop_token_ids),
        ignore_eos=o.ignore_eos,
    )
    if o.seed is not None:
        msg.seed = o.seed
    return msg


def options_from_pb(m: pb.SamplingOptions) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=m.max_tokens,
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        top_k=m.top_k if m.HasField("top_k") else 0,
        logprobs_k=m.logprobs_k,
        n=m.n or 1,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
    )


def generate_request(
    prompt_ids,
    options: SamplingOptions,
    *,
    request_id: str = "",
    job_id: str = "",
    group_id: str = "",
    metadata: dict[str, str] | None = None,
    include_record_arrays: bool = False,
    rollout_stream: str = "",
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=pack(np.asarray(prompt_ids), _I32),
        options=options_to_pb(options),
        request_id=request_id,
        job_id=job_id,
        group_id=group_id,
        metadata=metadata or {},
        include_record_arrays=include_record_arrays,
        rollout_stream=rollout_stream,
    )


def prompt_from_pb(m: pb.GenerateRequest) -> np.ndarray:
    if len(m.prompt_token_ids) % 4:
        raise WireError(f"prompt_token_ids: {len(m.prompt_token_ids)} bytes is not a whole number of int32")
    return unpack(m.prompt_token_ids, _I32, (len(m.prompt_token_ids) // 4,), "prompt_token_ids")


# ---- prompt jobs ----------------------------------------------------------------------------------


def job_to_pb(j: PromptJob) -> pb.PromptJob:
    return pb.PromptJob(
        job_id=j.job_id,
        prompt_token_ids=pack(j.prompt_ids, _I32),
        options=options_to_pb(j.options),
        group_id=j.group_id,
        metadata=j.metadata,
        submitted_at=j.submitted_at,
        rollout_stream=j.rollout_stream,
        schema_version=SCHEMA_VERSION,
        run_id=j.run_id,
    )


def decode_job(data: bytes) -> PromptJob:
    m = pb.PromptJob()
    try:
        m.ParseFromString(data)
    except Exception as e:
        raise WireError(f"not a PromptJob: {e}") from e
    if m.schema_version != SCHEMA_VERSION:
        raise WireError(f"PromptJob schema_version {m.schema_version}; this replica reads {SCHEMA_VERSION}")
    if not m.job_id or len(m.prompt_token_ids) % 4:
        raise WireError("PromptJob without job_id or with a partial int32 prompt")
    prompt = unpack(m.prompt_token_ids, _I32, (len(m.prompt_token_ids) // 4,), "prompt_token_ids")
    return PromptJob(
        job_id=m.job_id,
        prompt_ids=prompt,
        options=options_from_pb(m.options),
        group_id=m.group_id,
        metadata=dict(m.metadata),
        submitted_at=m.submitted_at,
        rollout_stream=m.rollout_stream,
        run_id=m.run_id,
    )


# ---- records --------------------------------------------------------------------------------------


def semantics_to_pb(s: Semantics) -> pb.Semantics:
    return pb.Semantics(**s.__dict__)


def semantics_from_pb(m: pb.Semantics) -> Semantics:
    return Semantics(
        logprobs_mode=m.logprobs_mode,
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        logprobs_k=m.logprobs_k,
        engine=m.engine,
        engine_version=m.engine_version,
        model=m.model,
    )


def record_to_pb(r: RolloutRecord, *, arrays: bool = True) -> pb.RolloutRecord:
    multi_turn = r.loss_mask is not None
    msg = pb.RolloutRecord(
        schema_version=MULTI_TURN_SCHEMA_VERSION if multi_turn else r.schema_version,
        rollout_id=r.rollout_id,
        request_id=r.request_id,
        job_id=r.job_id,
        group_id=r.group_id,
        sample_index=r.sample_index,
        metadata=r.metadata,
        prompt_token_ids=pack(r.prompt_ids, _I32),
        num_tokens=r.num_tokens,
        finish_reason=FINISH_TO_PB[r.finish_reason],
        semantics=semantics_to_pb(r.semantics),
        policy_version_first=r.policy_version_first,
        policy_version_last=r.policy_version_last,
        version_changes=[pb.VersionChange(token_index=i, version=v) for i, v in r.version_changes],
        replica_id=r.replica_id,
        created_at=r.created_at,
        group_size=r.group_size,
        run_id=r.run_id,
    )
    if multi_turn:
        msg.segment_starts.extend(r.segment_starts)
        msg.num_turns = r.num_turns
    if arrays:
        # A multi-turn record's logprobs exist only where the model sampled: only those travel.
        gen = np.asarray(r.loss_mask, bool) if multi_turn else slice(None)
        msg.completion_token_ids = pack(r.completion_ids, _I32)
        msg.sampled_logprobs = pack(r.sampled_logprobs[gen], _F32)
        msg.sampled_ranks = pack(r.sampled_ranks[gen], _I32)
        msg.topk_ids = pack(r.topk_ids[gen], _I32)
        msg.topk_logprobs = pack(r.topk_logprobs[gen], _F32)
        if multi_turn:
            msg.loss_mask = pack(r.loss_mask, _U8)
    return msg


def _loss_mask(m: pb.RolloutRecord, t: int) -> np.ndarray | None:
    """bool [T] of a multi-turn (version 2) record, None for a single-turn one."""
    if m.schema_version != MULTI_TURN_SCHEMA_VERSION:
        if m.loss_mask or m.segment_starts or m.num_turns:
            raise WireError(f"a version {m.schema_version} record carries multi-turn fields (version 2)")
        return None
    mask = unpack(m.loss_mask, _U8, (t,), "loss_mask")
    if mask.size and mask.max() > 1:
        raise WireError("loss_mask holds a value other than 0 and 1")
    starts = list(m.segment_starts)
    if starts != sorted(set(starts)) or any(not 0 < s < t for s in starts):
        raise WireError(f"segment_starts {starts} are not increasing within (0, {t})")
    return mask.astype(bool)


def _scatter(data: bytes, dtype: np.dtype, t: int, mask: np.ndarray | None, tail: tuple, what: str):
    """A logprob array [T, *tail] from its bytes: all T rows, or (multi-turn) the rows where `mask` is
    set, zero elsewhere."""
    if mask is None:
        return unpack(data, dtype, (t, *tail), what)
    out = np.zeros((mask.size, *tail), dtype.newbyteorder("="))
    out[mask] = unpack(data, dtype, (int(mask.sum()), *tail), what)
    return out


def record_from_pb(m: pb.RolloutRecord, *, arrays: bool = True) -> RolloutRecord:
    """Decode and validate. With arrays=False the arrays are left empty (a stream's record header)."""
    if m.schema_version not in (SCHEMA_VERSION, MULTI_TURN_SCHEMA_VERSION):
        raise WireError(
            f"schema_version {m.schema_version}; this client reads {SCHEMA_VERSION} (single-turn) and "
            f"{MULTI_TURN_SCHEMA_VERSION} (multi-turn)"
        )
    if m.finish_reason not in FINISH_FROM_PB:
        raise WireError(f"finish_reason {m.finish_reason} is not a finished state")
    if m.semantics.logprobs_mode != "processed":
        raise WireError(f"logprobs_mode {m.semantics.logprobs_mode!r}; maskroll records carry 'processed'")
    t, k = m.num_tokens, m.semantics.logprobs_k
    if k < 0:  # int32 on the wire; a [T, -1] shape would pass the byte count when T = 0
        raise WireError(f"semantics.logprobs_k {k} is negative")
    if len(m.prompt_token_ids) % 4:
        raise WireError("prompt_token_ids is not a whole number of int32")
    prompt = unpack(m.prompt_token_ids, _I32, (len(m.prompt_token_ids) // 4,), "prompt_token_ids")
    n = t if arrays else 0
    mask = _loss_mask(m, t) if arrays else None
    rec = RolloutRecord(
        rollout_id=m.rollout_id,
        request_id=m.request_id,
        prompt_ids=prompt,
        completion_ids=unpack(m.completion_token_ids, _I32, (n,), "completion_token_ids"),
        sampled_logprobs=_scatter(m.sampled_logprobs, _F32, n, mask, (), "sampled_logprobs"),
        sampled_ranks=_scatter(m.sampled_ranks, _I32, n, mask, (), "sampled_ranks"),
        topk_ids=_scatter(m.topk_ids, _I32, n, mask, (k,), "topk_ids"),
        topk_logprobs=_scatter(m.topk_logprobs, _F32, n, mask, (k,), "topk_logprobs"),
        finish_reason=FINISH_FROM_PB[m.finish_reason],
        semantics=semantics_from_pb(m.semantics),
        policy_version_first=m.policy_version_first,
        policy_version_last=m.policy_version_last,
        version_changes=[(c.token_index, c.version) for c in m.version_changes],
        job_id=m.job_id,
        group_id=m.group_id,
        sample_index=m.sample_index,
        metadata=dict(m.metadata),
        replica_id=m.replica_id,
        created_at=m.created_at,
        group_size=m.group_size or 1,
        schema_version=m.schema_version,
        run_id=m.run_id,
        loss_mask=mask,
        segment_starts=list(m.segment_starts) if mask is not None else [],
        num_turns=m.num_turns,
    )
    return rec


def encode_record(r: RolloutRecord) -> bytes:
    """A record as stored in Redis: the same protobuf message as on the gRPC stream."""
    return record_to_pb(r).SerializeToString()


def decode_record(data: bytes) -> RolloutRecord:
    """A record from Redis bytes; any payload that is not a valid record raises WireError, nothing else
    (tests/test_wire.py fuzzes this with random and mutated payloads)."""
    msg = pb.RolloutRecord()
    try:
        msg.ParseFromString(data)
    except Exception as e:  # protobuf raises DecodeError or RuntimeWarning-ish errors by backend
        raise WireError(f"not a RolloutRecord: {e}") from e
    return record_from_pb(msg)


# ---- chunks ---------------------------------------------------------------------------------------


def chunk_to_pb(c: RolloutChunk, *, record_arrays: bool = False) -> pb.GenerateChunk:
    msg = pb.GenerateChunk(
        request_id=c.request_id,
        sample_index=c.sample_index,
        start_index=c.start_index,
        token_ids=pack(c.token_ids, _I32),
        sampled_logprobs=pack(c.sampled_logprobs, _F32),
        sampled_ranks=pack(c.sampled_ranks, _I32),
        topk_ids=pack(c.topk_ids, _I32),
        topk_logprobs=pack(c.topk_logprobs, _F32),
        logprobs_k=c.topk_ids.shape[1] if c.topk_ids.ndim == 2 else 0,
        policy_version=c.policy_version,
    )
    if c.record is not None:
        msg.record.CopyFrom(record_to_pb(c.record, arrays=record_arrays))
    return msg


def chunk_from_pb(m: pb.GenerateChunk) -> RolloutChunk:
    if len(m.token_ids) % 4:
        raise WireError("token_ids is not a whole number of int32")
    t, k = len(m.token_ids) // 4, m.logprobs_k
    record = None
    if m.HasField("record"):
        record = record_from_pb(
            m.record, arrays=len(m.record.completion_token_ids) > 0 or m.record.num_tokens == 0
        )
    return RolloutChunk(
        request_id=m.request_id,
        sample_index=m.sample_index,
        start_index=m.start_index,
        token_ids=unpack(m.token_ids, _I32, (t,), "token_ids"),
        sampled_logprobs=unpack(m.sampled_logprobs, _F32, (t,), "sampled_logprobs"),
        sampled_ranks=unpack(m.sampled_ranks, _I32, (t,), "sampled_ranks"),
        topk_ids=unpack(m.topk_ids, _I32, (t, k), "topk_ids"),
        topk_logprobs=unpack(m.topk_logprobs, _F32, (t, k), "topk_logprobs"),
        policy_version=m.policy_version,
        record=record,
    )


# ---- unary RPCs: GetInfo, UpdateWeights ---------------------------------------------------------


def info_to_pb(i: ServerInfo) -> pb.ServerInfo:
    return pb.ServerInfo(**i.__dict__)


def info_from_pb(m: pb.ServerInfo) -> ServerInfo:
    return ServerInfo(**{name: getattr(m, name) for name in ServerInfo.__dataclass_fields__})


def update_request(version: int, checkpoint_dir: str, run_id: str = "") -> pb.UpdateWeightsRequest:
    return pb.UpdateWeightsRequest(
        version=version, checkpoint=pb.CheckpointSource(path=checkpoint_dir), run_id=run_id
    )


def update_from_pb(m: pb.UpdateWeightsRequest) -> WeightsUpdate:
    source = m.WhichOneof("source")
    return WeightsUpdate(
        version=m.version,
        checkpoint_dir=m.checkpoint.path if source == "checkpoint" else None,
        collective=source == "collective",
        run_id=m.run_id,
    )


def update_result_to_pb(r: WeightsUpdateResult) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(
        version=r.version, load_seconds=r.load_seconds, paused_requests=r.paused_requests
    )


def update_result_from_pb(m: pb.UpdateWeightsResponse) -> WeightsUpdateResult:
    return WeightsUpdateResult(
        version=m.version, load_seconds=m.load_seconds, paused_requests=m.paused_requests
    )


# ---- client-streaming RPC: PushWeights ------------------------------------------------------------


def tensor_spec_to_pb(t: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes, crc32=t.crc32)


def tensor_spec_from_pb(m: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(name=m.name, dtype=m.dtype, shape=tuple(m.shape), nbytes=m.nbytes, crc32=m.crc32)


def manifest_to_pb(m: WeightsManifest) -> pb.WeightsPushChunk:
    return pb.WeightsPushChunk(
        manifest=pb.WeightsManifest(
            version=m.version, run_id=m.run_id, tensors=[tensor_spec_to_pb(t) for t in m.tensors]
        )
    )


def manifest_from_pb(m: pb.WeightsPushChunk) -> WeightsManifest:
    """The manifest a push starts with; ValueError if the first message is not one."""
    if m.WhichOneof("part") != "manifest":
        raise ValueError("a PushWeights call must start with its manifest, got a data chunk first")
    mf = m.manifest
    return WeightsManifest(
        version=mf.version, run_id=mf.run_id, tensors=tuple(tensor_spec_from_pb(t) for t in mf.tensors)
    )


def push_chunk_to_pb(index: int, offset: int, data: bytes | memoryview) -> pb.WeightsPushChunk:
    return pb.WeightsPushChunk(data=pb.TensorChunk(index=index, offset=offset, data=bytes(data)))


def push_chunk_from_pb(m: pb.WeightsPushChunk) -> tuple[int, int, bytes]:
    """(tensor index, byte offset, bytes); ValueError for a second manifest."""
    if m.WhichOneof("part") != "data":
        raise ValueError("a PushWeights call carries one manifest, first; got another one mid-stream")
    return m.data.index, m.data.offset, m.data.data


def collective_to_pb(c: CollectiveSpec) -> pb.CollectiveSource:
    return pb.CollectiveSource(
        group_name=c.group_name,
        master_address=c.master_address,
        master_port=c.master_port,
        rank_offset=c.rank_offset,
        world_size=c.world_size,
        init=c.init,
        tensors=[tensor_spec_to_pb(t) for t in c.tensors],
        packed=c.packed,
    )


def collective_request(version: int, c: CollectiveSpec, run_id: str = "") -> pb.UpdateWeightsRequest:
    return pb.UpdateWeightsRequest(version=version, collective=collective_to_pb(c), run_id=run_id)


def collective_from_pb(m: pb.UpdateWeightsRequest) -> CollectiveSpec | None:
    """The request's NCCL source, or None when its source is not `collective`."""
    if m.WhichOneof("source") != "collective":
        return None
    c = m.collective
    return CollectiveSpec(
        group_name=c.group_name,
        master_address=c.master_address,
        master_port=c.master_port,
        rank_offset=c.rank_offset,
        world_size=c.world_size,
        init=c.init,
        tensors=tuple(tensor_spec_from_pb(t) for t in c.tensors),
        packed=c.packed,
    )
