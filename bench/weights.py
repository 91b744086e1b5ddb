"""Weight sync end to end: seconds and MB/s to bring N replicas to a new version of a ~500 MB model,
the directory transport (trainer save + UpdateWeights + replica load) against the stream (PushWeights),
each replica's peak RSS during an update against its steady state, and the CPU seconds each side spends.

Replicas are `maskroll serve --pull` processes (torch engine, one thread each) on a private Redis, all
on this machine (loopback); the trainer is this process, publishing a synthetic model's state dict
(`maskroll init-model --hidden 1024 --layers 7`, float32) through `CheckpointPublisher` (directory:
`<tmp>/weights`, the replicas' --weights-root) or `StreamPublisher` (`--chunk-mib` MiB chunks). One
measurement is one `publish` call: from the state dict in the trainer's memory to every replica serving
the new version. MB/s per replica = model MB / seconds; aggregate = N x model MB / seconds. One untimed
publish per transport comes first (first-touch page faults of a fresh process are not a steady
state); then repetitions alternate the transports so background load hits both alike; medians and
minima are reported. CPU seconds (user + system, from /proc/<pid>/stat and getrusage) are what an
update costs whatever else runs on the machine: on a shared box they are the figures to compare.

RSS: every replica's VmRSS is sampled every 10 ms (/proc/<pid>/status) during the update; the
steady state is the replica's RSS just before it. Target (issue 13): peak - steady <= model + chunk.

    python bench/weights.py                      # N = 1 and 3, 3 repetitions
    python bench/weights.py --replicas 1 --reps 1 --json
    python bench/weights.py --replicas 1 --engine vllm      # a vLLM replica (on a GPU where there is one)
    python bench/weights.py --replicas 1 --baseline /tmp/base   # old tree vs this one, interleaved

Seconds are median / min / max over the repetitions, with the 1-minute load average at start and end.

Every push here is a full one. The delta study (issue 36: versions after the first sent as sparse patches
on the last, bf16 replicas, real optimiser steps; trainer egress against N; compressing the patch
indices) is bench/weights_delta.py:

    python bench/weights_delta.py --part grpo --out /tmp/wd      # SmolLM2, GRPO, lr 1e-6 / 1e-5 / 1e-4
    python bench/weights_delta.py --part egress --out /tmp/wd    # N = 1, 2, 4: full vs delta egress
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
from common import rss_mb

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15 of stat)


def own_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class RssPeak:
    """Peak RSS of `pids` while the block runs, sampled every 10 ms."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.peak, self.steady = pids, {p: 0.0 for p in pids}, {p: rss_mb(p) for p in pids}
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.pids:
                self.peak[p] = max(self.peak[p], rss_mb(p))
            time.sleep(0.01)

    def __enter__(self) -> RssPeak:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    def growth(self) -> list[float]:
        return [self.peak[p] - self.steady[p] for p in self.pids]


def measure(n: int, reps: int, model_dir: Path, tmp: Path, chunk: int, engine: str = "torch") -> dict:
    from safetensors.torch import load_file

    from maskroll.client import RolloutQueue
    from maskroll.local.replica import stop_all
    from maskroll.weight_sync import CheckpointPublisher, StreamPublisher

    state = load_file(str(model_dir / "model.safetensors"))
    model_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    root = tmp / f"weights-{n}"
    root.mkdir()
    out: dict = {"replicas": n, "model_mb": model_mb, "directory": [], "stream": []}
    with common.open_store() as srv:
        serve = ["--engine", engine, "--port", "0", "--namespace", f"bench{n}", "--pull"]
        serve += ["--threads", "1"] if engine == "torch" else []
        serve += ["--weights-root", str(root), "--heartbeat-ttl-s", "30"]
        serve += ["--max-message-bytes", str(64 << 20)]
        env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": srv.url}
        procs = common.start_replicas(model_dir, n, tmp, *serve, env=env)
        try:
            with RolloutQueue(srv.url, f"bench{n}", run="new", batch_size=1) as q:
                common.wait_registered(q, n)
                pubs = {
                    "directory": CheckpointPublisher(q, root, keep=1, timeout=600),
                    "stream": StreamPublisher(q, follow_s=None, timeout=600, chunk_bytes=chunk),
                }
                for r in range(-1, reps):  # r = -1: the untimed warm-up round
                    for kind in ("directory", "stream") if r % 2 == 0 else ("stream", "directory"):
                        for t in state.values():  # a new version: every byte differs
                            t.add_(1e-3)
                        cpu0 = [cpu_s(p.pid) for p in procs]
                        own0 = own_cpu_s()
                        with RssPeak([p.pid for p in procs]) as rss:
                            t0 = time.perf_counter()
                            results = pubs[kind].publish(state)
                            seconds = time.perf_counter() - t0
                        assert set(results.values()) == {"ok"}, results
                        if r < 0:
                            continue
                        out[kind].append(
                            {
                                "seconds": seconds,
                                "rss_growth_mb": rss.growth(),
                                "steady_mb": list(rss.steady.values()),
                                "replica_cpu_s": [cpu_s(p.pid) - c for p, c in zip(procs, cpu0, strict=True)],
                                "trainer_cpu_s": own_cpu_s() - own0,
                            }
                        )
                        print(
                            f"  N={n} {kind:9s} {seconds:6.2f} s  RSS +{max(rss.growth()):.0f} MB  "
                            f"CPU trainer {out[kind][-1]['trainer_cpu_s']:.2f} s, replicas "
                            f"{' '.join(f'{c:.2f}' for c in out[kind][-1]['replica_cpu_s'])} s",
                            file=sys.stderr,  # stdout: the result
                            flush=True,
                        )
        finally:
            stop_all(procs, timeout=60)
    for kind in ("directory", "stream"):
        seconds = common.spread(x["seconds"] for x in out[kind])
        growth = common.spread(g for x in out[kind] for g in x["rss_growth_mb"])
        s = seconds["median"]
        out[f"{kind}_median_s"] = s
        out[f"{kind}_min_s"] = seconds["min"]
        out[f"{kind}_max_s"] = seconds["max"]
        out[f"{kind}_replica_cpu_s"] = statistics.median(c for x in out[kind] for c in x["replica_cpu_s"])
        out[f"{kind}_trainer_cpu_s"] = statistics.median(x["trainer_cpu_s"] for x in out[kind])
        out[f"{kind}_steady_mb"] = statistics.median(m for x in out[kind] for m in x["steady_mb"])
        out[f"{kind}_peak_mb"] = max(
            m + g for x in out[kind] for m, g in zip(x["steady_mb"], x["rss_growth_mb"], strict=True)
        )
        out[f"{kind}_median_rss_growth_mb"] = growth["median"]
        out[f"{kind}_mb_per_s_per_replica"] = model_mb / s
        out[f"{kind}_mb_per_s_aggregate"] = n * model_mb / s
        out[f"{kind}_max_rss_growth_mb"] = growth["max"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    common.add_reps(p, 3, help="timed repetitions after one warm-up per transport (median and min)")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (heads of 64)")
    p.add_argument("--chunk-mib", type=float, default=None, help="stream chunk size (default: the SDK's)")
    p.add_argument(
        "--engine", choices=("torch", "vllm"), default="torch", help="the replicas' engine (vllm: on a GPU)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON (the table on stderr)")
    common.add_baseline(p)
    a = p.parse_args(argv)
    if a.baseline:
        return common.run_baseline(__file__, argv, a, headline, digits=2)
    from maskroll.proto.tensor_push import DEFAULT_CHUNK_BYTES

    chunk = DEFAULT_CHUNK_BYTES if a.chunk_mib is None else int(a.chunk_mib * (1 << 20))
    load = common.load_1m()
    with tempfile.TemporaryDirectory(prefix="maskroll-wbench-") as d:
        tmp = Path(d)
        heads = max(1, a.hidden // 64)
        model_dir = common.model_dir(None, tmp, hidden=a.hidden, heads=heads, layers=a.layers)
        if a.engine == "vllm":
            common.vllm_run_env(tmp)
        results = [measure(n, a.reps, model_dir, tmp, chunk, a.engine) for n in a.replicas]
    for r in results:
        r["load_average_1m"] = [load, common.load_1m()]
    if a.json:
        print(json.dumps(results, indent=2))
    # With --json the table goes to stderr: stdout is one JSON document.
    out = sys.stderr if a.json else sys.stdout
    print(
        f"model: {results[0]['model_mb']:.0f} MB float32; chunk {chunk / (1 << 20):g} MiB; {a.reps} reps "
        f"after a warm-up; {os.cpu_count()} CPUs, 1-min load average {load:.1f} -> {common.load_1m():.1f}",
        file=out,
    )
    print(
        "| replicas | transport | seconds: median [min, max] | MB/s per replica | MB/s aggregate "
        "| CPU s per replica | CPU s trainer | peak RSS growth MB (median / max) "
        "| replica RSS MB (steady / peak) |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    for r in results:
        for kind in ("directory", "stream"):
            s, per, agg = (
                r[f"{kind}_median_s"],
                r[f"{kind}_mb_per_s_per_replica"],
                r[f"{kind}_mb_per_s_aggregate"],
            )
            print(
                f"| {r['replicas']} | {kind} | {s:.2f} [{r[f'{kind}_min_s']:.2f}, {r[f'{kind}_max_s']:.2f}] "
                f"| {per:.0f} | {agg:.0f} "
                f"| {r[f'{kind}_replica_cpu_s']:.2f} | {r[f'{kind}_trainer_cpu_s']:.2f} "
                f"| {r[f'{kind}_median_rss_growth_mb']:.0f} / {r[f'{kind}_max_rss_growth_mb']:.0f} "
                f"| {r[f'{kind}_steady_mb']:.0f} / {r[f'{kind}_peak_mb']:.0f} |",
                file=out,
            )
    print(f"RSS target: model + chunk = {results[0]['model_mb'] + chunk / 1e6:.0f} MB", file=out)
    return 0


def headline(results: list) -> dict[str, float]:
    """The figures `--baseline` compares, from one run's JSON: seconds per transport and N."""
    return {
        f"{kind} s, N={r['replicas']}": r[f"{kind}_median_s"]
        for r in results
        for kind in ("stream", "directory")
    }


if __name__ == "__main__":
    sys.exit(main())
