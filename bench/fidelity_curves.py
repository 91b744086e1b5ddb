"""Learning curves of the fidelity study: held-out accuracy against step, one training run per mask rule.

The question users ask of a mask is not which tokens it keeps but whether the policy learns. One curve
is one seed trained with one rule's mask on SmolLM2's arithmetic task (recipes/arithmetic.py): the
in-process torch engine samples each batch `staleness` versions behind the trainer (as fidelity_run),
the trainer takes the masked GRPO step, and every `eval_every` steps the trainer's own weights answer the
held-out problems greedily (accuracy = share whose last integer is the answer). Rules are paired by seed:
the same prompts in the same order, the same first batch. No own steps and no decomposition: this is
plain training, the cost of one run per rule.

Knows nothing of statistics across seeds (fidelity_stats.curve_summary) or of the report.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from fidelity_run import (
    RunConfig,
    drop_versions_before,
    rule_configs,
    sample_batch,
    save_version,
    task_sampler,
)

from maskroll.recipes import arithmetic
from maskroll.recipes.grpo import masks
from maskroll.server.engines.torch_engine import TorchEngine
from maskroll.trainer_adapter import collate, policy_loss, token_logprobs
from maskroll.trainer_adapter.forward import completion_logits


@dataclass(frozen=True)
class CurveConfig:
    seed: int
    rule: str  # a key of fidelity_run.rule_configs(): "dppo", "ppo", "predictive/proportional", ...
    steps: int = 6
    eval_every: int = 3
    eval_problems: int = 32
    eval_tokens: int = 12
    prompts_per_step: int = 4  # the demo's 4 × 8 (maskroll demo --model smollm2)
    n: int = 8
    max_tokens: int = 8
    lr: float = 2e-5
    staleness: int = 1
    engine_dtype: Literal["float32", "bfloat16"] = "float32"


@torch.no_grad()
def held_out_accuracy(
    model: torch.nn.Module, task: arithmetic.Task, problems: list, max_tokens: int
) -> float:
    """Greedy answers of the trainer's model to `problems` (one left-padded batch), verified."""
    ids = [task.encode(p) for p in problems]
    width = max(map(len, ids))
    pad = task.tokenizer.pad_token_id
    x = torch.tensor([[pad] * (width - len(i)) + i for i in ids])  # [P, L]
    attn = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])  # [P, L]
    was_training = model.training
    model.eval()
    out = model.generate(
        input_ids=x, attention_mask=attn, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad
    )[:, width:]  # [P, ≤ max_tokens]
    model.train(was_training)
    return sum(task.reward(o.numpy(), p) for o, p in zip(out, problems, strict=True)) / len(problems)


def curve(cfg: CurveConfig, model_dir: Path) -> dict:
    """Train `cfg.steps` steps with `cfg.rule`'s mask; held-out accuracy at step 0 and every eval_every."""
    import transformers

    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    run_cfg = RunConfig(
        seed=cfg.seed,
        optimizer="adam",
        lr=cfg.lr,
        model="smollm2",
        steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step,
        n=cfg.n,
        max_tokens=cfg.max_tokens,
        staleness=cfg.staleness,
        engine_dtype=cfg.engine_dtype,
    )
    mask_cfg = rule_configs(run_cfg.divergence)[cfg.rule]
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    task = arithmetic.Task(model_dir)
    draw = task_sampler(run_cfg, model_dir)
    held = arithmetic.held_out(cfg.eval_problems)
    rng = random.Random(cfg.seed)
    evals = [(0, held_out_accuracy(model, task, held, cfg.eval_tokens))]
    steps = []
    engine = TorchEngine(
        model_dir,
        max_logprobs=run_cfg.logprobs_k,
        max_batch=run_cfg.batch_size,
        threads=1,
        dtype=getattr(torch, cfg.engine_dtype),
    )
    with asyncio.Runner() as runner, tempfile.TemporaryDirectory(prefix="curve-ckpt-") as ckpt:
        runner.run(engine.start())
        try:
            for step in range(1, cfg.steps + 1):
                prompts, rewarders = draw(rng, cfg.prompts_per_step)
                records = sample_batch(engine, runner, prompts, run_cfg, step)
                b = collate(records, [rewarders[k // cfg.n](r.completion_ids) for k, r in enumerate(records)])
                logits = completion_logits(model, b)
                lp, stats = token_logprobs(
                    logits, b.completion_ids, temperature=b.temperature, return_stats=True
                )
                res = masks(logits.detach(), b, mask_cfg, vocab_stats=stats)
                loss, m = policy_loss(lp, b.sampled_logprobs, b.advantages, res.keep, masks=res)
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps.append(
                    {"step": step, "reward": float(b.rewards.mean()), "mask_frac": float(m["mask_frac"])}
                )
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    evals.append((step, held_out_accuracy(model, task, held, cfg.eval_tokens)))
                # Versions wait on disk, not in RAM (a SmolLM2 state is 0.54 GB; staleness 3 kept four)
                save_version(model.state_dict(), step, Path(ckpt))
                if step - cfg.staleness >= 1:
                    runner.run(
                        engine.update_weights(step - cfg.staleness, Path(ckpt) / f"v{step - cfg.staleness}")
                    )
                    drop_versions_before(step - cfg.staleness, Path(ckpt))
        finally:
            runner.run(engine.close())
    return {
        "config": asdict(cfg),
        "accuracy": [{"step": s, "accuracy": a} for s, a in evals],
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }
