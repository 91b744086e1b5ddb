"""What the benchmarks share: their common flags (--reps, --model), the model they measure (a fresh
`maskroll init-model` unless one is given), the stores and replicas they start (a private Redis or Redis
Cluster, `maskroll serve` processes), vLLM's per-run environment, the machine they ran on, the
statistics they report (median / min / max of repetitions, the median of per-repetition ratios, the
1-minute load average at start and end) and `--baseline PATH`: the same benchmark run against another
checkout of the repository, its repetitions alternating with this tree's, so that a before / after
comparison comes from one run under one load.

bench/ is not a package: `python bench/x.py` puts bench/ first on sys.path, so a script imports this as
`import common`. No file in bench/ is named like a standard-library module (hence queue_bench.py and
http_bench.py), so none needs to edit sys.path. Heavy imports (torch, redis, maskroll.*) happen inside
the functions that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
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


def load_1m() -> float:
    """The machine's 1-minute load average, rounded: printed at a benchmark's start and end, because on a
    shared machine it is what says how far a figure can be trusted."""
    return round(os.getloadavg()[0], 2)


def fmt_spread(values: Iterable[float] | dict[str, float], digits: int = 1, unit: str = "") -> str:
    """The text "median [min, max]" of `values` (or of an existing `spread`), e.g. "17.2 [15.9, 19.4] µs"."""
    s = values if isinstance(values, dict) else spread(values)
    f = f"{{:.{digits}f}}"
    text = f"{f.format(s['median'])} [{f.format(s['min'])}, {f.format(s['max'])}]"
    return f"{text} {unit}" if unit else text


# ---- --baseline: interleaving another checkout --------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def add_baseline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="PATH",
        help="another checkout of the repository (e.g. `git worktree add /tmp/base HEAD~3`): run this "
        "benchmark with --reps 1 against it and against this tree in alternation, --reps times each, and "
        "compare the two (median [min, max] of each side and of the per-repetition new/old ratios)",
    )


def tree_env(tree: Path, shim_dir: Path) -> dict[str, str]:
    """An environment in which `import maskroll` is `tree`'s code. The repository's folders are mapped
    into the `maskroll` namespace (pyproject.toml package-dir), so the tree cannot go on PYTHONPATH
    itself: `shim_dir/maskroll` is made a link to it and `shim_dir` put first. A path entry is found
    before the editable install's finder, which setuptools appends to sys.meta_path."""
    link = shim_dir / "maskroll"
    if not link.exists():
        link.symlink_to(Path(tree).resolve(), target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim_dir), *filter(None, [env.get("PYTHONPATH")])])
    return env


def without_flag(argv: Sequence[str], flag: str, has_value: bool = True) -> list[str]:
    """`argv` less `flag` (as `--flag V` or `--flag=V`, or a bare `--flag` when not `has_value`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = has_value
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def parse_json_output(stdout: str) -> dict | list:
    """A benchmark's result: all of stdout as JSON, else its last line (scripts that print a table first)."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        return json.loads(stdout.strip().splitlines()[-1])


def run_tree(script: Path, argv: Sequence[str], env: dict[str, str]) -> dict | list:
    """One run of `script` (a path inside this tree) with `env`; its stderr passes through."""
    proc = subprocess.run([sys.executable, str(script), *argv], stdout=subprocess.PIPE, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{script.name} {' '.join(argv)} exited with {proc.returncode}")
    return parse_json_output(proc.stdout)


def interleave(
    script: str | Path,
    argv: Sequence[str],
    baseline: Path,
    reps: int,
    figures: Callable[[dict | list], dict[str, float]],
    runner: Callable[[Path, Sequence[str], dict[str, str]], dict | list] = run_tree,
) -> dict:
    """`reps` repetitions of `script argv --reps 1 --json` against this tree ("new") and `baseline`
    ("old"), alternating which goes first (new-old, old-new, ...), so that drifting load hits both alike.
    `figures` picks the headline numbers out of one run's JSON. The same script (this tree's) measures
    both trees: only the code under test differs, not the method. Returns every value, each side's
    median [min, max] and those of the per-repetition new/old ratios, and the load at start and end."""
    script = Path(script).resolve()
    argv = [*without_flag(without_flag(argv, "--reps"), "--json", has_value=False), "--reps", "1", "--json"]
    out: dict = {"new": {}, "old": {}, "order": [], "load_average_1m": [load_1m()], "baseline": str(baseline)}
    with tempfile.TemporaryDirectory(prefix="maskroll-trees-") as tmp:
        envs = {}
        for side, tree in (("new", REPO), ("old", baseline)):
            (Path(tmp) / side).mkdir()
            envs[side] = tree_env(tree, Path(tmp) / side)
        for rep in range(reps):
            for side in ("new", "old") if rep % 2 == 0 else ("old", "new"):
                values = figures(runner(script, argv, envs[side]))
                out["order"].append(side)
                for name, v in values.items():
                    out[side].setdefault(name, []).append(v)
                print(
                    f"  rep {rep + 1}/{reps} {side}: "
                    + ", ".join(f"{n} {v:.4g}" for n, v in values.items())
                    + f" (load {load_1m()})",
                    file=sys.stderr,
                    flush=True,
                )
    out["load_average_1m"].append(load_1m())
    out["summary"] = compare(out["new"], out["old"])
    return out


def compare(new: dict[str, list[float]], old: dict[str, list[float]]) -> dict[str, dict]:
    """Per figure: each side's spread and the spread of the per-repetition ratios new / old (repetition i
    of one side ran next to repetition i of the other)."""
    summary = {}
    for name in new:
        row = {"new": spread(new[name]), "old": spread(old[name])}
        if all(b != 0 for b in old[name]):
            row["new_over_old"] = spread(a / b for a, b in zip(new[name], old[name], strict=True))
        summary[name] = row
    return summary


def compare_table(result: dict, digits: int = 1) -> str:
    """The interleaved comparison as Markdown: median [min, max] per side and of the ratios."""
    loads = result["load_average_1m"]
    reps = len(result["order"]) // 2
    lines = [
        f"{reps} interleaved repetitions per tree ({' '.join(result['order'])}); old = {result['baseline']}; "
        f"1-min load average {loads[0]} -> {loads[1]}",
        "",
        "| figure | new: median [min, max] | old: median [min, max] | new / old per rep: median [min, max] |",
        "|---|---|---|---|",
    ]
    for name, row in result["summary"].items():
        ratio = fmt_spread(row["new_over_old"], 3) if "new_over_old" in row else "–"
        lines.append(
            f"| {name} | {fmt_spread(row['new'], digits)} | {fmt_spread(row['old'], digits)} | {ratio} |"
        )
    return "\n".join(lines)


def run_baseline(
    script: str | Path,
    argv: Sequence[str] | None,
    args: argparse.Namespace,
    figures: Callable[[dict | list], dict[str, float]],
    digits: int = 1,
) -> int:
    """A script's `--baseline` mode: `interleave` its own command line (less --baseline) `args.reps`
    times per tree, then print the comparison (JSON with --json)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    result = interleave(script, without_flag(argv, "--baseline"), args.baseline, args.reps, figures)
    print(json.dumps(result, indent=1) if getattr(args, "json", False) else compare_table(result, digits))
    return 0
