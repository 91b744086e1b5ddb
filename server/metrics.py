"""Prometheus metrics of one replica, served over HTTP when `metrics_port` is set.

Each server gets its own CollectorRegistry, so several servers can live in one process (tests) without
colliding in prometheus_client's global registry. Knows nothing of gRPC messages or engines: callers
report numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_K_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


# The outcomes a pull job is counted under (maskroll_pull_jobs{outcome}).
JOB_OUTCOMES = ("ok", "rejected", "malformed", "error", "dead_lettered")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens = Counter(
            "maskroll_generated_tokens",
            "Completion tokens generated (streamed, or in pull jobs' records)",
            registry=r,
        )
        self.requests = Counter(
            "maskroll_requests", "RPCs by method and final status code", ["method", "code"], registry=r
        )
        self.latency = Histogram(
            "maskroll_request_seconds", "RPC duration", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "maskroll_time_to_first_token_seconds",
            "Generate: request start to the first streamed token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.logprobs_k = Histogram(
            "maskroll_logprobs_k", "Top-K asked for per Generate request", buckets=_K_BUCKETS, registry=r
        )
        self.policy_version = Gauge("maskroll_policy_version", "Current policy (weights) version", registry=r)
        self.in_flight = Gauge("maskroll_generate_in_flight", "Generate requests in progress", registry=r)
        self.weight_update = Histogram(
            "maskroll_weight_update_seconds", "UpdateWeights load time", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Redis queue (publisher and pull mode)
        self.published = Counter("maskroll_published_records", "Records published to Redis", registry=r)
        self.published_bytes = Counter("maskroll_published_bytes", "Bytes of records published", registry=r)
        self.backpressure = Counter(
            "maskroll_publish_backpressure_waits", "Publisher waits on a full rollout stream", registry=r
        )
        self.publish_failures = Counter(
            "maskroll_publish_failures", "Publishes given up (the job is left for redelivery)", registry=r
        )
        self.publish_seconds = Histogram(
            "maskroll_publish_seconds", "Publishing one job's records, waits included", registry=r
        )
        self.jobs = Counter("maskroll_pull_jobs", "Prompt jobs finished, by outcome", ["outcome"], registry=r)
        self.jobs_reclaimed = Counter(
            "maskroll_pull_jobs_reclaimed", "Jobs reclaimed from replicas that went silent", registry=r
        )
        self.jobs_active = Gauge("maskroll_pull_jobs_active", "Prompt jobs being generated", registry=r)
        # HTTP agent sessions
        self.session_answers = Gauge(
            "maskroll_session_answer_bytes",
            "Bytes kept for finished sessions, so that a retried finish gets its answer again",
            registry=r,
        )
        self.sessions_open = Gauge(
            "maskroll_sessions_open", "Agent sessions held in this replica's memory (its cache)", registry=r
        )
        self.session_turns = Counter(
            "maskroll_session_turns",
            "Session turns recorded, by where the session came from: local (this replica's cache), moved "
            "(loaded from Redis: served by another replica before, or this replica's copy was stale), new",
            ["source"],
            registry=r,
        )
        self.session_reprefill_tokens = Counter(
            "maskroll_session_reprefill_tokens",
            "Tokens of moved sessions' stored trajectories prefilled again (no local prefix cache)",
            registry=r,
        )

    def rpc_done(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)

    def generate_started(self, logprobs_k: int) -> GenerateTracker:
        self.in_flight.inc()
        self.logprobs_k.observe(logprobs_k)
        return GenerateTracker(self)

    def serve_http(self, host: str, port: int):
        """Start the /metrics endpoint on a daemon thread; returns (http server, bound port)."""
        httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
        return httpd, httpd.server_port


@dataclass
class GenerateTracker:
    """Per-request bookkeeping: tokens, time to the first token, in-flight gauge."""

    metrics: Metrics
    start: float = field(default_factory=time.perf_counter)
    seen_token: bool = False

    def tokens(self, n: int) -> None:
        if n and not self.seen_token:
            self.seen_token = True
            self.metrics.ttft.observe(time.perf_counter() - self.start)
        self.metrics.tokens.inc(n)

    def done(self) -> None:
        self.metrics.in_flight.dec()
