"""Running stage workers: `maskroll reward` and `maskroll teacher` (N worker processes each), and the
reward worker inside a replica (`maskroll serve --reward`, which calls `make_worker` on its own Redis
connection and event loop).

A worker process prints one ready line once its consumer groups exist, an activity line every
`log_every_s`, and exits on SIGTERM / SIGINT after the records it is scoring are done (or left pending
for another worker after a short drain). With several workers the parent starts them (spawned, not
forked: each its own interpreter and Redis connection), forwards SIGTERM, and exits with the first
worker's failure; a worker whose parent died exits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import replace

from .config import RewardStageConfig, TeacherStageConfig

log = logging.getLogger("maskroll.reward")

READY_PREFIX = "maskroll reward: ready"
TEACHER_READY_PREFIX = "maskroll teacher: ready"
DRAIN_S = 10.0


def make_worker(redis, keys, cfg: RewardStageConfig, worker_id: str | None = None):
    """A RewardWorker on an open Redis client and the namespace's keys (cluster already detected)."""
    from .worker import StageWorker

    worker_id = worker_id or cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return StageWorker(redis, keys, reward_step(cfg), cfg, worker_id)


def reward_step(cfg):
    """The reward function of `cfg` (a RewardStageConfig, or a TeacherStageConfig with --reward) as a step."""
    from .reward_call import Decoder, RewardStep, Scorer, load_reward

    fn, name = load_reward(cfg.reward)
    scorer = Scorer(fn, name, timeout_s=cfg.timeout_s, concurrency=cfg.concurrency)
    return RewardStep(scorer, Decoder(cfg.tokenizer), cfg.reward)


async def make_teacher_worker(redis, keys, cfg: TeacherStageConfig, worker_id: str | None = None):
    """A StageWorker whose step is the teacher fleet of `cfg` (after its reward function, if any), once
    the teachers' vocabulary is checked against a live student replica's (VocabularyMismatch)."""
    from maskroll.proto.scoring import ScoreOptions

    from .teacher import TeacherPool, TeacherStep, check_vocabulary
    from .teacher_batch import GroupBatcher
    from .worker import StageWorker

    root_certs = cfg.tls_ca.read_bytes() if cfg.tls_ca is not None else None
    pool = TeacherPool(
        cfg.teachers, token=cfg.token, timeout_s=cfg.timeout_s, retry_s=cfg.retry_s, root_certs=root_certs
    )
    try:
        _, teachers = await check_vocabulary(pool, redis, keys, cfg)
    except BaseException:
        await pool.close()
        raise
    options = ScoreOptions(logprobs_k=cfg.teacher_k, temperature=cfg.teacher_temperature)
    batcher = None
    if cfg.group_wait_s > 0:  # a batch goes to any teacher: at most the smallest max_n completions per call
        batcher = GroupBatcher(
            lambda prompt, completions: pool.score_many(prompt, completions, options),
            wait_s=cfg.group_wait_s,
            max_batch=max(1, min(t.max_n for t in teachers)),
            capacity=cfg.concurrency,
        )
    step = TeacherStep(pool, options, reward_step(cfg) if cfg.reward else None, batcher)
    worker_id = worker_id or cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return StageWorker(redis, keys, step, cfg, worker_id)


async def _activity(worker, every_s: float) -> None:
    last, t_last = 0, time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        c, now = worker.counters, time.monotonic()
        print(
            f"maskroll {worker.scorer.kind}: worker {worker.worker_id}: scored {c.scored} "
            f"({(c.scored - last) / (now - t_last):.1f}/s), failed {c.failed}, duplicates {c.duplicates}, "
            f"job errors {c.job_errors}, scoring {len(worker._active)}, hung {worker.scorer.hung}",
            flush=True,
        )
        last, t_last = c.scored, now


async def _parent_watch(parent: int | None) -> None:
    """End the worker when the process that started it is gone (SIGKILLed: no SIGTERM to forward)."""
    if parent is None:
        await asyncio.Event().wait()  # forever
    while os.getppid() == parent:
        await asyncio.sleep(1.0)


async def serve_worker(
    cfg: RewardStageConfig | TeacherStageConfig, worker_id: str | None = None, parent: int | None = None
) -> int:
    """One worker process's life: connect, ready line, score until SIGTERM / SIGINT, drain, unregister."""
    from maskroll.proto.redis_conn import open_redis
    from maskroll.proto.streams import StreamKeys

    from .reward_call import StageWedged

    r, cluster = await open_redis(cfg.redis_url)
    keys = StreamKeys(cfg.namespace, cfg.partitions, cluster)
    teacher = isinstance(cfg, TeacherStageConfig)
    try:
        worker = (
            await make_teacher_worker(r, keys, cfg, worker_id)
            if teacher
            else make_worker(r, keys, cfg, worker_id)
        )
    except ValueError as e:  # VocabularyMismatch, a reward function that does not import
        print(f"maskroll {'teacher' if teacher else 'reward'}: {e}", file=sys.stderr, flush=True)
        await r.aclose()
        return 2
    what = f"teachers {cfg.teacher} at K {cfg.teacher_k}, T {cfg.teacher_temperature:g}" if teacher else ""
    what += f"{', ' if teacher and cfg.reward else ''}{'reward ' + cfg.reward if cfg.reward else ''}"
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = []
    try:
        await worker.start()
        print(
            f"{TEACHER_READY_PREFIX if teacher else READY_PREFIX} (worker {worker.worker_id}, namespace "
            f"{cfg.namespace}, {what}, "
            f"{cfg.partitions} partitions, concurrency {cfg.concurrency}, timeout {cfg.timeout_s:g} s)",
            flush=True,
        )
        running = asyncio.create_task(worker.supervise(), name="reward-worker")
        tasks = [running, asyncio.create_task(stop.wait()), asyncio.create_task(_parent_watch(parent))]
        if cfg.log_every_s:
            tasks.append(asyncio.create_task(_activity(worker, cfg.log_every_s)))
        await asyncio.wait(tasks[:3], return_when=asyncio.FIRST_COMPLETED)
        worker.stop()
        left = await worker.drain(DRAIN_S)
        if left:
            log.warning("%d records still being scored were left pending for another worker", left)
        if running.done() and running.exception() is not None:
            exc = running.exception()
            print(
                f"maskroll {worker.scorer.kind}: worker {worker.worker_id} stopped: {exc}",
                file=sys.stderr,
                flush=True,
            )
            return 3 if isinstance(exc, StageWedged) else 1
        return 0
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await worker.unregister()
        worker.scorer.close()
        if teacher:
            await worker.scorer.pool.close()
        await r.aclose()


def _child(cfg: RewardStageConfig | TeacherStageConfig, worker_id: str, parent: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(serve_worker(cfg, worker_id, parent)))


def run_stage(cfg: RewardStageConfig | TeacherStageConfig) -> int:
    """`maskroll reward` / `maskroll teacher`: one worker in this process, or `cfg.workers` processes."""
    base = cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    if cfg.workers == 1:
        return asyncio.run(serve_worker(cfg, base if cfg.worker_id else None))
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=(replace(cfg, workers=1), f"{base}-w{i}", os.getpid()), name=f"w{i}")
        for i in range(cfg.workers)
    ]
    for p in procs:
        p.start()

    def forward(sig, _frame) -> None:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(0.5)
            if p.exitcode not in (None, 0) and code == 0:
                code = p.exitcode if p.exitcode > 0 else 1
                forward(signal.SIGTERM, None)  # one failed: stop the rest, let the orchestrator restart
    return code
