"""Engine outputs → streamed chunks and finished RolloutRecords (pure; no gRPC, no engine calls).

The record's arrays are exactly the concatenation of the sample's chunks, so a client that reassembles
the stream gets the same bytes as one that asked for `include_record_arrays`. Policy versions are
tracked per token: `policy_version_first/last` and the token indices where the version changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskroll.client.records import LOGPROBS_MODE, RolloutChunk, RolloutRecord, Semantics, rollout_id_for

from .engine import EngineOutput, SamplingParams


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


def _concat(arrays: list[np.ndarray], dtype, tail: tuple[int, ...]) -> np.ndarray:
    if not arrays:
        return np.zeros((0, *tail), dtype)
    return np.concatenate(arrays).astype(dtype, copy=False)


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
    k = header.semantics.logprobs_k
    first, last, changes = version_history(outputs, current_version)
    return RolloutRecord(
        # A job retried on another replica yields the same rollout_ids; without a job id the request
        # id stands in (unique per request, so no dedup across retries).
        rollout_id=rollout_id_for(header.job_id or header.request_id, sample_index),
        request_id=header.request_id,
        prompt_ids=header.prompt_ids,
        completion_ids=_concat([o.token_ids for o in outputs], np.int32, ()),
        sampled_logprobs=_concat([o.sampled_logprobs for o in outputs], np.float32, ()),
        sampled_ranks=_concat([o.sampled_ranks for o in outputs], np.int32, ()),
        # reshape with explicit T: -1 cannot be inferred when K = 0; [0] and [0, K] both mean "no tokens".
        topk_ids=_concat([np.reshape(o.topk_ids, (len(o.token_ids), k)) for o in outputs], np.int32, (k,)),
        topk_logprobs=_concat(
            [np.reshape(o.topk_logprobs, (len(o.token_ids), k)) for o in outputs], np.float32, (k,)
        ),
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
    )


def chunk_for(
    out: EngineOutput, *, request_id: str, sample_index: int, start_index: int, k: int
) -> RolloutChunk:
    return RolloutChunk(
        request_id=request_id,
        sample_index=sample_index,
        start_index=start_index,
        token_ids=np.asarray(out.token_ids, np.int32),
        sampled_logprobs=np.asarray(out.sampled_logprobs, np.float32),
        sampled_ranks=np.asarray(out.sampled_ranks, np.int32),
        topk_ids=np.asarray(out.topk_ids, np.int32).reshape(len(out.token_ids), k),
        topk_logprobs=np.asarray(out.topk_logprobs, np.float32).reshape(len(out.token_ids), k),
        policy_version=out.policy_version,
    )


def check_output(out: EngineOutput, k: int) -> None:
    """The engine contract, checked once per output: a mis-shaped output is an engine bug and must not
    reach a trainer as a record it could misread."""
    if out.finish_reason not in (None, "stop", "length", "abort"):
        raise RuntimeError(f"engine output finish_reason {out.finish_reason!r} is not stop / length / abort")
    t = len(out.token_ids)
    shapes = {
        "sampled_logprobs": (np.shape(out.sampled_logprobs), (t,)),
        "sampled_ranks": (np.shape(out.sampled_ranks), (t,)),
        "topk_ids": (np.shape(out.topk_ids), (t, k)),
        "topk_logprobs": (np.shape(out.topk_logprobs), (t, k)),
    }
    for name, (got, want) in shapes.items():
        # [0] and [0, K] are the same empty array: engines may build empty outputs either way.
        if got != want and not (t == 0 and int(np.prod(got)) == 0):
            raise RuntimeError(f"engine output {name} has shape {got}, expected {want}")


@dataclass
class SampleBuilder:
    """Accumulates one sample's engine outputs; each `add` returns the chunk to stream."""

    header: RecordHeader
    sample_index: int
    outputs: list[EngineOutput] = field(default_factory=list)
    num_tokens: int = 0
    finished: bool = False

    def add(self, out: EngineOutput, *, now: float) -> RolloutChunk:
        k = self.header.semantics.logprobs_k
        check_output(out, k)
        chunk = chunk_for(
            out,
            request_id=self.header.request_id,
            sample_index=self.sample_index,
            start_index=self.num_tokens,
            k=k,
        )
        self.outputs.append(out)
        self.num_tokens += len(chunk.token_ids)
        if out.finish_reason is not None:
            chunk.record = self._finish(out.finish_reason, out.policy_version, now)
        return chunk

    def abort(self, *, current_version: int, now: float) -> RolloutChunk:
        """The last chunk of a sample that ends without finishing (server drain, engine abort)."""
        k = self.header.semantics.logprobs_k
        chunk = chunk_for(
            EngineOutput.empty(k, current_version),
            request_id=self.header.request_id,
            sample_index=self.sample_index,
            start_index=self.num_tokens,
            k=k,
        )
        chunk.record = self._finish("abort", current_version, now)
        return chunk

    def _finish(self, reason: str, current_version: int, now: float) -> RolloutRecord:
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
