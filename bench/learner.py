"""The data-parallel learner (issue 21): publishing from W trainer ranks, full model vs FSDP2, and
consuming one run through `RankedQueue` with W ranks.

publish   W ranks under torchrun (gloo on CPU, `--backend nccl` on GPUs) load the same model (`maskroll
          init-model --hidden H --layers L`, float32); "full": every rank holds all of it (a DDP
          learner; rank 0 snapshots and pushes it), "fsdp": `fully_shard` per decoder layer and the root
          (every rank joins a gather per parameter, rank 0 writes it into its spool file and pushes that).
          Publisher: `make_publisher("stream", queue on rank 0, collective=TorchCollective())` to one
          `maskroll serve --pull` replica (torch engine) on a private Redis. One untimed publish, then
          `--reps` timed ones; seconds per publish (rank 0: from entering publish() to the version
          known on every rank, the replica loaded) and, per rank, the extra memory: the peak RSS over
          the publisher's life (start() and every publish) above the rank's RSS with the model loaded
          and sharded (VmRSS sampled every millisecond by a thread). A full model's publisher keeps a
          snapshot between versions (its follower's copy); it counts.
consume   N records (`--tokens` completion tokens, K = 20 top-K, groups of 8, the queue bench's synthetic
          records: bench/queue_bench.py) are published into a namespace before the clock starts; W
          ranks read them through `RankedQueue(batch_size=64)`: rank 0 reads and decodes each global
          batch (RolloutQueue.next_batch), splits it by groups and scatters the shares; every rank
          acks at once (no training: the queue's path alone). records/s = N / (first next_batch to
          last ack). "ready → step": per step, from rank 0's read returning (the batch decoded and
          checked) to the last rank holding its share (the split and the scatter), in ms.

    python bench/learner.py                          # both parts, 1 and 2 ranks, 3 repetitions
    python bench/learner.py --part publish --hidden 1024 --layers 7 --reps 3
    python bench/learner.py --part consume --ranks 1 2 4 --records 4096 --json
    python bench/learner.py --baseline /tmp/base     # an old tree vs this one, interleaved (common.py)

Figures are median [min, max] over the repetitions, with the 1-minute load average at start and end: on
a shared machine it is what says how far a figure can be trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve()


# ---- inside one rank (torchrun) ---------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest RSS of this process while the block runs (a thread samples it every millisecond)."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def _init(backend: str):
    import torch
    import torch.distributed as dist

    from maskroll.trainer_adapter.distributed import TorchCollective

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return TorchCollective()


def rank_publish(a: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from maskroll.client import RolloutQueue
    from maskroll.weight_sync import make_publisher

    coll = _init(a.backend)
    device = "cuda" if a.backend == "nccl" else "cpu"
    model = (
        AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(device).requires_grad_(False)
    )
    state = model.state_dict()
    # from_pretrained memory-maps the checkpoint: read every page now, so that the RSS base below holds
    # the model and the first snapshot's page-ins are not counted as the publisher's.
    for t in state.values():
        t.sum()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    if a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    shard_bytes = sum(
        (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
        for t in model.state_dict().values()
    )
    del state
    q = RolloutQueue(a.redis, a.namespace, run="new", batch_size=8) if coll.rank == 0 else None
    seconds = []
    # The extra memory is measured from the model alone (loaded, sharded, queue open) over the
    # publisher's whole life: what it keeps between versions (a full model's snapshot, for the
    # follower) counts, not only what one publish allocates on top (glibc reuses the freed snapshot).
    with PeakRSS() as mem:
        pub = make_publisher("stream", q, collective=coll, follow_s=None, timeout=600)
        pub.start(model)
        pub.publish(model)  # untimed: first-touch page faults, the spool's first file
        for _ in range(a.reps):
            dist.barrier()
            t0 = time.perf_counter()
            results = pub.publish(model)
            seconds.append(time.perf_counter() - t0)
            assert set(results.values()) == {"ok"}, results
    out = {
        "rank": coll.rank,
        "version": pub.version,
        "publish_s": seconds,
        "rss_extra": mem.peak - mem.base,
        "model_bytes": model_bytes,
        "shard_bytes": shard_bytes,
        "largest_param_bytes": largest,
    }
    pub.close()
    if q is not None:
        q.close()
    dist.destroy_process_group()
    return out


def rank_consume(a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from maskroll.client.ranks import RankedQueue

    coll = _init("gloo")  # the control plane is gloo whatever the model's backend
    ready: list[float] = []
    starts: list[float] = []
    with RankedQueue(coll, a.redis, a.namespace, run="resume", batch_size=a.batch) as rq:
        if rq.is_main:
            read = rq.queue.next_batch

            def timed_read(*args, **kwargs):
                batch = read(*args, **kwargs)
                ready.append(time.time())  # decoded and checked: the global batch is ready
                return batch

            rq.queue.next_batch = timed_read
        coll.barrier()
        t0, mine = time.time(), 0
        for _ in range(a.records // a.batch):
            share = rq.next_batch(timeout=120)
            starts.append(time.time())  # this rank's step could start now
            mine += len(share)
            rq.ack(share)
        coll.barrier()
        t1 = time.time()
    dist.destroy_process_group()
    return {"rank": coll.rank, "start": t0, "end": t1, "records": mine, "ready": ready, "starts": starts}


# ---- the parent: stores, replicas, torchrun ---------------------------------------------------------


def torchrun(ranks: int, argv: list[str], out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(HERE), *argv, "--out", str(out)], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        sys.stderr.write(proc.stderr[-8000:])
        raise RuntimeError(f"torchrun with {ranks} ranks exited with {proc.returncode}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def bench_publish(a: argparse.Namespace, tmp: Path) -> list[dict]:
    from maskroll.local.replica import stop_all

    model = common.model_dir(a.model, tmp, hidden=a.hidden, layers=a.layers, heads=max(4, a.hidden // 128))
    rows = []
    with common.open_store() as store:
        env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": store.url}
        args = ["--engine", "torch", "--port", "0", "--threads", "1", "--namespace", "learner", "--pull"]
        reps = common.start_replicas(model, 1, tmp, *args, "--max-message-bytes", str(64 << 20), env=env)
        try:
            for ranks in a.ranks:
                for mode in ("full", "fsdp"):
                    argv = ["--rank-main", "publish", "--model", str(model), "--redis", store.url]
                    argv += ["--namespace", "learner", "--mode", mode, "--reps", str(a.reps)]
                    argv += ["--backend", a.backend]
                    out = torchrun(ranks, argv, tmp / f"publish-{ranks}-{mode}")
                    rows.append(
                        {
                            "ranks": ranks,
                            "mode": mode,
                            "model_mb": out[0]["model_bytes"] / 1e6,
                            "largest_param_mb": out[0]["largest_param_bytes"] / 1e6,
                            "publish_s": common.spread(out[0]["publish_s"]),
                            "per_rank": [
                                {
                                    "rank": r["rank"],
                                    "shard_mb": r["shard_bytes"] / 1e6,
                                    "rss_extra_mb": r["rss_extra"] / 1e6,
                                }
                                for r in out
                            ],
                        }
                    )
                    print(_publish_line(rows[-1]), file=sys.stderr)
        finally:
            stop_all(reps)
    return rows


def _publish_line(row: dict) -> str:
    ranks = "; ".join(
        f"rank {r['rank']}: shard {r['shard_mb']:.0f} MB, extra RSS {r['rss_extra_mb']:.1f} MB"
        for r in row["per_rank"]
    )
    return (
        f"publish {row['mode']:4s} x{row['ranks']}: {common.fmt_spread(row['publish_s'], 2)} s "
        f"(model {row['model_mb']:.0f} MB, largest parameter {row['largest_param_mb']:.1f} MB); {ranks}"
    )


def fill(url: str, ns: str, records: int, tokens: int) -> None:
    """`records` synthetic records of BENCH_RUN at version 0 in `ns`'s rollout stream (queue_bench's)."""
    import asyncio

    import queue_bench as qb
    import redis

    from maskroll.proto.streams import StreamKeys

    qb.claim_run(redis.Redis.from_url(url), ns)
    tpl = qb.templates(tokens, 20, qb.GROUP)

    async def run() -> None:
        r, _, send = qb.job_sender(
            "maskroll", url, StreamKeys(ns).rollouts, tpl, [], max_len=2 * records, jobs=records // qb.GROUP
        )
        for j in range(records // qb.GROUP):
            await send(j)
        await r.aclose()

    asyncio.run(run())


def bench_consume(a: argparse.Namespace, tmp: Path) -> list[dict]:
    rows = []
    for ranks in a.ranks:
        times, lat = [], []
        for rep in range(a.reps):
            with common.open_store() as store:
                ns = f"consume{ranks}r{rep}"
                fill(store.url, ns, a.records, a.tokens)
                argv = ["--rank-main", "consume", "--redis", store.url, "--namespace", ns]
                argv += ["--records", str(a.records), "--batch", str(a.batch)]
                out = torchrun(ranks, argv, tmp / f"consume-{ranks}-{rep}")
            assert sum(r["records"] for r in out) == a.records, out
            start, end = min(r["start"] for r in out), max(r["end"] for r in out)
            times.append(a.records / (end - start))
            ready = out[0]["ready"]
            lat += [1e3 * (max(r["starts"][i] for r in out) - ready[i]) for i in range(len(ready))]
        rows.append(
            {
                "ranks": ranks,
                "records_per_s": common.spread(times),
                "ready_to_step_ms": common.spread(lat),
            }
        )
        r = rows[-1]
        print(
            f"consume x{ranks}: {common.fmt_spread(r['records_per_s'], 0)} records/s, batch ready -> step "
            f"starts {common.fmt_spread(r['ready_to_step_ms'], 2)} ms",
            file=sys.stderr,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("publish", "consume", "both"), default="both")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    common.add_reps(ap, 3)
    common.add_model(ap)
    ap.add_argument("--hidden", type=int, default=1024, help="init-model hidden size (publish)")
    ap.add_argument("--layers", type=int, default=4, help="init-model layers (publish)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="the model's process group")
    ap.add_argument("--records", type=int, default=2048, help="records consumed per run (consume)")
    ap.add_argument("--tokens", type=int, default=512, help="completion tokens per record (consume)")
    ap.add_argument("--batch", type=int, default=64, help="global batch in records (consume)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    common.add_baseline(ap)
    # inside a rank (torchrun runs this file again)
    ap.add_argument("--rank-main", choices=("publish", "consume"), help=argparse.SUPPRESS)
    ap.add_argument("--redis", help=argparse.SUPPRESS)
    ap.add_argument("--namespace", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("full", "fsdp"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.rank_main is not None:
        out = (rank_publish if a.rank_main == "publish" else rank_consume)(a)
        (a.out / f"rank{out['rank']}.json").write_text(json.dumps(out))
        return
    if a.baseline is not None:

        def figures(run: dict) -> dict[str, float]:
            got = {
                f"publish_s {r['mode']} x{r['ranks']}": r["publish_s"]["median"]
                for r in run.get("publish", [])
            }
            got.update(
                {f"records/s x{r['ranks']}": r["records_per_s"]["median"] for r in run.get("consume", [])}
            )
            return got

        print(json.dumps(common.interleave(HERE, sys.argv[1:], a.baseline, a.reps, figures), indent=2))
        return
    result: dict = {"load_average_1m": [common.load_1m()], "cpu": common.cpu_model(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="maskroll-learner-") as tmp:
        if a.part in ("publish", "both"):
            result["publish"] = bench_publish(a, Path(tmp))
        if a.part in ("consume", "both"):
            result["consume"] = bench_consume(a, Path(tmp))
    result["load_average_1m"].append(common.load_1m())
    print(f"load average (1 min): {result['load_average_1m']}", file=sys.stderr)
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
