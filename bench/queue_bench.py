"""Throughput of the Redis rollout queue against raw redis-py on the same bytes.

For each completion length T (1024 and 8192 tokens, K = 20 top-K logprobs per token) records are built
like real ones (int32 ids, float32 logprobs, [T, K] top-K arrays, a 256-token prompt) in groups of
G = 8 per job, and N records go end to end through a private redis-server (LocalRedis, no AOF):

    maskroll     RolloutPublisher.publish(one job's records) → RolloutQueue.next_batch(64) → ack.
                 publish encodes (wire.record_pieces: the header, then views of the record's arrays,
                 sent unjoined) and XADDs the group in one MULTI (with an XLEN that tells the next
                 publish whether it must check the bound first); next_batch reads
                 (XREADGROUP COUNT 128), decodes (wire.decode_record), checks every record (problems(),
                 run, version) and the `done` markers (ZMSCORE) and buffers whole groups; ack is XACK +
                 XDEL + ZADD done (+ ZREMRANGEBYSCORE of old ones) in one MULTI.
    raw          XADD of the same bytes, pre-encoded, one MULTI per group (the publisher's pipelining)
                 → XREADGROUP COUNT 64 → XACK + XDEL in one MULTI (XDEL too, as the queue does, so the
                 stream stays as short in both), no decoding. Plain redis-py, no retry wrapper.
    raw+decode   raw, plus wire.decode_record of every payload on the consumer side.
    raw+codec    raw+decode, plus wire.encode_record of every record on the producer side (from the
                 same RolloutRecord objects the maskroll producer publishes), so maskroll vs raw+codec
                 is the queue's protocol overhead alone, raw+decode vs raw the protobuf decode cost and
                 raw+codec vs raw+decode the encode cost.

Producer and consumer are two processes (multiprocessing, spawn), started and connected before the
clock starts: a replica publishes from its own process and the trainer reads in another, and in one
process the two sides would share one GIL, so the time would be the sum of both sides' CPU rather than
that of the slower one. The maskroll producer is asyncio (as in a replica); both consumers are
synchronous (RolloutQueue is the trainer-facing facade, with its private event-loop thread; raw uses
the synchronous redis.Redis, or redis.asyncio with --raw-client async). The raw producer uses
redis.asyncio like the publisher.

Flow control is the same for all modes: the producer stays at most `window` records (≈ 256 MB of
payload, at least four batches) ahead of the consumer's acks, read from a shared counter (polled every
2 ms while full), so Redis memory stays bounded. The publisher has `maskroll serve`'s default bound
(max_len 100 000 records, or twice the window if larger), so it never waits (`backpressure` in
--json; expect 0) and, the backlog being under half of it, skips the XLEN check before each publish as
a replica does.
A producer that never waits on the window is the bottleneck; one that waits is ahead of its consumer.

Time: from the start signal to the consumer's last ack. records/s = N / time; MB/s = payload bytes
(Σ len(encode_record(rec)), 10⁶ bytes per MB) / time. Reported: the median of `--reps` runs; the modes
run interleaved within each repetition (order rotated), and the ratios are medians of per-repetition
ratios of back-to-back runs, so drifting background load hits both sides alike. Also per record: CPU
time (user + sys) of the producer, of the consumer (whole process: the queue's loop thread included)
and of redis-server (INFO cpu), and minor page faults of producer and consumer. On a shared machine the
CPU figures move much less than wall time; where the three processes share the same cores, records/s
is about inversely proportional to their sum, hence the second (CPU) ratio. `others` is the CPU the rest
of the machine used during the run (/proc/stat busy time minus the three processes'), in cores.

--malloc-tuned runs producer and consumer with glibc's malloc thresholds fixed (MALLOC_TUNED below).
It mattered while encode_record built each payload through protobuf's intermediate copies: glibc then
returned the freed buffers to the kernel after every publish and the next one page-faulted them back in
(≈ 96 faults per 177 kB record); encode_record now writes each payload with one allocation and the
producer takes ~0 faults either way. --breakdown measures each side alone instead, step by step, plus the
queue's per-record bookkeeping commands and cheaper alternatives.

    .venv/bin/python bench/queue_bench.py                  # T = 1024 (12288 records), 8192 (1024), 3 reps
    .venv/bin/python bench/queue_bench.py --malloc-tuned   # the same with MALLOC_TUNED in the workers
    .venv/bin/python bench/queue_bench.py --breakdown      # one side at a time, CPU per step and command
    .venv/bin/python bench/queue_bench.py --quick          # 1/8 of the records, 1 rep
    .venv/bin/python bench/queue_bench.py --tokens 1024 --reps 5 --json
    .venv/bin/python bench/queue_bench.py --profile /tmp/qprof   # cProfile (CPU time) each worker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
import uuid

import common

TARGET_RATIO = 0.8  # records/s through maskroll over raw redis-py (issue 14)
SERVE_MAX_LEN = 100_000  # `maskroll serve --rollout-stream-max-len` default (ServerConfig)
MODES = ("maskroll", "raw", "raw+decode", "raw+codec")
DECODING = ("raw+decode", "raw+codec")  # raw consumers that decode_record every payload
GROUP = 8  # records per job (GRPO group)
BATCH = 64  # RolloutQueue.next_batch(batch_size) and raw XREADGROUP COUNT
PROMPT_TOKENS = 256
VOCAB = 151936
WINDOW_BYTES = 256 * 10**6
# ≥ 5 s per run even on a quiet 2-vCPU machine (raw at T = 1024 reaches ~2200 records/s there)
DEFAULT_RECORDS = {1024: 12288, 8192: 1024}
BREAKDOWN_RECORDS = {1024: 1024, 8192: 128}  # ≈ 180 MB of payload in Redis at once
# glibc malloc with fixed thresholds: no heap trimming and no mmap for blocks below 32 MiB, so freed
# payload buffers are reused instead of being returned to the kernel and page-faulted back in.
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


# ---- records ----------------------------------------------------------------------------------------


# Every namespace the bench makes belongs to this run (claim_run), and every record it publishes carries
# it at policy version 0: the trainer queue refuses records of another run or from a future version.
BENCH_RUN = "bench-run"


def claim_run(admin, ns: str) -> None:
    """Record BENCH_RUN as `ns`'s run (sync client), so consumers open it with run="resume"."""
    from maskroll.proto.streams import StreamKeys

    admin.hset(StreamKeys(ns).run, mapping={"run_id": BENCH_RUN, "version": "0", "started_by": "bench"})


def templates(tokens: int, k: int, group: int, seed: int = 0) -> list:
    """One job's records with distinct arrays per sample; ids are replaced per job."""
    import numpy as np

    from maskroll.proto.records import RolloutRecord, Semantics

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32)
    out = []
    for i in range(group):
        topk_lp = np.sort(np.log(rng.random((tokens, k), dtype=np.float32) + 1e-6), axis=1)[:, ::-1]
        out.append(
            RolloutRecord(
                rollout_id="0" * 32,
                request_id="0" * 32,
                prompt_ids=prompt,
                completion_ids=rng.integers(0, VOCAB, tokens, dtype=np.int32),
                sampled_logprobs=topk_lp[:, 0].copy(),
                sampled_ranks=np.ones(tokens, np.int32),
                topk_ids=rng.integers(0, VOCAB, (tokens, k), dtype=np.int32),
                topk_logprobs=np.ascontiguousarray(topk_lp),
                finish_reason="length",
                semantics=Semantics(temperature=1.0, logprobs_k=k, engine="bench", model="bench-model"),
                policy_version_first=0,
                policy_version_last=0,
                run_id=BENCH_RUN,
                job_id="0" * 32,
                group_id="0" * 32,
                sample_index=i,
                replica_id="bench-replica",
                created_at=1.7e9,
                group_size=group,
            )
        )
    return out


def job_records(tpl: list, job_id: str) -> list:
    from dataclasses import replace

    from maskroll.proto.records import rollout_id_for

    return [
        replace(r, rollout_id=rollout_id_for(job_id, i), request_id=job_id, job_id=job_id, group_id=job_id)
        for i, r in enumerate(tpl)
    ]


def payload_bytes(tpl: list) -> list[int]:
    """len(encode_record) per sample index, with ids of the real length (all ids are 32 hex chars)."""
    from maskroll.proto import wire

    return [len(wire.encode_record(r)) for r in job_records(tpl, uuid.uuid4().hex)]


def encoded_pool(tpl: list) -> list[list[bytes]]:
    """Four distinct jobs, encoded before the clock starts, that the raw producers cycle through (the raw
    consumers never look at ids)."""
    from maskroll.proto import wire

    return [[wire.encode_record(x) for x in job_records(tpl, uuid.uuid4().hex)] for _ in range(4)]


# ---- workers (child processes) ----------------------------------------------------------------------


def _usage() -> resource.struct_rusage:
    return resource.getrusage(resource.RUSAGE_SELF)


def _delta(u0: resource.struct_rusage, u1: resource.struct_rusage) -> dict:
    """CPU seconds (user + sys; all threads), sys seconds and minor page faults between u0 and u1."""
    return {
        "cpu_s": (u1.ru_utime + u1.ru_stime) - (u0.ru_utime + u0.ru_stime),
        "sys_s": u1.ru_stime - u0.ru_stime,
        "minflt": u1.ru_minflt - u0.ru_minflt,
    }


def _profiled(fn, path: str | None):
    if not path:
        return fn()
    import cProfile

    prof = cProfile.Profile(time.process_time)  # CPU time: waits on Redis do not count
    try:
        return prof.runcall(fn)
    finally:
        prof.dump_stats(path)


def _report(results, role: str, fn, cfg: dict) -> None:
    try:
        results.put((role, _profiled(fn, cfg["profile"] and f"{cfg['profile']}.{role}.prof")))
    except BaseException as e:
        results.put((role, {"error": f"{type(e).__name__}: {e}"}))
        raise


def job_sender(mode: str, url: str, stream: str, tpl: list, pool: list, max_len: int, jobs: int) -> tuple:
    """`mode`'s producer side, chosen once: (redis.asyncio client, publisher or None, send), where the
    coroutine `send(j)` (0 <= j < jobs) puts job j's GROUP records into `stream`:

        maskroll     RolloutPublisher.publish of fresh records (new ids per job)
        raw          one MULTI of XADDs of pool[j % len(pool)], pre-encoded (raw+decode sends the same)
        raw+codec    one MULTI of XADDs of fresh records, encode_record'd here

    The fresh records of all `jobs` jobs are built here, before any clock starts: building them is the
    replica's work (its generation pipeline makes each record once), not the queue's, and the raw modes
    send pre-made bytes. (Until 2026-12-02 each job's records were built inside the timed loop, ~20 µs a
    record of dataclasses.replace on the maskroll side only.) The timed producer and --breakdown's
    producer steps both send through it."""
    fresh = [] if mode in ("raw", "raw+decode") else [job_records(tpl, uuid.uuid4().hex) for _ in range(jobs)]
    if mode in ("maskroll", "maskroll-joined"):
        from maskroll.proto.redis_conn import connect
        from maskroll.server.pull.publisher import RolloutPublisher

        r = connect(url)  # as `maskroll serve` builds the publisher's client
        pub = RolloutPublisher(r, stream, max_len=max_len)
        # --breakdown's "maskroll-joined": the same publisher and client, each record joined into one
        # payload first (what a client that cannot send pieces gets)
        pub._pieces = mode == "maskroll"

        async def publish(j: int) -> None:
            await pub.publish(fresh[j])

        return r, pub, publish

    import redis.asyncio as aioredis

    from maskroll.proto import wire
    from maskroll.proto.streams import F_RECORD

    r = aioredis.Redis.from_url(url)

    async def xadd(payloads: list[bytes]) -> None:  # one MULTI per job: the publisher's pipelining
        pipe = r.pipeline(transaction=True)
        for data in payloads:
            pipe.xadd(stream, {F_RECORD: data})
        await pipe.execute()

    async def raw(j: int) -> None:
        await xadd(pool[j % len(pool)])

    held: list[bytes] = []

    async def raw_codec(j: int) -> None:
        # The previous job's payloads stay alive until this job's are encoded, as in a loop that holds
        # its last batch: glibc then never trims the heap between jobs, unlike after each publish. The
        # raw+codec figures in docs/benchmarks.md ("Checks") were measured that way.
        nonlocal held
        held = [wire.encode_record(x) for x in fresh[j]]
        await xadd(held)

    return r, None, raw_codec if mode == "raw+codec" else raw


def producer(cfg: dict, ready, go, acked, results) -> None:
    from maskroll.proto.streams import StreamKeys

    mode, stream = cfg["mode"], StreamKeys(cfg["namespace"]).rollouts
    tpl = templates(cfg["tokens"], cfg["k"], GROUP)
    jobs, window = cfg["records"] // GROUP, cfg["window"]
    pool = [] if mode == "maskroll" else encoded_pool(tpl)

    async def run() -> dict:
        bound = max(SERVE_MAX_LEN, 2 * (window + 4 * BATCH))
        r, pub, send = job_sender(mode, cfg["url"], stream, tpl, pool, max_len=bound, jobs=jobs)
        await r.ping()
        ready.put("producer")
        go.wait()
        waited = 0.0
        t0, u0 = time.monotonic(), _usage()
        for j in range(jobs):
            if j * GROUP - acked.value >= window:
                w = time.monotonic()
                while j * GROUP - acked.value >= window:
                    await asyncio.sleep(0.002)
                waited += time.monotonic() - w
            await send(j)
        t1, u1 = time.monotonic(), _usage()
        out = {"start": t0, "end": t1, "window_wait_s": waited, **_delta(u0, u1)}
        if pub is not None:
            out["backpressure"] = pub.metrics.backpressure._value.get()
        await r.aclose()
        return out

    _report(results, "producer", lambda: asyncio.run(run()), cfg)


def entry_ids(entries: list, decode: bool) -> list:
    """The ids of one XREADGROUP reply's entries; with `decode`, every payload is decode_record'd first."""
    ids = [entry_id for entry_id, _ in entries]
    if decode:
        from maskroll.proto import wire
        from maskroll.proto.streams import F_RECORD

        recs = [wire.decode_record(fields[F_RECORD]) for _, fields in entries]
        assert len(recs) == len(ids)
    return ids


def ack_delete(r, stream: str, group: str, ids: list):
    """XACK + XDEL in one MULTI (XDEL too, as the queue does, so the stream stays as short in every
    mode). Returns pipe.execute(): the replies, or a coroutine for a redis.asyncio client."""
    pipe = r.pipeline(transaction=True)
    pipe.xack(stream, group, *ids)
    pipe.xdel(stream, *ids)
    return pipe.execute()


def consume_maskroll(cfg: dict, ready, go, acked) -> dict:
    """RolloutQueue.next_batch(64) → ack: the trainer-facing facade."""
    from maskroll.client.queue import RolloutQueue

    with RolloutQueue(cfg["url"], cfg["namespace"], consumer="bench", batch_size=BATCH, run="resume") as q:
        ready.put("consumer")
        go.wait()
        t0, u0, n = time.monotonic(), _usage(), 0
        while n < cfg["records"]:
            batch = q.next_batch(BATCH, timeout=120)
            q.ack(batch)
            n += len(batch)
            acked.value = n
        t1, u1 = time.monotonic(), _usage()
        return {"start": t0, "end": t1, "records": n, "duplicates": q.stats.duplicates, **_delta(u0, u1)}


def create_group(r, stream: str) -> None:
    """The trainer group on `stream` (made with the stream), unless it exists: sync client."""
    import redis

    from maskroll.proto.streams import TRAINER_GROUP

    try:
        r.xgroup_create(stream, TRAINER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def consume_raw(cfg: dict, ready, go, acked) -> dict:
    """Synchronous redis.Redis: XREADGROUP COUNT 64 → (decode) → XACK + XDEL."""
    import redis

    from maskroll.proto.streams import TRAINER_GROUP, StreamKeys

    stream, decode = StreamKeys(cfg["namespace"]).rollouts, cfg["mode"] in DECODING
    r = redis.Redis.from_url(cfg["url"])
    create_group(r, stream)
    ready.put("consumer")
    go.wait()
    t0, u0, n = time.monotonic(), _usage(), 0
    while n < cfg["records"]:
        resp = r.xreadgroup(TRAINER_GROUP, "bench", {stream: ">"}, count=BATCH, block=1000)
        if not resp:
            continue
        ids = entry_ids(resp[0][1], decode)
        ack_delete(r, stream, TRAINER_GROUP, ids)
        n += len(ids)
        acked.value = n
    t1, u1 = time.monotonic(), _usage()
    r.close()
    return {"start": t0, "end": t1, "records": n, **_delta(u0, u1)}


async def consume_raw_async(cfg: dict, ready, go, acked) -> dict:
    """consume_raw on redis.asyncio (--raw-client async): the same loop, awaited."""
    import redis
    import redis.asyncio as aioredis

    from maskroll.proto.streams import TRAINER_GROUP, StreamKeys

    stream, decode = StreamKeys(cfg["namespace"]).rollouts, cfg["mode"] in DECODING
    with redis.Redis.from_url(cfg["url"]) as setup:  # before the clock: the client type does not matter
        create_group(setup, stream)
    r = aioredis.Redis.from_url(cfg["url"])
    ready.put("consumer")
    go.wait()
    t0, u0, n = time.monotonic(), _usage(), 0
    while n < cfg["records"]:
        resp = await r.xreadgroup(TRAINER_GROUP, "bench", {stream: ">"}, count=BATCH, block=1000)
        if not resp:
            continue
        ids = entry_ids(resp[0][1], decode)
        await ack_delete(r, stream, TRAINER_GROUP, ids)
        n += len(ids)
        acked.value = n
    t1, u1 = time.monotonic(), _usage()
    await r.aclose()
    return {"start": t0, "end": t1, "records": n, **_delta(u0, u1)}


def consumer(cfg: dict, ready, go, acked, results) -> None:
    def run() -> dict:
        if cfg["mode"] == "maskroll":
            return consume_maskroll(cfg, ready, go, acked)
        if cfg["raw_client"] == "async":
            return asyncio.run(consume_raw_async(cfg, ready, go, acked))
        return consume_raw(cfg, ready, go, acked)

    _report(results, "consumer", run, cfg)


# ---- parent ---------------------------------------------------------------------------------------


def redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz


def run_once(url: str, mode: str, tokens: int, records: int, window: int, args) -> dict:
    import redis

    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    acked = ctx.RawValue("q", 0)
    admin = redis.Redis.from_url(url)
    admin.flushall()  # our private server: nothing else lives there
    cfg = {
        "url": url,
        "namespace": f"bench-{uuid.uuid4().hex[:8]}",
        "mode": mode,
        "tokens": tokens,
        "k": args.topk,
        "records": records,
        "window": window,
        "raw_client": args.raw_client,
        "profile": args.profile and os.path.join(args.profile, f"{mode}-T{tokens}-{uuid.uuid4().hex[:6]}"),
    }
    claim_run(admin, cfg["namespace"])
    procs = [
        ctx.Process(target=role, args=(cfg, ready, go, acked, results), daemon=True)
        for role in (consumer, producer)
    ]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        for _ in procs:
            ready.get(timeout=180)
        rcpu0, (busy0, steal0), w0 = redis_cpu(admin), machine_cpu(), time.monotonic()
        go.set()
        for _ in procs:
            role, res = results.get(timeout=900)
            out[role] = res
        rcpu1, (busy1, steal1), w1 = redis_cpu(admin), machine_cpu(), time.monotonic()
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:  # only the two workers started above
            if p.is_alive():
                p.terminate()
                p.join(5)
        admin.flushall()
        admin.close()
    errors = [f"{role}: {res['error']}" for role, res in out.items() if "error" in res]
    if errors:
        raise RuntimeError(f"{mode} T={tokens}: " + "; ".join(errors))
    prod, cons = out["producer"], out["consumer"]
    ours = prod["cpu_s"] + cons["cpu_s"] + (rcpu1 - rcpu0)
    return {
        "mode": mode,
        "tokens": tokens,
        "records": cons["records"],
        "seconds": cons["end"] - prod["start"],
        "producer_seconds": prod["end"] - prod["start"],
        "producer_window_wait_s": prod["window_wait_s"],
        "producer_cpu_s": prod["cpu_s"],
        "consumer_cpu_s": cons["cpu_s"],
        "redis_cpu_s": rcpu1 - rcpu0,
        "producer_sys_s": prod["sys_s"],
        "consumer_sys_s": cons["sys_s"],
        "producer_minflt": prod["minflt"],
        "consumer_minflt": cons["minflt"],
        # CPU the rest of the machine used meanwhile (cores, averaged over the run), and VM steal
        "others_cores": max(0.0, (busy1 - busy0) - ours) / (w1 - w0),
        "steal_cores": (steal1 - steal0) / (w1 - w0),
        "backpressure": prod.get("backpressure", 0),
        "duplicates": cons.get("duplicates", 0),
    }


def summarise(runs: list[dict], sizes: dict[int, float]) -> list[dict]:
    rows = []
    med = statistics.median
    for tokens in sorted({r["tokens"] for r in runs}):
        by_mode = {m: [r for r in runs if r["tokens"] == tokens and r["mode"] == m] for m in MODES}
        mask = by_mode["maskroll"]
        for mode in MODES:
            rs = by_mode[mode]
            if not rs:
                continue
            n = rs[0]["records"]
            rates = common.spread(r["records"] / r["seconds"] for r in rs)
            rate = rates["median"]

            def per_rec(key: str, scale: float = 1e6, rs=rs, n=n) -> float:
                return med(r[key] / n * scale for r in rs)

            row = {
                "tokens": tokens,
                "mode": mode,
                "records": n,
                "payload_bytes": sizes[tokens],
                "seconds": med(r["seconds"] for r in rs),
                "records_per_s": rate,
                "records_per_s_range": rates,
                "mb_per_s": rate * sizes[tokens] / 1e6,
                "producer_cpu_us": per_rec("producer_cpu_s"),
                "consumer_cpu_us": per_rec("consumer_cpu_s"),
                "redis_cpu_us": per_rec("redis_cpu_s"),
                "total_cpu_us": med(_total(r) / n * 1e6 for r in rs),
                "producer_sys_us": per_rec("producer_sys_s"),
                "consumer_sys_us": per_rec("consumer_sys_s"),
                "producer_faults": per_rec("producer_minflt", 1.0),
                "consumer_faults": per_rec("consumer_minflt", 1.0),
                "producer_window_wait_s": med(r["producer_window_wait_s"] for r in rs),
                "others_cores": med(r["others_cores"] for r in rs),
                "steal_cores": med(r["steal_cores"] for r in rs),
                "backpressure": max(r["backpressure"] for r in rs),
                "reps": len(rs),
            }
            if mode != "maskroll" and mask:
                # paired: repetition i of maskroll against repetition i of this mode (same N, back to back)
                pairs = list(zip(mask, rs, strict=False))
                ratios = common.spread(b["seconds"] / m["seconds"] for m, b in pairs)
                row["maskroll_over_this"] = ratios["median"]
                row["maskroll_over_this_range"] = ratios  # median [min, max] of the per-repetition ratios
                row["maskroll_over_this_cpu"] = med(_total(b) / _total(m) for m, b in pairs)
            rows.append(row)
    return rows


def _total(run: dict) -> float:
    return run["producer_cpu_s"] + run["consumer_cpu_s"] + run["redis_cpu_s"]


def table(rows: list[dict]) -> str:
    head = (
        f"{'T':>5} {'mode':<10} {'N':>5} {'KB/rec':>7} {'s':>6} {'rec/s':>6} {'MB/s':>5} {'mr/this':>7} "
        f"{'prod':>5} {'cons':>5} {'redis':>5} {'Σ µs':>5} {'mr/this':>7} {'faults p/c':>10} {'others':>6}"
    )
    over = f"{'':>5} {'':<10} {'':>5} {'':>7} {'':>6} {'':>6} {'':>5} {'wall':>7} "
    over += f"{'— CPU µs per record —':^23} {'CPU':>7} {'per rec':>10} {'cores':>6}"
    lines = [head, over, "-" * len(head)]
    for r in rows:
        wall = f"{r['maskroll_over_this']:.2f}" if "maskroll_over_this" in r else "—"
        cpu = f"{r['maskroll_over_this_cpu']:.2f}" if "maskroll_over_this_cpu" in r else "—"
        faults = f"{r['producer_faults']:.0f}/{r['consumer_faults']:.0f}"
        lines.append(
            f"{r['tokens']:>5} {r['mode']:<10} {r['records']:>5} {r['payload_bytes'] / 1e3:>7.1f} "
            f"{r['seconds']:>6.2f} {r['records_per_s']:>6.0f} {r['mb_per_s']:>5.0f} {wall:>7} "
            f"{r['producer_cpu_us']:>5.0f} {r['consumer_cpu_us']:>5.0f} {r['redis_cpu_us']:>5.0f} "
            f"{r['total_cpu_us']:>5.0f} {cpu:>7} {faults:>10} {r['others_cores']:>6.2f}"
        )
    lines += [
        "mr/this wall: maskroll's records/s over this mode's. mr/this CPU: this mode's producer + consumer",
        "+ redis-server CPU per record over maskroll's (both medians of per-repetition ratios).",
        "faults p/c: minor page faults per record, producer / consumer. others: cores the rest of the",
        "machine kept busy meanwhile.",
    ]
    return "\n".join(lines)


def verdict(rows: list[dict]) -> list[str]:
    out = []
    for tokens in sorted({r["tokens"] for r in rows}):
        these = {r["mode"]: r for r in rows if r["tokens"] == tokens and "maskroll_over_this" in r}
        if "raw" not in these:
            continue
        raw = these.pop("raw")
        ok = raw["maskroll_over_this"] >= TARGET_RATIO
        mine = next(r for r in rows if r["tokens"] == tokens and r["mode"] == "maskroll")
        parts = [
            f"T={tokens}: maskroll {common.fmt_spread(mine['records_per_s_range'], 0)} records/s, raw "
            f"{common.fmt_spread(raw['records_per_s_range'], 0)}; "
            f"maskroll/raw = {common.fmt_spread(raw['maskroll_over_this_range'], 2)} records/s "
            f"({'meets' if ok else 'misses'} the ≥ {TARGET_RATIO} target; CPU ratio "
            f"{raw['maskroll_over_this_cpu']:.2f})"
        ]
        parts += [
            f"maskroll/{m} = {common.fmt_spread(r['maskroll_over_this_range'], 2)} "
            f"(CPU {r['maskroll_over_this_cpu']:.2f})"
            for m, r in these.items()
        ]
        out.append("; ".join(parts))
    return out


# ---- breakdown: one side at a time, sequentially, CPU time per record ------------------------------


def breakdown_child(url: str, tokens: int, k: int, n: int, results) -> None:
    """Each step alone in this process against a quiet Redis: this process's CPU (all threads) and
    redis-server's, per record; the best of three passes. Producer steps publish n records into an
    empty stream (deleted between passes); consumer steps drain a stream pre-filled with n records of
    distinct rollout ids (filling is not timed)."""
    import redis

    tpl = templates(tokens, k, GROUP)
    pool = encoded_pool(tpl)
    admin = redis.Redis.from_url(url)
    out: dict[str, dict] = {}
    for name, mode in (
        ("produce: XADD pre-encoded (raw)", "raw"),
        ("produce: encode_record + XADD (raw+codec)", "raw+codec"),
        ("produce: RolloutPublisher.publish (maskroll)", "maskroll"),
        ("produce: publish, each record joined first", "maskroll-joined"),
    ):
        out[name] = best_of_3(
            admin,
            n,
            lambda m=mode: producer_alone(url, m, tpl, pool, n),  # its records built here, untimed
            lambda sender: asyncio.run(produce_alone(sender, n)),
        )
    for name, step in (
        ("consume: sync XREADGROUP + XACK/XDEL (raw)", lambda ns: drain_raw(url, ns, n, False)),
        ("consume: + decode_record (raw+decode)", lambda ns: drain_raw(url, ns, n, True)),
        (
            "consume: asyncio XREADGROUP + XACK/XDEL",
            lambda ns: asyncio.run(drain_raw_async(url, ns, n, False)),
        ),
        ("consume: asyncio + decode_record", lambda ns: asyncio.run(drain_raw_async(url, ns, n, True))),
        (
            "consume: AsyncRolloutQueue next_batch + ack",
            lambda ns: asyncio.run(drain_async_queue(url, ns, n)),
        ),
        ("consume: RolloutQueue next_batch + ack (maskroll)", lambda ns: drain_queue(url, ns, n)),
    ):
        out[name] = best_of_3(admin, n, lambda: fill(admin, tpl, n), step)
    admin.flushall()
    out.update(asyncio.run(bookkeeping_commands(url, admin)))
    admin.flushall()
    admin.close()
    results.put(out)


def best_of_3(admin, n: int, setup, step) -> dict:
    """CPU µs per record of step(setup()) — this process's and redis-server's — against an emptied Redis;
    the pass with the least of both together, of three."""
    best = None
    for _ in range(3):
        admin.flushall()
        arg = setup()
        c0, r0 = time.process_time(), redis_cpu(admin)
        step(arg)
        c1, r1 = time.process_time(), redis_cpu(admin)
        res = {"cpu_us": (c1 - c0) / n * 1e6, "redis_us": (r1 - r0) / n * 1e6}
        if best is None or res["cpu_us"] + res["redis_us"] < best["cpu_us"] + best["redis_us"]:
            best = res
    return best


def producer_alone(url: str, mode: str, tpl: list, pool: list, n: int) -> tuple:
    """`mode`'s sender (job_sender, its n records built) into a fresh stream, with no consumer and no
    window."""
    from maskroll.proto.streams import StreamKeys

    stream = StreamKeys(f"b{uuid.uuid4().hex[:6]}").rollouts
    return job_sender(mode, url, stream, tpl, pool, max_len=10**9, jobs=n // GROUP)


async def produce_alone(sender: tuple, n: int) -> None:
    """n records into the sender's stream (producer_alone), as `mode`'s producer sends them."""
    r, _, send = sender
    await r.ping()
    for j in range(n // GROUP):
        await send(j)
    await r.aclose()


def fill(admin, tpl: list, n: int) -> str:
    """A fresh namespace whose stream (with the trainer group) holds n encoded records; returns it."""
    from maskroll.proto import wire
    from maskroll.proto.streams import F_RECORD, TRAINER_GROUP, StreamKeys

    ns = f"b{uuid.uuid4().hex[:6]}"
    keys = StreamKeys(ns)
    claim_run(admin, ns)
    admin.xgroup_create(keys.rollouts, TRAINER_GROUP, id="0", mkstream=True)
    for _ in range(n // GROUP):
        pipe = admin.pipeline(transaction=False)
        for x in job_records(tpl, uuid.uuid4().hex):
            pipe.xadd(keys.rollouts, {F_RECORD: wire.encode_record(x)})
        pipe.execute()
    return ns


def drain_raw(url: str, ns: str, n: int, decode: bool) -> None:
    import redis

    from maskroll.proto.streams import TRAINER_GROUP, StreamKeys

    stream, r, got = StreamKeys(ns).rollouts, redis.Redis.from_url(url), 0
    while got < n:
        ids = entry_ids(r.xreadgroup(TRAINER_GROUP, "b", {stream: ">"}, count=BATCH)[0][1], decode)
        ack_delete(r, stream, TRAINER_GROUP, ids)
        got += len(ids)
    r.close()


async def drain_raw_async(url: str, ns: str, n: int, decode: bool) -> None:
    import redis.asyncio as aioredis

    from maskroll.proto.streams import TRAINER_GROUP, StreamKeys

    stream, r, got = StreamKeys(ns).rollouts, aioredis.Redis.from_url(url), 0
    while got < n:
        entries = (await r.xreadgroup(TRAINER_GROUP, "b", {stream: ">"}, count=BATCH))[0][1]
        ids = entry_ids(entries, decode)
        await ack_delete(r, stream, TRAINER_GROUP, ids)
        got += len(ids)
    await r.aclose()


async def drain_async_queue(url: str, ns: str, n: int) -> None:
    from maskroll.client.queue import AsyncRolloutQueue

    async with AsyncRolloutQueue(url, ns, consumer="b", batch_size=BATCH, run="resume") as q:
        got = 0
        while got < n:
            batch = await q.next_batch(BATCH, timeout=60)
            await q.ack(batch)
            got += len(batch)


def drain_queue(url: str, ns: str, n: int) -> None:
    from maskroll.client.queue import RolloutQueue

    with RolloutQueue(url, ns, consumer="b", batch_size=BATCH, run="resume") as q:
        got = 0
        while got < n:
            batch = q.next_batch(BATCH, timeout=60)
            q.ack(batch)
            got += len(batch)


async def bookkeeping_commands(url: str, admin) -> dict[str, dict]:
    """Per-record bookkeeping commands alone (64 records per call, 50 calls, best of 3) and alternatives.
    These are the per-record `done` keys the queue used before its sorted set; kept for comparison."""
    import redis.asyncio as aioredis

    from maskroll.proto.streams import TRAINER_GROUP

    r = aioredis.Redis.from_url(url)
    keys = [f"maskroll:b:done:{uuid.uuid4().hex}" for _ in range(BATCH)]
    ids = [f"{i}-0" for i in range(1, BATCH + 1)]
    mark = r.register_script("for _, k in ipairs(KEYS) do redis.call('SET', k, 1, 'PX', ARGV[1]) end")
    await mark(keys=keys, args=[1000])

    async def exists() -> None:  # AsyncRolloutQueue._ingest
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        await pipe.execute()

    async def ack(sets: str) -> None:  # AsyncRolloutQueue.ack
        pipe = r.pipeline(transaction=True)
        pipe.xack("s", TRAINER_GROUP, *ids)
        pipe.xdel("s", *ids)
        if sets == "set":
            for k in keys:
                pipe.set(k, 1, px=604_800_000)
        elif sets == "lua":
            await mark(keys=keys, args=[604_800_000], client=pipe)
        await pipe.execute()

    out = {}
    for name, fn in (
        ("dedupe: 64 EXISTS, one pipeline (queue)", exists),
        ("dedupe: one MGET of the 64 done keys", lambda: r.mget(keys)),
        ("ack: MULTI XACK + XDEL", lambda: ack("")),
        ("ack: MULTI XACK + XDEL + 64 SET PX (queue)", lambda: ack("set")),
        ("ack: MULTI XACK + XDEL + EVALSHA(64 SET PX)", lambda: ack("lua")),
    ):
        best = None
        for _ in range(3):
            c0, r0 = time.process_time(), redis_cpu(admin)
            for _ in range(50):
                await fn()
            c1, r1 = time.process_time(), redis_cpu(admin)
            res = {"cpu_us": (c1 - c0) / (50 * BATCH) * 1e6, "redis_us": (r1 - r0) / (50 * BATCH) * 1e6}
            if best is None or res["cpu_us"] < best["cpu_us"]:
                best = res
        out[name] = best
    await r.aclose()
    return out


def breakdown(url: str, tokens: int, k: int, n: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=breakdown_child, args=(url, tokens, k, n, results), daemon=True)
    p.start()
    try:
        return results.get(timeout=900)
    finally:
        p.join(30)
        if p.is_alive():  # only the child started above
            p.terminate()
            p.join(5)


def breakdown_table(tokens: int, steps: dict) -> str:
    lines = [
        f"T={tokens}: CPU µs per record, one side alone (best of 3)",
        f"{'step':<52} {'client':>7} {'redis':>6}",
    ]
    lines += [f"{name:<52} {v['cpu_us']:>7.0f} {v['redis_us']:>6.0f}" for name, v in steps.items()]
    return "\n".join(lines)


def machine(url: str) -> dict:
    import google.protobuf
    import redis
    from google.protobuf.internal import api_implementation

    client = redis.Redis.from_url(url)
    server = client.info("server")["redis_version"]
    client.close()
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "pure-Python (no hiredis)"
    return {
        "cpu": common.cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "redis_server": server,
        "redis_py": redis.__version__,
        "redis_py_parser": parser,
        "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()})",
        "loadavg_start": os.getloadavg(),
        "load_average_1m": [common.load_1m()],
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[int]]:
    """The options, the modes to run and the T values."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, action="append", help="T (repeatable); default 1024 and 8192")
    p.add_argument("--topk", type=int, default=20, help="K top logprobs per token")
    p.add_argument("--records", type=int, help="N records per run (rounded up to a multiple of 64)")
    common.add_reps(p, 3, help="repetitions of each mode (median [min, max] reported)")
    common.add_baseline(p)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument(
        "--raw-client",
        choices=("sync", "async"),
        default="sync",
        help="redis-py client of the raw consumers: redis.Redis (default) or redis.asyncio",
    )
    p.add_argument(
        "--malloc-tuned",
        action="store_true",
        help=f"run the producer and consumer with {' '.join(f'{k}={v}' for k, v in MALLOC_TUNED.items())}",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="instead: each side alone, step by step (raw, + decode, asyncio, queue), CPU per record",
    )
    p.add_argument("--quick", action="store_true", help="1/8 of the records, 1 repetition")
    p.add_argument("--profile", metavar="DIR", help="cProfile (CPU time) every worker into DIR/*.prof")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; expected some of {list(MODES)}")
    if args.quick:
        args.reps = 1
    return args, modes, args.tokens or sorted(DEFAULT_RECORDS)


def header(info: dict, args: argparse.Namespace, token_list: list[int]) -> str:
    return (
        f"bench/queue_bench.py: T={token_list} K={args.topk} group={GROUP} batch={BATCH} reps={args.reps} | "
        f"{info['cpu']}, {info['cores']} cores, Python {info['python']}, redis-server "
        f"{info['redis_server']}, redis-py {info['redis_py']} ({info['redis_py_parser']}), protobuf "
        f"{info['protobuf']}, load {info['loadavg_start'][0]:.2f}"
        + (", malloc tuned" if args.malloc_tuned else "")
    )


def run_breakdown(url: str, args: argparse.Namespace, token_list: list[int]) -> dict[int, dict]:
    """--breakdown: per T, each step's CPU per record (one side at a time, in a child process)."""
    steps = {}
    for tokens in token_list:
        n = args.records or BREAKDOWN_RECORDS.get(tokens, 128)
        steps[tokens] = breakdown(url, tokens, args.topk, max(BATCH, n // BATCH * BATCH))
        print(breakdown_table(tokens, steps[tokens]) + "\n", file=sys.stderr, flush=True)
    return steps


def run_modes(
    url: str, args: argparse.Namespace, modes: list[str], token_list: list[int]
) -> tuple[list[dict], dict[int, float]]:
    """Every mode at every T, `args.reps` times, interleaved (order rotated per repetition): the runs,
    and the mean payload bytes per record for each T."""
    runs: list[dict] = []
    sizes: dict[int, float] = {}
    for tokens in token_list:
        per_index = payload_bytes(templates(tokens, args.topk, GROUP))
        sizes[tokens] = sum(per_index) / len(per_index)
        n = args.records or DEFAULT_RECORDS.get(tokens, 512)
        if args.quick:
            n //= 8
        n = max(BATCH, -(-n // BATCH) * BATCH)
        window = max(4 * BATCH, int(WINDOW_BYTES / sizes[tokens]) // GROUP * GROUP)
        for rep in range(args.reps):
            order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
            for mode in order:
                r = run_once(url, mode, tokens, n, window, args)
                runs.append(r)
                print(
                    f"  T={tokens} rep {rep + 1}/{args.reps} {mode:<10}: {r['records']} records in "
                    f"{r['seconds']:.2f} s = {r['records'] / r['seconds']:.0f} rec/s, CPU "
                    f"{_total(r) / r['records'] * 1e6:.0f} µs/rec (producer done at "
                    f"{r['producer_seconds']:.2f} s, {r['producer_window_wait_s']:.2f} s of it waiting; "
                    f"others {r['others_cores']:.2f} cores)",
                    file=sys.stderr,
                    flush=True,
                )
    return runs, sizes


def main(argv: list[str] | None = None) -> int:
    args, modes, token_list = parse_args(argv)
    if args.baseline:
        return common.run_baseline(__file__, argv, args, headline, digits=2)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)

    with common.open_store() as server:
        if args.malloc_tuned:  # after redis-server started: the workers (spawned below) inherit it
            os.environ.update(MALLOC_TUNED)
        info = machine(server.url)
        info["malloc_tuned"] = args.malloc_tuned
        print(header(info, args, token_list), file=sys.stderr, flush=True)
        if args.breakdown:
            steps = run_breakdown(server.url, args, token_list)
            if args.json:
                print(json.dumps({"machine": info, "args": vars(args), "breakdown": steps}, indent=1))
            else:
                print("\n\n".join(breakdown_table(t, v) for t, v in steps.items()))
            return 0
        runs, sizes = run_modes(server.url, args, modes, token_list)
    info["loadavg_end"] = os.getloadavg()
    info["load_average_1m"].append(common.load_1m())
    rows = summarise(runs, sizes)
    if args.json:
        out = {"machine": info, "args": vars(args), "results": rows, "runs": runs, "verdict": verdict(rows)}
        print(json.dumps(out, indent=1))
    else:
        print(table(rows))
        print("\n" + "\n".join(verdict(rows)))
        print(f"median [min, max] over {args.reps} repetitions; 1-min load average "
              f"{info['load_average_1m'][0]} -> {info['load_average_1m'][1]}")  # fmt: skip
    return 0


def headline(result: dict) -> dict[str, float]:
    """The figures `--baseline` compares, from one run's JSON: per T, maskroll's records/s and its
    ratio to raw redis-py's."""
    out = {}
    for r in result["results"]:
        if r["mode"] == "maskroll":
            out[f"maskroll records/s T={r['tokens']}"] = r["records_per_s"]
        elif r["mode"] == "raw":
            out[f"maskroll/raw T={r['tokens']}"] = r["maskroll_over_this"]
    return out


if __name__ == "__main__":
    sys.exit(main())
