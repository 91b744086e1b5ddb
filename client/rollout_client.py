"""RolloutClient: the trainer's gRPC client for one rollout replica, and a synchronous facade for scripts.

    async with RolloutClient("127.0.0.1:50051", token=None) as c:
        async for chunk in c.generate(prompt_ids, SamplingOptions(max_tokens=64, logprobs_k=20)):
            ...                                  # RolloutChunk: new tokens with their logprob arrays
        rec = await c.generate_record(prompt_ids, SamplingOptions(max_tokens=64))

Failures surface as `RolloutError(code, message)` with the gRPC status code. Leaving a `generate`
iteration early (break, exception, or dropping the iterator) cancels the call, and the server aborts
the engine request. Imports grpc, protobuf and numpy only — never torch or vllm.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from maskroll.proto import wire
from maskroll.proto._generated import rollout_pb2 as pb
from maskroll.proto._generated import rollout_pb2_grpc as pb_grpc
from maskroll.proto.prompts import prompt_problem
from maskroll.proto.records import (
    RecordAssembler,
    RolloutChunk,
    RolloutRecord,
    SamplingOptions,
    ServerInfo,
    WeightsUpdateResult,
)
from maskroll.proto.scoring import ScoreJob, ScoreOptions, ScoreResult

from ._sync import signature_of, sync_facade
from .generate_stream import GenerateStreamCall, Lane, StreamFailed

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a record with arrays is ~8 bytes per token per K


class RolloutError(Exception):
    """An RPC failed; `code` is the grpc.StatusCode, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError) -> RolloutError:
        return cls(exc.code(), exc.details() or "")


def _checked(options: SamplingOptions) -> SamplingOptions:
    problems = options.problems()
    if problems:  # the same code the server would answer with, without the round trip
        raise RolloutError(grpc.StatusCode.INVALID_ARGUMENT, "options: " + "; ".join(problems))
    return options


def _prompt_array(prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:  # -> int32 [P]
    """The prompt as the wire carries it (int32 [P]). The prompt rule (`maskroll.proto.prompts`, without
    the vocabulary and context the replica knows) is checked here, except for an empty prompt: the
    replica answers that one itself (INVALID_ARGUMENT, in the same words) and counts it."""
    a = np.asarray(prompt_ids)
    if a.size == 0:
        return np.zeros(0, np.int32)
    if problem := prompt_problem(a):
        raise RolloutError(grpc.StatusCode.INVALID_ARGUMENT, problem)
    info = np.iinfo(np.int32)
    if a.max() > info.max:  # packing to int32 would wrap them into valid-looking ids
        raise RolloutError(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: ids must fit in int32")
    return a.astype(np.int32)


class ChunkStream:
    """The chunks of one generate request: a lane of the client's GenerateStream call, or a Generate
    call of its own. Async iterator; `cancel()`, `aclose()` or dropping the last reference (CPython
    frees it as soon as an `async for` is left) cancels the request."""

    def __init__(
        self,
        *,
        lane: Lane | None = None,
        call: grpc.aio.UnaryStreamCall | None = None,
        fallback: Callable[[], grpc.aio.UnaryStreamCall] | None = None,
    ) -> None:
        self._lane = lane
        self._call = call
        # A replica older than GenerateStream refuses the call (UNIMPLEMENTED) before any event: the
        # request then goes as a Generate call of its own, made by `fallback`.
        self._fallback = fallback

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> RolloutChunk:
        if self._lane is not None:
            try:
                msg = await self._lane.read()
            except StreamFailed as exc:
                if not (
                    exc.code is grpc.StatusCode.UNIMPLEMENTED and not self._lane.received and self._fallback
                ):
                    raise RolloutError(exc.code, exc.message) from None
                self._lane, self._call = None, self._fallback()
                return await self.__anext__()
            if msg is None:
                raise StopAsyncIteration
        else:
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise RolloutError.from_rpc(exc) from None
            if msg is grpc.aio.EOF:
                raise StopAsyncIteration
        try:
            return wire.chunk_from_pb(msg)
        except Exception:
            self.cancel()  # a payload we cannot read: stop the server generating more of it
            raise

    def cancel(self) -> None:
        if self._lane is not None:
            self._lane.cancel()
        elif self._call is not None and not self._call.done():
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> ChunkStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.cancel()

    def __del__(self) -> None:
        lane, call = getattr(self, "_lane", None), getattr(self, "_call", None)
        if lane is not None and not lane.ended:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the call ended with it
                lane.loop.call_soon_threadsafe(lane.cancel)  # __del__ may run on another thread
        elif call is not None and not call.done():
            call.cancel()


class RolloutClient:
    """Async client of one replica. The channel opens on first use (or `async with`), inside the
    event loop that uses it; one client per event loop."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certs: bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        multiplex: bool = True,
    ) -> None:
        """target: "host:port". token: bearer token, if the server requires one. tls / root_certs: use
        TLS, trusting `root_certs` (PEM) or the system roots. tls_server_name: the name to check the
        server certificate against, when it differs from the target's host. timeout: default deadline
        of unary calls, in seconds (streams have none unless given per call). multiplex: send every
        generate request over one GenerateStream call (the replica batches their chunks: less CPU on
        both sides); False, or a replica that predates it: one Generate call per request."""
        self._target = target
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls or root_certs is not None
        self._root_certs = root_certs
        self._timeout = timeout
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.RolloutServiceStub | None = None
        self._multiplex = multiplex
        self._stream: GenerateStreamCall | None = None  # the GenerateStream call, opened on first use

    def _rollout(self) -> pb_grpc.RolloutServiceStub:
        if self._stub is None:
            if self._tls:
                creds = grpc.ssl_channel_credentials(root_certificates=self._root_certs)
                self._channel = grpc.aio.secure_channel(self._target, creds, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self._target, options=self._options)
            self._stub = pb_grpc.RolloutServiceStub(self._channel)
        return self._stub

    async def __aenter__(self) -> RolloutClient:
        self._rollout()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (streams still open end with CANCELLED)."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def _unary(self, method, request, timeout: float | None):
        try:
            return await method(request, metadata=self._metadata, timeout=timeout or self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise RolloutError.from_rpc(exc) from None

    # ---- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        options: SamplingOptions | None = None,
        *,
        request_id: str = "",
        job_id: str = "",
        group_id: str = "",
        metadata: dict[str, str] | None = None,
        include_record_arrays: bool = False,
        timeout: float | None = None,
        namespace: str = "",
    ) -> ChunkStream:
        """Stream the chunks of every sample as the server produces them; each sample's last chunk
        carries its record (arrays only with include_record_arrays; otherwise reassemble them with
        RecordAssembler, as generate_records does). namespace: on a replica serving LoRA runs, sample
        with that namespace's current adapter ("": the replica's own namespace; docs/lora.md)."""
        request = wire.generate_request(
            _prompt_array(prompt_ids),
            _checked(options or SamplingOptions()),
            request_id=request_id,
            job_id=job_id,
            group_id=group_id,
            metadata=metadata,
            include_record_arrays=include_record_arrays,
            namespace=namespace,
        )

        def call() -> grpc.aio.UnaryStreamCall:
            return self._rollout().Generate(request, metadata=self._metadata, timeout=timeout)

        def fallback() -> grpc.aio.UnaryStreamCall:
            self._multiplex = False  # the replica has no GenerateStream: every later request goes alone
            return call()

        if not self._multiplex:
            return ChunkStream(call=call())
        if self._stream is None or self._stream.failed is not None:
            self._stream = GenerateStreamCall(self._rollout(), self._metadata)
        return ChunkStream(lane=self._stream.open(request, timeout), fallback=fallback)

    async def generate_records(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        options: SamplingOptions | None = None,
        *,
        request_id: str = "",
        job_id: str = "",
        group_id: str = "",
        metadata: dict[str, str] | None = None,
        timeout: float | None = None,
        namespace: str = "",
    ) -> list[RolloutRecord]:
        """All n samples' records, ordered by sample index (keyword arguments as for `generate`)."""
        options = options or SamplingOptions()
        assembler, records = RecordAssembler(), {}
        kw = dict(request_id=request_id, job_id=job_id, group_id=group_id, metadata=metadata, timeout=timeout)
        kw["namespace"] = namespace
        async with self.generate(prompt_ids, options, **kw) as stream:
            async for chunk in stream:
                record = assembler.add(chunk)
                if record is not None:
                    records[record.sample_index] = record
        if sorted(records) != list(range(options.n)):
            raise RolloutError(
                grpc.StatusCode.DATA_LOSS,
                f"stream ended with records for samples {sorted(records)} of n={options.n}",
            )
        return [records[i] for i in range(options.n)]

    async def generate_record(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        options: SamplingOptions | None = None,
        *,
        request_id: str = "",
        job_id: str = "",
        group_id: str = "",
        metadata: dict[str, str] | None = None,
        timeout: float | None = None,
        namespace: str = "",
    ) -> RolloutRecord:
        """The one record of an n=1 request."""
        options = options or SamplingOptions()
        if options.n != 1:
            raise RolloutError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"generate_record is for n=1 (got n={options.n}); use generate_records",
            )
        kw = dict(request_id=request_id, job_id=job_id, group_id=group_id, metadata=metadata, timeout=timeout)
        return (await self.generate_records(prompt_ids, options, namespace=namespace, **kw))[0]

    # ---- scoring --------------------------------------------------------------------------------

    async def score(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        completions: Sequence[Sequence[int] | np.ndarray],
        options: ScoreOptions | None = None,
        *,
        request_id: str = "",
        timeout: float | None = None,
        namespace: str = "",
    ) -> ScoreResult:
        """Score `completions` of `prompt_ids` without sampling: per completion token the given token's
        log μ and rank and the top-K of μ, the processed distribution at `options`' temperature /
        top_k / top_p (a record's μ for the same options; docs/records.md "Scoring"). namespace: under
        that namespace's current LoRA adapter, as `generate`."""
        options = options or ScoreOptions()
        job = ScoreJob(
            _prompt_array(prompt_ids), tuple(_prompt_array(c) for c in completions), options, request_id
        )
        problems = options.problems()
        if problems:  # the server's words, without the round trip
            raise RolloutError(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        request = wire.score_request(job, namespace=namespace)
        return wire.score_result_from_pb(await self._unary(self._rollout().Score, request, timeout))

    # ---- weights and info -----------------------------------------------------------------------

    async def update_weights(
        self,
        version: int,
        checkpoint_dir: str | os.PathLike,
        *,
        timeout: float | None = None,
        run_id: str = "",
    ) -> WeightsUpdateResult:
        """Make the replica load the safetensors checkpoint `checkpoint_dir` (a path on the replica's
        machine, under its weights_root) as policy `version` of training run `run_id`: greater than its
        current version within the same run; any version when the replica serves another run (it reloads).
        Without a run id, the version must be greater."""
        request = wire.update_request(version, os.fspath(checkpoint_dir), run_id)
        return wire.update_result_from_pb(await self._unary(self._rollout().UpdateWeights, request, timeout))

    async def adopt_weights(
        self, fingerprint: str, *, run_id: str, timeout: float | None = None
    ) -> WeightsUpdateResult:
        """Make the replica's starting weights version 0 of run `run_id`, no bytes sent: taken only when
        their fingerprint (`info().weights_fingerprint`) is `fingerprint`, the trainer's model's; else
        FAILED_PRECONDITION (then push the model)."""
        request = wire.adopt_request(0, fingerprint, run_id)
        return wire.update_result_from_pb(await self._unary(self._rollout().UpdateWeights, request, timeout))

    async def info(self, *, timeout: float | None = None) -> ServerInfo:
        """The replica's model, engine, limits, effective engine settings, policy version and run."""
        return wire.info_from_pb(await self._unary(self._rollout().GetInfo, pb.GetInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The standard health service's status name: "SERVING", "NOT_SERVING", ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._rollout()
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = await self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


@sync_facade(
    RolloutClient,
    methods=["generate_records", "generate_record", "score", "update_weights", "info", "health"],
    init_doc="See RolloutClient for what each argument means.",
    thread_name="maskroll-rollout-client",
)
class SyncRolloutClient:
    """Blocking facade over RolloutClient for scripts: its own event loop on a daemon thread.

    Same arguments and methods; `generate` returns a plain iterator (closing it or breaking out of the
    loop cancels the call). Use as a context manager or call `close()`."""

    _core: RolloutClient

    @signature_of(
        RolloutClient.generate,
        "RolloutClient.generate as a plain iterator; leaving the loop early cancels the call.",
    )
    def generate(self, *args, **kwargs) -> Iterator[RolloutChunk]:
        async def open_stream() -> ChunkStream:  # the call must be created on the client's loop
            return self._core.generate(*args, **kwargs)

        return self._iterate(self._loop.run(open_stream()))

    def _iterate(self, stream: ChunkStream) -> Iterator[RolloutChunk]:
        loop = self._loop.loop
        try:
            while True:
                try:
                    chunk = self._loop.run(stream.__anext__())
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            if not loop.is_closed():  # closing the client first already ended the call
                loop.call_soon_threadsafe(stream.cancel)

    def close(self) -> None:
        """Close the client and its event loop thread."""
        if self._loop.loop.is_closed():
            return
        self._loop.run(self._core.close())
        self._loop.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
