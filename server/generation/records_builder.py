"""Engine outputs → streamed chunks and finished RolloutRecords (pure; no gRPC, no engine calls).

A sample's outputs are held until the caller takes them as one chunk (`SampleBuilder.take_chunk`; when
is `pipeline`'s rule), then kept as one merged output, so neither a chunk nor the record is built from
one small array per token; a caller that streams nothing takes no chunk at all. The record's arrays are
exactly the concatenation of the sample's chunks, so a client that reassembles the stream gets the same
bytes as one that asked for `include_record_arrays`. Policy versions are tracked per token:
`policy_version_first/last` and the token indices where the version changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskroll.proto.records import LOGPROBS_MODE, RolloutChunk, RolloutRecord, Semantics, rollout_id_for

from ..engines.contract import EngineOutput, SamplingParams


def semantics_for(params: SamplingParams, *, engine: str, engine_version: str, model: str) -> Semantics:
    return Semantics(
        logprobs_mode=LOGPROBS_MODE,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        logprobs_k=params.logprobs_k,
        engine=engine,
        engine_version=engine_version,
        model=model,
    )


def version_history(
    outputs: list[EngineOutput], current_version: int
) -> tuple[int, int, list[tuple[int, int]]]:
    """(version at the first token, at the last token, [(token_index, version) where it changed]).

    Outputs without tokens carry no version information; with no tokens at all, first = last =
    `current_version` (the version the sample would have been generated under)."""
    first = last = None
    changes: list[tuple[int, int]] = []
    index = 0
    for out in outputs:
        t = len(out.token_ids)
        if t == 0:
            continue
        if first is None:
            first = out.policy_version
        elif out.policy_version != last:
            changes.append((index, out.policy_version))
        last = out.policy_version
        index += t
    if first is None:
        return current_version, current_version, []
    return first, last, changes


_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)


def _joined(arrays: list, dtype: np.dtype, t: int, tail: tuple[int, ...]) -> np.ndarray:
    """One array field of outputs that all have tokens, joined: [t] or [t, *tail] (a single output's
    array of the right dtype is not copied)."""
    if not arrays:
        return np.zeros((0, *tail), dtype)
    if len(arrays) == 1:
        return _shaped(np.asarray(arrays[0], dtype), t, tail)
    # The bytes of C-ordered [t_i, *tail] arrays, joined, are those of their concatenation along axis 0.
    # np.concatenate costs ~1 µs per input (dtype and shape resolution), several times a small array's
    # tobytes, and an engine's outputs are mostly of one token: this is the per-chunk cost of a streamed
    # sample (bench/server.py --scripted). A bytearray keeps the result writable. `is`: numpy's native
    # dtypes are singletons; anything else (another dtype, a list from a fake engine) is concatenated.
    try:
        parts = [x.tobytes() for x in arrays if x.dtype is dtype]
    except AttributeError:
        parts = []
    if len(parts) == len(arrays):
        return _shaped(np.frombuffer(bytearray().join(parts), dtype), t, tail)
    return _shaped(np.concatenate(arrays).astype(dtype, copy=False), t, tail)


def _shaped(a: np.ndarray, t: int, tail: tuple[int, ...]) -> np.ndarray:
    return a.reshape(t, *tail) if tail else a  # explicit t: -1 cannot be inferred when K = 0


def merge(outputs: list[EngineOutput], k: int, version: int) -> EngineOutput:
    """Consecutive outputs of one policy version (`version`) as one output; outputs without tokens add
    nothing ([0] and [0, K] both mean "no tokens"). No finish reason: the caller knows the sample's end."""
    outs = [o for o in outputs if len(o.token_ids)]
    t = sum([len(o.token_ids) for o in outs])
    return EngineOutput(
        token_ids=_joined([o.token_ids for o in outs], _I32, t, ()),
        sampled_logprobs=_joined([o.sampled_logprobs for o in outs], _F32, t, ()),
        sampled_ranks=_joined([o.sampled_ranks for o in outs], _I32, t, ()),
        topk_ids=_joined([o.topk_ids for o in outs], _I32, t, (k,)),
        topk_logprobs=_joined([o.topk_logprobs for o in outs], _F32, t, (k,)),
        policy_version=version,
    )


@dataclass(frozen=True)
class RecordHeader:
    """What a record knows before its first token: identity, prompt and semantics."""

    request_id: str
    job_id: str
    group_id: str
    metadata: dict[str, str]
    prompt_ids: np.ndarray  # int32 [P]
    semantics: Semantics
    replica_id: str
    group_size: int = 1  # samples of this request / job (n)
    run_id: str = ""  # the training run the records belong to (the job's; docs/records.md)
    adapter: str = ""  # the LoRA adapter the samples run with ("<namespace>/<run_id>/v<version>"); "": none

    @property
    def logprobs_k(self) -> int:
        """K of the request: its records' `semantics.logprobs_k`, which every engine output, chunk and
        record array of the request is built and checked to (`RolloutRecord.logprobs_k` reads it back)."""
        return self.semantics.logprobs_k


def build_record(
    header: RecordHeader,
    sample_index: int,
    outputs: list[EngineOutput],
    *,
    finish_reason: str,
    current_version: int,
    created_at: float,
) -> RolloutRecord:
    """The finished record of one sample from all of its engine outputs, in order."""
    first, last, changes = version_history(outputs, current_version)
    tokens = merge(outputs, header.logprobs_k, last)
    return RolloutRecord(
        # A job retried on another replica yields the same rollout_ids; without a job id the request
        # id stands in (unique per request, so no dedup across retries).
        rollout_id=rollout_id_for(header.job_id or header.request_id, sample_index),
        request_id=header.request_id,
        prompt_ids=header.prompt_ids,
        completion_ids=tokens.token_ids,
        sampled_logprobs=tokens.sampled_logprobs,
        sampled_ranks=tokens.sampled_ranks,
        topk_ids=tokens.topk_ids,
        topk_logprobs=tokens.topk_logprobs,
        finish_reason=finish_reason,
        semantics=header.semantics,
        policy_version_first=first,
        policy_version_last=last,
        version_changes=changes,
        job_id=header.job_id,
        group_id=header.group_id,
        sample_index=sample_index,
        metadata=dict(header.metadata),
        replica_id=header.replica_id,
        created_at=created_at,
        group_size=header.group_size,
        run_id=header.run_id,
        adapter=header.adapter,
    )


def chunk_for(out: EngineOutput, *, request_id: str, sample_index: int, start_index: int) -> RolloutChunk:
    """A chunk of one (merged) output's tokens; the arrays are shared, not copied."""
    return RolloutChunk(
        request_id=request_id,
        sample_index=sample_index,
        start_index=start_index,
        token_ids=out.token_ids,
        sampled_logprobs=out.sampled_logprobs,
        sampled_ranks=out.sampled_ranks,
        topk_ids=out.topk_ids,
        topk_logprobs=out.topk_logprobs,
        policy_version=out.policy_version,
    )


_FINISH_REASONS = (None, "stop", "length", "abort")


def check_output(out: EngineOutput, k: int) -> None:
    """The engine contract, checked once per output: a mis-shaped output is an engine bug and must not
    reach a trainer as a record it could misread."""
    if out.finish_reason not in _FINISH_REASONS:
        raise RuntimeError(f"engine output finish_reason {out.finish_reason!r} is not stop / length / abort")
    t = len(out.token_ids)
    arrays = (out.sampled_logprobs, out.sampled_ranks, out.topk_ids, out.topk_logprobs)
    try:  # the attribute where the engine built arrays: np.shape costs several times more, per token
        got = (arrays[0].shape, arrays[1].shape, arrays[2].shape, arrays[3].shape)
    except AttributeError:
        got = tuple(np.shape(a) for a in arrays)
    if got == ((t,), (t,), (t, k), (t, k)):  # every output of a healthy engine: one comparison
        return
    wanted = ((t,), (t,), (t, k), (t, k))
    names = ("sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs")
    for name, g, w in zip(names, got, wanted, strict=True):
        # [0] and [0, K] are the same empty array: engines may build empty outputs either way.
        if g != w and not (t == 0 and int(np.prod(g)) == 0):
            raise RuntimeError(f"engine output {name} has shape {g}, expected {w}")


@dataclass
class SampleBuilder:
    """One sample's engine outputs: all of them kept for the record, the ones not yet streamed held until
    `take_chunk` sends them as one chunk (the caller decides when: `pipeline`'s latency bound)."""

    header: RecordHeader
    sample_index: int
    outputs: list[EngineOutput] = field(default_factory=list)
    num_tokens: int = 0  # tokens added
    sent_tokens: int = 0  # tokens already in chunks: where the next chunk starts
    finished: bool = False
    _unsent: int = 0  # outputs[_unsent:] are in no chunk yet
    _held_version: int | None = None  # policy version of the held tokens (None: none held)

    @property
    def held_tokens(self) -> int:
        return self.num_tokens - self.sent_tokens

    def hold(self, out: EngineOutput) -> None:
        """Keep an output (checked against the engine contract) for the next chunk and the record. The
        caller takes the held tokens as a chunk before adding tokens of another policy version
        (`changes_version`): a chunk has one version."""
        check_output(out, self.header.logprobs_k)
        t = len(out.token_ids)
        if t and self._held_version is None:
            self._held_version = out.policy_version
        self.outputs.append(out)
        self.num_tokens += t

    def changes_version(self, out: EngineOutput) -> bool:
        """Whether `out` brings tokens of another policy version than the held ones."""
        return (
            self._held_version is not None
            and len(out.token_ids) > 0
            and out.policy_version != self._held_version
        )

    def take_chunk(self, version: int | None = None) -> RolloutChunk:
        """The held tokens as one chunk (no tokens: an empty chunk of policy version `version`). They
        stay in `outputs` as one merged output, so the record joins a few arrays, not one per token."""
        if self._held_version is not None:
            version = self._held_version
        elif version is None:
            version = self.outputs[-1].policy_version if self.outputs else 0
        held = merge(self.outputs[self._unsent :], self.header.logprobs_k, version)
        self.outputs[self._unsent :] = [held] if len(held.token_ids) else []
        chunk = chunk_for(
            held,
            request_id=self.header.request_id,
            sample_index=self.sample_index,
            start_index=self.sent_tokens,
        )
        self._unsent, self.sent_tokens, self._held_version = len(self.outputs), self.num_tokens, None
        return chunk

    def finish(self, reason: str, current_version: int, now: float) -> RolloutChunk:
        """The last chunk: the held tokens (perhaps none) and the finished record."""
        if self.finished:  # before taking a chunk: a second finish must change nothing
            raise RuntimeError(f"sample {self.sample_index} of {self.header.request_id} finished twice")
        chunk = self.take_chunk(current_version)
        chunk.record = self.record(reason, current_version, now)
        return chunk

    def add(self, out: EngineOutput, *, now: float) -> RolloutChunk:
        """`hold` and take at once: a chunk per output, the record on the one that finishes the sample."""
        self.hold(out)
        if out.finish_reason is not None:
            return self.finish(out.finish_reason, out.policy_version, now)
        return self.take_chunk(out.policy_version)

    def abort(self, *, current_version: int, now: float) -> RolloutChunk:
        """The last chunk of a sample that ends without finishing (server drain, engine abort): the
        tokens still held and a record with finish_reason "abort"."""
        return self.finish("abort", current_version, now)

    def record(self, reason: str, current_version: int, now: float) -> RolloutRecord:
        """The finished record (for callers that stream no chunks: pull mode)."""
        if self.finished:
            raise RuntimeError(f"sample {self.sample_index} of {self.header.request_id} finished twice")
        self.finished = True
        return build_record(
            self.header,
            self.sample_index,
            self.outputs,
            finish_reason=reason,
            current_version=current_version,
            created_at=now,
        )
