"""One replica's gRPC server: build it from a ServerConfig, run it, drain it on SIGTERM / SIGINT.

`start()` starts the engine, binds every port first (0 = a free one; the bound port is returned; one that
cannot be bound is a BindError before anything is served), registers the rollout and standard health
services, serves metrics when configured, joins the namespace's training run (weights/join.py), and with
`redis_url` + `pull` then consumes prompt jobs from Redis (the puller supervised: restarted with backoff
after an error). Until the replica has joined its run, both health services and /readyz read NOT_SERVING
and Generate is refused; a run record that is not valid keeps it so (said, re-checked every
JOIN_RETRY_S) instead of crashing it. A health monitor polls the engine and the puller every
HEALTH_PERIOD_S: while either cannot serve (a dead or stuck engine, a prompt stream that cannot be read)
both health services read NOT_SERVING, with the reason logged once per change. `Replica.drain()` is the
graceful stop: health → NOT_SERVING, no new requests or jobs, in-flight streams and jobs run on for up
to drain_timeout_s (streams then end with finish_reason "abort"; unfinished jobs stay pending in Redis
for another replica), then the engine closes.

With `--lora-namespaces` the replica serves several namespaces (several LoRA runs on its base,
docs/lora.md "Several runs, one fleet"): a `ServedNamespace` each (namespaces.py) — its own puller (sharing
pull_concurrency through pull/slots.py), registry heartbeat and join, all joined in parallel; it is
ready once every namespace has joined (or its join gave up).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # the asyncio HealthServicer

from maskroll.proto._generated import rollout_pb2, rollout_pb2_grpc
from maskroll.proto.heartbeat import encode_heartbeat
from maskroll.proto.run_record import RunRecordError
from maskroll.proto.streams import StreamKeys

from . import activity, namespaces
from .activity import log_activity
from .auth import BearerTokenInterceptor, server_credentials
from .config import ConfigError, ServerConfig
from .core import ReplicaCore
from .engines.contract import Engine
from .grpc_api.servicer import RolloutServicer, add_raw_handlers
from .metrics import Metrics
from .namespaces import ServedNamespace
from .pull.jobs import JobRunner
from .pull.publisher import RolloutPublisher
from .pull.puller import PromptPuller
from .pull.slots import JobSlots
from .weights.dir_fingerprint import fingerprint_dir
from .weights.join import join_current_version

log = logging.getLogger(__name__)

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
# After the drain timeout, aborted streams still need a moment to send their final "abort" chunks.
ABORT_GRACE_S = 5.0
STOP_GRACE_S = 1.0
HEALTH_PERIOD_S = 0.5  # how often the health monitor asks the engine and the puller
JOIN_RETRY_S = 2.0  # how often a replica that could not join its run (an invalid run record) tries again
STARTING = "starting: joining the training run"


class BindError(OSError):
    """The gRPC port could not be bound (in use, or an address this host does not have)."""


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class Replica:
    config: ServerConfig
    engine: Engine
    core: ReplicaCore  # what the replica is and does (core.py); both front ends adapt it
    servicer: RolloutServicer
    health: health_aio.HealthServicer
    server: grpc.aio.Server
    port: int
    metrics: Metrics
    metrics_port: int | None
    owns_engine: bool
    _httpd: object | None = None
    _drained: bool = False
    redis: object | None = None  # redis.asyncio.Redis (or RedisCluster) when redis_url is set
    # the namespaces served when redis_url is set (namespaces.py): --namespace first, then --lora-namespaces
    namespaces: list[ServedNamespace] = field(default_factory=list)
    _health_task: asyncio.Task | None = None
    http: object | None = None  # http_server.HttpFrontEnd when http_port is set
    _activity_task: asyncio.Task | None = None  # the periodic activity line (activity.py)
    reward_worker: object | None = None  # maskroll.stages' RewardWorker with --reward
    _reward_task: asyncio.Task | None = None
    _serving: bool = False  # what both health services say now (SERVING), until the drain

    @property
    def keys(self) -> StreamKeys | None:
        """--namespace's key layout (partitions, cluster) when redis_url is set."""
        return self.namespaces[0].keys if self.namespaces else None

    @property
    def puller(self) -> PromptPuller | None:
        """--namespace's puller (pull mode)."""
        return self.namespaces[0].puller if self.namespaces else None

    def _namespace_tasks(self) -> list[asyncio.Task]:
        return [t for ns in self.namespaces for t in (ns.join_task, ns.announce_task) if t is not None]

    def abort_all(self) -> None:
        """End every in-flight request of both front ends now (a second SIGTERM)."""
        self.core.running.abort_all()

    @property
    def address(self) -> str:
        return _hostport(self.config.host, self.port)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Graceful stop; `timeout_s` overrides the config's drain_timeout_s. Idempotent.

        The port stays open while in-flight requests finish, so health checks read NOT_SERVING (rather
        than failing to connect) and new Generate calls get UNAVAILABLE with a reason."""
        if self._drained:
            return
        self._drained = True
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for every service, permanently
        for task in (self._health_task, self._activity_task, *self._namespace_tasks()):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for ns in self.namespaces:
            if ns.announce_task is not None:  # out of the registry: trainers stop pushing to it
                with contextlib.suppress(Exception):
                    await self.redis.delete(ns.keys.replica(self.config.replica_id))
        # Both front ends refuse new work from now on (one running set); what runs has timeout_s.
        self.core.running.begin_drain()
        started = asyncio.get_running_loop().time()
        pulling = [ns for ns in self.namespaces if ns.puller is not None]
        if pulling:
            for ns in pulling:  # every namespace stops taking jobs at once, then all drain together
                ns.puller.stop()
            left = sum(await asyncio.gather(*(ns.puller.drain(timeout_s) for ns in pulling)))
            if left:
                log.warning("drain: %d jobs unfinished; left pending in Redis for another replica", left)
            for ns in pulling:
                if ns.puller_task is not None:  # None: the namespace never joined its run
                    await asyncio.gather(ns.puller_task, return_exceptions=True)
                await ns.puller.unregister()
            timeout_s = max(0.0, timeout_s - (asyncio.get_running_loop().time() - started))
        if self.reward_worker is not None:  # what it is scoring finishes, or stays pending for another
            self.reward_worker.stop()
            await self.reward_worker.drain(min(timeout_s, self.config.reward_timeout_s))
            await asyncio.gather(self._reward_task, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.reward_worker.unregister()
            self.reward_worker.scorer.close()
        running = self.core.running
        if not await running.wait_idle(timeout_s):
            log.warning("drain: %d requests still running after %.1f s; aborting", len(running), timeout_s)
            running.abort_all()
            if not await running.wait_idle(ABORT_GRACE_S):
                log.warning("drain: %d requests did not end after the abort", len(running))
        # Whatever is left (health Watch streams, a client not reading its last chunks) is cancelled.
        await self.server.stop(grace=STOP_GRACE_S)
        if self.http is not None:  # closed before the engine
            await self.http.close()
        if self.owns_engine:
            await self.engine.close()
        if self._httpd is not None:
            await asyncio.to_thread(self._httpd.shutdown)  # blocks until its serve loop notices
            self._httpd.server_close()
        if self.redis is not None:
            await self.redis.aclose()


async def start(config: ServerConfig, engine: Engine | None = None) -> Replica:
    """Start a replica. With `engine` given (already started), the caller keeps ownership of it."""
    owns_engine = engine is None
    if engine is None:
        from .engines.factory import make_engine

        log.info("starting the %s engine on %s", config.resolved_engine, config.model)
        engine = make_engine(config)
        await engine.start()
        log.info("engine settings: %s, max_model_len %d", engine.settings, engine.limits.max_model_len)
    try:
        return await _serve_engine(config, engine, owns_engine)
    except BaseException:
        if owns_engine:
            await engine.close()
        raise


async def _serve_engine(config: ServerConfig, engine: Engine, owns_engine: bool) -> Replica:
    """Every port is bound before anything is served; both health services and /readyz say NOT_SERVING
    until the replica has joined its training run (server/weights/join.py), and Generate is refused
    (UNAVAILABLE) until then: a joining replica must not sample from the weights it started with."""
    metrics = Metrics()
    redis, served = await _queue(config, metrics)
    publisher = served[0].publisher if served else None  # --namespace's: Generate's and HTTP's records
    try:
        core = ReplicaCore(engine, config, metrics, publisher)
        core.not_ready = STARTING
        core.updates.base_fingerprint = await _starting_fingerprint(config, engine)
        core.tokenizer_fingerprint = await _tokenizer_fingerprint(config)
        servicer = RolloutServicer(core)
        health = health_aio.HealthServicer()
        for service in ("", SERVICE_NAME):
            await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        server, port = _grpc_server(config, servicer, health, metrics)
    except BaseException:
        if redis is not None:
            await redis.aclose()
        raise
    try:
        httpd, metrics_port = _metrics_server(config, metrics)
    except BaseException:
        await server.stop(grace=0)
        if redis is not None:
            await redis.aclose()
        raise
    replica = Replica(
        config=config,
        engine=engine,
        core=core,
        servicer=servicer,
        health=health,
        server=server,
        port=port,
        metrics=metrics,
        metrics_port=metrics_port,
        owns_engine=owns_engine,
        _httpd=httpd,
        redis=redis,
        namespaces=served,
    )
    if config.pull:
        # several namespaces share pull_concurrency (taken in turn); one keeps its own, as it always had
        slots = JobSlots(config.pull_concurrency) if len(served) > 1 else None
        for ns in served:
            ns.puller = _puller(config, engine, redis, ns, port, core, slots)
    else:  # publishes records: trainers must find it
        for ns in served:
            name = f"registry-heartbeat-{ns.namespace}"
            ns.announce_task = asyncio.create_task(_announce(replica, ns), name=name)
    if config.reward:  # needs no weights: it scores from the first record on
        replica.reward_worker = _reward_worker(config, redis, publisher.keys)
        replica._reward_task = asyncio.create_task(replica.reward_worker.supervise(), name="reward-stage")
    try:
        await server.start()  # PushWeights may bring the run's version while joining
        if config.http_port is not None:
            replica.http = await _start_http(replica, publisher)
        replica._health_task = asyncio.create_task(_watch_health(replica), name="health-monitor")
        if config.activity_log_s > 0:
            activity = log_activity(replica.metrics, lambda: engine.policy_version, config.activity_log_s)
            replica._activity_task = asyncio.create_task(activity, name="activity-log")
        await _join_all(replica)
        await _refresh_health(replica)
    except BaseException:
        await _abandon(replica)
        raise
    return replica


async def _starting_fingerprint(config: ServerConfig, engine: Engine) -> str:
    """The fingerprint of --model's weights (GetInfo reports it until other weights load), "" when it
    cannot be read: trainers then push their model rather than adopt these weights."""
    if engine.policy_version != 0:  # an engine handed in after it loaded other weights
        return ""
    try:
        return await asyncio.to_thread(fingerprint_dir, config.model)
    except Exception as exc:  # unreadable safetensors: the engine loaded them, so say it, don't fail
        log.warning("weights: no fingerprint of %s (%s: %s)", config.model, type(exc).__name__, exc)
        return ""


async def _tokenizer_fingerprint(config: ServerConfig) -> str:
    """The fingerprint of --model's tokenizer (proto/tokenizer_fingerprint.py; GetInfo reports it, a teacher
    stage compares it with the student's), "" when --model holds none the replica can read."""
    from maskroll.proto.tokenizer_fingerprint import fingerprint_tokenizer_json, vocab_fingerprint

    def compute() -> str:
        found = fingerprint_tokenizer_json(config.model)
        if found is None and (config.model / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer  # a tokenizer without a tokenizer.json: the same map

            found = vocab_fingerprint(AutoTokenizer.from_pretrained(str(config.model)).get_vocab())
        return found or ""

    if not config.model.is_dir():
        return ""
    try:
        return await asyncio.to_thread(compute)
    except Exception as exc:  # the engine loaded the model: a tokenizer we cannot hash is a warning
        log.warning("no tokenizer fingerprint of %s (%s: %s)", config.model, type(exc).__name__, exc)
        return ""


async def _join_all(replica: Replica) -> None:
    """Join every namespace's run, all at once (a streamed run waits for its trainer's push: those waits
    overlap); a namespace whose run record is invalid keeps retrying in the background."""
    if not replica.namespaces:  # no Redis: no run to join
        replica.core.not_ready = None
        return
    for ns in replica.namespaces:
        ns.not_ready = STARTING
    joined = await asyncio.gather(*(_join(replica, ns) for ns in replica.namespaces))
    for ns, ok in zip(replica.namespaces, joined, strict=True):
        if not ok:
            ns.join_task = asyncio.create_task(_rejoin(replica, ns), name=f"join-run-{ns.namespace}")


async def _join(replica: Replica, ns: ServedNamespace) -> bool:
    """Join the namespace's run (the run's current weights, or its adapter, before the first job or
    request); then serve it. False, with the reason where health checks and refused requests show it,
    when the run record is invalid: the replica then stays NOT_SERVING rather than serve outside the run
    or crash (every replica of the namespace would, in a loop)."""
    try:
        await join_current_version(replica, ns)
    except RunRecordError as exc:
        reason = (
            f"cannot join the training run: {exc}; NOT_SERVING until the record is valid (a trainer's "
            "run='new' rewrites it), checked every few seconds"
        )
        if ns.not_ready != reason:
            log.error("%s%s", reason, ns.label)
        ns.not_ready = reason
        replica.core.not_ready = namespaces.not_ready(replica.namespaces)
        return False
    ns.not_ready = None
    replica.core.not_ready = namespaces.not_ready(replica.namespaces)
    if ns.puller is not None and ns.puller_task is None:
        name = "prompt-puller" if len(replica.namespaces) == 1 else f"prompt-puller-{ns.namespace}"
        ns.puller_task = asyncio.create_task(ns.puller.supervise(), name=name)
    return True


async def _rejoin(replica: Replica, ns: ServedNamespace) -> None:
    while True:
        await asyncio.sleep(JOIN_RETRY_S)
        try:
            if await _join(replica, ns):
                log.info("joined the training run%s; serving", ns.label)
                await _refresh_health(replica)
                return
        except Exception:  # Redis unreachable for a while, say: the next attempt retries
            log.warning("joining the training run%s failed; retrying", ns.label, exc_info=True)


async def _abandon(replica: Replica) -> None:
    """Undo a start that failed halfway: nothing may keep listening or running."""
    pullers = [ns.puller_task for ns in replica.namespaces]
    tasks = (replica._health_task, replica._activity_task, *replica._namespace_tasks(), *pullers)
    for task in (*tasks, replica._reward_task):
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if replica.http is not None:
        await replica.http.stop()
    await replica.server.stop(grace=0)
    if replica._httpd is not None:
        replica._httpd.shutdown()
        replica._httpd.server_close()
    if replica.redis is not None:
        await replica.redis.aclose()


def _metrics_server(config: ServerConfig, metrics: Metrics) -> tuple[object | None, int | None]:
    """(the /metrics HTTP server, its bound port) when metrics_port is set; BindError if it cannot bind."""
    if config.metrics_port is None:
        return None, None
    try:
        return metrics.serve_http(config.host, config.metrics_port)
    except OSError as exc:
        where = _hostport(config.host, config.metrics_port)
        raise BindError(f"cannot listen on {where} for metrics: {exc.strerror or exc}") from exc


async def _start_http(replica: Replica, publisher: RolloutPublisher | None):
    """The HTTP / OpenAI front end beside gRPC (same engine, token, TLS, limits); BindError (or the error)
    if it cannot start. Its /readyz reads `problems`, as the gRPC health services do."""
    from .http_api.server import HttpFrontEnd  # fastapi and uvicorn load only when HTTP is on

    c = replica.config
    try:
        http = await HttpFrontEnd.create(replica.core)
        http.problems = lambda: problems(replica)
        await http.start()
    except OSError as exc:
        raise BindError(f"cannot listen on {_hostport(c.host, c.http_port)} for HTTP: {exc}") from exc
    return http


def problems(replica: Replica) -> list[str]:
    """Why the replica cannot serve now (empty: it can): not joined its run yet, the engine's and the
    puller's reasons."""
    found = [replica.core.not_ready, replica.engine.failure()]
    for ns in replica.namespaces:
        if ns.puller is not None and ns.puller_task is not None:
            failure = ns.puller.failure()
            found.append(failure and failure + ns.label)
    return [p for p in found if p]


async def _refresh_health(replica: Replica) -> None:
    """Set both health services to SERVING exactly when `problems` is empty (on a change only). A failing
    check is itself a reason."""
    try:
        found = problems(replica)
    except Exception as exc:
        log.exception("health check failed")
        found = [f"the health check failed: {type(exc).__name__}: {exc}"]
    if replica._serving == bool(found) and not replica._drained:
        replica._serving = not found
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if replica._serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await replica.health.set(service, status)
        if replica._serving:
            log.info("health: SERVING")
        else:
            log.error("health: NOT_SERVING: %s", "; ".join(found))


async def _watch_health(replica: Replica) -> None:
    """Keep both health services at SERVING exactly while `problems` is empty (until the drain, whose
    NOT_SERVING is final). The monitor must never die silently."""
    while True:
        await _refresh_health(replica)
        await asyncio.sleep(HEALTH_PERIOD_S)


async def _queue(config: ServerConfig, metrics: Metrics) -> tuple[object | None, list[ServedNamespace]]:
    """(Redis client, a `ServedNamespace` each: namespaces.py) when redis_url is set, else (None, []). The
    URL may name any node of a Redis Cluster: the cluster client is used then, and the keys carry hash
    tags (StreamKeys)."""
    if config.redis is None:
        return None, []
    from maskroll.proto.redis_conn import open_redis

    redis, cluster = await open_redis(config.redis)
    try:
        return redis, await namespaces.open_namespaces(config, redis, cluster, metrics)
    except BaseException:
        await redis.aclose()
        raise


def _grpc_server(
    config: ServerConfig, servicer: RolloutServicer, health: health_aio.HealthServicer, metrics: Metrics
) -> tuple[grpc.aio.Server, int]:
    """The gRPC server with the rollout and health services, bound (not started): (server, port)."""
    interceptors = []
    if config.token:
        interceptors.append(
            BearerTokenInterceptor(
                config.token, on_denied=lambda m: metrics.rpc_done(m, "UNAUTHENTICATED", 0.0)
            )
        )
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Without this, a second server on the same fixed port would silently share it.
            ("grpc.so_reuseport", 0),
        ],
    )
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    add_raw_handlers(servicer, server)  # PushWeights and GenerateStream without protobuf's copies
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bind = _hostport(config.host, config.port)
    try:
        if config.tls_cert is not None and config.tls_key is not None:
            port = server.add_secure_port(bind, server_credentials(config.tls_cert, config.tls_key))
        else:
            port = server.add_insecure_port(bind)
    except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise BindError(f"cannot listen on {bind} (address in use, or not an address of this host)") from exc
    if not port:
        raise BindError(f"cannot listen on {bind}")
    return server, port


def _replica_info(core: ReplicaCore, port: int, ns: ServedNamespace) -> Callable[[], dict]:
    """What the registry heartbeat of one namespace says of this replica besides its jobs: address,
    model, the weights that namespace is served (its run and version: `ServedNamespace.weights_served`),
    and the replica's load (tokens/s since the previous heartbeat, from its own metrics)."""
    config, engine, metrics = core.config, core.engine, core.metrics
    address = config.advertise_address or _hostport(config.host, port)
    last = [activity.snapshot(metrics)]

    def info() -> dict:
        now = activity.snapshot(metrics)
        before, last[0] = last[0], now
        run_id, version = ns.weights_served(core)
        return {
            "address": address,
            "engine": engine.name,
            "model": engine.model_id,
            "policy_version": version,
            "run_id": run_id,
            # the full weights' (weights/updates.py): a trainer checks its replicas hold its version
            "weights_fingerprint": core.updates.weights_fingerprint,
            "in_flight": int(now.in_flight),
            "tokens_per_s": (now.tokens - before.tokens) / max(now.at - before.at, 1e-9),
        }

    return info


async def _announce(replica: Replica, ns: ServedNamespace) -> None:
    """The registry heartbeat (of one namespace) of a replica that publishes records without pulling jobs
    (HTTP sessions, Generate with a rollout stream): trainers find it there, push it each new version and
    count it live. A puller writes its own (with its running jobs)."""
    config, keys = replica.config, ns.keys
    info = _replica_info(replica.core, replica.port, ns)
    period = max(0.2, config.heartbeat_ttl_s / 3)
    while True:
        try:
            beat = encode_heartbeat(
                config.replica_id, **info(), active_jobs=len(replica.core.running), pull=False
            )
            await replica.redis.set(
                keys.replica(config.replica_id), beat, px=int(config.heartbeat_ttl_s * 1000)
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # Redis hiccup: the next beat retries; the TTL tolerates a few misses
            log.warning("registry heartbeat failed", exc_info=True)
        await asyncio.sleep(period)


def _puller(
    config: ServerConfig,
    engine: Engine,
    redis: object,
    ns: ServedNamespace,
    port: int,
    core: ReplicaCore,
    slots,
) -> PromptPuller:
    """Pull mode: consume the namespace's prompt jobs (sampled with its adapter), advertising this replica
    in the namespace's registry; `slots` (a JobSlots or None): pull_concurrency shared with the other
    namespaces' pullers."""
    runner = JobRunner(engine, config, core.adapters, ns.namespace, pipeline=core.serving.pipeline)
    return PromptPuller(
        redis,
        ns.keys,
        config.replica_id,
        runner,
        ns.publisher,
        concurrency=config.pull_concurrency,
        claim_idle_s=config.claim_idle_s,
        heartbeat_ttl_s=config.heartbeat_ttl_s,
        max_deliveries=config.max_job_deliveries,
        replica_info=_replica_info(core, port, ns),
        slots=slots,
    )


def _reward_worker(config: ServerConfig, redis: object, keys: StreamKeys):
    """--reward: the reward stage's worker on this replica's Redis connection and event loop, decoding
    with --model's tokenizer; the same worker as `maskroll reward`'s (maskroll.stages)."""
    from maskroll.stages import RewardStageConfig, make_worker

    cfg = RewardStageConfig(
        redis_url=config.redis,
        namespace=config.namespace,
        reward=config.reward,
        concurrency=config.reward_concurrency,
        tokenizer=config.model if config.model.is_dir() else None,
        timeout_s=config.reward_timeout_s,
        partitions=config.partitions,
        claim_idle_s=max(config.claim_idle_s, 2 * config.reward_timeout_s),  # past a call's timeout
        max_len=config.rollout_stream_max_len,
        heartbeat_ttl_s=config.heartbeat_ttl_s,
        log_every_s=0,  # the replica's own activity line
    )
    return make_worker(redis, keys, cfg, f"{config.replica_id}-reward")


def ready_line(r: Replica) -> str:
    metrics = f"http://{_hostport(r.config.host, r.metrics_port)}/metrics" if r.metrics_port else "off"
    tls = "tls" if r.config.tls_cert else "plaintext"
    auth = "token" if r.config.token else "no auth"
    names = ", ".join(repr(ns.namespace) for ns in r.namespaces)
    pull = ""
    if r.puller is not None:
        pull = f"; pulling jobs from namespace{'s' if len(r.namespaces) > 1 else ''} {names}"
    if r.http is not None:
        pull += f"; http {r.http.scheme}://{_hostport(r.config.host, r.http.port)}"
    return (
        f"maskroll serve: ready on {r.address} ({tls}, {auth}; engine {r.engine.name} {r.engine.version}, "
        f"model {r.engine.model_id}, policy version {r.engine.policy_version}; metrics {metrics}{pull})"
    )


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM / SIGINT, then drain. A second signal skips the rest of the drain timeout.
    Returns the exit code: 2 when the engine refuses its arguments (as for a bad flag)."""
    try:
        replica = await start(config)
    except ConfigError as exc:  # engine arguments only vLLM can check (--vllm-arg, quantization, ...)
        print(f"maskroll serve: {exc}", file=sys.stderr, flush=True)
        return 2
    # Everything alive now (the imports: torch, vLLM, grpc; the engine) lives as long as the process: out
    # of the cyclic collector's reach, a full collection no longer walks it — a pause of tens of ms that
    # landed in the middle of serving (bench/server.py --scripted: single repetitions 3-4x the median).
    gc.freeze()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(ready_line(replica), flush=True)
    await stop.wait()
    log.info(
        "draining: %d requests in flight, up to %.1f s", len(replica.core.running), config.drain_timeout_s
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, replica.abort_all)
    await replica.drain()
    print("maskroll serve: stopped", file=sys.stderr, flush=True)
    return 0
