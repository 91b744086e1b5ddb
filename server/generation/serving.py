"""Serving a client's request, whatever front end it came through: what a Generate or a Score is beyond
its generation.

    serving = Serving(engine, config, metrics, running, adapters, publisher, run_id=updates_run_id)
    serving.check()                                  # UNAVAILABLE while draining, not ready, engine dead
    async for chunk in serving.generate(request):    # RolloutChunk; request: records.GenerateRequest
        ...
    await serving.push(request, send)                # each chunk handed to send(chunk) as it is made
    result = await serving.score(job, namespace)     # a ScoreJob → ScoreResult

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
from typing import TYPE_CHECKING

from maskroll.proto.records import GenerateRequest, RolloutChunk
from maskroll.proto.scoring import ScoreJob, ScoreResult
from maskroll.proto.streams import StreamKeys

from ..config import ServerConfig
from ..engines.contract import AdapterRef, Engine
from ..errors import AlreadyExists, FailedPrecondition, Unavailable
from ..metrics import Metrics
from ..running import Running
from . import scoring, validation
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
        """Given completions scored without sampling (generation/scoring.py), under the namespace's
        current adapter; refused like a Generate while draining, not ready or with a dead engine."""
        self.check()
        with self.adapters.use(namespace) as adapter:
            return await scoring.score(self.engine, job, self.caps, adapter)
