"""One generation request, transport-agnostic: validate → fan out to the engine → chunks and records.

Every front end runs a request through here, so they share one set of rules: validation against the
replica's limits, the record header (identity, prompt, sampling semantics), one `SampleBuilder` per
sample and the fan-out loop (a chunk per engine output; a sample whose stream ends without a finish
reason, or that is still running when the request is aborted, ends with an "abort" record). Callers add
only their transport:

- `servicer.Generate` (gRPC): converts protobuf in and out, refuses a duplicate request id in flight
  (ALREADY_EXISTS), tracks requests for drain, counts metrics, publishes to `rollout_stream`.
- `jobs.JobRunner` (pull mode): maps InvalidArgument to JobRejected, gives every run of a job its own
  engine ids (a reclaimed job may run twice at once here), returns the records.
- A future HTTP / OpenAI front end the same way: a pre-tokenized prompt and per-request metadata go to
  `prepare`, chunks stream as they come, `header.semantics` says how to read the logprobs, and a client
  that disconnects closes the stream (or calls `abort()` to end it with "abort" records instead).

    pipeline = Pipeline(engine, config)                   # once per process
    gen = pipeline.prepare(prompt_ids, options, request_id="", metadata={...})
                                                          # InvalidArgument here, before any engine call
    async with contextlib.aclosing(gen.stream()) as chunks:
        async for chunk in chunks:                        # RolloutChunk, in arrival order over the n samples
            ...                                           # chunk.record is set on each sample's last chunk
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

import contextlib
import time
from collections.abc import AsyncIterator, Mapping

import numpy as np

from maskroll.client.records import RolloutChunk, RolloutRecord, SamplingOptions

from . import validation
from .config import ServerConfig
from .engine import Engine, SamplingParams
from .fanout import FanOut
from .records_builder import RecordHeader, SampleBuilder, semantics_for


class Generation:
    """One validated request, run once: `stream()` or `records()`; `abort()` may come at any time."""

    def __init__(self, engine: Engine, header: RecordHeader, params: SamplingParams, engine_id: str) -> None:
        self.header = header  # identity, prompt and semantics: what every record of this request carries
        self.params = params  # the engine's parameters for sample 0 (sample i is seeded seed + i)
        self._engine = engine
        # Built now (no engine call yet) so that an abort() before the stream starts is not lost.
        self._fan = FanOut(engine, validation.engine_requests(engine_id, header.prompt_ids, params, self.n))
        self._started = False

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def n(self) -> int:
        return self.header.group_size

    def abort(self) -> None:
        """End the request now (the server is draining): the stream stops reading, cancels the engine
        requests, then ends every unfinished sample with an empty chunk whose record has finish_reason
        "abort". Before the stream starts it ends at once; after it ended, this does nothing."""
        self._fan.abort()

    async def stream(self) -> AsyncIterator[RolloutChunk]:
        """Every chunk of the n samples in arrival order; each sample's last chunk carries its record."""
        if self._started:
            raise RuntimeError(f"request {self.request_id!r} has already been run")
        self._started = True
        samples = [SampleBuilder(self.header, i) for i in range(self.n)]
        async with self._fan as fan:
            async for i, out in fan.outputs():
                if out is not None:
                    yield samples[i].add(out, now=time.time())
                elif not samples[i].finished:  # the engine ended the stream without a finish reason
                    yield samples[i].abort(current_version=self._engine.policy_version, now=time.time())
        # Unfinished samples are left only after abort(): their engine requests are cancelled by now;
        # each still gets its last chunk, so every sample of a request ends with a record.
        for sample in samples:
            if not sample.finished:
                yield sample.abort(current_version=self._engine.policy_version, now=time.time())

    async def records(self) -> list[RolloutRecord]:
        """Run to the end and return the n records by sample index (for callers that do not stream)."""
        records: dict[int, RolloutRecord] = {}
        async with contextlib.aclosing(self.stream()) as chunks:
            async for chunk in chunks:
                if chunk.record is not None:
                    records[chunk.sample_index] = chunk.record
        return [records[i] for i in range(self.n)]  # the stream ends every sample with a record


class Pipeline:
    """The replica's request rules: its limits (`caps`), engine and replica id. One per process."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.replica_id = config.replica_id
        self.caps = validation.Caps.of(
            engine.limits, max_logprobs=config.max_logprobs, max_tokens=config.max_tokens, max_n=config.max_n
        )

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
    ) -> Generation:
        """Validate a request and return it ready to run; raises InvalidArgument naming the field.

        prompt_ids: token ids [P] (any integer dtype; records carry int32). request_id: "" for a fresh
        one. job_id gives the rollout ids (a retried job yields the same ones); group_id "" is no group.
        engine_id: sample i runs as engine request f"{engine_id}-{i}", by default the request id; a
        caller that may run the same request twice at once must pass a unique one. run_id: the training
        run every record carries (a pull-mode job's; trainers refuse records of another run)."""
        # An id given as both request and job id (a pull-mode job) is named once, as job_id.
        validation.check_ids("" if request_id == job_id else request_id, job_id, group_id)
        validation.check_metadata(metadata or {})
        prompt = np.asarray(prompt_ids)
        validation.check_prompt(prompt, self.caps)
        prompt = prompt.astype(np.int32, copy=False)  # in [0, vocab_size) by now, so the cast is exact
        params = validation.sampling_params(prompt, options, self.caps)
        request_id = request_id or validation.new_request_id()
        e = self.engine
        header = RecordHeader(
            request_id=request_id,
            job_id=job_id,
            group_id=group_id,
            metadata=dict(metadata or {}),
            prompt_ids=prompt,
            semantics=semantics_for(params, engine=e.name, engine_version=e.version, model=e.model_id),
            replica_id=self.replica_id,
            group_size=options.n,
            run_id=run_id,
        )
        return Generation(e, header, params, engine_id or request_id)
