"""One generation request, transport-agnostic: validate → fan out to the engine → chunks and records.

Every front end runs a request through here, so they share one set of rules: validation against the
replica's limits, the record header (identity, prompt, sampling semantics), one `SampleBuilder` per
sample and the fan-out loop (a sample whose stream ends without a finish reason, or that is still
running when the request is aborted, ends with an "abort" record), and how streamed tokens are gathered
into chunks (`Coalescing`: a sample's held tokens wait at most `chunk_interval_ms`; its first tokens and
its last chunk go at once). `records()` builds no chunk at all. Callers add only their transport:

- `serving.Serving` (a client's Generate, over gRPC or the native JSON API): refuses a duplicate request
  id in flight (ALREADY_EXISTS), tracks requests for drain, counts metrics, publishes to `rollout_stream`;
  a GenerateStream call's requests take their chunks through `push`, straight into the call's outbox.
- `jobs.JobRunner` (pull mode): maps InvalidArgument to JobRejected, gives every run of a job its own
  engine ids (a reclaimed job may run twice at once here), returns the records.
- `openai_serving` (HTTP / OpenAI): checks a call's prompt and options once (`check`, all n choices),
  then runs each choice as a request of its own (`Checked.sample`, `prepare_checked`); chunks stream as
  they come, `header.semantics` says how to read the logprobs, and a client that disconnects closes the
  stream (or calls `abort()` to end it with "abort" records instead).

    pipeline = Pipeline(engine, config)                   # once per process
    gen = pipeline.prepare(prompt_ids, options, request_id="", metadata={...})
                                                          # InvalidArgument here, before any engine call
    # or: checked = pipeline.check(prompt_ids, options); gen = pipeline.prepare_checked(checked, ...)
    async with contextlib.aclosing(gen.stream()) as chunks:
        async for chunk in chunks:                        # RolloutChunk, in order over the n samples
            ...                                           # chunk.record is set on each sample's last chunk
    # or: await gen.push(send)                            # send(chunk) called as each chunk is made
    # or: records = await gen.records()                   # the n records, by sample index
    gen.abort()                                           # from anywhere (drain): see Generation.abort

Leaving the stream early — closing it, an error, or the caller's task being cancelled — cancels every
engine request and waits until the engine has freed them (`fanout.FanOut`); close it explicitly
(`aclosing`) rather than leave that to garbage collection. Errors propagate unchanged: InvalidArgument
(a field is invalid, or the engine refused the parameters before the first token) and anything else
the engine raised; mapping them to a status or a rejection is the caller's. Knows nothing of gRPC,
protobuf, Redis or metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from maskroll.proto.records import RolloutChunk, RolloutRecord, SamplingOptions

from ..config import ServerConfig
from ..engines.contract import AdapterRef, Engine, EngineOutput, SamplingParams
from . import validation
from .fanout import FanOut
from .records_builder import RecordHeader, SampleBuilder, semantics_for

Send = Callable[[RolloutChunk], None]  # takes a chunk as soon as it is made (Generation.push)


class Coalescing(NamedTuple):
    """When a streamed sample's held tokens go out (ServerConfig.chunk_interval_ms / chunk_max_tokens)."""

    interval_s: float  # a held token waits at most this long; 0 = every engine output its own chunk
    max_tokens: int  # a chunk goes as soon as it holds this many tokens
    message_bytes: int = 16 << 20  # the largest message the transport sends

    @classmethod
    def of(cls, config: ServerConfig) -> Coalescing:
        return cls(config.chunk_interval_ms / 1e3, config.chunk_max_tokens, config.max_message_bytes)

    def tokens_per_chunk(self, k: int) -> int:
        """max_tokens, or fewer where K is so large that a chunk's arrays (12 + 8·K bytes a token) would
        pass half the largest message (the other half: the record on the last chunk, the framing)."""
        return max(1, min(self.max_tokens, self.message_bytes // 2 // (12 + 8 * k)))


class _StreamedSample:
    """One sample of a stream: holds its engine outputs and emits them as chunks under the latency bound.

    Runs in the engine stream's task (and a timer), so that an output which is only held costs a check and
    a copy of its bytes (`SampleBuilder.hold`), and the consumer wakes once per chunk. A chunk goes at once
    for the sample's first tokens, its last output (with the record), before tokens of a new policy
    version, and when it holds `max_tokens`; otherwise `interval_s` after its first held token."""

    def __init__(
        self, builder: SampleBuilder, fan: FanOut, rule: Coalescing, max_tokens: int, send: Send | None
    ) -> None:
        self.builder, self._fan, self._max_tokens = builder, fan, max_tokens
        # Where a chunk goes: to the consumer through the fan-out's queue (stream()), or straight to the
        # caller's callback (push(): no task wake per chunk).
        self._deliver = send or functools.partial(fan.emit, builder.sample_index)
        self._interval = rule.interval_s
        # Timers fall due on a grid of interval / 8, so that the samples whose tokens came in the same
        # stretch of time send their chunks in one event-loop turn (one message on a GenerateStream
        # call: grpc_api/session.py). A held token still waits at most interval_s (at least 7/8 of it).
        self._tick = rule.interval_s / 8
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, out: EngineOutput) -> None:
        # Runs once per engine output (one token per sequence per vLLM step): the serving path's per-token
        # cost, so it reads each field once and calls as little as it can (bench/server.py --scripted).
        b = self.builder
        if b.changes_version(out):
            self._send(b.take_chunk())
        held = b.hold(out)
        if out.finish_reason is not None:
            self._send(b.finish(out.finish_reason, out.policy_version, time.time()))
        elif not held:
            return
        elif b.sent_tokens == 0 or held >= self._max_tokens or not self._interval:
            self._send(b.take_chunk())
        elif self._timer is None:
            due = self._loop.time() + self._interval
            self._timer = self._loop.call_at(due - due % self._tick, self._due)

    def _due(self) -> None:
        self._timer = None
        if self.builder.held_tokens and not self.builder.finished:
            try:
                self._send(self.builder.take_chunk())
            except Exception as exc:  # a timer has no caller: the consumer raises it, as a pump's error
                self._fan.emit(self.builder.sample_index, exc)

    def _send(self, chunk: RolloutChunk) -> None:
        self.cancel_timer()
        self._deliver(chunk)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


@dataclass(frozen=True)
class Checked:
    """A prompt and its sampling options that passed validation (`Pipeline.check`): what a request runs,
    never validated again."""

    prompt_ids: np.ndarray  # int32 [P], every id in [0, vocab_size)
    params: SamplingParams  # sample 0's engine parameters (sample i is seeded seed + i)
    n: int  # samples

    def sample(self, i: int, *, logprobs_k: int | None = None) -> Checked:
        """Sample i alone, as a request of its own (its seed: `validation.sample_params`). logprobs_k: a K
        in place of the checked one, within the replica's max_logprobs (not checked again: an HTTP
        session records the replica's K, which is that limit)."""
        params = validation.sample_params(self.params, i)
        if logprobs_k is not None:
            params = replace(params, logprobs_k=logprobs_k)
        return Checked(self.prompt_ids, params, 1)


class Generation:
    """One validated request, run once: `stream()` or `records()`; `abort()` may come at any time."""

    def __init__(
        self,
        engine: Engine,
        header: RecordHeader,
        params: SamplingParams,
        engine_id: str,
        rule: Coalescing,
        adapter: AdapterRef | None = None,
    ) -> None:
        self.header = header  # identity, prompt and semantics: what every record of this request carries
        self.params = params  # the engine's parameters for sample 0 (sample i is seeded seed + i)
        self.adapter = adapter  # the LoRA adapter every sample runs with (None: the engine's weights)
        self._engine = engine
        self._rule = rule
        requests = validation.engine_requests(engine_id, header.prompt_ids, params, self.n)
        if adapter is not None:
            requests = [replace(r, adapter=adapter) for r in requests]
        # Built now (no engine call yet) so that an abort() before the stream starts is not lost.
        self._fan = FanOut(engine, requests)
        self._started = False

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def n(self) -> int:
        return self.header.group_size

    @property
    def logprobs_k(self) -> int:
        """K of every record and chunk of this request (`RecordHeader.logprobs_k`)."""
        return self.header.logprobs_k

    def abort(self) -> None:
        """End the request now (the server is draining): the stream stops reading, cancels the engine
        requests, then ends every unfinished sample with a last chunk (the tokens it still held) whose
        record has finish_reason "abort". Before the stream starts it ends at once; after it ended, this
        does nothing."""
        self._fan.abort()

    def stream(self) -> AsyncIterator[RolloutChunk]:
        """Every chunk of the n samples in order; each sample's last chunk carries its record. A chunk
        holds one or more engine outputs' tokens, all of one policy version (`Coalescing`)."""
        return self._chunks(None)

    async def push(self, send: Send) -> None:
        """stream()'s chunks, in the same order, each handed to `send(chunk)` as soon as it is made, in
        the task that made it (an engine stream's, or a coalescing timer): the caller's task does not
        wake for each chunk, as it does to read stream(). `send` must not block; what it raises fails
        the request, as an engine error would. Returns when every sample has sent its last chunk. (When
        one engine stream fails, the chunks other samples made before the error reaches this task have
        been sent; stream() would have dropped them.)"""
        async with contextlib.aclosing(self._chunks(send)) as chunks:
            async for chunk in chunks:  # the chunks made here rather than by a sample: aborted samples'
                send(chunk)

    async def _chunks(self, send: Send | None) -> AsyncIterator[RolloutChunk]:
        """Runs the request. Yields every chunk when `send` is None; else the samples hand their chunks
        to `send` themselves, and only the last chunks of aborted samples are yielded."""
        self._start()
        most = self._rule.tokens_per_chunk(self.header.logprobs_k)
        samples = [
            _StreamedSample(SampleBuilder(self.header, i), self._fan, self._rule, most, send)
            for i in range(self.n)
        ]
        self._fan.sinks = [sample.add for sample in samples]
        # A stream that ends without a finish reason: the sample's timer must not emit its held tokens
        # after the end, behind the abort chunk that takes them (below).
        self._fan.ends = [sample.cancel_timer for sample in samples]
        try:
            async with self._fan as fan:
                try:
                    async for i, chunk in fan.items():
                        if chunk is not None:
                            yield chunk
                        elif not samples[i].builder.finished:
                            # The engine ended the stream without a finish reason.
                            samples[i].cancel_timer()
                            yield self._abort(samples[i].builder)
                except BaseException:
                    # Left on an error, or closed or cancelled by the caller: no chunk may go out while
                    # the fan-out waits for the engine to free the requests (push() would send it).
                    for sample in samples:
                        sample.cancel_timer()
                    raise
            # Left only after abort(): the engine requests are cancelled by now. What the samples emitted
            # meanwhile still goes out, then each unfinished sample gets its last chunk, so every sample
            # of a request ends with a record.
            for _, chunk in self._fan.leftover():
                yield chunk
            for sample in samples:
                sample.cancel_timer()
                if not sample.builder.finished:
                    yield self._abort(sample.builder)
        finally:
            for sample in samples:
                sample.cancel_timer()

    async def records(self) -> list[RolloutRecord]:
        """Run to the end and return the n records by sample index (for callers that do not stream: no
        chunk is built)."""
        self._start()
        builders = [SampleBuilder(self.header, i) for i in range(self.n)]

        def add(i: int, out: EngineOutput) -> None:
            builders[i].hold(out)
            if out.finish_reason is not None:
                self._fan.emit(i, builders[i].record(out.finish_reason, out.policy_version, time.time()))

        self._fan.on_output = add
        records: dict[int, RolloutRecord] = {}
        async with self._fan as fan:
            async for i, record in fan.items():
                if record is not None:
                    records[i] = record
        records.update(self._fan.leftover())
        for b in builders:  # the engine ended the stream without a finish reason, or abort()
            if not b.finished:
                records[b.sample_index] = b.record("abort", self._current_version(), time.time())
        return [records[i] for i in range(self.n)]

    def _start(self) -> None:
        if self._started:
            raise RuntimeError(f"request {self.request_id!r} has already been run")
        self._started = True

    def _abort(self, builder: SampleBuilder) -> RolloutChunk:
        return builder.abort(current_version=self._current_version(), now=time.time())

    def _current_version(self) -> int:
        """The version a sample without tokens would have had: its adapter's, else the engine's."""
        return self._engine.policy_version if self.adapter is None else self.adapter.version


class Pipeline:
    """The replica's request rules: its limits (`caps`), engine and replica id. One per process."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.replica_id = config.replica_id
        self.coalescing = Coalescing.of(config)  # how streamed tokens are gathered into chunks
        self.caps = validation.Caps.of(
            engine.limits, max_logprobs=config.max_logprobs, max_tokens=config.max_tokens, max_n=config.max_n
        )

    def check(self, prompt_ids: np.ndarray, options: SamplingOptions) -> Checked:
        """Validate a prompt (token ids [P], any integer dtype) and its options (all n samples) against the
        replica's limits; raises InvalidArgument naming the field."""
        prompt = np.asarray(prompt_ids)
        validation.check_prompt(prompt, self.caps)
        prompt = prompt.astype(np.int32, copy=False)  # in [0, vocab_size) by now, so the cast is exact
        return Checked(prompt, validation.sampling_params(prompt, options, self.caps), options.n)

    def prepare(
        self,
        prompt_ids: np.ndarray,
        options: SamplingOptions,
        *,
        request_id: str = "",
        job_id: str = "",
        group_id: str = "",
        metadata: Mapping[str, str] | None = None,
        engine_id: str = "",
        run_id: str = "",
        adapter: AdapterRef | None = None,
    ) -> Generation:
        """Validate a request and return it ready to run; raises InvalidArgument naming the field.

        prompt_ids: token ids [P] (any integer dtype; records carry int32). request_id: "" for a fresh
        one. job_id gives the rollout ids (a retried job yields the same ones); group_id "" is no group.
        engine_id: sample i runs as engine request f"{engine_id}-{i}", by default the request id; a
        caller that may run the same request twice at once must pass a unique one. run_id: the training
        run every record carries (a pull-mode job's; trainers refuse records of another run). adapter:
        the LoRA adapter every sample runs with (the caller holds it in use: `AdapterTable.use`); the
        records carry its name, and its run id in place of `run_id`."""
        self._check_identity(request_id, job_id, group_id, metadata, run_id)
        checked = self.check(prompt_ids, options)
        return self._generation(checked, request_id, job_id, group_id, metadata, engine_id, run_id, adapter)

    def prepare_checked(
        self,
        checked: Checked,
        *,
        request_id: str = "",
        job_id: str = "",
        group_id: str = "",
        metadata: Mapping[str, str] | None = None,
        engine_id: str = "",
        run_id: str = "",
        adapter: AdapterRef | None = None,
    ) -> Generation:
        """`prepare` for a prompt and options that `check` validated already (they are not validated
        again; the ids and metadata are)."""
        self._check_identity(request_id, job_id, group_id, metadata, run_id)
        return self._generation(checked, request_id, job_id, group_id, metadata, engine_id, run_id, adapter)

    @staticmethod
    def _check_identity(
        request_id: str, job_id: str, group_id: str, metadata: Mapping | None, run_id: str = ""
    ) -> None:
        # An id given as both request and job id (a pull-mode job) is named once, as job_id.
        validation.check_ids("" if request_id == job_id else request_id, job_id, group_id, run_id)
        validation.check_metadata(metadata or {})

    def _generation(
        self,
        checked: Checked,
        request_id: str,
        job_id: str,
        group_id: str,
        metadata: Mapping[str, str] | None,
        engine_id: str,
        run_id: str,
        adapter: AdapterRef | None = None,
    ) -> Generation:
        request_id = request_id or validation.new_request_id()
        e = self.engine
        header = RecordHeader(
            request_id=request_id,
            job_id=job_id,
            group_id=group_id,
            metadata=dict(metadata or {}),
            prompt_ids=checked.prompt_ids,
            semantics=semantics_for(
                checked.params, engine=e.name, engine_version=e.version, model=e.model_id
            ),
            replica_id=self.replica_id,
            group_size=checked.n,
            # an adapter is a version of its own run (a replica serving several runs holds several)
            run_id=run_id if adapter is None else adapter.run_id,
            adapter="" if adapter is None else adapter.name,
        )
        return Generation(e, header, checked.params, engine_id or request_id, self.coalescing, adapter)
