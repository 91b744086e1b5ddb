"""StageConfig: what every stage's configuration has (where it reads and publishes, the worker's limits);
RewardStageConfig: the one validated configuration of a reward stage (`maskroll reward`, and the same
stage inside a replica: `maskroll serve --reward`); TeacherStageConfig: the teacher stage's (`maskroll
teacher`).

Standard library only, so that `maskroll reward --help` and a bad flag answer before redis, numpy or a
tokenizer is imported; its fields become the command's flags (app/flags.py: the help is each field's entry
in the class's docstring or, when it has none, in its base's; the default its default).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")


@dataclass(frozen=True)
class StageConfig:
    """The fields every stage has: where it reads and publishes, what scores, and the worker's limits
    (stages/worker.py). The entries below are the reward stage's words; another stage's docstring words
    again those that mean something else there.

    redis_url: the Redis of the rollout queue (redis:// or rediss://); default $MASKROLL_REDIS_URL
    namespace: the queue namespace (one training run) whose finished records the stage scores
    reward: the reward function, MODULE:FUNCTION (imported by path; fn(RewardInput) -> float | RewardResult,
        sync or async; maskroll.rewards)
    workers: worker processes (each one a consumer of the stage's group; scale further with more pods)
    concurrency: records each worker scores at once (sync functions run in threads, async ones on its loop)
    tokenizer: directory of the run's tokenizer (tokenizer.json, or a Hugging Face tokenizer); default: each
        record's model (semantics.model) when it is such a directory
    timeout_s: seconds one reward call may take; past it the record is dead-lettered, never given a reward
    partitions: the namespace's partitions (as `maskroll serve --partitions`; Redis records and checks it)
    claim_idle_s: records another worker took and left unfinished this long are taken over (it died)
    max_deliveries: a record delivered this many times without being scored (its worker died on it each
        time) is dead-lettered
    max_len: the most unconsumed records the trainer's rollout stream may hold: past it the stage waits
        (backpressure, never a trim)
    dedupe_ttl_s: how long published rollout ids are remembered, so a duplicate record is published once
    heartbeat_ttl_s: a worker's heartbeat key (maskroll status) expires this long after its last beat
    log_every_s: seconds between two activity lines (0: none)
    worker_id: this worker's consumer name (default: host-pid-random)
    """

    redis_url: str | None = field(default_factory=lambda: os.environ.get("MASKROLL_REDIS_URL"))
    namespace: str = "default"
    reward: str = ""
    workers: int = 1
    concurrency: int = 8
    tokenizer: Path | None = None
    timeout_s: float = 30.0
    partitions: int = 1
    claim_idle_s: float = 60.0
    max_deliveries: int = 5
    max_len: int = 100_000
    dedupe_ttl_s: float = 7 * 86400.0
    heartbeat_ttl_s: float = 15.0
    log_every_s: float = 30.0
    worker_id: str | None = None


@dataclass(frozen=True)
class RewardStageConfig(StageConfig):
    """Where the stage reads and publishes, what scores, and its limits (StageConfig's fields; `reward` is
    required)."""

    def __post_init__(self) -> None:
        _check_where(self)
        if not _SPEC.fullmatch(self.reward):
            raise ValueError(
                f"reward={self.reward!r}; expected MODULE:FUNCTION, "
                "e.g. maskroll.recipes.digits:digit_reward_fn"
            )
        _check_limits(self)


def _check_where(cfg: StageConfig) -> None:
    """The Redis URL and the namespace of a stage's config."""
    if not cfg.redis_url or not cfg.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"redis_url={cfg.redis_url!r}; expected redis://host:port, rediss:// or unix:// "
            "(--redis-url, or $MASKROLL_REDIS_URL)"
        )
    if not _NAMESPACE.fullmatch(cfg.namespace):
        raise ValueError(f"namespace={cfg.namespace!r}; expected 1-128 of A-Z a-z 0-9 _ . -")


def _check_limits(cfg: StageConfig, ints: tuple = (), floats: tuple = ()) -> None:
    """The limits every stage's config has (StageConfig's), and `ints` / `floats` ((name, low[, high]) more
    of them)."""
    for name, low, high in (
        ("workers", 1, 256),
        ("concurrency", 1, 4096),
        ("partitions", 1, 1024),
        ("max_deliveries", 1, 1000),
        ("max_len", 1, 10**9),
        *ints,
    ):
        value = getattr(cfg, name)
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            raise ValueError(f"{name}={value!r}; expected an int in [{low}, {high}]")
    for name, low in (
        ("timeout_s", 0.001),
        ("claim_idle_s", 0.1),
        ("dedupe_ttl_s", 1.0),
        ("heartbeat_ttl_s", 0.5),
        ("log_every_s", 0.0),
        *floats,
    ):
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
            raise ValueError(f"{name}={value!r}; expected a finite number >= {low}")
    if cfg.claim_idle_s <= cfg.timeout_s:
        # a live worker keeps its records claimed, but a call that outlives the reclaim threshold
        # would still race a second worker's reclaim
        raise ValueError(
            f"claim_idle_s={cfg.claim_idle_s} must exceed timeout_s={cfg.timeout_s}: a record still "
            "being scored would be taken over by another worker"
        )


@dataclass(frozen=True)
class TeacherStageConfig(StageConfig):
    """Where the teacher stage reads and publishes, which teachers score, and its limits: StageConfig's
    fields (their entries there, but for those worded again here) and the teacher's.

    namespace: the queue namespace (one training run) whose finished records the teachers score
    teacher: the teacher replicas, ADDR[,ADDR...] (host:port of `maskroll serve` gRPC): each record goes to
        the next in turn, and to the one after when one is UNAVAILABLE
    teacher_k: K_teacher, the teacher's top-K entries per token attached to each record
    teacher_temperature: the temperature of μ_teacher (softmax(ℓ_teacher / T), no top-k / top-p); vLLM
        teachers score only 1
    token: bearer token of the teacher and student replicas, if they require one; default
        $MASKROLL_AUTH_TOKEN (the environment keeps it off the command line)
    tls_ca: CA certificate (PEM) that the teacher and student replicas' TLS certificates are checked
        against; unset: plaintext gRPC
    reward: also score each record with this reward function first, MODULE:FUNCTION (as `maskroll reward`
        --reward: one worker runs both stages); empty: the teacher only
    concurrency: records each worker has scored at once
    group_wait_s: how long a record waits for the other records of its GRPO group (same prompt) so that
        they are scored in one Score call; a group sends as soon as it is whole. 0: one call per record
    tokenizer: the student's tokenizer directory: decodes records for --reward and is compared with the
        teacher's at start-up; default: the student replicas' model directory when it is local
    timeout_s: seconds one Score call (or one reward call) may take
    retry_s: how long a record waits for a teacher when every one is unavailable, before it is left
        pending for another worker
    student_wait_s: at start-up, how long to wait for a live student replica of the namespace (its
        vocabulary is compared with the teachers')
    """

    teacher: str = ""
    teacher_k: int = 20
    teacher_temperature: float = 1.0
    token: str | None = field(default_factory=lambda: os.environ.get("MASKROLL_AUTH_TOKEN") or None)
    tls_ca: Path | None = None
    group_wait_s: float = 0.05
    retry_s: float = 60.0
    student_wait_s: float = 300.0
    # the teacher stage's own defaults for two of StageConfig's fields: a Score call (a forward on a
    # remote replica, a whole group at once) gets longer than a reward call, and claim_idle_s must
    # exceed it (_check_limits)
    timeout_s: float = 60.0
    claim_idle_s: float = 120.0

    @property
    def teachers(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.teacher.split(",") if a.strip())

    def __post_init__(self) -> None:
        _check_where(self)
        if not self.teachers or any(not _ADDRESS.fullmatch(a) for a in self.teachers):
            raise ValueError(
                f"teacher={self.teacher!r}; expected HOST:PORT[,HOST:PORT...] of teacher replicas"
            )
        if self.reward and not _SPEC.fullmatch(self.reward):
            raise ValueError(f"reward={self.reward!r}; expected MODULE:FUNCTION, or none")
        t = self.teacher_temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"teacher_temperature={t!r}; expected a finite number > 0")
        _check_limits(
            self,
            ints=(("teacher_k", 1, 4096),),
            floats=(("retry_s", 0.0), ("student_wait_s", 0.0), ("group_wait_s", 0.0)),
        )
