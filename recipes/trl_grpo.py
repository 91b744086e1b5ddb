"""The demo's task through TRL: `maskroll demo --trainer trl`, the five-line change in a complete run.

The same toy task (`digits`), model, replicas and mask as `grpo.py`, but the loop is TRL's
`GRPOTrainer` — as `maskroll.integrations.trl.MaskrollGRPOTrainer`: a dataset of prompts, a reward
function, a `trl.GRPOConfig`, and a `MaskrollConfig` naming the queue, the weights root and the mask.
Returns the same summary as `grpo.train` (per-step rewards, mask and divergence statistics, realised
direction agreement, held-out reward before and after, the replicas' versions), read from TRL's logs.

Data-parallel (`maskroll demo --trainer trl --trainer-ranks N`): `train_ranks` runs `main` on N local
processes (torchrun, as `accelerate launch --multi_gpu --num_processes N` does; gloo on CPU), each rank
`train` with the run file's arguments; rank 0 reads the queue, evaluates, prints and returns the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch

from maskroll.client import RolloutQueue, SyncRolloutClient
from maskroll.integrations.trl import MaskrollConfig, MaskrollGRPOTrainer
from maskroll.weight_sync import CpuTransport

from . import digits
from .config import GRPOConfig
from .grpo import StepLog, evaluate, grpc_auth, progress, wait_for_replicas
from .grpo_launch import read_config, write_config
from .launch import exit_rank, run_ranks

# TRL log key → StepLog field (the `maskroll/*` keys are MaskrollGRPOTrainer's)
LOG_KEYS = {
    "reward": "reward",
    "maskroll/mask_frac": "mask_frac",
    "maskroll/far_frac": "far_frac",
    "maskroll/divergence_mean": "divergence_mean",
    "maskroll/mismatch_kl": "mismatch_kl",
    "maskroll/staleness": "staleness",
    "loss": "loss",
    "maskroll/agree_ratio_far": "agree_ratio_far",
    "maskroll/agree_predictive_far": "agree_predictive_far",
    "maskroll/agree_ratio_all": "agree_ratio_all",
    "maskroll/agree_predictive_all": "agree_predictive_all",
    "maskroll/disagreement_frac_far": "disagreement_frac_far",
}


def _step_log(
    step: int, version: int, logs: dict, seconds: float, tokens_per_s: float, replicas: dict
) -> StepLog:
    values = {f: float("nan") if logs.get(k) is None else float(logs[k]) for k, f in LOG_KEYS.items()}
    timing = {"tokens_per_s": tokens_per_s, "seconds": seconds}
    return StepLog(step=step, policy_version=version, replicas=replicas, **timing, **values)


def train(
    cfg: GRPOConfig,
    *,
    redis_url: str,
    namespace: str,
    model_dir: Path,
    weights_root: Path,
    min_replicas: int = 1,
    run: Literal["new", "resume"] = "new",
    out_dir: Path | None = None,
    weight_transport: CpuTransport = "stream",
    reward_stage: bool = False,
) -> dict | None:
    """Train against the replicas of `namespace` with MaskrollGRPOTrainer; returns grpo.train's summary.
    weight_transport: "stream" pushes each version over gRPC (weights_root: the trainer's own copy),
    "directory" writes it under weights_root, the replicas' --weights-root. reward_stage: the records
    arrive scored by a reward stage (digits.digit_reward_fn; MaskrollConfig.rewards_from_records).
    Under a launcher with WORLD_SIZE = W > 1 (`train_ranks`), each rank trains cfg.batch_size / W rows
    of every step; rank 0 returns the summary, the other ranks None."""
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig as TRLConfig

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    rng = random.Random(cfg.seed)
    encode = digits.encoder(model_dir)
    eval_prompts = [encode(p) for p in digits.held_out(cfg.eval_prompts)]
    dataset = Dataset.from_dict({"prompt": digits.prompts(rng, cfg.steps * cfg.prompts_per_step)})
    if reward_stage:  # the job's metadata: what digit_reward_fn reads on the stage
        dataset = dataset.add_column("max_tokens", [cfg.max_tokens] * len(dataset))

    def digit_reward(completion_ids, **_) -> list[float]:
        return [digits.digit_reward(ids, cfg.max_tokens) for ids in completion_ids]

    world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's ranks (TRL's GRPOConfig reads it too)
    if cfg.prompts_per_step % world:
        raise ValueError(
            f"prompts_per_step={cfg.prompts_per_step} on {world} ranks: each rank trains whole groups of "
            "the same number of prompts per step (TRL's per-device batch), so ranks must divide it"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    args = TRLConfig(
        output_dir=str(out_dir or Path(weights_root).parent / "trl"),
        # one optimiser step = one generation batch of cfg.batch_size rollouts, over all ranks
        per_device_train_batch_size=cfg.batch_size // world,
        num_generations=cfg.n,
        max_completion_length=cfg.max_tokens,
        temperature=cfg.temperature,
        max_steps=cfg.steps,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",  # grpo.py's Adam: no decay, no weight decay
        weight_decay=0.0,
        loss_type="bnpo",  # token mean over the batch, as grpo.py's policy_loss
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast, meant for GPUs; grpo.py trains in float32
    )
    auth = grpc_auth()
    maskroll = MaskrollConfig(
        redis_url=redis_url,
        namespace=namespace,
        run="resume",
        weight_transport=weight_transport,
        weights_root=weights_root,
        mask=cfg.mask,
        logprobs_k=cfg.logprobs_k,
        max_staleness=cfg.max_staleness,
        min_replicas=min_replicas,
        direction_diagnostics=True,
        rewards_from_records=reward_stage,
        **auth,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = MaskrollGRPOTrainer(
        model,
        reward_funcs=None if reward_stage else digit_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        maskroll=maskroll,
    )
    history: list[StepLog] = []
    t_train, t_step = time.monotonic(), [time.monotonic()]

    class Progress(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs or not state.is_world_process_zero:
                return
            now = time.monotonic()
            tokens = trainer.rollout_counts["tokens"]
            log = _step_log(
                state.global_step,
                trainer.policy_version,
                logs,
                now - t_step[0],
                tokens / (now - t_train),
                trainer.last_replicas,
            )
            t_step[0] = now
            history.append(log)
            print(progress(log.step, cfg.steps, log), flush=True)

    trainer.remove_callback(transformers.PrinterCallback)  # our progress line replaces its log dicts
    trainer.add_callback(Progress())
    main = trainer.accelerator.is_main_process
    if not main:  # rank 0 opens the run and evaluates; the others wait for it inside train()
        trainer.train()
        return None
    # This opens the run (new or resumed); the trainer then resumes it when train() connects.
    with RolloutQueue(redis_url, namespace, run=run, **auth) as q:
        eval_address = wait_for_replicas(q, min_replicas)[0].address
    reward_before = evaluate(eval_address, eval_prompts, cfg)
    print(f"  held-out reward before training: {reward_before:.3f}", flush=True)
    trainer.train()
    reward_after = evaluate(eval_address, eval_prompts, cfg)
    print(f"  held-out reward after training: {reward_after:.3f} (before: {reward_before:.3f})", flush=True)
    with RolloutQueue(redis_url, namespace, run="resume", **auth) as q:
        replica_versions = {}
        for rep in q.replicas():  # ask each replica: heartbeats refresh only every few seconds
            with SyncRolloutClient(rep.address, **auth) as c:
                replica_versions[rep.replica_id] = c.info().policy_version
    return {
        "mask_config": asdict(cfg.mask),
        "reward_before": reward_before,
        "reward_after": reward_after,
        "steps": [asdict(h) for h in history],
        "replica_versions": replica_versions,
        "queue": trainer.rollout_counts,
    }


def train_ranks(cfg: GRPOConfig, *, ranks: int, log: Path, **train_args) -> dict:
    """`train(cfg, **train_args)` on `ranks` local processes (torchrun; DDP over gloo on CPU); rank 0's
    summary. The run file and the summary go beside `log` (the ranks' output)."""
    if cfg.prompts_per_step % ranks:
        raise ValueError(
            f"--trainer trl on {ranks} ranks needs --prompts-per-step divisible by {ranks} (got "
            f"{cfg.prompts_per_step}): TRL gives every rank the same number of prompts per step"
        )
    result = log.with_name("trainer-summary.json")
    result.unlink(missing_ok=True)
    config = write_config(log.with_name("trainer-run.json"), cfg, result=result, **train_args)
    run_ranks(ranks, __name__, ["--config", config], log=log)
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    """One rank: `train` as the run file (`grpo_launch.write_config`) says; rank 0 writes the summary."""
    p = argparse.ArgumentParser(prog="maskroll.recipes.trl_grpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the run file (grpo_launch.write_config)")
    a = p.parse_args(argv)
    cfg, train_args, _, result = read_config(a.config)
    summary = train(cfg, **train_args)
    if summary is not None:  # rank 0
        tmp = result.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, result)
    return 0


if __name__ == "__main__":
    exit_rank(main())  # launch.exit_rank says why a rank does not return through the interpreter's exit
