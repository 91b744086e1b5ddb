"""One rank of test_trl_ranks.py's run: MaskrollGRPOTrainer under `accelerate launch --num_processes 2`.

Run by path by accelerate's launcher (never imported by pytest). Trains a few steps against the test's
replicas and Redis, then writes what this rank saw to `<out>/rank<r>.json`: per optimiser step the policy
version it held, per generation batch the records it trained on (rollout id, job id, sample index), its
rollout counts and the world it ran in.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig

from maskroll.integrations.trl import MaskrollConfig, MaskrollGRPOTrainer, UnsupportedOption
from maskroll.trainer_adapter import MaskConfig

G = 4  # num_generations
DIGITS = set(range(ord("0"), ord("9") + 1))


class RecordingTrainer(MaskrollGRPOTrainer):
    """Remembers the records of every generation batch this rank scores for training, and the
    micro-batches of the first optimiser step (the test recomputes that step on one process)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[list]] = []
        self.first_step: list[dict] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training and self.state.global_step == 0:
            self.first_step.append({k: v.detach().clone() for k, v in inputs.items()})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _score(self, records, rows, mode):
        out = super()._score(records, rows, mode)
        if mode == "train":  # (rollout id, job id, sample index, its reward, the advantage trained with)
            rewards = digits([r.completion_ids for r in records])
            advantages = out["advantages"].tolist()
            self.batches.append(
                [
                    [r.rollout_id, r.job_id, int(r.sample_index), w, a]
                    for r, w, a in zip(records, rewards, advantages, strict=True)
                ]
            )
        else:
            self.evaluated = [row["row_id"] for row in rows]
        return out


def digits(completion_ids, **_) -> list[float]:
    return [sum(t in DIGITS for t in ids) / 10 for ids in completion_ids]


def trl_args(out: str, steps: int, per_device: int = 4, accumulation: int = 2) -> GRPOConfig:
    """The run's TRL config: per process 4 rows (one group) in each of 2 micro-steps."""
    return GRPOConfig(
        output_dir=str(Path(out) / "trl"),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,  # = steps_per_generation: micro-steps per share
        num_generations=G,
        max_completion_length=10,
        max_steps=steps,
        max_grad_norm=0.0,  # no clipping: the first step's gradient is compared unscaled
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        bf16=False,  # TRL's default bf16 autocast: the test recomputes the first step in float32
        loss_type="bnpo",
        disable_tqdm=True,
        per_device_eval_batch_size=G,  # evaluation: one prompt's group per process
    )


def exact_hash(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in name order: equal only for bit-identical weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--redis-url", "--namespace", "--model-dir", "--weights-root", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    tok.padding_side = "left"
    words = ["count", "sum", "total", "pin", "year", "page"]
    ds = Dataset.from_dict({"prompt": [f"{words[i % 6]} {i}:" for i in range(64)], "row_id": list(range(64))})
    args = trl_args(a.out, a.steps)
    cfg = MaskrollConfig(
        redis_url=a.redis_url,
        namespace=a.namespace,
        run="new",
        weights_root=a.weights_root,
        mask=MaskConfig(method="predictive", divergence="topk_kl"),
        logprobs_k=8,
        max_staleness=1,
        min_replicas=2,
    )
    refused = ""
    try:  # what two processes cannot do: direct gRPC, a share of 2 rows of groups of 4
        direct = MaskrollConfig(replicas=("127.0.0.1:1",), weights_root=a.weights_root)
        small = trl_args(a.out, a.steps, per_device=2, accumulation=1)
        MaskrollGRPOTrainer(a.model_dir, reward_funcs=digits, args=small, train_dataset=ds, maskroll=direct)
    except UnsupportedOption as e:
        refused = str(e)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    trainer = RecordingTrainer(
        model, reward_funcs=digits, args=args, train_dataset=ds, processing_class=tok, maskroll=cfg
    )
    versions: list[list[int]] = []
    rank = trainer.accelerator.process_index

    class Versions(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # DDP's averaged gradient
            if state.global_step == 0:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                saved = {"inputs": trainer.first_step, "grads": grads}
                torch.save(saved, Path(a.out, f"rank{rank}-step1.pt"))

        def on_step_end(self, args, state, control, **kwargs):  # after MaskrollGRPOTrainer's publish
            versions.append([state.global_step, trainer.policy_version])

    trainer.add_callback(Versions())
    trainer.train()
    # evaluation: each process's prompt sampled by one replica through rank 0 (never queued)
    evaluated = trainer.evaluate(eval_dataset=ds.select(range(2)))
    acc = trainer.accelerator
    out = {
        "rank": acc.process_index,
        "world": acc.num_processes,
        "distributed_type": str(acc.distributed_type.value),
        "backend": acc.state.backend,
        "generation_batch_size": args.generation_batch_size,
        "versions": versions,
        "batches": trainer.batches,
        "counts": trainer.rollout_counts,
        "refused": refused,
        "evaluated_rows": trainer.evaluated,
        "eval": {k: v for k, v in evaluated.items() if k in ("eval_reward", "eval_completions/mean_length")},
        "version_after_eval": trainer.policy_version,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": exact_hash(acc.unwrap_model(trainer.model)),
    }
    Path(a.out, f"rank{acc.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    from maskroll.recipes.launch import exit_rank

    main()
    exit_rank(0)  # launch.exit_rank: a DDP rank does not return through the interpreter's exit
