"""The teacher stage's added latency per record (docs/rewards.md "The teacher stage"): from a record's
arrival on the finished stream to its arrival, with the teacher's top-K, on the rollout stream — one
teacher replica (`maskroll serve --engine torch`, the tiny `maskroll init-model` model unless --model),
one stage worker, a private Redis; scoring per record (one Score call each, `--group-wait-s 0`) against
per group (a GRPO group's records in one call, `--group-wait-s` > 0).

Arrival times are the Redis entry ids (the server's clock at XADD, in ms), so neither the feeder nor a
reader adds to them. Each repetition feeds --groups groups of --n records (a 16-token prompt, --tokens
completion tokens each, K = --k), a group's records in one pipeline as a replica publishes a job's, one
group every --interval-s (open loop: at 0.5 s the teacher is idle when a group arrives, so the figure is
the stage's own latency; a shorter interval keeps the teacher busy, and adds its queue). The two modes
alternate repetition by repetition (each in its own namespace: one stage each), so background load hits
both alike. Reported: per-record latency, median [min, max] and p90 over every record of every
repetition (bench/common.py's spread); per group, its first record's arrival on the finished stream to
its last record's on the rollout stream (what a trainer that reads whole groups waits); the Score calls
each mode made (the teacher's own metrics); and, for scale, the teacher alone (no stage): one call of n
completions against n concurrent calls of one, --groups times each. The worker runs in this process
(make_teacher_worker's parts without its start-up vocabulary check: no student replica).

    .venv/bin/python bench/teacher_stage.py                  # G = 20, n = 8, T = 32, K = 20, 3 reps
    .venv/bin/python bench/teacher_stage.py --interval-s 0.1   # the teacher busy
    .venv/bin/python bench/teacher_stage.py --tokens 128 --reps 5 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import common
import numpy as np

MODES = ("per_record", "per_group")


def records(group: str, n: int, tokens: int, vocab: int, seed: int) -> list:
    from maskroll.proto.records import RolloutRecord, Semantics, rollout_id_for

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 16).astype(np.int32)
    out = []
    for i in range(n):
        t = tokens
        out.append(
            RolloutRecord(
                rollout_id=rollout_id_for(group, i),
                request_id=group,
                prompt_ids=prompt,
                completion_ids=rng.integers(0, vocab, t).astype(np.int32),
                sampled_logprobs=np.full(t, -1.0, np.float32),
                sampled_ranks=np.ones(t, np.int32),
                topk_ids=np.zeros((t, 1), np.int32),
                topk_logprobs=np.full((t, 1), -1.0, np.float32),
                finish_reason="length",
                semantics=Semantics(temperature=1.0, logprobs_k=1, engine="torch", model="student"),
                job_id=group,
                group_id=group,
                sample_index=i,
                group_size=n,
                run_id="bench",
                created_at=time.time(),
            )
        )
    return out


def _ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


async def one_rep(url: str, teacher: str, mode: str, rep: int, vocab: int, a: argparse.Namespace) -> dict:
    """One repetition of one mode: the latency in ms of every record, and of every group (its first
    record's arrival on the finished stream to its last record's on the rollout stream)."""
    from maskroll.proto import wire
    from maskroll.proto.redis_conn import open_redis
    from maskroll.proto.scoring import ScoreOptions
    from maskroll.proto.streams import F_RECORD, StreamKeys
    from maskroll.stages.config import TeacherStageConfig
    from maskroll.stages.teacher import TeacherPool, TeacherStep
    from maskroll.stages.teacher_batch import GroupBatcher
    from maskroll.stages.worker import StageWorker

    wait_s = 0.0 if mode == "per_record" else a.group_wait_s
    ns = f"bench-{mode}-{rep}"
    cfg = TeacherStageConfig(
        redis_url=url, namespace=ns, teacher=teacher, teacher_k=a.k, group_wait_s=wait_s, concurrency=a.n
    )
    r, cluster = await open_redis(url)
    keys = StreamKeys(ns, 1, cluster)
    pool = TeacherPool(cfg.teachers, token=None, timeout_s=cfg.timeout_s, retry_s=cfg.retry_s)
    options = ScoreOptions(logprobs_k=a.k)
    batcher = None
    if wait_s > 0:
        batcher = GroupBatcher(
            lambda prompt, completions: pool.score_many(prompt, completions, options),
            wait_s=wait_s,
            max_batch=a.n,
            capacity=cfg.concurrency,
        )
    step = TeacherStep(pool, options, None, batcher)
    worker = StageWorker(r, keys, step, cfg, f"bench-{mode}")
    await worker.start()
    task = asyncio.create_task(worker.run())
    fed: dict[str, int] = {}
    try:
        for g in range(a.groups):
            group = records(f"{ns}-g{g}", a.n, a.tokens, vocab, seed=1000 * (rep + 1) + g)
            pipe = r.pipeline(transaction=False)
            for rec in group:
                pipe.xadd(keys.part(0).finished, {F_RECORD: wire.encode_record(rec)})
            for rec, entry_id in zip(group, await pipe.execute(), strict=True):
                fed[rec.rollout_id] = _ms(entry_id)
            await asyncio.sleep(a.interval_s)
        deadline = time.monotonic() + 120
        while await r.xlen(keys.rollouts) < len(fed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{await r.xlen(keys.rollouts)} of {len(fed)} records published")
            await asyncio.sleep(0.05)
        out = await r.xrange(keys.rollouts)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
        step.close()
        await pool.close()
    latencies, groups = [], {}
    for entry_id, fields in out:
        rec = wire.decode_record(fields[F_RECORD])
        assert rec.has_teacher and rec.teacher_topk_ids.shape == (a.tokens, a.k)
        latencies.append(_ms(entry_id) - fed[rec.rollout_id])
        first, last = groups.get(rec.group_id, (fed[rec.rollout_id], 0))
        groups[rec.group_id] = (min(first, fed[rec.rollout_id]), max(last, _ms(entry_id)))
    await r.delete(keys.part(0).finished, keys.rollouts, keys.part(0).scored)
    await r.aclose()
    return {"latency_ms": latencies, "group_latency_ms": [last - first for first, last in groups.values()]}


async def direct_calls(teacher: str, vocab: int, a: argparse.Namespace, reps: int) -> dict:
    """The teacher alone, no stage: one Score call of n completions against n concurrent calls of one,
    interleaved, --interval-s apart (ms each)."""
    from maskroll.client.rollout_client import RolloutClient
    from maskroll.proto.scoring import ScoreOptions

    rng = np.random.default_rng(7)
    prompt = rng.integers(0, vocab, 16).astype(np.int32)
    completions = [rng.integers(0, vocab, a.tokens).astype(np.int32) for _ in range(a.n)]
    options = ScoreOptions(logprobs_k=a.k)
    one_call, n_calls = [], []
    async with RolloutClient(teacher, timeout=60) as c:
        await c.score(prompt, completions, options)  # warm-up
        for _ in range(reps):
            await asyncio.sleep(a.interval_s)
            t0 = time.perf_counter()
            await c.score(prompt, completions, options)
            one_call.append(1e3 * (time.perf_counter() - t0))
            await asyncio.sleep(a.interval_s)
            t0 = time.perf_counter()
            await asyncio.gather(*(c.score(prompt, [x], options) for x in completions))
            n_calls.append(1e3 * (time.perf_counter() - t0))
    return {"one_call_of_n_ms": common.spread(one_call), "n_calls_of_one_ms": common.spread(n_calls)}


def score_calls(replica) -> float:
    """Score RPCs the replica answered OK (its own Prometheus counter)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{replica.metrics}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "maskroll_requests_total" and sample.labels == {
                "method": "Score",
                "code": "OK",
            }:
                return sample.value
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model(p)
    common.add_reps(p, 3)
    p.add_argument("--groups", type=int, default=20, help="groups fed per repetition and mode (G)")
    p.add_argument(
        "--n", type=int, default=8, help="records per group (GRPO's n; also the worker's concurrency)"
    )
    p.add_argument("--tokens", type=int, default=32, help="completion tokens per record (T)")
    p.add_argument("--k", type=int, default=20, help="K_teacher")
    p.add_argument("--interval-s", type=float, default=0.5, help="seconds between two groups")
    p.add_argument("--group-wait-s", type=float, default=0.05, help="per_group mode's bound on a lone record")
    p.add_argument("--threads", type=int, default=1, help="the teacher replica's torch threads")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from maskroll.local.replica import stop_all

    result: dict = {"machine": common.cpu_model(), "load_1m_start": common.load_1m()}
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="maskroll-bench-teacher-") as tmp, common.open_store() as redis:
        model = common.model_dir(a.model, Path(tmp))
        args = ["--engine", "torch", "--port", "0", "--metrics-port", "0", "--threads", str(a.threads)]
        args += ["--max-logprobs", str(a.k)]
        (teacher,) = common.start_replicas(model, 1, Path(tmp), *args, name="teacher")
        try:
            from maskroll.proto.tokenizer_fingerprint import tokenizer_json_vocab

            vocab = len(tokenizer_json_vocab(model / "tokenizer.json"))
            asyncio.run(one_rep(redis.url, teacher.address, "per_group", -1, vocab, a))  # warm-up
            for rep in range(a.reps):
                for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                    before = score_calls(teacher)
                    run = asyncio.run(one_rep(redis.url, teacher.address, mode, rep, vocab, a))
                    run["calls"] = int(score_calls(teacher) - before)
                    runs[mode].append(run)
            result["direct"] = asyncio.run(direct_calls(teacher.address, vocab, a, a.groups))
        finally:
            stop_all([teacher])
    result["load_1m_end"] = common.load_1m()
    result["shape"] = {
        "groups": a.groups,
        "n": a.n,
        "tokens": a.tokens,
        "K": a.k,
        "prompt": 16,
        "reps": a.reps,
    }
    for mode in MODES:
        lat = [x for run in runs[mode] for x in run["latency_ms"]]
        whole = [x for run in runs[mode] for x in run["group_latency_ms"]]
        result[mode] = {
            "latency_ms": common.spread(lat),
            "p90_ms": statistics.quantiles(lat, n=10)[-1],
            "group_latency_ms": common.spread(whole),
            "records": len(lat),
            "score_calls": [run["calls"] for run in runs[mode]],
        }
    if a.json:
        print(json.dumps(result, indent=2))
        return
    s = result["shape"]
    print(f"{result['machine']}, load {result['load_1m_start']:.1f} -> {result['load_1m_end']:.1f}")
    print(f"G = {s['groups']} groups of n = {s['n']}, T = {s['tokens']}, K = {s['K']}, {s['reps']} reps")
    d = result["direct"]
    print(
        f"the teacher alone: one call of {s['n']}: {common.fmt_spread(d['one_call_of_n_ms'], 0, 'ms')}; "
        f"{s['n']} concurrent calls of one: {common.fmt_spread(d['n_calls_of_one_ms'], 0, 'ms')}"
    )
    for mode in MODES:
        m = result[mode]
        print(
            f"{mode:>10}: record {common.fmt_spread(m['latency_ms'], 0, 'ms')} (p90 {m['p90_ms']:.0f} ms), "
            f"whole group {common.fmt_spread(m['group_latency_ms'], 0, 'ms')}, over {m['records']} records; "
            f"Score calls per rep {m['score_calls']}"
        )


if __name__ == "__main__":
    main()
