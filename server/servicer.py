"""RolloutServicer: the gRPC methods, each validate → convert → call → yield (STYLE.md §6).

A request's generation (validation, record header, engine fan-out, chunks and records) is `pipeline`'s,
shared with pull-mode jobs; checkpoint rules are `weights`', protobuf conversion `maskroll.client.wire`'s
and the mapping of exceptions to status codes `errors.rpc_boundary`'s. What is left here is gRPC's part:
conversion, duplicate ids in flight, publishing to a rollout_stream, metrics, and the bookkeeping a
drain needs (which requests are in flight).
"""

from __future__ import annotations

import asyncio
import contextlib

from maskroll.client import wire
from maskroll.client._proto import rollout_pb2 as pb
from maskroll.client._proto import rollout_pb2_grpc as pb_grpc
from maskroll.client.records import LOGPROBS_MODE, ServerInfo, WeightsUpdateResult

from . import weights
from .config import ServerConfig
from .engine import Engine
from .errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    Unimplemented,
    rpc_boundary,
)
from .metrics import Metrics
from .pipeline import Generation, Pipeline
from .publisher import RolloutPublisher


def maskroll_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("maskroll")
    except PackageNotFoundError:
        return "unknown"


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        metrics: Metrics,
        publisher: RolloutPublisher | None = None,
    ) -> None:
        self._engine = engine
        self._publisher = publisher
        self._config = config
        self._metrics = metrics
        self._pipeline = Pipeline(engine, config)
        self._caps = self._pipeline.caps
        self._active: dict[str, Generation] = {}  # request_id -> the running request, for drain and dedup
        self._idle = asyncio.Event()
        self._idle.set()
        self._weights_lock = asyncio.Lock()  # one UpdateWeights at a time: versions must increase
        self._updates: set[asyncio.Task] = set()  # running updates (a task needs a strong reference)
        self._draining = False
        metrics.policy_version.set(engine.policy_version)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._metrics.rpc_done(method, code, seconds)

    # ---- Generate -------------------------------------------------------------------------------

    @rpc_boundary("Generate")
    async def Generate(self, request: pb.GenerateRequest, context):
        if self._draining:
            raise Unavailable("the server is draining; send the request to another replica")
        gen = self._pipeline.prepare(
            wire.prompt_from_pb(request),
            wire.options_from_pb(request.options),
            request_id=request.request_id,
            job_id=request.job_id,
            group_id=request.group_id,
            metadata=request.metadata,
        )
        if request.rollout_stream and self._publisher is None:
            raise FailedPrecondition("rollout_stream needs a server started with redis_url")
        if gen.request_id in self._active:
            raise AlreadyExists(f"request_id {gen.request_id!r} is already in flight on this replica")
        finished = []  # records, published to request.rollout_stream once the request is complete
        arrays = request.include_record_arrays
        tracker = self._metrics.generate_started(gen.params.logprobs_k)
        self._track(gen)
        try:
            async with contextlib.aclosing(gen.stream()) as chunks:
                async for chunk in chunks:
                    tracker.tokens(len(chunk.token_ids))
                    if chunk.record is not None:
                        finished.append(chunk.record)
                    yield wire.chunk_to_pb(chunk, record_arrays=arrays)
            # A group with aborted samples would never be whole on the queue: it is not published.
            if request.rollout_stream and all(r.finish_reason != "abort" for r in finished):
                await self._publisher.publish(finished, request.rollout_stream)
        finally:
            self._untrack(gen.request_id)
            tracker.done()

    def _track(self, gen: Generation) -> None:
        self._active[gen.request_id] = gen
        self._idle.clear()

    def _untrack(self, request_id: str) -> None:
        del self._active[request_id]
        if not self._active:
            self._idle.set()

    # ---- UpdateWeights --------------------------------------------------------------------------

    @rpc_boundary("UpdateWeights")
    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context) -> pb.UpdateWeightsResponse:
        update = wire.update_from_pb(request)
        if update.collective:
            raise Unimplemented("collective (NCCL) weight updates are not implemented; send a checkpoint")
        if update.checkpoint_dir is None:
            raise InvalidArgument("source is not set; give checkpoint.path")
        if self._draining:
            raise Unavailable("the server is draining")
        path = weights.resolve_checkpoint(update.checkpoint_dir, self._config.weights_root)
        # Once begun, an update runs to its end even if the caller goes away (deadline, disconnect): a
        # load cancelled halfway would leave the weights and the version to chance. The caller's own
        # cancellation still propagates through the shield.
        task = asyncio.ensure_future(self._update_weights(update.version, path))
        self._updates.add(task)
        task.add_done_callback(self._update_done)
        return wire.update_result_to_pb(await asyncio.shield(task))

    def _update_done(self, task: asyncio.Task) -> None:
        self._updates.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an orphaned update's error already went to its (gone) caller

    async def _update_weights(self, version: int, path) -> WeightsUpdateResult:
        async with self._weights_lock:
            current = self._engine.policy_version
            if version <= current:
                raise FailedPrecondition(
                    f"version {version} must be greater than the current policy version {current}"
                )
            paused, seconds = await weights.load_checkpoint(self._engine, version, path)
        self._metrics.weight_update.observe(seconds)
        self._metrics.policy_version.set(self._engine.policy_version)
        return WeightsUpdateResult(
            version=self._engine.policy_version, load_seconds=seconds, paused_requests=paused
        )

    # ---- GetInfo --------------------------------------------------------------------------------

    @rpc_boundary("GetInfo")
    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.ServerInfo:
        return wire.info_to_pb(self.info())

    def info(self) -> ServerInfo:
        e, c = self._engine, self._caps
        return ServerInfo(
            model=e.model_id,
            engine=e.name,
            engine_version=e.version,
            maskroll_version=maskroll_version(),
            policy_version=e.policy_version,
            max_logprobs_k=c.max_logprobs,
            max_model_len=c.max_model_len,
            vocab_size=c.vocab_size,
            max_tokens=min(c.max_tokens, c.max_model_len - 1),
            max_n=c.max_n,
            logprobs_mode=LOGPROBS_MODE,
            replica_id=self._config.replica_id,
            max_message_bytes=self._config.max_message_bytes,
            **vars(e.settings),  # EngineSettings and ServerInfo name the engine's settings alike
        )

    # ---- drain ----------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def begin_drain(self) -> None:
        """Refuse new work (UNAVAILABLE, so clients retry elsewhere); in-flight requests go on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every in-flight Generate finished within `timeout` seconds."""
        if self._idle.is_set():  # wait_for(..., 0) would time out even on a set event
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort_all(self) -> None:
        """End every in-flight Generate now: each unfinished sample gets a record with finish_reason abort."""
        for gen in self._active.values():
            gen.abort()
