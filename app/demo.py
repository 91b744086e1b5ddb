"""`maskroll demo`: asynchronous RL end to end, on one machine, in a few minutes.

A private Redis, two pull-mode rollout replicas (`maskroll serve --pull`, engine auto: vLLM if
installed, else the torch engine) on a model made by `init-model`, and a trainer loop in the
foreground: submit prompts under admission control → consume whole GRPO groups → collate → group
advantages → compute_masks → policy_loss → Adam → publish weights → next step, with max_staleness = 1
so generation and training overlap. The task (`maskroll.recipes.digits`) is verifiable: write digits.

This module is the orchestrator only (processes, CLI, summary, figure): the trainer is the GRPO recipe
(`recipes/grpo.py`), which uses only the public APIs, as a user's trainer would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Literal, get_args

from maskroll.trainer_adapter.config import Divergence, Estimator, Method

Engine = Literal["auto", "torch", "vllm"]
Trainer = Literal["maskroll", "trl"]  # the GRPO recipe, or TRL's GRPOTrainer through maskroll (recipes/)
# stream: weights pushed to the replicas over gRPC (no shared filesystem); directory: a shared weights root
WeightTransport = Literal["stream", "directory"]


@dataclass(frozen=True)
class DemoConfig:
    out: Path = Path("maskroll-demo")
    steps: int = 30
    seed: int = 0
    method: Method = "predictive"
    divergence: Divergence = "topk_kl"
    estimator: Estimator = "proportional"
    delta: float | None = None  # default per divergence (MaskConfig)
    engine: Engine = "auto"
    trainer: Trainer = "maskroll"
    replicas: int = 2
    prompts_per_step: int = 8
    n: int = 8  # samples per prompt (one GRPO group)
    max_tokens: int = 16
    logprobs_k: int = 20
    temperature: float = 1.0
    lr: float = 2e-3
    max_staleness: int = 1
    eval_prompts: int = 16
    eval_n: int = 4
    # --no-spawn: train against an existing Redis and replicas (compose / Kubernetes)
    spawn: bool = True
    redis_url: str | None = None
    namespace: str = "demo"
    weights_dir: Path | None = None
    model: Path | None = None  # default: <out>/model, written by init-model
    weight_transport: WeightTransport = "stream"

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.n


# ---- processes ------------------------------------------------------------------------------------


class Cluster:
    """Redis + pull-mode replicas started by the demo; every process started here is stopped on exit."""

    def __init__(self, cfg: DemoConfig, model: Path, weights: Path, log_dir: Path) -> None:
        self.cfg, self.model, self.weights, self.log_dir = cfg, model, weights, log_dir
        self.redis = None
        self.procs: list[subprocess.Popen] = []
        self.url = cfg.redis_url

    def __enter__(self) -> Cluster:
        if not self.cfg.spawn:
            return self
        from maskroll.local.redis_server import LocalRedis

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = LocalRedis(appendonly=False, data_dir=self.log_dir / "redis").start()
        self.url = self.redis.url
        threads = max(1, (os.cpu_count() or 2) // (self.cfg.replicas + 1))
        for i in range(self.cfg.replicas):
            log = open(self.log_dir / f"replica-{i}.log", "w")  # the child keeps its own copy of the fd
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MASKROLL_REDIS_URL": self.url}
            cmd = [
                sys.executable,
                "-m",
                "maskroll.app.cli",
                "serve",
                "--model",
                str(self.model),
                "--engine",
                self.cfg.engine,
                "--port",
                "0",
                "--threads",
                str(threads),
                "--namespace",
                self.cfg.namespace,
                "--pull",
                "--replica-id",
                f"demo-replica-{i}",
                *(("--weights-root", str(self.weights)) if self.cfg.weight_transport == "directory" else ()),
                "--max-logprobs",
                str(self.cfg.logprobs_k),
                "--drain-timeout-s",
                "5",
                # vLLM on CPU: compiling the model would cost more start-up than a short run saves
                "--enforce-eager",
            ]
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
            log.close()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        for i, p in enumerate(self.procs):
            path = self.log_dir / f"replica-{i}.log"
            while "ready on" not in path.read_text(errors="replace"):
                if p.poll() is not None:
                    tail = path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"replica {i} exited with {p.returncode}:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {i} not ready after {timeout} s (log: {path})")
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        interrupted = False
        for p in self.procs:
            try:
                p.wait(0 if interrupted else 20)
            except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
                # A second Ctrl-C / SIGTERM while replicas drain must not orphan them: kill the rest now.
                interrupted = interrupted or isinstance(e, KeyboardInterrupt)
                p.kill()
                p.wait()
        if self.redis is not None:
            self.redis.close()
        if interrupted:
            raise KeyboardInterrupt


# ---- the trainer loop -------------------------------------------------------------------------------


def grpo_config(cfg: DemoConfig):
    """The trainer's part of the demo's configuration (the recipe's own config)."""
    from maskroll.recipes.grpo import GRPOConfig

    return GRPOConfig(**{f.name: getattr(cfg, f.name) for f in fields(GRPOConfig)})


def run(cfg: DemoConfig) -> dict:
    """Run one demo (cluster up, train with the GRPO recipe, cluster down); returns the summary dict."""
    from maskroll.recipes import grpo

    from .model_init import init_model

    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir = cfg.model or out / "model"
    if cfg.model is None and not (model_dir / "config.json").exists():
        init_model(model_dir, seed=cfg.seed)
    weights = (cfg.weights_dir or out / "weights").resolve()
    if cfg.spawn and weights.exists():
        shutil.rmtree(weights)  # versions restart at 1 with fresh replicas
    weights.mkdir(parents=True, exist_ok=True)

    t_start = time.monotonic()
    print(
        f"maskroll demo: {cfg.replicas} replicas (engine {cfg.engine}), trainer {cfg.trainer}, method "
        f"{cfg.method} + {cfg.divergence} + {cfg.estimator}, {cfg.steps} steps of {cfg.batch_size} "
        f"rollouts -> {out}/",
        flush=True,
    )
    with Cluster(cfg, model_dir.resolve(), weights, out / "logs") as cluster:
        cluster.wait_ready()
        print(f"  replicas ready after {time.monotonic() - t_start:.0f} s", flush=True)
        train = partial(grpo.train, weight_transport=cfg.weight_transport)
        if cfg.trainer == "trl":
            from maskroll.recipes import trl_grpo

            train = partial(trl_grpo.train, out_dir=out / "trl", weight_transport=cfg.weight_transport)
        result = train(
            grpo_config(cfg),
            redis_url=cluster.url,
            namespace=cfg.namespace,
            model_dir=model_dir,
            weights_root=weights,
            min_replicas=cfg.replicas if cfg.spawn else 1,
        )
    summary = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        **result,
        "seconds": time.monotonic() - t_start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# ---- report ---------------------------------------------------------------------------------------


def summary_table(summary: dict) -> str:
    steps = summary["steps"]
    first, last = steps[: max(1, len(steps) // 5)], steps[-max(1, len(steps) // 5) :]

    def mean(rows, key):
        vals = [r[key] for r in rows if r[key] == r[key]]  # drop nan
        return sum(vals) / len(vals) if vals else float("nan")

    lines = [
        f"{'':28}{'first steps':>14}{'last steps':>14}",
        f"{'train reward':28}{mean(first, 'reward'):14.3f}{mean(last, 'reward'):14.3f}",
        f"{'mask fraction':28}{mean(first, 'mask_frac'):14.2%}{mean(last, 'mask_frac'):14.2%}",
        f"{'mean divergence':28}{mean(first, 'divergence_mean'):14.4f}{mean(last, 'divergence_mean'):14.4f}",
        f"{'mismatch KL on S':28}{mean(first, 'mismatch_kl'):14.4f}{mean(last, 'mismatch_kl'):14.4f}",
        f"{'staleness (versions)':28}{mean(first, 'staleness'):14.2f}{mean(last, 'staleness'):14.2f}",
        f"{'agreement on far: ratio':28}{mean(steps, 'agree_ratio_far'):14.3f}",
        f"{'agreement on far: predictive':28}{mean(steps, 'agree_predictive_far'):14.3f}",
        f"held-out reward: {summary['reward_before']:.3f} before -> {summary['reward_after']:.3f} after; "
        f"{summary['seconds']:.0f} s in all",
    ]
    return "\n".join(lines)


def figure(summaries: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    # One colour per run; the line style tells the series apart (solid / dotted, dashed / solid).
    for i, (run, s) in enumerate(summaries.items()):
        name, c = (run if len(summaries) > 1 else ""), f"C{i}"  # one run: no need to name it in labels
        steps = [r["step"] for r in s["steps"]]

        def series(key: str, rows=s["steps"]) -> list[float]:
            return [r[key] for r in rows]

        ax[0].plot(steps, series("reward"), color=c, label=f"{name} train".strip())
        ax[0].scatter([0, steps[-1]], [s["reward_before"], s["reward_after"]], color=c, marker="D", s=30)
        ax[1].plot(steps, series("mask_frac"), color=c, label=f"{name} masked".strip())
        ax[1].plot(steps, series("far_frac"), color=c, linestyle=":", label=f"{name} far (D > δ)".strip())
        ax[2].plot(
            steps, series("agree_ratio_far"), color=c, linestyle="--", label=f"{name} ratio rule".strip()
        )
        ax[2].plot(steps, series("agree_predictive_far"), color=c, label=f"{name} predictive rule".strip())
    ax[0].set(title="reward (◆ = held-out before / after)", xlabel="step", ylabel="digit fraction")
    ax[1].set(title="tokens masked / outside the trust region", xlabel="step", ylabel="fraction")
    ax[2].set(
        title="sign agreement with realised ΔD (far tokens)",
        xlabel="step",
        ylabel="agreement",
        ylim=(0, 1.05),
    )
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- CLI ------------------------------------------------------------------------------------------


def parse(argv: list[str]) -> tuple[DemoConfig, bool]:
    d = DemoConfig()
    p = argparse.ArgumentParser(prog="maskroll demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=d.out, help="output directory (summary.json, demo.png)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--method", choices=get_args(Method), default=d.method)
    p.add_argument("--divergence", choices=get_args(Divergence), default=d.divergence)
    p.add_argument("--estimator", choices=get_args(Estimator), default=d.estimator)
    p.add_argument("--delta", type=float, default=None, help="trust-region δ (default per divergence)")
    p.add_argument("--engine", choices=get_args(Engine), default=d.engine)
    p.add_argument(
        "--trainer",
        choices=get_args(Trainer),
        default=d.trainer,
        help="maskroll: the GRPO recipe; trl: TRL's GRPOTrainer as MaskrollGRPOTrainer (recipes/trl_grpo.py)",
    )
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--n", type=int, default=d.n, help="samples per prompt (GRPO group size)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--compare", action="store_true", help="run ppo, dppo and predictive with the same seed")
    p.add_argument("--no-spawn", action="store_true", help="use an existing Redis and replicas")
    p.add_argument("--redis-url", default=os.environ.get("MASKROLL_REDIS_URL"))
    p.add_argument("--namespace", default=d.namespace)
    p.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        help="checkpoints: the trainer's copy (stream) or the replicas' weights root (directory)",
    )
    p.add_argument(
        "--weight-transport",
        choices=get_args(WeightTransport),
        default=d.weight_transport,
        help="stream: push weights to the replicas over gRPC (default); directory: a shared weights root",
    )
    p.add_argument("--model", type=Path, default=None, help="model directory (default: <out>/model)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.n < 2 or a.prompts_per_step < 1 or a.replicas < 1 or a.max_tokens < 1:
        p.error("need steps >= 1, n >= 2 (a group needs two samples), prompts-per-step >= 1, replicas >= 1")
    if a.no_spawn and not (a.redis_url and a.model and (a.weights_dir or a.weight_transport == "stream")):
        p.error(
            "--no-spawn needs --redis-url, --model and, with --weight-transport directory, --weights-dir "
            "(the replicas' weights root)"
        )
    cfg = DemoConfig(
        out=a.out,
        steps=a.steps,
        seed=a.seed,
        method=a.method,
        divergence=a.divergence,
        estimator=a.estimator,
        delta=a.delta,
        engine=a.engine,
        trainer=a.trainer,
        replicas=a.replicas,
        prompts_per_step=a.prompts_per_step,
        n=a.n,
        max_tokens=a.max_tokens,
        lr=a.lr,
        spawn=not a.no_spawn,
        redis_url=a.redis_url,
        namespace=a.namespace,
        weights_dir=a.weights_dir,
        model=a.model,
        weight_transport=a.weight_transport,
    )
    return cfg, a.compare


def main(argv: list[str]) -> int:
    cfg, compare = parse(argv)
    # SIGTERM ends the demo like Ctrl-C: the `with Cluster` blocks stop every process they started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if compare:
            summaries = {}
            for method in ("ppo", "dppo", "predictive"):
                run_cfg = replace(
                    cfg, method=method, out=cfg.out / method, namespace=f"{cfg.namespace}-{method}"
                )
                summaries[method] = run(run_cfg)
                print(summary_table(summaries[method]), flush=True)
            figure(summaries, cfg.out / "demo.png")
            (cfg.out / "summary.json").write_text(json.dumps(summaries, indent=2))
        else:
            summary = run(cfg)
            figure({cfg.method: summary}, cfg.out / "demo.png")
            print(summary_table(summary))
        print(f"wrote {cfg.out}/summary.json and {cfg.out}/demo.png")
        return 0
    except KeyboardInterrupt:
        print("maskroll demo: interrupted; all processes it started were stopped", file=sys.stderr)
        return 130
