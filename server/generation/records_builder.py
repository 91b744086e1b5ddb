"""Engine outputs → streamed chunks and finished RolloutRecords (pure; no gRPC, no engine calls).

Each engine output is checked against the engine contract and its arrays kept (not copied) when the
sample holds it; the held tokens go out when the caller takes them as one chunk
(`SampleBuilder.take_chunk`; when is `pipeline`'s rule), whose arrays, joined once, are then kept as one
part, so the record is joined from a few parts, not one small array per token; a caller that streams
nothing takes no chunk at all. The record's arrays are exactly the concatenation of the sample's chunks,
so a client that reassembles the stream gets the same bytes as one that asked for
`include_record_arrays`. Policy versions are tracked per token: `policy_version_first/last` and the
token indices where the version changed.
"""

from __future__ import annotations

from dataclasses import dataclass

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


_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)


def _token_arrays(out: EngineOutput, k: int) -> tuple[int, tuple[np.ndarray, ...]]:
    """(t, its five arrays as int32 / float32) of an output checked against the engine contract
    (`check_output` raises). Runs once per engine output: the serving path's per-token cost
    (bench/server.py --scripted). The common output — numpy arrays of the contract's dtypes and shapes —
    costs one shape comparison and is kept as it is (the engine gave the arrays away: Engine contract);
    any other (lists from a fake engine, other dtypes, an empty output built as [0]) is checked and cast."""
    x = out.token_ids
    t = len(x)
    a1, a2, a3, a4 = out.sampled_logprobs, out.sampled_ranks, out.topk_ids, out.topk_logprobs
    try:  # `is`: numpy's native dtypes are singletons
        fast = (
            out.finish_reason in _FINISH_REASONS
            and (x.shape, a1.shape, a2.shape, a3.shape, a4.shape) == ((t,), (t,), (t,), (t, k), (t, k))
            and x.dtype is _I32
            and a1.dtype is _F32
            and a2.dtype is _I32
            and a3.dtype is _I32
            and a4.dtype is _F32
        )
    except AttributeError:  # not arrays
        fast = False
    if not fast:
        check_output(out, k)
        if not t:
            return 0, ()
        x, a1, a2 = np.asarray(x, _I32), np.asarray(a1, _F32), np.asarray(a2, _I32)
        a3, a4 = np.asarray(a3, _I32).reshape(t, k), np.asarray(a4, _F32).reshape(t, k)
    return t, (x, a1, a2, a3, a4)


_DTYPES = (_I32, _F32, _I32, _I32, _F32)


def _arrays(parts: tuple[list[np.ndarray], ...], k: int) -> tuple[np.ndarray, ...]:
    """Each field's parts joined into a new array of its own (writable, never a view of an engine's
    array): ids, logprobs, ranks [t]; topk_ids, topk_logprobs [t, K]. One np.concatenate per field per
    chunk, rather than a copy of every output's arrays as it came (~4 µs a token, timed in place)."""
    if not parts[0]:
        return tuple(np.zeros((0, k) if i >= 3 else 0, d) for i, d in enumerate(_DTYPES))
    return tuple(np.concatenate(p) for p in parts)


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


_FINISH_REASONS = (None, "stop", "length", "abort")


def check_output(out: EngineOutput, k: int) -> None:
    """The engine contract, checked once per output: a mis-shaped output is an engine bug and must not
    reach a trainer as a record it could misread."""
    if out.finish_reason not in _FINISH_REASONS:
        raise RuntimeError(f"engine output finish_reason {out.finish_reason!r} is not stop / length / abort")
    t = len(out.token_ids)
    arrays = (out.token_ids, out.sampled_logprobs, out.sampled_ranks, out.topk_ids, out.topk_logprobs)
    try:  # the attribute where the engine built arrays: np.shape costs several times more, per token
        got = tuple(a.shape for a in arrays)
    except AttributeError:
        got = tuple(np.shape(a) for a in arrays)
    wanted = ((t,), (t,), (t,), (t, k), (t, k))
    if got == wanted:  # every output of a healthy engine: one comparison
        return
    names = ("token_ids", "sampled_logprobs", "sampled_ranks", "topk_ids", "topk_logprobs")
    for name, g, w in zip(names, got, wanted, strict=True):
        # [0] and [0, K] are the same empty array: engines may build empty outputs either way.
        if g != w and not (t == 0 and int(np.prod(g)) == 0):
            raise RuntimeError(f"engine output {name} has shape {g}, expected {w}")


class SampleBuilder:
    """One sample's tokens: all of them kept for the record, the ones not yet streamed held until
    `take_chunk` sends them as one chunk (the caller decides when: `pipeline`'s latency bound). Each
    output is checked and its arrays kept when it is held (`_token_arrays`); a chunk joins the held
    arrays once and keeps them as one part, so the record joins a few parts, not one per token. The
    policy version history is kept as the tokens arrive: the version of the first and the last token, and
    (token index, version) where it changed; outputs without tokens carry no version."""

    __slots__ = (
        "_changes",
        "_first",
        "_held_version",
        "_k",
        "_last_version",
        "_parts",
        "_token_version",
        "_unsent",
        "finished",
        "header",
        "num_tokens",
        "sample_index",
        "sent_tokens",
    )

    def __init__(self, header: RecordHeader, sample_index: int) -> None:
        self.header, self.sample_index = header, sample_index
        self.num_tokens = 0  # tokens added
        self.sent_tokens = 0  # tokens already in chunks: where the next chunk starts
        self.finished = False
        self._k = header.logprobs_k
        self._parts: tuple[list[np.ndarray], ...] = ([], [], [], [], [])  # per array field, in token order
        self._unsent = 0  # parts[i][_unsent:] are in no chunk yet
        self._held_version: int | None = None  # policy version of the held tokens (None: none held)
        self._last_version: int | None = None  # of the last output, tokens or not (None: none yet)
        self._token_version = 0  # of the last token (read once there is one)
        self._first: int | None = None  # version of the first token
        self._changes: list[tuple[int, int]] = []  # (token index, version) where the version changed

    @property
    def held_tokens(self) -> int:
        return self.num_tokens - self.sent_tokens

    def hold(self, out: EngineOutput) -> int:
        """Check an output against the engine contract (RuntimeError: an engine bug must not reach a
        trainer as a record it could misread) and keep it for the next chunk and the record; returns the
        tokens now held. The caller takes the held tokens as a chunk before adding tokens of another
        policy version (`changes_version`): a chunk has one version."""
        t, data = _token_arrays(out, self._k)
        v = out.policy_version
        self._last_version = v
        if t:
            if self._first is None:
                self._first = v
            elif v != self._token_version:
                self._changes.append((self.num_tokens, v))
            self._token_version = v
            if self._held_version is None:
                self._held_version = v
            ids, lps, rks, tis, tls = self._parts
            ids.append(data[0])
            lps.append(data[1])
            rks.append(data[2])
            tis.append(data[3])
            tls.append(data[4])
            self.num_tokens += t
        return self.num_tokens - self.sent_tokens

    def changes_version(self, out: EngineOutput) -> bool:
        """Whether `out` brings tokens of another policy version than the held ones."""
        return (
            self._held_version is not None
            and len(out.token_ids) > 0
            and out.policy_version != self._held_version
        )

    def take_chunk(self, version: int | None = None) -> RolloutChunk:
        """The held tokens as one chunk (no tokens: an empty chunk of policy version `version`)."""
        if self._held_version is not None:
            version = self._held_version
        elif version is None:
            version = 0 if self._last_version is None else self._last_version
        u, t = self._unsent, self.num_tokens - self.sent_tokens
        held = tuple(p[u:] for p in self._parts)
        ids, lps, rks, tis, tls = _arrays(held, self._k)
        if t:  # kept as one part per field: the chunk's own arrays
            for p, a in zip(self._parts, (ids, lps, rks, tis, tls), strict=True):
                p[u:] = [a]
        chunk = RolloutChunk(
            request_id=self.header.request_id,
            sample_index=self.sample_index,
            start_index=self.sent_tokens,
            token_ids=ids,
            sampled_logprobs=lps,
            sampled_ranks=rks,
            topk_ids=tis,
            topk_logprobs=tls,
            policy_version=version,
        )
        self._unsent, self.sent_tokens, self._held_version = len(self._parts[0]), self.num_tokens, None
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
        """The finished record, its arrays the chunks' arrays in order (without chunks: pull mode).
        Without tokens, its version is `current_version` (the one it would have been generated under)."""
        if self.finished:
            raise RuntimeError(f"sample {self.sample_index} of {self.header.request_id} finished twice")
        self.finished = True
        h = self.header
        first, last = (current_version,) * 2 if self._first is None else (self._first, self._token_version)
        ids, lps, rks, tis, tls = _arrays(self._parts, self._k)
        return RolloutRecord(
            # A job retried on another replica yields the same rollout_ids; without a job id the request
            # id stands in (unique per request, so no dedup across retries).
            rollout_id=rollout_id_for(h.job_id or h.request_id, self.sample_index),
            request_id=h.request_id,
            prompt_ids=h.prompt_ids,
            completion_ids=ids,
            sampled_logprobs=lps,
            sampled_ranks=rks,
            topk_ids=tis,
            topk_logprobs=tls,
            finish_reason=reason,
            semantics=h.semantics,
            policy_version_first=first,
            policy_version_last=last,
            version_changes=list(self._changes),
            job_id=h.job_id,
            group_id=h.group_id,
            sample_index=self.sample_index,
            metadata=dict(h.metadata),
            replica_id=h.replica_id,
            created_at=now,
            group_size=h.group_size,
            run_id=h.run_id,
            adapter=h.adapter,
        )
