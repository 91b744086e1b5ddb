"""The reward stage (`maskroll reward`, docs/rewards.md "The reward stage"): records scored per second per
worker with a cheap rule, and the latency it adds between "record finished" and "record available to the
trainer".

A private Redis (no AOF) and one real `maskroll reward` process (one worker, --concurrency C) scoring
with the demo's rule (`maskroll.recipes.digits:digit_reward_fn`: digit bytes / max_tokens) — what is
measured is the stage itself: read, decode the ids with the tokenizer, call, encode, the publishing
script. Records are the size a trainer reads (T completion tokens, top-K = K).

- throughput: N records put on the finished stream in one pipeline once the worker is ready; records/s
  = N / (time until the last is on the rollout stream). Repeated --reps times (median [min, max]).
- latency: one record at a time on an idle stage; for each, the time from the XADD to the finished
  stream until a trainer-side XREAD BLOCK on the rollout stream returns it, minus the same time for a
  record XADDed straight to the rollout stream (what a replica without a stage does) — both measured
  the same way, so the read's own cost cancels. median / min / max over --samples records.

    python bench/reward_stage.py [--records 5000] [--tokens 256] [--k 20] [--samples 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np

READY = "maskroll reward: ready"


def records(n: int, t: int, k: int, model: Path, tag: str):
    from maskroll.proto.records import RolloutRecord, Semantics, rollout_id_for

    rng = np.random.default_rng(0)
    out = []
    for j in range(n):
        ids = rng.integers(32, 127, t).astype(np.int32)  # printable bytes: some digits among them
        out.append(
            RolloutRecord(
                rollout_id=rollout_id_for(f"{tag}{j}", 0),
                request_id=f"{tag}{j}",
                prompt_ids=np.frombuffer(b"the code is", np.uint8).astype(np.int32),
                completion_ids=ids,
                sampled_logprobs=np.full(t, -1.0, np.float32),
                sampled_ranks=np.ones(t, np.int32),
                topk_ids=rng.integers(0, 256, (t, k)).astype(np.int32),
                topk_logprobs=-np.sort(rng.random((t, k)).astype(np.float32), axis=1),
                finish_reason="length",
                semantics=Semantics(logprobs_k=k, engine="torch", model=str(model)),
                job_id=f"{tag}{j}",
                group_id=f"{tag}{j}",
                metadata={"max_tokens": str(t)},
                run_id="bench",
            )
        )
    return out


def start_worker(url: str, namespace: str, model: Path, concurrency: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "maskroll.app.cli", "reward", "--redis-url", url, "--namespace", namespace]
    cmd += ["--reward", "maskroll.recipes.digits:digit_reward_fn", "--tokenizer", str(model)]
    cmd += ["--concurrency", str(concurrency), "--log-every-s", "0"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while READY not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the reward worker did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


async def throughput(url: str, keys, payloads: list[bytes]) -> float:
    """Seconds until every payload put on the finished stream is on the rollout stream."""
    from maskroll.proto.redis_conn import open_redis
    from maskroll.proto.streams import F_RECORD

    r, _ = await open_redis(url)
    part = keys.part(0)
    await r.delete(part.rollouts)
    start = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for data in payloads:
        pipe.xadd(part.finished, {F_RECORD: data})
    await pipe.execute()
    while await r.xlen(part.rollouts) < len(payloads):
        await asyncio.sleep(0.002)
    took = time.perf_counter() - start
    await r.delete(part.rollouts)
    await r.aclose()
    return took


async def latency(url: str, keys, payloads: list[bytes], stage: bool) -> list[float]:
    """Per record, ms from its XADD (to the finished stream when `stage`, else straight to the rollout
    stream) until a blocked XREAD on the rollout stream returns it."""
    from maskroll.proto.redis_conn import open_redis
    from maskroll.proto.streams import F_RECORD

    writer, _ = await open_redis(url)
    reader, _ = await open_redis(url)
    part = keys.part(0)
    out = []
    last = (
        (await writer.xinfo_stream(part.rollouts))["last-generated-id"]
        if await writer.exists(part.rollouts)
        else "0-0"
    )
    for data in payloads:
        read = asyncio.create_task(reader.xread({part.rollouts: last}, count=1, block=10_000))
        await asyncio.sleep(0.005)  # the read is blocked on Redis before the record is added
        t0 = time.perf_counter()
        await writer.xadd(part.finished if stage else part.rollouts, {F_RECORD: data})
        resp = await read
        out.append((time.perf_counter() - t0) * 1000)
        last = resp[0][1][0][0]
    await writer.aclose()
    await reader.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=5000, help="records per throughput repetition")
    p.add_argument("--tokens", type=int, default=256, help="completion tokens per record (T)")
    p.add_argument("--k", type=int, default=20, help="top-K logprobs per token (K)")
    p.add_argument("--concurrency", type=int, default=8, help="the worker's --concurrency")
    p.add_argument("--samples", type=int, default=200, help="records timed one by one for the latency")
    common.add_reps(p, 3)
    common.add_model(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args()

    from maskroll.proto import wire
    from maskroll.proto.streams import StreamKeys

    load_start = common.load_1m()
    with tempfile.TemporaryDirectory() as tmp, common.open_store("single") as store:
        tmp = Path(tmp)
        model = common.model_dir(a.model, tmp)
        keys = StreamKeys("bench-reward")
        worker = start_worker(store.url, keys.namespace, model, a.concurrency, tmp / "worker.log")
        try:
            rates = []
            for rep in range(a.reps + 1):  # the first is a warm-up (imports, the tokenizer's first decode)
                batch = [wire.encode_record(r) for r in records(a.records, a.tokens, a.k, model, f"t{rep}-")]
                took = asyncio.run(throughput(store.url, keys, batch))
                if rep:
                    rates.append(a.records / took)
            lat_records = records(2 * a.samples, a.tokens, a.k, model, "lat-")
            payloads = [wire.encode_record(r) for r in lat_records]
            direct = asyncio.run(latency(store.url, keys, payloads[: a.samples], stage=False))
            staged = asyncio.run(latency(store.url, keys, payloads[a.samples :], stage=True))
        finally:
            worker.terminate()
            worker.wait(30)
    base = float(np.median(direct))
    added = [x - base for x in staged]
    result = {
        "records_per_s_per_worker": common.spread(rates),
        "latency_ms_direct": common.spread(direct),
        "latency_ms_through_stage": common.spread(staged),
        "added_latency_ms": common.spread(added),
        "records": a.records,
        "tokens": a.tokens,
        "k": a.k,
        "concurrency": a.concurrency,
        "reps": a.reps,
        "samples": a.samples,
        "payload_bytes": len(payloads[0]),
        "cpu": common.cpu_model(),
        "cpus": os.cpu_count(),
        "load_1m": [load_start, common.load_1m()],
    }
    if a.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"reward stage, one worker (concurrency {a.concurrency}), cheap rule, T={a.tokens} K={a.k} "
        f"({result['payload_bytes']} B per record); load {result['load_1m']}"
    )
    print(f"  records scored per second per worker: {common.fmt_spread(rates, 0)}")
    print(f"  finished -> available, through the stage: {common.fmt_spread(staged, 2, 'ms')}")
    print(f"  finished -> available, straight (no stage): {common.fmt_spread(direct, 2, 'ms')}")
    print(f"  added by the stage: {common.fmt_spread(added, 2, 'ms')}")


if __name__ == "__main__":
    main()
