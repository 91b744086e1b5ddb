"""RolloutServicer: the gRPC methods, each validate → convert → call → yield (STYLE.md §6).

A request's generation (validation, record header, engine fan-out, chunks and records) is `pipeline`'s,
shared with pull-mode jobs; checkpoint rules are `weights`', protobuf conversion `maskroll.proto.wire`'s
and the mapping of exceptions to status codes `errors.rpc_boundary`'s. What is left here is gRPC's part:
conversion, duplicate ids in flight, publishing to a rollout_stream, metrics, and the bookkeeping a
drain needs (which requests are in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.proto.records import LOGPROBS_MODE, ServerInfo, WeightsUpdate, WeightsUpdateResult
from maskroll.proto.streams import StreamKeys

from .. import activity
from ..config import ServerConfig
from ..engines.contract import Engine
from ..errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
    Unavailable,
    message_of,
    shown,
)
from ..generation import scoring, validation
from ..generation.pipeline import Pipeline
from ..metrics import Metrics
from ..pull.publisher import RolloutPublisher
from ..running import Running
from ..weights import checkpoints as weights
from ..weights import receive as weight_stream
from ..weights import sources as weight_sources
from ..weights import tensor_rules
from ..weights.adapters import AdapterTable
from .errors import rpc_boundary
from .session import StreamSession

log = logging.getLogger("maskroll.weights")


@functools.cache  # reading the package metadata takes ~2 ms, and GetInfo asks on every call
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
        # a Generate may publish to its rollout streams only (the layout app.py detected: partitions, cluster)
        self._keys = (publisher and publisher.keys) or StreamKeys(config.namespace)
        self._caps = self._pipeline.caps
        self._running = Running()  # for drain, and to refuse a request id already in flight
        self._weights_lock = asyncio.Lock()  # one UpdateWeights at a time: versions must increase
        self._updates: set[asyncio.Task] = set()  # running updates (a task needs a strong reference)
        # The training run of the weights served ("" = the starting weights, or a client without runs):
        # the version rule is per run (docs/records.md, "Runs"), and Generate's records carry it.
        self._run_id = ""
        # The replica's LoRA adapters (docs/lora.md), one per namespace served: what Generate / Score and
        # the pull-mode jobs sample with, and what heartbeats and joins report (`adapters.served(ns)`).
        # It holds the starting weights' fingerprint (`base_fingerprint` below).
        self.adapters = AdapterTable(
            engine,
            base_fingerprint="",
            max_loras=config.max_loras,
            versions_per_run=config.lora_versions,
            namespaces=(config.namespace, *config.lora_namespaces),
            base_layouts=lambda: tensor_rules.directory_layouts(config.model),
        )
        self.tokenizer_fingerprint = ""  # set by app.py at start-up (GetInfo; the teacher stage compares it)
        # Why this replica may not serve Generate yet (starting, joining its training run, an invalid
        # run record), or None; server/app.py sets it. Weight updates are taken meanwhile.
        self.not_ready: str | None = None
        metrics.policy_version.set(engine.policy_version)

    @property
    def base_fingerprint(self) -> str:
        """The fingerprint of the starting weights (server/weights/fingerprint.py; app.py sets it) while
        they are served; "" once any update loaded other weights, or when unknown. Adapters apply to it."""
        return self.adapters.base_fingerprint

    @base_fingerprint.setter
    def base_fingerprint(self, value: str) -> None:
        self.adapters.base_fingerprint = value

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._metrics.rpc_done(method, code, seconds)

    def _check_serving(self) -> None:
        """UNAVAILABLE (so clients go to another replica) while draining, not ready or with a dead engine."""
        if self._running.draining:
            raise Unavailable("the server is draining; send the request to another replica")
        if self.not_ready:
            raise Unavailable(
                f"this replica is not ready ({self.not_ready}); send the request to another one"
            )
        if failure := self._engine.failure():
            raise Unavailable(
                f"this replica's engine is out of service ({failure}); send the request to another "
                "replica (this one needs a restart)"
            )

    # ---- Generate -------------------------------------------------------------------------------

    @rpc_boundary("Generate")
    async def Generate(self, request: pb.GenerateRequest, context):
        async with contextlib.aclosing(self.serve_request(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    @rpc_boundary("GenerateStream")
    async def GenerateStream(self, requests, context):
        """Many Generate requests over one call, each run by `push_request` (session.py); yields the
        bytes of each pb.StreamEvents message (its handler's response serializer is the identity)."""
        # At once, so that the client's first write cannot race a refusal (client/generate_stream.py).
        await context.send_initial_metadata(())
        stream = StreamSession(self.push_request, self.observe_rpc, self._config.max_message_bytes)
        async with contextlib.aclosing(stream.messages(requests)) as messages:
            async for message in messages:
                yield message

    async def serve_request(self, request: pb.GenerateRequest, send=None):
        """One Generate request's chunks (pb.GenerateChunk), or with `send` each handed to it instead
        (yielding none); raises what the call ends with."""
        self._check_serving()
        # The namespace's current adapter samples every token (None: the engine's weights); held
        # resident until the request ends, however it ends.
        with self.adapters.use(request.namespace) as adapter:
            async with contextlib.aclosing(self._generate(request, adapter, send)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def push_request(self, request: pb.GenerateRequest, send) -> None:
        """serve_request with each chunk handed to `send(pb.GenerateChunk)` as soon as it is made
        (pipeline.Generation.push), for a GenerateStream call's outbox; returns when the request has ended
        (its records published), raises what a Generate call would end with."""
        async with contextlib.aclosing(self.serve_request(request, send)) as nothing:
            async for _ in nothing:  # pushing: the generator yields nothing
                pass

    async def _generate(self, request: pb.GenerateRequest, adapter, send=None):
        """Run one request: yields its pb.GenerateChunk messages, or hands them to `send` (yielding none)."""
        gen = self._pipeline.prepare(
            wire.prompt_from_pb(request),
            wire.options_from_pb(request.options),
            request_id=request.request_id,
            job_id=request.job_id,
            group_id=request.group_id,
            metadata=request.metadata,
            run_id=self._run_id,
            adapter=adapter,
        )
        stream = None
        if request.rollout_stream:
            if self._publisher is None:
                raise FailedPrecondition("rollout_stream needs a server started with redis_url")
            stream = validation.rollout_stream(request.rollout_stream, self._keys)
        if gen.request_id in self._running:
            raise AlreadyExists(f"request_id {gen.request_id!r} is already in flight on this replica")
        finished = []  # records, published to `stream` once the request is complete
        arrays = request.include_record_arrays
        tracker = self._metrics.generate_started(gen.logprobs_k)

        def served(chunk) -> pb.GenerateChunk:
            tracker.tokens(len(chunk.token_ids))
            if chunk.record is not None:
                finished.append(chunk.record)
            return wire.chunk_to_pb(chunk, record_arrays=arrays)

        self._running.add(gen)
        try:
            if send is None:
                async with contextlib.aclosing(gen.stream()) as chunks:
                    async for chunk in chunks:
                        yield served(chunk)
            else:
                await gen.push(lambda chunk: send(served(chunk)))
            # A group with aborted samples would never be whole on the queue: it is not published.
            if stream and all(r.finish_reason != "abort" for r in finished):
                await self._publisher.publish(finished, stream)
        finally:
            self._running.discard(gen)
            tracker.done()

    # ---- Score ----------------------------------------------------------------------------------

    @rpc_boundary("Score")
    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        """Given completions scored without sampling (generation/scoring.py); refused like a Generate
        while draining, not ready or with a dead engine."""
        self._check_serving()
        job = wire.score_from_pb(request)
        with self.adapters.use(request.namespace) as adapter:
            result = await scoring.score(self._engine, job, self._caps, adapter)
        return wire.score_result_to_pb(result)

    # ---- UpdateWeights --------------------------------------------------------------------------

    @rpc_boundary("UpdateWeights")
    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context) -> pb.UpdateWeightsResponse:
        update = wire.update_from_pb(request)
        try:
            validation.check_run_id(update.run_id)
            if self._running.draining:
                raise Unavailable("the server is draining")
            if update.adopt_fingerprint is None:
                self._check_full_weights()
            if update.collective:
                source = weight_sources.CollectiveSource(wire.collective_from_pb(request))
                if source.spec.init:  # the rendezvous: join the trainer's group, no version change
                    await weight_sources.join_collective(self._engine, source)
                    joined = WeightsUpdateResult(self._engine.policy_version, 0.0, paused_requests=0)
                    return wire.update_result_to_pb(joined)
            elif update.adopt_fingerprint is not None:
                return wire.update_result_to_pb(await self._adopt(update))
            elif update.checkpoint_dir is None:
                raise InvalidArgument("source is not set; give checkpoint.path")
            else:
                path = weights.resolve_checkpoint(update.checkpoint_dir, self._config.weights_root)
                source = weight_sources.DirectorySource(path)
        except ServiceError as exc:
            _log_refused(update, exc)
            raise
        return wire.update_result_to_pb(await self._run_update(update, source))

    async def _adopt(self, update: WeightsUpdate) -> WeightsUpdateResult:
        """AdoptSource: the starting weights, unchanged, become version 0 of `update.run_id` — only when
        they are what the trainer's model holds (equal fingerprints). No bytes move, nothing is paused."""
        async with self._weights_lock:
            mine, theirs = self.base_fingerprint, update.adopt_fingerprint
            if update.version != 0 or not update.run_id:
                raise InvalidArgument(
                    "adopt takes version 0 of a run (a run_id): a new run's starting weights"
                )
            if self._run_id == update.run_id and self._engine.policy_version == 0:
                return WeightsUpdateResult(0, 0.0, paused_requests=0)  # adopted already: a retry
            if self._run_id or not mine:
                held = f"version {self._engine.policy_version} of run {self._run_id}" if self._run_id else ""
                raise FailedPrecondition(
                    f"cannot adopt: this replica serves {held or 'weights of unknown fingerprint'}, not "
                    "its starting weights; push the model instead"
                )
            if mine != theirs:
                raise FailedPrecondition(
                    f"cannot adopt: this replica's starting weights have fingerprint {mine}, the trainer's "
                    f"model {_cut(theirs or '')!r}: they are other weights; push the model instead"
                )
            self._run_id = update.run_id
        log.info("weights: starting weights (%s) adopted as version 0 of run %s", mine, update.run_id)
        return WeightsUpdateResult(0, 0.0, paused_requests=0)

    @rpc_boundary("PushWeights")
    async def PushWeights(self, request_iterator, context) -> pb.UpdateWeightsResponse:
        """UpdateWeights with the tensors in the call (server/weights/receive.py): the version rule is
        checked on the manifest, before any byte is received, and again when the load begins."""
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            raise InvalidArgument("PushWeights ended before its manifest") from None
        try:
            manifest = wire.manifest_from_pb(first)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        if manifest.adapter is not None:
            return wire.update_result_to_pb(await self._push_adapter(manifest, request_iterator, context))
        update = WeightsUpdate(version=manifest.version, checkpoint_dir="(push)", run_id=manifest.run_id)

        def check() -> None:
            self._check_full_weights()
            self._check_version(update)

        source = await self._receive_push(
            update, manifest, request_iterator, context, check,
            weight_sources.receive(self._engine, manifest, request_iterator),
        )  # fmt: skip
        return wire.update_result_to_pb(await self._run_update(update, source))

    async def _receive_push(self, update, manifest, request_iterator, context, check, receiving_bytes):
        """The receiving half both kinds of push share: the run id, the drain and `check()` (the push's
        own rules, on the manifest) before any byte is received, then `receiving_bytes` (a coroutine)
        awaited. A refusal is logged and the rest of the call drained (the client's send finishes and
        reads the status). When the client goes away (a deadline, a dropped connection) the request
        iterator may wait on: the receiving task is ended then, so nothing partial is kept."""
        try:
            validation.check_run_id(update.run_id)
            if self._running.draining:
                raise Unavailable("the server is draining")
            check()
            receiving = asyncio.current_task()
            context.add_done_callback(lambda _: receiving is not None and receiving.cancel())
            try:
                return await receiving_bytes
            finally:
                receiving = None
        except ServiceError as exc:
            _log_refused(update, exc)
            await weight_stream.drain(request_iterator, manifest.total_bytes)
            raise
        finally:
            receiving_bytes.close()  # never awaited when a check refused the push first

    async def _push_adapter(self, manifest, request_iterator, context) -> WeightsUpdateResult:
        """A LoRA adapter's push: its rules checked on the manifest before any byte arrives
        (`AdapterTable.check_manifest`), received into memory whatever the engine (adapters are small),
        then loaded by the table, which asks the rules again. Like a full update, once received it loads
        to its end even if the caller goes away."""
        update = WeightsUpdate(
            version=manifest.version, checkpoint_dir="(adapter push)", run_id=manifest.run_id
        )
        tensors = await self._receive_push(
            update, manifest, request_iterator, context,
            lambda: self.adapters.check_manifest(manifest),
            weight_stream.receive_tensors(manifest, request_iterator),
        )  # fmt: skip
        task = asyncio.ensure_future(self._load_adapter(update, manifest, tensors))
        self._updates.add(task)
        task.add_done_callback(self._update_done)
        return await asyncio.shield(task)

    async def _load_adapter(self, update: WeightsUpdate, manifest, tensors: dict) -> WeightsUpdateResult:
        try:
            paused, seconds = await self.adapters.load(manifest, tensors)
        except ServiceError as exc:
            _log_refused(update, exc)
            raise
        self._metrics.weight_update.observe(seconds)
        return WeightsUpdateResult(version=manifest.version, load_seconds=seconds, paused_requests=paused)

    def _check_full_weights(self) -> None:
        """Full weights replace the base every namespace's adapters apply to: refused on a replica
        serving several LoRA runs (`--lora-namespaces`), whose runs each push only their adapter."""
        if self._config.lora_namespaces:
            served = [self._config.namespace, *self._config.lora_namespaces]
            raise FailedPrecondition(
                f"this replica serves several LoRA runs on its base (namespaces {served}): it takes their "
                "adapters only, not full weights; push an adapter, or use a replica without --lora-namespaces"
            )

    @property
    def weights_served(self) -> tuple[str, int]:
        """(run id, policy version) of the weights this replica serves ("" = its starting weights)."""
        return self._run_id, self._engine.policy_version

    async def load_source(
        self, update: WeightsUpdate, source: weight_sources.WeightSource
    ) -> WeightsUpdateResult:
        """An update decided inside the replica (joining the run at start-up, server/app.py): the
        rules of the RPCs, without one."""
        self._check_full_weights()
        self._check_version(update)
        return await self._run_update(update, source)

    async def _run_update(
        self, update: WeightsUpdate, source: weight_sources.WeightSource
    ) -> WeightsUpdateResult:
        # Once begun, an update runs to its end even if the caller goes away (deadline, disconnect): a
        # load cancelled halfway would leave the weights and the version to chance. The caller's own
        # cancellation still propagates through the shield.
        task = asyncio.ensure_future(self._update_weights(update, source))
        self._updates.add(task)
        task.add_done_callback(self._update_done)
        return await asyncio.shield(task)

    def _update_done(self, task: asyncio.Task) -> None:
        self._updates.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an orphaned update's error already went to its (gone) caller

    def _check_version(self, update: WeightsUpdate) -> None:
        """The version rule, per run: within the run the replica serves, versions increase; a version of
        another run is a reload (any version >= 0: a new run starts again from 0 or 1). An update without
        a run id (a client older than runs) must be greater than the current version."""
        version, current, run = update.version, self._engine.policy_version, self._run_id
        if version < 0:
            raise InvalidArgument(f"version {version} is negative")
        if (not update.run_id or update.run_id == run) and version <= current:
            of_run = f" of run {run}" if run else ""
            raise FailedPrecondition(
                f"version {version} must be greater than the current policy version {current}{of_run}"
            )

    async def _update_weights(
        self, update: WeightsUpdate, source: weight_sources.WeightSource
    ) -> WeightsUpdateResult:
        version = update.version
        try:
            async with self._weights_lock:
                current, run = self._engine.policy_version, self._run_id
                self._check_version(update)  # again: another update may have won the lock meanwhile
                paused, seconds = await weight_sources.load(self._engine, version, source)
                self._run_id = update.run_id
                self.base_fingerprint = ""  # other weights now, even if the load was of the same bytes
                # No adapter trained on the base fits the new weights: every namespace back to them.
                await self.adapters.drop_all()
        except ServiceError as exc:
            _log_refused(update, exc, source)
            raise
        finally:
            weight_sources.release(source)  # the spool file of a push: loaded or refused, it goes
        log.info(
            "weights: loaded version %d of run %s (was %d of run %s) from %s in %.2f s, %d requests paused",
            version,
            update.run_id or "-",
            current,
            run or "-",
            source.describe(),
            seconds,
            paused,
        )
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
        load = activity.snapshot(self._metrics)
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
            run_id=self._run_id,
            weights_fingerprint="" if self._run_id else self.base_fingerprint,
            in_flight=int(load.in_flight),
            jobs_running=int(load.jobs_running),
            generated_tokens=int(load.tokens),
            published_records=int(load.published),
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            base_fingerprint=self.base_fingerprint,
            max_lora_rank=e.max_lora_rank,
            max_loras=self._config.max_loras if e.max_lora_rank > 0 else 0,
            adapters=self.adapters.info(),
            **vars(e.settings),  # EngineSettings and ServerInfo name the engine's settings alike
        )

    # ---- drain ----------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def begin_drain(self) -> None:
        """Refuse new work (UNAVAILABLE, so clients retry elsewhere); in-flight requests go on."""
        self._running.begin_drain()

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every in-flight Generate finished within `timeout` seconds."""
        return await self._running.wait_idle(timeout)

    def abort_all(self) -> None:
        """End every in-flight Generate now: each unfinished sample gets a record with finish_reason abort."""
        self._running.abort_all()


def add_raw_handlers(servicer: RolloutServicer, server) -> None:
    """Serve two methods with bytes where protobuf would copy (after `add_RolloutServiceServicer_to_server`,
    which this overrides for them): PushWeights with no request deserializer, so that
    `wire.push_chunk_from_pb` takes the tensor bytes as a view into each message, where protobuf's parse
    and field access would copy every pushed byte twice more (bench/weights.py); and GenerateStream with
    no response serializer, as its messages are framed from chunks serialised once (session.py)."""
    import grpc

    push = grpc.stream_unary_rpc_method_handler(
        servicer.PushWeights, response_serializer=pb.UpdateWeightsResponse.SerializeToString
    )
    stream = grpc.stream_stream_rpc_method_handler(
        servicer.GenerateStream, request_deserializer=pb.StreamRequest.FromString
    )
    service = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    server.add_registered_method_handlers(service, {"PushWeights": push, "GenerateStream": stream})


def _log_refused(update: WeightsUpdate, exc: ServiceError, source=None) -> None:
    # The run id and path are the client's: quoted cut short, as the message the client gets.
    log.warning(
        "weights: refused version %d of run %s from %s: %s %s",
        update.version,
        _cut(update.run_id) or "-",
        source.describe() if source is not None else _path_of(update),
        exc.code,
        message_of(str(exc)),
    )


def _path_of(update: WeightsUpdate) -> str:
    path = update.checkpoint_dir
    if path is None:
        return "an NCCL group" if update.collective else "no source"
    return _cut(path, 256)


def _cut(text: str, limit: int = 64) -> str:
    """A client's string in a log line: as it is when short, else quoted and cut (errors.shown)."""
    return text if len(text) <= limit and text.isprintable() else shown(text, limit)
