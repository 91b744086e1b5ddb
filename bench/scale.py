"""Scale, simulated: many replicas publishing rollouts into one Redis or a Redis Cluster, trainers consuming.

What a fleet puts on the store, without the GPUs: R simulated replicas (asyncio tasks in one producer
process) each finish one job — a GRPO group of G records of T completion tokens with K top-K logprobs
per token, the real record layout (`wire.encode_record`) — every G·T / rate seconds, `rate` being the
tokens/s one replica generates (a Poisson process per replica). Each publishes with the real
`RolloutPublisher` (encode + one MULTI of XADDs per job) into the rollout stream of its partition
(replica r → partition r mod P, as jobs spread over partitions). C trainer processes read with the real
`RolloutQueue` (partitions = P, batch = one group so that the latency is the queue's, not the time to fill
a training batch), record each rollout's publish-to-batch latency (next_batch's return − the record's
`created_at`, stamped just before its publish; one clock, one machine) and ack.

Per configuration (store, P, R), after `--warmup` s the script measures for `--duration` s:
offered and achieved records/s and MB/s (payload bytes, 10⁶ B per MB), p50 / p99 latency, Redis CPU
(`INFO cpu` user + sys deltas of every node, in cores: their sum and the busiest node) and the share of
jobs the producer published more than one interval late (the producer, not the store, was the limit).

    .venv/bin/python bench/scale.py                  # the table in docs/scaling.md (about 4 minutes)
    .venv/bin/python bench/scale.py --quick          # 2 configurations, 6 s each
    .venv/bin/python bench/scale.py --replicas 64,256 --rate 1000 --stores single,cluster --partitions 1,3

The store runs here (LocalRedis, or LocalRedisCluster: 3 masters + 3 replicas, no AOF) on the same 2
shared cores as the producer and the trainers, so the absolute figures are this box's; what carries over
to a real deployment is Redis's CPU per MB moved (docs/scaling.md does that arithmetic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, replace

from common import open_store
from queue_bench import BENCH_RUN, templates  # the queue benchmark's records and their run

NAMESPACE = "scale"
PUBLISHERS = 64  # publishes in flight at once in the producer process


@dataclass(frozen=True)
class Config:
    store: str  # "single" | "cluster"
    partitions: int
    replicas: int
    rate: float  # tokens/s per simulated replica
    tokens: int  # completion tokens per record
    k: int
    group: int
    trainers: int
    warmup: float
    duration: float

    @property
    def job_interval(self) -> float:
        """Seconds between two jobs of one replica."""
        return self.group * self.tokens / self.rate

    @property
    def offered_records(self) -> float:
        return self.replicas * self.rate / self.tokens


# ---- simulated replicas (one producer process) ----------------------------------------------------------


async def _produce(cfg: Config, url: str, ns: str, t0: float, out) -> None:
    from maskroll.proto.redis_conn import open_redis
    from maskroll.proto.streams import StreamKeys
    from maskroll.server.pull.publisher import RolloutPublisher

    r, cluster = await open_redis(url)
    keys = StreamKeys(ns, cfg.partitions, cluster=cluster)
    pubs = [RolloutPublisher(r, part.rollouts, max_len=10**7) for part in keys.parts]
    tpl = templates(cfg.tokens, cfg.k, cfg.group)
    end = t0 + cfg.warmup + cfg.duration
    stats = {"jobs": 0, "late": 0, "publish_s": 0.0}
    # One process stands in for R replicas, each of which would have its own connection: bound the
    # publishes in flight so that a producer that falls behind queues here instead of opening hundreds.
    gate = asyncio.Semaphore(PUBLISHERS)

    async def replica(i: int) -> None:
        rng = random.Random(i)
        pub = pubs[i % cfg.partitions]
        due = t0 + rng.expovariate(1.0 / cfg.job_interval)  # a Poisson process from the start
        while due < end:
            await asyncio.sleep(max(0.0, due - time.time()))
            if time.time() - due > cfg.job_interval:
                stats["late"] += 1
            job = uuid.uuid4().hex
            now = time.time()
            recs = [
                replace(
                    x,
                    job_id=job,
                    group_id=job,
                    request_id=job,
                    rollout_id=f"{job[:30]}{j:02d}",
                    created_at=now,
                )
                for j, x in enumerate(tpl)
            ]
            async with gate:
                t = time.perf_counter()
                await pub.publish(recs)
                stats["publish_s"] += time.perf_counter() - t
            stats["jobs"] += 1
            due += rng.expovariate(1.0 / cfg.job_interval)

    await asyncio.gather(*(replica(i) for i in range(cfg.replicas)))
    await r.aclose()
    out.put(("producer", stats))


def producer(cfg: Config, url: str, ns: str, t0: float, out) -> None:
    try:
        asyncio.run(_produce(cfg, url, ns, t0, out))
    except BaseException:
        out.put(("error", "producer: " + traceback.format_exc()))
        raise


# ---- trainers ---------------------------------------------------------------------------------------


def consumer(cfg: Config, url: str, ns: str, index: int, t0: float, ready, out) -> None:
    try:
        _consume(cfg, url, ns, index, t0, ready, out)
    except BaseException:
        out.put(("error", f"trainer {index}: " + traceback.format_exc()))
        ready.put(index)  # never leave the parent waiting for a trainer that died while connecting
        raise


def _consume(cfg: Config, url: str, ns: str, index: int, t0: float, ready, out) -> None:
    import resource

    from maskroll.client import QueueTimeout, RolloutQueue
    from maskroll.proto import wire

    q = RolloutQueue(
        url,
        ns,
        run="resume",
        partitions=cfg.partitions,
        consumer=f"trainer-{index}",
        batch_size=cfg.group,
        stale_policy="keep",
    ).open()
    ready.put(index)
    start, end = t0 + cfg.warmup, t0 + cfg.warmup + cfg.duration
    lat, records, payload = [], 0, 0
    size = len(wire.encode_record(templates(cfg.tokens, cfg.k, cfg.group)[0]))
    u0 = None
    while (now := time.time()) < end + 5.0:  # drain what was published in the window
        if u0 is None and now >= start:
            u0 = resource.getrusage(resource.RUSAGE_SELF)
        try:
            batch = q.next_batch(timeout=0.5)
        except QueueTimeout:
            if now > end:
                break
            continue
        got = time.time()
        q.ack(batch)
        inside = [r for r in batch if start <= r.created_at < end]
        lat += [got - r.created_at for r in inside]
        records += len(inside)
        payload += size * len(inside)
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (u1.ru_utime + u1.ru_stime) - ((u0.ru_utime + u0.ru_stime) if u0 else 0.0)
    q.close()
    out.put(("consumer", {"latencies": lat, "records": records, "bytes": payload, "cpu_s": cpu}))


# ---- the store --------------------------------------------------------------------------------------


def _nodes(store) -> list[str]:
    return [store.node_url(p) for p in store.ports] if hasattr(store, "ports") else [store.url]


def redis_cpu(urls: list[str]) -> dict[str, float]:
    """used_cpu_user + used_cpu_sys (s) of every node."""
    import redis

    out = {}
    for u in urls:
        c = redis.Redis.from_url(u)
        info = c.info("cpu")
        out[u] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        c.close()
    return out


def full_syncs(store) -> int:
    """Full resynchronisations of a replica node so far (a cluster's master logs "Starting BGSAVE for
    SYNC" for each): a replica that fell behind its output-buffer limit is cut off and copied again —
    a fork and a full transfer on the master, the likeliest cause of a latency spike on a cluster."""
    root = getattr(store, "data_dir", None)
    if root is None or not hasattr(store, "ports"):
        return 0
    total = 0
    for log in root.glob("*/redis.log"):
        total += log.read_text(errors="replace").count("Starting BGSAVE for SYNC")
    return total


def claim_run(url: str, cfg: Config, ns: str) -> None:
    """The run of the queue bench's record templates (bench/queue_bench.py BENCH_RUN) owns `ns` at
    version 0, so the trainers resume it and accept the simulated records."""
    from maskroll.proto.redis_conn import open_redis
    from maskroll.proto.streams import StreamKeys

    async def go():
        r, cluster = await open_redis(url)
        keys = StreamKeys(ns, cfg.partitions, cluster=cluster)
        await r.hset(keys.run, mapping={"run_id": BENCH_RUN, "version": "0", "started_by": "bench/scale.py"})
        await r.aclose()

    asyncio.run(go())


def run_config(cfg: Config, store) -> dict:
    ns = f"{NAMESPACE}-{uuid.uuid4().hex[:6]}"
    claim_run(store.url, cfg, ns)
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Queue()
    # The clock starts 8 s from now: the trainers connect first (they create the consumer groups).
    t0 = time.time() + 8.0
    procs = [
        ctx.Process(target=consumer, args=(cfg, store.url, ns, i, t0, ready, out), daemon=True)
        for i in range(cfg.trainers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    if time.time() > t0 - 0.5:
        raise RuntimeError("trainers took more than 8 s to connect; the machine is too loaded to measure")
    prod = ctx.Process(target=producer, args=(cfg, store.url, ns, t0, out), daemon=True)
    prod.start()
    nodes = _nodes(store)
    syncs0 = full_syncs(store)
    time.sleep(max(0.0, t0 + cfg.warmup - time.time()))
    c0, w0 = redis_cpu(nodes), time.time()
    time.sleep(max(0.0, t0 + cfg.warmup + cfg.duration - time.time()))
    c1, w1 = redis_cpu(nodes), time.time()
    results = [out.get(timeout=120) for _ in range(cfg.trainers + 1)]
    errors = [s for kind, s in results if kind == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    for p in [*procs, prod]:
        p.join(30)
    prod_stats = next(s for kind, s in results if kind == "producer")
    cons = [s for kind, s in results if kind == "consumer"]
    lat = sorted(x for s in cons for x in s["latencies"])
    per_node = {u: (c1[u] - c0[u]) / (w1 - w0) for u in nodes}
    records = sum(s["records"] for s in cons)
    size_bytes = sum(s["bytes"] for s in cons) / max(1, records)
    return {
        **asdict(cfg),
        "offered_records_s": cfg.offered_records,
        "offered_mb_s": cfg.offered_records * size_bytes / 1e6,
        "records_s": records / cfg.duration,
        "mb_s": sum(s["bytes"] for s in cons) / cfg.duration / 1e6,
        "p50_ms": 1000 * lat[len(lat) // 2] if lat else float("nan"),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        "redis_cores": sum(per_node.values()),
        "redis_busiest_core": max(per_node.values()),
        "late_jobs": prod_stats["late"] / max(1, prod_stats["jobs"]),
        "full_syncs": full_syncs(store) - syncs0,
        "trainer_cores": sum(s["cpu_s"] for s in cons) / cfg.duration,
        "record_bytes": size_bytes,
        "load_avg": os.getloadavg()[0],
    }


def table(rows: list[dict]) -> str:
    head = (
        "| store | P | replicas | offered rec/s | rec/s | MB/s | p50 ms | p99 ms | Redis cores (Σ / busiest) "
        "| trainer cores | late jobs | full syncs | load |\n"
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    )
    lines = [
        f"| {r['store']} | {r['partitions']} | {r['replicas']} | {r['offered_records_s']:.0f} | "
        f"{r['records_s']:.0f} | {r['mb_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
        f"{r['redis_cores']:.2f} / {r['redis_busiest_core']:.2f} | {r['trainer_cores']:.2f} | "
        f"{100 * r['late_jobs']:.0f} % | {r['full_syncs']} | {r['load_avg']:.1f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--stores", default="single,cluster", help="single and/or cluster (3 masters + 3 replicas)"
    )
    ap.add_argument("--partitions", default="1,3", help="P per store (a single Redis runs P = 1 only)")
    ap.add_argument("--replicas", default="64,256", help="simulated replicas")
    ap.add_argument("--rate", type=float, default=1000.0, help="tokens/s per simulated replica")
    ap.add_argument("--tokens", type=int, default=1024, help="completion tokens per record")
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--quick", action="store_true", help="single P=1 and cluster P=3 at 64 replicas, 6 s")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    replicas = [int(x) for x in a.replicas.split(",")]
    parts = [int(x) for x in a.partitions.split(",")]
    stores = a.stores.split(",")
    if a.quick:
        replicas, a.duration, a.warmup = [64], 6.0, 2.0
    rows = []
    for kind in stores:
        with open_store(kind) as store:
            for p in [1] if kind == "single" else [x for x in parts if not (a.quick and x == 1)] or [3]:
                for n in replicas:
                    cfg = Config(kind, p, n, a.rate, a.tokens, a.k, a.group, a.trainers, a.warmup, a.duration)
                    print(f"  {kind} P={p} replicas={n} ...", file=sys.stderr, flush=True)
                    rows.append(run_config(cfg, store))
                    print("  " + table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=2) if a.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
