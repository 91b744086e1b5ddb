"""The replica's core: what a replica is and does, whichever front end speaks for it.

    core = ReplicaCore(engine, config, metrics, publisher)   # server/app.py, once per process
    core.serving      # generation/serving.py: Generate and Score requests (check, adapter, publish)
    core.updates      # weights/updates.py: the weights served and every change to them
    core.running      # running.py: the requests in flight, the one drain of every front end
    core.adapters     # weights/adapters.py: the LoRA adapters of each namespace served
    core.info()       # GetInfo's answer (ServerInfo)

The gRPC servicer (grpc_api/servicer.py) and the HTTP front end (http_api/) are adapters of this object:
they convert their messages to the domain objects of maskroll.proto.records and call it. server/app.py
builds it, joins the run through `updates.load_source`, sets `not_ready` and drains `running`. Knows
nothing of gRPC, HTTP or protobuf.
"""

from __future__ import annotations

import functools

from maskroll.proto.records import LOGPROBS_MODE, ServerInfo

from . import activity
from .config import ServerConfig
from .engines.contract import Engine
from .generation.serving import Serving
from .metrics import Metrics
from .pull.publisher import RolloutPublisher
from .running import Running
from .weights import tensor_rules
from .weights.adapters import AdapterTable
from .weights.updates import WeightUpdates


@functools.cache  # reading the package metadata takes ~2 ms, and GetInfo asks on every call
def maskroll_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("maskroll")
    except PackageNotFoundError:
        return "unknown"


class ReplicaCore:
    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        metrics: Metrics,
        publisher: RolloutPublisher | None = None,
    ) -> None:
        """publisher: --namespace's (the records of Generate calls and agent sessions); None without Redis."""
        self.engine, self.config, self.metrics = engine, config, metrics
        self.running = Running()  # every front end's requests: refused once draining, aborted at its end
        # The replica's LoRA adapters (docs/lora.md), one per namespace served: what Generate / Score and
        # the pull-mode jobs sample with, and what heartbeats and joins report (`adapters.served(ns)`).
        # It holds the starting weights' fingerprint (`updates.base_fingerprint`).
        self.adapters = AdapterTable(
            engine,
            base_fingerprint="",
            max_loras=config.max_loras,
            versions_per_run=config.lora_versions,
            namespaces=(config.namespace, *config.lora_namespaces),
            base_layouts=lambda: tensor_rules.directory_layouts(config.model),
        )
        self.updates = WeightUpdates(engine, config, metrics, self.adapters, lambda: self.running.draining)
        self.serving = Serving(
            engine, config, metrics, self.running, self.adapters, publisher, lambda: self.updates.run_id
        )
        self.tokenizer_fingerprint = ""  # set by app.py at start-up (GetInfo; the teacher stage compares it)

    @property
    def not_ready(self) -> str | None:
        """Why this replica may not serve requests yet (starting, joining its run), or None."""
        return self.serving.not_ready

    @not_ready.setter
    def not_ready(self, reason: str | None) -> None:
        self.serving.not_ready = reason

    def info(self) -> ServerInfo:
        e, c, updates = self.engine, self.serving.caps, self.updates
        load = activity.snapshot(self.metrics)
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
            replica_id=self.config.replica_id,
            max_message_bytes=self.config.max_message_bytes,
            run_id=updates.run_id,
            weights_fingerprint=updates.weights_fingerprint,
            in_flight=int(load.in_flight),
            jobs_running=int(load.jobs_running),
            generated_tokens=int(load.tokens),
            published_records=int(load.published),
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            base_fingerprint=updates.base_fingerprint,
            max_lora_rank=e.max_lora_rank,
            max_loras=self.config.max_loras if e.max_lora_rank > 0 else 0,
            adapters=self.adapters.info(),
            **vars(e.settings),  # EngineSettings and ServerInfo name the engine's settings alike
        )
