"""The one place that converts protobuf messages ⇄ domain objects (STYLE.md §5, §9).

Here: sampling options, prompt jobs, records (with the Redis codec `encode_record` / `decode_record`),
streamed chunks, GetInfo and UpdateWeights. The PushWeights / CollectiveSource conversions are written in
`wire_push`, Score's in `wire_score`, and what every part shares (WireError, packed arrays, Semantics) in
`wire_base`; all are re-exported below, so callers still import one converter. Arrays travel as packed
little-endian bytes. Decoding validates lengths and shapes, so a truncated or foreign payload raises
`WireError` instead of producing a record a trainer could misread.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import varint
from ._generated import rollout_pb2 as pb
from .records import (
    MULTI_TURN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    AdapterInfo,
    GenerateRequest,
    PromptJob,
    RolloutChunk,
    RolloutRecord,
    SamplingOptions,
    Semantics,
    ServerInfo,
    WeightsUpdate,
    WeightsUpdateResult,
)

# What the converter's parts share (its error, packed arrays, Semantics), and the PushWeights /
# CollectiveSource and Score conversions, live in wire_base, wire_push and wire_score; every caller
# imports them from here, the one converter.
from .wire_base import _F32, _I32, _U8, WireError, pack, semantics_from_pb, semantics_to_pb, unpack
from .wire_push import (  # noqa: F401
    PUSH_WEIGHTS_METHOD,
    collective_from_pb,
    collective_request,
    collective_to_pb,
    manifest_from_pb,
    manifest_to_pb,
    push_chunk_bytes,
    push_chunk_from_pb,
    push_chunk_to_pb,
    tensor_spec_from_pb,
    tensor_spec_to_pb,
)
from .wire_score import score_from_pb, score_request, score_result_from_pb, score_result_to_pb  # noqa: F401

FINISH_TO_PB = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


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
    namespace: str = "",
) -> pb.GenerateRequest:
    """namespace: sample with that namespace's current LoRA adapter ("": the replica's own namespace)."""
    return pb.GenerateRequest(
        prompt_token_ids=pack(np.asarray(prompt_ids), _I32),
        options=options_to_pb(options),
        request_id=request_id,
        job_id=job_id,
        group_id=group_id,
        metadata=metadata or {},
        include_record_arrays=include_record_arrays,
        rollout_stream=rollout_stream,
        namespace=namespace,
    )


def prompt_from_pb(m: pb.GenerateRequest) -> np.ndarray:
    if len(m.prompt_token_ids) % 4:
        raise WireError(f"prompt_token_ids: {len(m.prompt_token_ids)} bytes is not a whole number of int32")
    return unpack(m.prompt_token_ids, _I32, (len(m.prompt_token_ids) // 4,), "prompt_token_ids")


def generate_from_pb(m: pb.GenerateRequest) -> GenerateRequest:
    """The request a replica serves (WireError when its prompt does not decode)."""
    return GenerateRequest(
        prompt_ids=prompt_from_pb(m),
        options=options_from_pb(m.options),
        request_id=m.request_id,
        job_id=m.job_id,
        group_id=m.group_id,
        metadata=dict(m.metadata),
        rollout_stream=m.rollout_stream,
        include_record_arrays=m.include_record_arrays,
        namespace=m.namespace,
    )


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
        adapter=r.adapter,
    )
    if multi_turn:
        msg.segment_starts.extend(r.segment_starts)
        msg.num_turns = r.num_turns
    if r.reward is not None:  # optional: an unscored record has no reward at all, not a 0
        msg.reward = r.reward
        msg.reward_verifier = r.reward_verifier
        msg.reward_reason = r.reward_reason
    if r.teacher_semantics is not None:  # its presence says a teacher scored the record
        msg.teacher_semantics.CopyFrom(semantics_to_pb(r.teacher_semantics))
        msg.teacher_policy_version = r.teacher_policy_version
    if arrays:
        for name, _, a in _record_arrays(r):
            setattr(msg, name, a.tobytes())
    return msg


# RolloutRecord's array fields: (field name, field number, dtype), in the order encode_record appends them.
_RECORD_ARRAYS = (
    ("completion_token_ids", 9, _I32),
    ("sampled_logprobs", 10, _F32),
    ("sampled_ranks", 11, _I32),
    ("topk_ids", 12, _I32),
    ("topk_logprobs", 13, _F32),
    ("loss_mask", 24, _U8),
    ("teacher_topk_ids", 30, _I32),
    ("teacher_topk_logprobs", 31, _F32),
    ("teacher_sampled_logprobs", 32, _F32),
)
# The ones decode_record takes out of the payload itself (fields 9-13 and the teacher's 30-32, [T] and
# [T, K]); the small loss mask stays with the header, which protobuf parses.
_BIG_ARRAYS = {number: name for name, number, _ in _RECORD_ARRAYS if number != 24}


def _record_arrays(r: RolloutRecord) -> list[tuple[str, int, np.ndarray]]:
    """The record's array fields as contiguous little-endian arrays (no copy when they already are).
    A multi-turn record's logprobs exist only where the model sampled: only those travel."""
    multi_turn = r.loss_mask is not None
    gen = np.asarray(r.loss_mask, bool) if multi_turn else slice(None)
    values = (r.completion_ids, r.sampled_logprobs[gen], r.sampled_ranks[gen], r.topk_ids[gen])
    values += (r.topk_logprobs[gen], r.loss_mask)
    teacher = (r.teacher_topk_ids, r.teacher_topk_logprobs, r.teacher_sampled_logprobs)
    values += tuple(None if a is None else a[gen] for a in teacher)
    return [
        (name, number, np.ascontiguousarray(a, dtype=dtype))
        for (name, number, dtype), a in zip(_RECORD_ARRAYS, values, strict=True)
        if a is not None
    ]


@functools.lru_cache(maxsize=1024)  # records of one length share their heads: ~0.2 µs instead of ~1.4
def _field_head(number: int, size: int, at: int) -> bytes:
    """The tag and length varint of a length-delimited field that starts at byte `at` (mod 4) of the
    payload, padded (each varint at most 5 bytes) so that its contents start at a multiple of 4:
    decode_record's np.frombuffer views of int32 / float32 arrays are then aligned (numpy runs unaligned
    ones about 2× slower)."""
    tag, length = varint.encode((number << 3) | 2), varint.encode(size)
    pad = -(at + len(tag) + len(length)) % 4
    in_length = min(pad, 5 - len(length))
    return varint.encode((number << 3) | 2, pad - in_length) + varint.encode(size, in_length)


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


def _scatter(
    data: bytes, dtype: np.dtype, t: int, mask: np.ndarray | None, tail: tuple, what: str, read=unpack
):
    """A logprob array [T, *tail] from its bytes (read by `read`: unpack or _view): all T rows, or
    (multi-turn) the rows where `mask` is set, zero elsewhere."""
    if mask is None:
        return read(data, dtype, (t, *tail), what)
    out = np.zeros((mask.size, *tail), dtype.newbyteorder("="))
    out[mask] = read(data, dtype, (int(mask.sum()), *tail), what)
    return out


def _view(data: bytes | memoryview, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    """unpack without the copy: a read-only view of `data` (on a little-endian host; a big-endian one
    gets a native copy)."""
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise WireError(f"{what}: {len(data)} bytes, expected {expected} for shape {shape}")
    out = np.frombuffer(data, dtype=dtype).reshape(shape)
    return out if dtype.isnative else out.astype(dtype.newbyteorder("="))


def _copy(data: bytes | memoryview, dtype: np.dtype, n: int, what: str) -> np.ndarray:
    """unpack of a [n] array — the same array, and the same error for the same bytes — in two numpy
    calls instead of three (no reshape; on a little-endian host a copy, not an astype): every record read
    from the queue copies four [T] or [P] arrays out."""
    if len(data) != n * dtype.itemsize:
        raise WireError(f"{what}: {len(data)} bytes, expected {n * dtype.itemsize} for shape {(n,)}")
    out = np.frombuffer(data, dtype=dtype)
    return out.copy() if dtype.isnative else out.astype(dtype.newbyteorder("="))


@functools.lru_cache(maxsize=256)
def _semantics(serialized: bytes) -> Semantics:
    """semantics_from_pb of a Semantics message, by its bytes: the records of one replica all carry the
    same few, and Semantics is frozen, so they share one object (~0.3 µs instead of ~1.8 per record).
    Keyed by the bytes, not the values, so that -0.0 and 0.0 stay apart."""
    return semantics_from_pb(pb.Semantics.FromString(serialized))


def record_from_pb(m: pb.RolloutRecord, *, arrays: bool = True) -> RolloutRecord:
    """Decode and validate. With arrays=False the arrays are left empty (a stream's record header)."""
    return _record_from(m, arrays, {name: getattr(m, name) for name in _BIG_ARRAYS.values()})


def _record_from(m: pb.RolloutRecord, arrays: bool, blobs: dict, views: bool = False) -> RolloutRecord:
    """record_from_pb, with the bytes of the array fields 9-13 and 30-32 taken from `blobs` (field name →
    bytes or memoryview; a missing name is an empty field) rather than from `m`. views: the [T, K] top-K
    arrays are read-only views of those bytes rather than copies.

    Every record a trainer reads from the queue passes here (decode_record), so the checks run in the
    order they always have (the first broken rule is the one reported) with each protobuf field read
    once, and a single-turn record's arrays are read without _scatter (no rows to place)."""
    big = _view if views else unpack
    version = m.schema_version
    if version != SCHEMA_VERSION and version != MULTI_TURN_SCHEMA_VERSION:
        raise WireError(
            f"schema_version {version}; this client reads {SCHEMA_VERSION} (single-turn) and "
            f"{MULTI_TURN_SCHEMA_VERSION} (multi-turn)"
        )
    finish = FINISH_FROM_PB.get(m.finish_reason)
    if finish is None:
        raise WireError(f"finish_reason {m.finish_reason} is not a finished state")
    sem = m.semantics
    if sem.logprobs_mode != "processed":
        raise WireError(f"logprobs_mode {sem.logprobs_mode!r}; maskroll records carry 'processed'")
    # K is the one the record declares: its top-K arrays are read at [T, K] (or [sampled, K]), so arrays of
    # another width fail their byte count here and every record decoded has logprobs_k == semantics' K.
    t, k = m.num_tokens, sem.logprobs_k
    if k < 0:  # int32 on the wire; a [T, -1] shape would pass the byte count when T = 0
        raise WireError(f"semantics.logprobs_k {k} is negative")
    prompt_bytes = m.prompt_token_ids
    if len(prompt_bytes) % 4:
        raise WireError("prompt_token_ids is not a whole number of int32")
    prompt = _copy(prompt_bytes, _I32, len(prompt_bytes) // 4, "prompt_token_ids")
    n = t if arrays else 0
    mask = _loss_mask(m, t) if arrays else None
    get = blobs.get
    if mask is None:  # every row travels: each array is read as it is
        completion = _copy(get("completion_token_ids", b""), _I32, n, "completion_token_ids")
        sampled = _copy(get("sampled_logprobs", b""), _F32, n, "sampled_logprobs")
        ranks = _copy(get("sampled_ranks", b""), _I32, n, "sampled_ranks")
        topk_ids = big(get("topk_ids", b""), _I32, (n, k), "topk_ids")
        topk_logprobs = big(get("topk_logprobs", b""), _F32, (n, k), "topk_logprobs")
    else:
        completion = unpack(get("completion_token_ids", b""), _I32, (n,), "completion_token_ids")
        sampled = _scatter(get("sampled_logprobs", b""), _F32, n, mask, (), "sampled_logprobs")
        ranks = _scatter(get("sampled_ranks", b""), _I32, n, mask, (), "sampled_ranks")
        topk_ids = _scatter(get("topk_ids", b""), _I32, n, mask, (k,), "topk_ids", big)
        topk_logprobs = _scatter(get("topk_logprobs", b""), _F32, n, mask, (k,), "topk_logprobs", big)
    changes, meta = m.version_changes, m.metadata
    rec = RolloutRecord(
        rollout_id=m.rollout_id,
        request_id=m.request_id,
        prompt_ids=prompt,
        completion_ids=completion,
        sampled_logprobs=sampled,
        sampled_ranks=ranks,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        finish_reason=finish,
        semantics=_semantics(sem.SerializeToString()),
        policy_version_first=m.policy_version_first,
        policy_version_last=m.policy_version_last,
        version_changes=[(c.token_index, c.version) for c in changes] if changes else [],
        job_id=m.job_id,
        group_id=m.group_id,
        sample_index=m.sample_index,
        metadata=dict(meta) if meta else {},
        replica_id=m.replica_id,
        created_at=m.created_at,
        group_size=m.group_size or 1,
        schema_version=version,
        run_id=m.run_id,
        loss_mask=mask,
        segment_starts=list(m.segment_starts) if mask is not None else [],
        num_turns=m.num_turns,
        reward=m.reward if m.HasField("reward") else None,
        reward_verifier=m.reward_verifier,
        reward_reason=m.reward_reason,
        adapter=m.adapter,
    )
    if m.HasField("teacher_semantics"):
        kt = m.teacher_semantics.logprobs_k
        if kt < 0:
            raise WireError(f"teacher_semantics.logprobs_k {kt} is negative")
        rec.teacher_semantics = semantics_from_pb(m.teacher_semantics)
        rec.teacher_policy_version = m.teacher_policy_version
        for name, tail, dtype in (
            ("teacher_topk_ids", (kt,), _I32),
            ("teacher_topk_logprobs", (kt,), _F32),
            ("teacher_sampled_logprobs", (), _F32),
        ):
            read = big if tail else unpack  # as fields 10-13: [T, K] views, [T] copies
            setattr(rec, name, _scatter(get(name, b""), dtype, n, mask, tail, name, read))
    elif get("teacher_topk_ids") or get("teacher_topk_logprobs") or get("teacher_sampled_logprobs"):
        raise WireError("teacher arrays without teacher_semantics")
    return rec


def encode_record(r: RolloutRecord) -> bytes:
    """A record as stored in Redis: the same protobuf message as on the gRPC stream (record_to_pb).

    Protobuf serialises the header (every field but the arrays); the array fields follow it, each copied
    once, straight from its numpy array into the payload. A parser reads fields in any order, so this
    is the same message as record_to_pb(r).SerializeToString(), with the arrays last — without the two
    intermediate copies (tobytes, then protobuf's own) and the temporary buffers that made a replica
    page-fault every payload back in after each publish (docs/benchmarks.md, Queue)."""
    return b"".join(record_pieces(r))


def record_pieces(r: RolloutRecord) -> list[bytes | np.ndarray]:
    """encode_record's payload as the pieces it joins: the header, then each array field's tag and length
    (bytes) and its contents (the record's own contiguous array, not a copy). The publisher hands these
    to Redis as they are (redis_conn.Pieces), so a published record is never copied into a payload of its
    own; the record's arrays must then stay unchanged until the publish returns."""
    pieces: list[bytes | np.ndarray] = [record_to_pb(r, arrays=False).SerializeToString()]
    at = len(pieces[0])
    for _, number, a in _record_arrays(r):
        if a.size:  # proto3 leaves empty bytes fields out; so does this
            head = _field_head(number, a.nbytes, at % 4)
            pieces += (head, a)
            at += len(head) + a.nbytes
    return pieces


def decode_record(data: bytes) -> RolloutRecord:
    """A record from Redis bytes; any payload that is not a valid record raises WireError, nothing else
    (tests/test_wire.py fuzzes this with random and mutated payloads).

    Protobuf parses only the header: the array fields are found by one scan of the payload's top-level
    fields (_split_arrays). The [T, K] top-K arrays (nine tenths of a payload at K = 20) are read-only
    views of `data`, aligned when encode_record wrote it; the [T] arrays are copied out, so keeping one
    of them does not keep the payload. A whole-message parse copied every array three times (into the
    message, out to bytes, into the arrays): at 1024 tokens that was ~45 µs of a trainer's ~300 µs per
    record read from the queue (docs/benchmarks.md, Queue)."""
    if not isinstance(data, bytes):
        data = bytes(data)  # views of a buffer the caller may still change would change the record
    split = _split_arrays(data)
    msg = pb.RolloutRecord()
    try:
        msg.ParseFromString(data if split is None else split[0])
    except Exception as e:  # protobuf raises DecodeError or RuntimeWarning-ish errors by backend
        raise WireError(f"not a RolloutRecord: {e}") from e
    if split is None:
        return record_from_pb(msg)
    return _record_from(msg, True, split[1], views=True)


def _split_arrays(data: bytes) -> tuple[bytes, dict[str, memoryview]] | None:
    """A RolloutRecord payload split into its header (every top-level field but 9-13, in order, for
    protobuf to parse) and views of the array fields' bytes (the last one of each number, as protobuf
    keeps). None when the payload is not a plain run of fields (a group, a bad wire type, a field that
    overruns the end): protobuf then parses all of it and says what is wrong.

    A record has some twenty fields, each scanned here in Python, so a one-byte varint (every tag of
    fields 1-15, every length under 128, most values) is read inline: varint.decode reads the rest, with
    the same result; an index past the end is a truncated varint, as in varint.decode."""
    view, n, pos = memoryview(data), len(data), 0
    header: list[memoryview] = []  # the stretches between array fields
    arrays: dict[str, memoryview] = {}
    start = 0  # of the current stretch
    decode, big = varint.decode, _BIG_ARRAYS
    try:
        while pos < n:
            field_start = pos
            tag = data[pos]
            if tag < 0x80:
                pos += 1
            else:
                tag, pos = decode(data, pos)
            kind = tag & 7
            if kind == 2:  # length-delimited
                size = data[pos]
                if size < 0x80:
                    pos += 1
                else:
                    size, pos = decode(data, pos)
                end = pos + size
                if end > n:
                    return None
                name = big.get(tag >> 3)
                if name is not None:
                    arrays[name] = view[pos:end]
                    header.append(view[start:field_start])
                    start = end
                pos = end
            elif kind == 0:
                if data[pos] < 0x80:
                    pos += 1
                else:
                    pos = decode(data, pos)[1]
            elif kind == 1:  # fixed 64 bits
                pos += 8
            elif kind == 5:  # fixed 32 bits
                pos += 4
            else:
                return None
    except (ValueError, IndexError):  # a varint that runs off the end
        return None
    if pos != n:
        return None
    header.append(view[start:n])
    return b"".join(header), arrays


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
        logprobs_k=c.logprobs_k,
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
        if t and record.logprobs_k != k:  # an empty chunk carries no K
            raise WireError(
                f"chunk logprobs_k {k} differs from its record's semantics.logprobs_k {record.logprobs_k}"
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
    fields = dict(i.__dict__)
    fields["adapters"] = [pb.AdapterInfo(**a.__dict__) for a in i.adapters]
    return pb.ServerInfo(**fields)


def info_from_pb(m: pb.ServerInfo) -> ServerInfo:
    fields = {name: getattr(m, name) for name in ServerInfo.__dataclass_fields__}
    fields["adapters"] = tuple(
        AdapterInfo(**{name: getattr(a, name) for name in AdapterInfo.__dataclass_fields__})
        for a in m.adapters
    )
    return ServerInfo(**fields)


def update_request(version: int, checkpoint_dir: str, run_id: str = "") -> pb.UpdateWeightsRequest:
    return pb.UpdateWeightsRequest(
        version=version, checkpoint=pb.CheckpointSource(path=checkpoint_dir), run_id=run_id
    )


def adopt_request(version: int, fingerprint: str, run_id: str) -> pb.UpdateWeightsRequest:
    """UpdateWeights with an AdoptSource: the replica's starting weights become `version` of `run_id`."""
    return pb.UpdateWeightsRequest(
        version=version, adopt=pb.AdoptSource(weights_fingerprint=fingerprint), run_id=run_id
    )


def update_from_pb(m: pb.UpdateWeightsRequest) -> WeightsUpdate:
    source = m.WhichOneof("source")
    return WeightsUpdate(
        version=m.version,
        checkpoint_dir=m.checkpoint.path if source == "checkpoint" else None,
        collective=collective_from_pb(m),
        run_id=m.run_id,
        adopt_fingerprint=m.adopt.weights_fingerprint if source == "adopt" else None,
    )


def update_result_to_pb(r: WeightsUpdateResult) -> pb.UpdateWeightsResponse:
    return pb.UpdateWeightsResponse(
        version=r.version, load_seconds=r.load_seconds, paused_requests=r.paused_requests
    )


def update_result_from_pb(m: pb.UpdateWeightsResponse) -> WeightsUpdateResult:
    return WeightsUpdateResult(
        version=m.version, load_seconds=m.load_seconds, paused_requests=m.paused_requests
    )
