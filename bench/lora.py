"""LoRA weight sync: bytes and seconds per update, the adapter against the full weights, and the replica's
RSS with K resident adapters.

One `maskroll serve --pull` replica (torch engine, one thread, `--max-lora-rank 64 --lora-versions 4
--max-loras 4`) on a private Redis, on loopback; the trainer is this process with `StreamPublisher`
(the stream transport, PushWeights). Per model (the demo's tiny init-model, and SmolLM2-135M float32 as
`maskroll.app.smollm2.cached` converted it), in this order:

1. for rank 8 then 64 (each a new run): the recipe's LoRA model (`recipes.grpo.lora_model`: q/k/v/o
   projections, alpha = 2 × rank), `start` (version 0: the adapter pushed, 1 resident), then `--reps`
   timed publishes, each after a stand-in optimiser step on the adapters (version v resident beside the
   older ones, up to K = 4 with `--reps 3`);
2. the full model (a new run): `--reps` timed publishes of the whole state dict, after an untimed one.

Seconds = one `publish` call: from the model in the trainer's memory (adapter extraction or snapshot,
checksums) to the replica serving the new version (received, checked, loaded). Bytes = what the replica
was sent per update (`StreamPublisher.last_update_bytes`: the tensors' bytes, not gRPC framing), and
its share of the model's parameter bytes (a tied embedding counted once: SmolLM2's full update is 121 %
of it, since its state dict, hence the push, holds the tied lm_head.weight too). RSS:
the replica's VmRSS sampled every 10 ms; "K = 1" is the peak over the start of a LoRA run (its first
adapter arriving), "K = 4" the peak over the whole run (four versions resident), against the RSS before
the run.

    python bench/lora.py                          # demo model and SmolLM2, 3 repetitions
    python bench/lora.py --models demo --reps 2
    python bench/lora.py --json

Medians [min, max] over the repetitions, with the 1-minute load average at start and end: on a shared
machine, the figure to trust least is seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
from common import rss_mb

NS = "bench-lora"
RANKS = (8, 64)


class RssPeak:
    """The peak VmRSS (MiB) of `pid` while the block runs, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()

    def __enter__(self) -> RssPeak:
        self.peak = rss_mb(self.pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_mb(self.pid))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb(self.pid))


def _step(model, seed: int) -> None:
    """A stand-in for an optimiser step: every trainable tensor moves (the adapters; all of a full model)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def _timed_publishes(pub, model, reps: int) -> tuple[list[float], int]:
    seconds = []
    for i in range(reps):
        _step(model, i + 1)
        t0 = time.perf_counter()
        results = pub.publish(model)
        seconds.append(time.perf_counter() - t0)
        assert set(results.values()) == {"ok"}, results
    return seconds, pub.last_update_bytes


def measure(name: str, model_dir: Path, reps: int, tmp: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from maskroll.client import RolloutQueue
    from maskroll.local.replica import stop_all
    from maskroll.recipes.config import LoraConfig
    from maskroll.recipes.grpo import lora_model, model_bytes
    from maskroll.weight_sync.stream import StreamPublisher

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    out: dict = {"model": name, "lora": {}}
    with common.open_store() as store:
        args = ["--engine", "torch", "--port", "0", "--threads", "1", "--namespace", NS, "--pull"]
        args += ["--max-lora-rank", str(max(RANKS)), "--lora-versions", "4", "--max-loras", "4"]
        (rep,) = common.start_replicas(
            model_dir, 1, tmp / "logs", *args, env={"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": store.url}
        )
        pid = rep.proc.pid
        try:
            for rank in RANKS:
                torch.manual_seed(0)
                model = lora_model(load(), LoraConfig(lora_rank=rank))
                out["model_bytes"] = model_bytes(model)
                with RolloutQueue(store.url, NS, run="new", batch_size=2) as q:
                    common.wait_registered(q, 1, timeout=120)
                    steady = rss_mb(pid)
                    with StreamPublisher(q, follow_s=None, timeout=300) as pub, RssPeak(pid) as all_k:
                        with RssPeak(pid) as one:
                            pub.start(model)
                        seconds, sent = _timed_publishes(pub, model, reps)
                out["lora"][rank] = {
                    "bytes_per_update": sent,
                    "seconds": common.spread(seconds),
                    "rss_before_mb": steady,
                    "rss_k1_mb": one.peak,
                    f"rss_k{min(reps + 1, 4)}_mb": all_k.peak,
                }
                del model
            model = load()
            with (
                RolloutQueue(store.url, NS, run="new", batch_size=2) as q,
                StreamPublisher(q, follow_s=None, timeout=600) as pub,
            ):
                pub.start(model)  # version 0: the replica adopts its own starting weights or is pushed
                _timed_publishes(pub, model, 1)  # untimed: first-touch page faults of the replica
                seconds, sent = _timed_publishes(pub, model, reps)
            out["full"] = {"bytes_per_update": sent, "seconds": common.spread(seconds)}
        finally:
            stop_all([rep])
    return out


def table(results: list[dict], reps: int) -> str:
    k = min(reps + 1, 4)
    lines = [
        f"{'model':10}{'update':14}{'MB/update':>12}{'% of model':>11}{'seconds/update':>24}"
        f"{'replica RSS MiB: before / K=1 / K=' + str(k):>40}"
    ]
    for r in results:
        full = r["full"]
        rows = [(f"LoRA r={rank}", v) for rank, v in r["lora"].items()] + [("full", full)]
        for label, v in rows:
            rss = ""
            if "rss_k1_mb" in v:
                rss = f"{v['rss_before_mb']:.0f} / {v['rss_k1_mb']:.0f} / {v[f'rss_k{k}_mb']:.0f}"
            lines.append(
                f"{r['model']:10}{label:14}{v['bytes_per_update'] / 1e6:12.3f}"
                f"{v['bytes_per_update'] / r['model_bytes']:11.2%}"
                f"{common.fmt_spread(v['seconds'], 3, 's'):>24}{rss:>40}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo,smollm2", help="comma-separated: demo, smollm2")
    common.add_reps(p, 3, help="timed publishes per case (median); LoRA runs then hold reps + 1 versions")
    p.add_argument("--json", action="store_true", help="print the results as JSON only")
    a = p.parse_args(argv)
    load_start = common.load_1m()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        for name in a.models.split(","):
            if name == "demo":
                model_dir = common.model_dir(None, Path(tmp))
            elif name == "smollm2":
                from maskroll.app import smollm2

                model_dir = smollm2.cached("float32")
            else:
                raise SystemExit(f"unknown model {name!r}; expected demo or smollm2")
            results.append(measure(name, model_dir, a.reps, Path(tmp) / name))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # kept if a later model fails
    meta = {"load_1m": [load_start, common.load_1m()], "cpu": common.cpu_model(), "reps": a.reps}
    if a.json:
        print(json.dumps({"results": results, **meta}))
    else:
        print(table(results, a.reps))
        print(f"load average (1 min) {meta['load_1m'][0]} -> {meta['load_1m'][1]}; {meta['cpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
