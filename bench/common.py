"""What the benchmarks share: their common flags (--reps, --model), the model they measure (a fresh
`maskroll init-model` unless one is given), the stores and replicas they start (a private Redis or Redis
Cluster, `maskroll serve` processes), vLLM's per-run environment, the machine they ran on, and the
statistics they report (median / min / max of repetitions, the median of per-repetition ratios).

bench/ is not a package: `python bench/x.py` puts bench/ first on sys.path, so a script imports this as
`import common`. No file in bench/ is named like a standard-library module (hence queue_bench.py and
http_bench.py), so none needs to edit sys.path. Heavy imports (torch, redis, maskroll.*) happen inside
the functions that need them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

GRPC_PREFIX_BYTES = 5  # gRPC length-prefixed message: 1 flag byte + 4 length bytes


# ---- flags ------------------------------------------------------------------------------------------


def add_reps(
    parser: argparse.ArgumentParser, default: int | None, help: str = "repetitions (median)"
) -> None:
    parser.add_argument("--reps", type=int, default=default, help=help)


def add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh `maskroll init-model`)")


# ---- what is measured -----------------------------------------------------------------------------


def model_dir(given: Path | None, tmp: Path, name: str = "model", **init: int) -> Path:
    """`given`, else a fresh `maskroll init-model` under `tmp` with `init` over its defaults (seed 0;
    init-model is deterministic, so every run of a benchmark measures the same model)."""
    if given is not None:
        return given
    from maskroll.app.model_init import init_model

    return init_model(tmp / name, **init)


def prompts(n: int) -> list[list[int]]:
    """Distinct short byte prompts after <bos> (256), 8..23 tokens (bench/server.py, bench/http_bench.py)."""
    return [[256, *(b"request %d: " % i), *(b"abc" * (i % 6))] for i in range(n)]


def vllm_run_env(tmp: Path) -> None:
    """vLLM's caches and IPC sockets under `tmp` (this run's only), its logs on stderr (stdout carries the
    result), no usage reporting."""
    from maskroll.server.engines.vllm_engine import default_cache_env

    default_cache_env(tmp / "vllm-env")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


# ---- processes --------------------------------------------------------------------------------------


def open_store(kind: str = "single"):
    """A private store, not yet started (use it as a context manager): "single" a redis-server without
    AOF, "cluster" a Redis Cluster of 3 masters + 3 replicas."""
    if kind == "single":
        from maskroll.local.redis_server import LocalRedis

        return LocalRedis(appendonly=False)
    if kind == "cluster":
        from maskroll.local.redis_cluster import LocalRedisCluster

        return LocalRedisCluster(node_timeout_ms=5000)
    raise ValueError(f"store {kind!r}; expected 'single' or 'cluster'")


def start_replicas(
    model: Path,
    n: int,
    log_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    name: str = "rep",
    timeout: float = 600.0,
) -> list:
    """`n` `maskroll serve --model <model> <args> --replica-id <name>-<i>` processes (LocalReplica), logs
    under `log_dir`, all started before any is waited for; returns them ready. The caller stops them
    (`maskroll.local.replica.stop_all`); they are stopped here if one fails to start."""
    from maskroll.local.replica import LocalReplica, stop_all, wait_all

    replicas = [
        LocalReplica(
            ["--model", model, *args, "--replica-id", f"{name}-{i}"],
            env=env,
            log=log_dir / f"{name}-{i}.log",
            name=f"{name}-{i}",
        ).start()
        for i in range(n)
    ]
    try:
        wait_all(replicas, timeout)
    except BaseException:
        stop_all(replicas)
        raise
    return replicas


def wait_registered(queue, n: int, timeout: float = 600.0) -> list:
    """Block until `n` replicas are in the queue's registry (RolloutQueue.replicas()); returns them."""
    deadline = time.monotonic() + timeout
    while len(found := queue.replicas()) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(found)} of {n} replicas registered after {timeout:.0f} s")
        time.sleep(0.1)
    return found


def rss_mb(pid: int) -> float:
    """VmRSS of process `pid` in MiB (0.0 once it has exited). Linux only."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), "unknown" where it does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ---- statistics -------------------------------------------------------------------------------------


def spread(values: Iterable[float]) -> dict[str, float]:
    """Median, minimum and maximum of the timed repetitions (warm-up runs left out by the caller)."""
    xs = list(values)
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of per-repetition ratios of back-to-back runs: background load drifts slowly, so it
    hits both runs of a repetition alike and cancels in their ratio, not in a ratio of medians."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))
