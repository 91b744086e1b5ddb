"""Serving a client's request, whatever front end it came through: what a Generate or a Score is beyond
its generation.

    serving = Serving(engine, config, metrics, running, adapters, publisher, run_id=updates_run_id)
    serving.check()                                  # UNAVAILABLE while draining, not ready, engine dead
    async for chunk in serving.generate(request):    # RolloutChunk; request: records.GenerateRequest
        ...
    await serving.push(request, send)                # each chunk handed to send(chunk) as it is made
    result = await serving.score(job, namespace)     # a ScoreJob → ScoreResult (`score_job`)

`generate` / `push` add to `pipeline`'s generation: the serving check, the request's LoRA adapter held
resident for its whole run (`AdapterTable.use(namespace)`), a request id already in flight refused
(ALREADY_EXISTS), the request in the replica's one running set (server/running.py: the drain), metrics,
and the finished records published to the request's `rollout_stream` once every sample is done (a group
with an aborted sample is never published: it would never be whole on the queue). The gRPC servicer and
the native JSON API both call this; the OpenAI calls share its check, its running set and its pipeline.
Knows nothing of gRPC, HTTP or protobuf.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from maskroll.proto.records import GenerateRequest, RolloutChunk, Semantics
from maskroll.proto.scoring import ScoredTokens, ScoreJob, ScoreResult
from maskroll.proto.streams import StreamKeys

from ..config import ServerConfig
from ..engines.contract import AdapterRef, Engine, SamplingParams, ScoreRequest
from ..errors import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable, Unimplemented
from ..metrics import Metrics
from ..running import Running
from . import validation
from .pipeline import Pipeline, Send

if TYPE_CHECKING:
    from ..pull.publisher import RolloutPublisher
    from ..weights.adapters import AdapterTable


class Serving:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        metrics: Metrics,
        running: Running,
        adapters: AdapterTable,
        publisher: RolloutPublisher | None,
        run_id: Callable[[], str],
    ) -> None:
        """run_id(): the training run of the weights served now (weights/updates.py), which every record
        sampled from them carries. publisher: --namespace's (None without Redis: nothing is published)."""
        self.engine = engine
        self.pipeline = Pipeline(engine, config)  # the replica's one: every front end's requests
        self.caps = self.pipeline.caps
        self.running = running
        self.adapters = adapters
        self.publisher = publisher
        # a request may publish to its namespace's rollout streams only (the layout app.py detected)
        self.keys = (publisher and publisher.keys) or StreamKeys(config.namespace)
        self.run_id = run_id
        self._metrics = metrics
        # Why this replica may not serve yet (starting, joining its training run, an invalid run record),
        # or None; server/app.py sets it. Weight updates are taken meanwhile.
        self.not_ready: str | None = None

    def check(self) -> None:
        """UNAVAILABLE (so clients go to another replica) while draining, not ready or with a dead engine."""
        if self.running.draining:
            raise Unavailable("the server is draining; send the request to another replica")
        if self.not_ready:
            raise Unavailable(
                f"this replica is not ready ({self.not_ready}); send the request to another one"
            )
        if failure := self.engine.failure():
            raise Unavailable(
                f"this replica's engine is out of service ({failure}); send the request to another "
                "replica (this one needs a restart)"
            )

    async def generate(
        self, request: GenerateRequest, send: Send | None = None
    ) -> AsyncIterator[RolloutChunk]:
        """The request's chunks in order (each sample's last one carries its record), or with `send` each
        handed to it as soon as it is made instead (yielding none); raises what the call ends with."""
        self.check()
        # The namespace's current adapter samples every token (None: the engine's weights); held
        # resident until the request ends, however it ends.
        with self.adapters.use(request.namespace) as adapter:
            async with contextlib.aclosing(self._generate(request, adapter, send)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def push(self, request: GenerateRequest, send: Send) -> None:
        """`generate` with each chunk handed to `send` in the task that made it (pipeline.Generation.push:
        a GenerateStream call's outbox); returns when the request has ended, its records published."""
        async with contextlib.aclosing(self.generate(request, send)) as nothing:
            async for _ in nothing:  # pushing: the generator yields nothing
                pass

    async def _generate(
        self, request: GenerateRequest, adapter: AdapterRef | None, send: Send | None
    ) -> AsyncIterator[RolloutChunk]:
        gen = self.pipeline.prepare(
            request.prompt_ids,
            request.options,
            request_id=request.request_id,
            job_id=request.job_id,
            group_id=request.group_id,
            metadata=request.metadata,
            run_id=self.run_id(),
            adapter=adapter,
        )
        stream = None
        if request.rollout_stream:
            if self.publisher is None:
                raise FailedPrecondition("rollout_stream needs a server started with redis_url")
            stream = validation.rollout_stream(request.rollout_stream, self.keys)
        if gen.request_id in self.running:
            raise AlreadyExists(f"request_id {gen.request_id!r} is already in flight on this replica")
        finished = []  # records, published to `stream` once the request is complete
        tracker = self._metrics.generate_started(gen.logprobs_k)

        def served(chunk: RolloutChunk) -> RolloutChunk:
            tracker.tokens(len(chunk.token_ids))
            if chunk.record is not None:
                finished.append(chunk.record)
            return chunk

        self.running.add(gen)
        try:
            if send is None:
                async with contextlib.aclosing(gen.stream()) as chunks:
                    async for chunk in chunks:
                        yield served(chunk)
            else:
                await gen.push(lambda chunk: send(served(chunk)))
            if stream and all(r.finish_reason != "abort" for r in finished):
                await self.publisher.publish(finished, stream)
        finally:
            self.running.discard(gen)
            tracker.done()

    async def score(self, job: ScoreJob, namespace: str = "") -> ScoreResult:
        """Given completions scored without sampling (`score_job`), under the namespace's current
        adapter; refused like a Generate while draining, not ready or with a dead engine."""
        self.check()
        with self.adapters.use(namespace) as adapter:
            return await score_job(self.engine, job, self.caps, adapter)


# ---- Score: given tokens under the processed μ, no sampling ------------------------------------------
#
# Every rule is the SDK's (`proto.scoring`: the prompt rule, non-empty completions in the vocabulary that
# fit the context, the sampling rules for temperature / top_p / top_k / K) asked with the replica's limits;
# a broken one is an `InvalidArgument` naming the wire field ("completion_token_ids[1][3] = 70000 is
# outside the vocabulary [0, 259)"). Also bounded here: the number of completions per call (the server's
# max_n, as a Generate's samples).


def score_request(job: ScoreJob, caps: validation.Caps) -> ScoreRequest:
    """Validate `job` against `caps` and return the engine's request (a fresh request id if it has none)."""
    validation.check_ids(job.request_id, "", "")
    problems = job.problems(vocab_size=caps.vocab_size, max_model_len=caps.max_model_len)
    problems += job.options.problems(vocab_size=caps.vocab_size, max_logprobs=caps.max_logprobs)
    if problems:
        raise InvalidArgument(problems[0])
    if len(job.completions) > caps.max_n:
        raise InvalidArgument(
            f"completion_token_ids has {len(job.completions)} completions; at most {caps.max_n} "
            "(max_n) per call"
        )
    o = job.options
    return ScoreRequest(
        request_id=job.request_id or validation.new_request_id(),
        prompt_ids=np.asarray(job.prompt_ids, np.int32),
        completions=tuple(np.asarray(c, np.int32) for c in job.completions),
        params=SamplingParams(
            max_tokens=max(int(c.size) for c in job.completions),
            temperature=float(o.temperature),
            top_p=float(o.top_p),
            top_k=max(o.top_k, 0),  # -1 and 0 both mean off; engines and semantics use 0
            logprobs_k=o.logprobs_k,
        ),
    )


async def score_job(
    engine: Engine, job: ScoreJob, caps: validation.Caps, adapter: AdapterRef | None = None
) -> ScoreResult:
    """Validate, score every completion in one engine call, and say which μ the numbers describe.
    adapter: score under base + this LoRA adapter (the caller holds it in use: `AdapterTable.use`)."""
    request = score_request(job, caps)
    if adapter is not None:
        request = replace(request, adapter=adapter)
    try:
        out = await engine.score(request)
    except NotImplementedError as e:
        raise Unimplemented(str(e)) from e
    except ValueError as e:  # the engine's own guard (vLLM: a temperature it cannot score at), as fanout's
        raise InvalidArgument(f"the {engine.name} engine refused the request: {e}") from e
    p = request.params
    return ScoreResult(
        request_id=request.request_id,
        completions=[
            ScoredTokens(lp, r, i, v)
            for lp, r, i, v in zip(out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs, strict=True)
        ],
        semantics=Semantics(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            logprobs_k=p.logprobs_k,
            engine=engine.name,
            engine_version=engine.version,
            model=engine.model_id,
        ),
        policy_version=out.policy_version,
    )
