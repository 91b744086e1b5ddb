"""`maskroll demo`: asynchronous RL end to end, on one machine, in a few minutes.

A private Redis, two pull-mode rollout replicas (`maskroll serve --pull`, engine auto: vLLM if
installed, else the torch engine) on a model made by `init-model`, and a trainer loop in the
foreground: submit prompts under admission control → consume whole GRPO groups → collate → group
advantages → compute_masks → policy_loss → Adam → publish weights → next step, with max_staleness = 1
so generation and training overlap. The task (`maskroll.recipes.digits`) is verifiable: write digits.

This module is the orchestrator only (processes, CLI, summary, figure): the trainer is the GRPO recipe
(`recipes/grpo.py`), which uses only the public APIs, as a user's trainer would. Its configuration,
DemoConfig, holds the recipe's GRPOConfig, which holds the MaskConfig; each flag is one of their fields
(FLAGS), with that field's documentation as its --help (app/flags.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

from maskroll.local.replica import LocalReplica, stop_all, wait_all
from maskroll.recipes.config import GRPOConfig
from maskroll.weight_sync import CpuTransport

from .flags import add_flags, from_flags

Engine = Literal["auto", "torch", "vllm"]
Trainer = Literal["maskroll", "trl"]  # the GRPO recipe, or TRL's GRPOTrainer through maskroll (recipes/)


@dataclass(frozen=True)
class DemoConfig:
    """What `maskroll demo` starts and where it writes; the trainer's own settings are `grpo`.

    out: output directory (summary.json, demo.png)
    grpo: the GRPO recipe's settings (recipes.config.GRPOConfig), the mask nested in them
    engine: the replicas' engine: vllm, torch, or auto = vllm if installed, else torch
    trainer: maskroll: the GRPO recipe; trl: TRL's GRPOTrainer as MaskrollGRPOTrainer (recipes/trl_grpo.py)
    trainer_ranks: the learner as this many local processes (torchrun, gloo): rank 0 reads each batch and
        scatters whole groups, balanced by tokens; the loss is normalised over the whole batch
    replicas: pull-mode replicas to start
    reward_workers: score the rollouts with this many `maskroll reward` processes (the reward stage) instead
        of in the trainer; 0: in the trainer
    spawn: start a private Redis and the replicas (--no-spawn: use an existing Redis and replicas)
    redis_url: the existing Redis (--no-spawn); default $MASKROLL_REDIS_URL
    namespace: the queue namespace the replicas serve
    weights_dir: checkpoints: the trainer's copy (stream) or the replicas' weights root (directory)
    model: model directory (default: <out>/model, a tiny init-model on the digits task); `smollm2`:
        SmolLM2-135M-Instruct (init-model --from smollm2; 4-bit weights, dequantised) on arithmetic word
        problems (recipes/arithmetic.py), with its own defaults for the other flags (SMOLLM2_DEFAULTS)
    weight_transport: stream: push weights to the replicas over gRPC (default); directory: a shared weights
        root
    distill: a teacher model directory (e.g. an earlier demo's <out>/final, same tokenizer): train the
        student by on-policy distillation from it — a teacher replica and a `maskroll teacher` process attach
        its scores to every rollout (docs/rewards.md "The teacher stage"); pure distillation unless
        --distill-weight
    distill_weight: with --distill, mix: advantage = the RL advantage + this × (log π_teacher − log π) per
        token; unset: the distillation term alone (weight 1)
    """

    out: Path = Path("maskroll-demo")
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    engine: Engine = "auto"
    trainer: Trainer = "maskroll"
    trainer_ranks: int = 1
    replicas: int = 2
    reward_workers: int = 0
    spawn: bool = True
    redis_url: str | None = field(default_factory=lambda: os.environ.get("MASKROLL_REDIS_URL"))
    namespace: str = "demo"
    weights_dir: Path | None = None
    model: Path | None = None  # written by init-model when unset
    weight_transport: CpuTransport = "stream"
    distill: Path | None = None
    distill_weight: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.grpo, GRPOConfig):
            raise TypeError(f"DemoConfig.grpo must be a GRPOConfig, got {type(self.grpo).__name__}")
        if not (isinstance(self.replicas, int) and self.replicas >= 1):
            raise ValueError(f"DemoConfig.replicas={self.replicas!r}; expected an int >= 1")
        ranks = self.trainer_ranks
        if not (isinstance(ranks, int) and not isinstance(ranks, bool) and 1 <= ranks <= 64):
            raise ValueError(f"DemoConfig.trainer_ranks={ranks!r}; expected an int in [1, 64]")
        if ranks > self.grpo.prompts_per_step:
            raise ValueError(
                f"--trainer-ranks {ranks} needs --prompts-per-step >= {ranks} (got "
                f"{self.grpo.prompts_per_step}): each rank trains whole groups, one per prompt"
            )
        if ranks > 1 and self.trainer not in ("maskroll", "trl"):
            raise ValueError(f"--trainer-ranks {ranks} is not supported with --trainer {self.trainer} yet")
        if ranks > 1 and self.trainer == "trl" and self.grpo.prompts_per_step % ranks:
            raise ValueError(
                f"--trainer trl --trainer-ranks {ranks} needs --prompts-per-step divisible by {ranks} (got "
                f"{self.grpo.prompts_per_step}): TRL gives every rank the same number of prompts per step"
            )
        if not (isinstance(self.reward_workers, int) and 0 <= self.reward_workers <= 64):
            raise ValueError(f"DemoConfig.reward_workers={self.reward_workers!r}; expected an int in [0, 64]")
        if self.reward_workers and not self.spawn:
            raise ValueError(
                "--reward-workers starts reward processes: it needs the demo to spawn (no --no-spawn)"
            )
        if self.distill is not None and (not self.spawn or self.trainer != "maskroll" or self.is_smollm2):
            raise ValueError(
                "--distill starts a teacher replica and a teacher stage for the GRPO recipe on the digits "
                "task: it needs the demo to spawn, --trainer maskroll and the tiny model"
            )
        w = self.distill_weight
        if w is not None and (self.distill is None or not math.isfinite(w)):
            raise ValueError(f"--distill-weight {self.distill_weight} needs --distill and a finite value")
        if self.is_smollm2 and (self.trainer != "maskroll" or self.reward_workers):
            given = f"--trainer {self.trainer}" if self.trainer != "maskroll" else "--reward-workers"
            raise ValueError(
                "--model smollm2 runs the GRPO recipe with the arithmetic task scored in the trainer; "
                f"{given} is not supported with it yet"
            )
        rank = self.grpo.lora.lora_rank
        if rank and (self.trainer != "maskroll" or self.weight_transport != "stream"):
            raise ValueError(
                f"--lora-rank {rank} trains adapters with the GRPO recipe and pushes them over the stream "
                f"transport: it needs --trainer maskroll and --weight-transport stream (got --trainer "
                f"{self.trainer}, --weight-transport {self.weight_transport})"
            )
        if not self.spawn and not (
            self.redis_url and self.model and (self.weights_dir or self.weight_transport == "stream")
        ):
            needed = {"redis_url": self.redis_url, "model": self.model}
            if self.weight_transport == "directory":
                needed["weights_dir"] = self.weights_dir
            unset = ", ".join(k for k, v in needed.items() if not v)
            raise ValueError(
                "--no-spawn needs --redis-url, --model and, with --weight-transport directory, --weights-dir "
                f"(the replicas' weights root); unset: {unset}"
            )

    @property
    def is_smollm2(self) -> bool:
        return self.model is not None and str(self.model) == "smollm2"


# `maskroll demo --model smollm2`: a pretrained 135M model needs a learning rate ~100× below the tiny
# model's 2e-3 and fewer, shorter rollouts per step to fit 2 CPU cores; the flags still override each.
# Measured on 2 loaded cores (README): these 6 steps took 618 s and held-out accuracy went 0.06 → 0.23.
SMOLLM2_DEFAULTS = GRPOConfig(steps=6, prompts_per_step=4, n=8, max_tokens=10, lr=2e-5)


# The flags of `maskroll demo`, in --help order: each is the field at this path (app/flags.py).
FLAGS = (
    "out",
    "grpo.steps",
    "grpo.seed",
    "grpo.mask.method",
    "grpo.mask.divergence",
    "grpo.mask.estimator",
    "grpo.mask.delta",
    "engine",
    "trainer",
    "trainer_ranks",
    "replicas",
    "reward_workers",
    "distill",
    "distill_weight",
    "grpo.prompts_per_step",
    "grpo.n",
    "grpo.max_tokens",
    "grpo.lr",
    "grpo.lora.lora_rank",
    "grpo.lora.lora_alpha",
    "grpo.replica_dtype",
    "grpo.weight_deltas",
)
CLUSTER_FLAGS = ("spawn", "redis_url", "namespace", "weights_dir", "weight_transport", "model")


# ---- processes ------------------------------------------------------------------------------------


class Cluster:
    """Redis + pull-mode replicas started by the demo; every process started here is stopped on exit."""

    def __init__(self, cfg: DemoConfig, model: Path, weights: Path, log_dir: Path) -> None:
        self.cfg, self.model, self.weights, self.log_dir = cfg, model, weights, log_dir
        self.redis = None
        self.replicas: list[LocalReplica] = []
        self.rewarders: list = []  # `maskroll reward` processes (--reward-workers)
        self.teachers: list[LocalReplica] = []  # the teacher replica (--distill)
        self.teacher_stage = None  # its `maskroll teacher` process
        self.url = cfg.redis_url

    def __enter__(self) -> Cluster:
        if not self.cfg.spawn:
            return self
        from maskroll.local.redis_server import LocalRedis

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = LocalRedis(appendonly=False, data_dir=self.log_dir / "redis").start()
        self.url = self.redis.url
        threads = max(1, (os.cpu_count() or 2) // (self.cfg.replicas + 1))
        directory = self.cfg.weight_transport == "directory"
        for i in range(self.cfg.replicas):
            args = ["--model", self.model, "--engine", self.cfg.engine, "--port", "0"]
            args += ["--threads", str(threads), "--namespace", self.cfg.namespace, "--pull"]
            args += ["--replica-id", f"demo-replica-{i}"]
            args += ["--weights-root", self.weights] if directory else []
            args += ["--max-logprobs", str(self.cfg.grpo.logprobs_k), "--drain-timeout-s", "5"]
            if self.cfg.grpo.replica_dtype != "auto":  # the trainer casts and pushes in it too
                args += ["--dtype", self.cfg.grpo.replica_dtype]
            if self.cfg.grpo.lora.enabled:  # the replicas apply the trainer's adapters up to this rank
                args += ["--max-lora-rank", str(self.cfg.grpo.lora.lora_rank)]
            # vLLM on CPU: compiling the model would cost more start-up than a short run saves
            args += ["--enforce-eager"]
            replica = LocalReplica(
                args,
                env={"OMP_NUM_THREADS": str(threads), "MASKROLL_REDIS_URL": self.url},
                log=self.log_dir / f"replica-{i}.log",
                name=f"replica {i}",
                own_session=True,
            )
            self.replicas.append(replica.start())
        for i in range(self.cfg.reward_workers):
            self.rewarders.append(self._rewarder(i))
        if self.cfg.distill is not None:
            args = ["--model", Path(self.cfg.distill).resolve(), "--engine", self.cfg.engine, "--port", "0"]
            args += ["--threads", str(threads), "--max-logprobs", str(self.cfg.grpo.logprobs_k)]
            args += ["--enforce-eager", "--drain-timeout-s", "5", "--replica-id", "demo-teacher"]
            teacher = LocalReplica(
                args,
                env={"OMP_NUM_THREADS": str(threads)},
                log=self.log_dir / "teacher.log",
                name="teacher",
                own_session=True,
            )
            self.teachers.append(teacher.start())
        return self

    def _teacher_stage(self):
        """One `maskroll teacher` process: every rollout's teacher scores and reward (--distill)."""
        import subprocess

        cmd = [sys.executable, "-m", "maskroll.app.cli", "teacher", "--redis-url", self.url]
        cmd += ["--namespace", self.cfg.namespace, "--teacher", self.teachers[0].address]
        cmd += ["--teacher-k", str(self.cfg.grpo.logprobs_k), "--tokenizer", str(self.model)]
        # the task's reward too (one stage does both): the trainer reads scored records, and reports the
        # reward even when it trains on the distillation term alone
        cmd += ["--reward", "maskroll.recipes.digits:digit_reward_fn"]
        cmd += ["--worker-id", "demo-teacher-stage", "--log-every-s", "0"]
        with open(self.log_dir / "teacher-stage.log", "wb") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _rewarder(self, i: int):
        """One `maskroll reward` process scoring the demo's task (recipes.digits.digit_reward_fn)."""
        import subprocess

        cmd = [sys.executable, "-m", "maskroll.app.cli", "reward", "--redis-url", self.url]
        cmd += ["--namespace", self.cfg.namespace, "--reward", "maskroll.recipes.digits:digit_reward_fn"]
        cmd += ["--tokenizer", str(self.model), "--worker-id", f"demo-reward-{i}", "--log-every-s", "0"]
        with open(self.log_dir / f"reward-{i}.log", "wb") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        wait_all(self.replicas + self.teachers, timeout)
        if self.teachers:  # after the replicas: the stage compares the teacher's vocabulary with theirs
            self.teacher_stage = self._teacher_stage()

    def __exit__(self, *exc: object) -> None:
        try:
            stages = self.rewarders + ([self.teacher_stage] if self.teacher_stage is not None else [])
            for p in stages:  # only the processes started here, by PID
                p.send_signal(signal.SIGTERM)
            for p in stages:
                try:
                    p.wait(20)
                except Exception:
                    p.kill()
                    p.wait()
            # a second Ctrl-C here kills the rest, then re-raises
            stop_all(self.replicas + self.teachers, timeout=20.0)
        finally:
            if self.redis is not None:
                self.redis.close()


# ---- the trainer loop -------------------------------------------------------------------------------


def run(cfg: DemoConfig) -> dict:
    """Run one demo (cluster up, train with the GRPO recipe, cluster down); returns the summary dict."""
    from maskroll.recipes import grpo

    from .model_init import init_model

    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    model_dir = cfg.model or out / "model"
    task = {}
    if cfg.is_smollm2:  # converted once per venv (app/smollm2.py), then shared by every run
        from maskroll.recipes import arithmetic

        from . import smollm2

        try:
            model_dir = smollm2.cached("float32")
        except smollm2.SmolLM2Missing as exc:  # the install hint, not a traceback
            raise SystemExit(f"maskroll demo --model smollm2: {exc}") from None
        task = {"task": arithmetic.QueueTask(model_dir)}
    elif cfg.model is None and not (model_dir / "config.json").exists():
        init_model(model_dir, seed=cfg.grpo.seed)
    weights = (cfg.weights_dir or out / "weights").resolve()
    if cfg.spawn and weights.exists():
        shutil.rmtree(weights)  # versions restart at 1 with fresh replicas
    weights.mkdir(parents=True, exist_ok=True)

    t_start = time.monotonic()
    g, mask = cfg.grpo, cfg.grpo.mask
    print(
        f"maskroll demo: {cfg.replicas} replicas (engine {cfg.engine}), trainer {cfg.trainer}"
        + (f" on {cfg.trainer_ranks} ranks" if cfg.trainer_ranks > 1 else "")
        + (f", {cfg.reward_workers} reward workers" if cfg.reward_workers else "")
        + ", method "
        f"{mask.method} + {mask.divergence} + {mask.estimator}, {g.steps} steps of {g.batch_size} "
        f"rollouts -> {out}/",
        flush=True,
    )
    with Cluster(cfg, model_dir.resolve(), weights, out / "logs") as cluster:
        # vLLM CPU loads SmolLM2 in 1-2 min on an idle machine; on a loaded one it has taken 5
        cluster.wait_ready(900.0 if cfg.is_smollm2 else 300.0)
        print(f"  replicas ready after {time.monotonic() - t_start:.0f} s", flush=True)
        stage = {"reward_stage": True} if cfg.reward_workers or cfg.distill else {}
        distill = {}
        if cfg.distill is not None:  # pure distillation (weight 1, no RL term) unless --distill-weight
            w = cfg.distill_weight
            distill = {"distill_weight": 1.0 if w is None else w, "distill_rl": w is not None}
        train = partial(
            grpo.train,
            weight_transport=cfg.weight_transport,
            final_dir=out / "final",
            **stage,
            **task,
            **distill,
        )
        if cfg.trainer_ranks > 1:  # N local ranks under torchrun; rank 0's summary comes back
            from maskroll.recipes import grpo_launch

            train = partial(
                grpo_launch.train_ranks,
                ranks=cfg.trainer_ranks,
                log=out / "logs" / "trainer.log",
                task="arithmetic" if cfg.is_smollm2 else "digits",
                weight_transport=cfg.weight_transport,
                final_dir=out / "final",
                **stage,
                **distill,
            )
        if cfg.trainer == "trl":
            from maskroll.recipes import trl_grpo

            train = partial(
                trl_grpo.train, out_dir=out / "trl", weight_transport=cfg.weight_transport, **stage
            )
            if cfg.trainer_ranks > 1:  # N local ranks (torchrun, DDP over gloo); rank 0's summary
                log = out / "logs" / "trainer.log"
                train = partial(trl_grpo.train_ranks, ranks=cfg.trainer_ranks, log=log, **train.keywords)
        result = train(
            cfg.grpo,
            redis_url=cluster.url,
            namespace=cfg.namespace,
            model_dir=model_dir,
            weights_root=weights,
            min_replicas=cfg.replicas if cfg.spawn else 1,
        )
    summary = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        **result,
        "reward_workers": cfg.reward_workers,
        "trainer_ranks": cfg.trainer_ranks,
        "seconds": time.monotonic() - t_start,
    }
    # the weights each update moves: the adapter with --lora-rank, else the whole model (the recipe's
    # figures; the TRL trainer reports none)
    summary.setdefault("lora_rank", cfg.grpo.lora.lora_rank)
    for key in ("model_bytes", "weight_bytes_per_update", "weight_updates", "replicas_match_trainer"):
        summary.setdefault(key, None)
    if cfg.trainer == "maskroll":
        summary["final"] = str(out / "final")
    if cfg.distill is not None:  # first / last training step: the KL to the teacher and the batch reward
        steps = result["steps"]
        summary["distill"] = {
            "teacher": str(cfg.distill),
            "weight": cfg.distill_weight,
            "kl_first": steps[0]["distill_kl"],
            "kl_last": steps[-1]["distill_kl"],
            "reward_first": steps[0]["reward"],
            "reward_last": steps[-1]["reward"],
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
    sent, full = summary.get("weight_bytes_per_update"), summary.get("model_bytes")
    if sent and full:
        what = f"LoRA rank {summary['lora_rank']} adapter" if summary.get("lora_rank") else "full weights"
        how = summary.get("weight_updates") or {}
        if how.get("delta"):
            what += f"; {how['delta']} deltas, {how.get('full', 0)} full"
        lines.append(
            f"weights per update and replica: {sent / 1e6:.3f} MB ({what}; the full model is "
            f"{full / 1e6:.1f} MB: {sent / full:.2%})"
        )
        if summary.get("replicas_match_trainer") is not None:
            same = "equal" if summary["replicas_match_trainer"] else "NOT equal"
            lines.append(f"replicas' weights fingerprints after the last version: {same} to the trainer's")
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
    """The demo's config from its flags (one per field in FLAGS and CLUSTER_FLAGS, help from the fields'
    docs), and whether to --compare; an invalid value exits 2 with the config's message."""
    p = argparse.ArgumentParser(prog="maskroll demo", description=__doc__.split("\n\n")[0])
    smol = any(
        a == "--model=smollm2" or (a == "smollm2" and i and argv[i - 1] == "--model")
        for i, a in enumerate(argv)
    )
    default = DemoConfig(grpo=SMOLLM2_DEFAULTS) if smol else DemoConfig()
    add_flags(p, default, FLAGS)
    p.add_argument("--compare", action="store_true", help="run ppo, dppo and predictive with the same seed")
    add_flags(p, DemoConfig(), CLUSTER_FLAGS)
    a = p.parse_args(argv)
    try:
        cfg = from_flags(DemoConfig, a, FLAGS + CLUSTER_FLAGS)
    except ValueError as e:
        p.error(str(e))
    return cfg, a.compare


def main(argv: list[str]) -> int:
    cfg, compare = parse(argv)
    # SIGTERM ends the demo like Ctrl-C: the `with Cluster` blocks stop every process they started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if compare:
            summaries = {}
            for method in ("ppo", "dppo", "predictive"):
                grpo_cfg = replace(cfg.grpo, mask=replace(cfg.grpo.mask, method=method))
                run_cfg = replace(
                    cfg, grpo=grpo_cfg, out=cfg.out / method, namespace=f"{cfg.namespace}-{method}"
                )
                summaries[method] = run(run_cfg)
                print(summary_table(summaries[method]), flush=True)
            figure(summaries, cfg.out / "demo.png")
            (cfg.out / "summary.json").write_text(json.dumps(summaries, indent=2))
        else:
            summary = run(cfg)
            figure({cfg.grpo.mask.method: summary}, cfg.out / "demo.png")
            print(summary_table(summary))
        print(f"wrote {cfg.out}/summary.json and {cfg.out}/demo.png")
        return 0
    except KeyboardInterrupt:
        print("maskroll demo: interrupted; all processes it started were stopped", file=sys.stderr)
        return 130
