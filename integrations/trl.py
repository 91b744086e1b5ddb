"""TRL's GRPOTrainer with maskroll: generation on maskroll replicas, maskroll's masks as the loss.

A TRL user changes the class and adds one config object::

    trainer = MaskrollGRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=ds,
                                  maskroll=MaskrollConfig(redis_url=..., namespace=..., weights_root=...))

What changes under TRL's training loop:
- **Generation**: the prompts of each generation batch become jobs on the replicas (`rollouts.py`: the
  Redis queue, or direct gRPC when no Redis URL is given). The trainer reads the next generation batches
  ahead from its dataloader (`get_batch_samples`) and submits them while admission allows, so they are
  generated during the current optimiser steps, at most `max_staleness` policy versions behind.
  Completions come back as records (sampled and top-K logprobs of the distribution sampled from);
  TRL's reward functions, reward weights and advantage scaling run on them unchanged.
- **Loss**: `compute_loss` is maskroll's `token_logprobs` → `compute_masks` → `policy_loss` on the
  records (temperature and replayed truncation as collate carries them), aggregated as TRL's
  `loss_type` says; TRL's `beta` KL-to-reference term is policy_loss's (`ref_logprobs`, `kl_coef`).
  Mask, divergence, mismatch and IS-weight metrics land in TRL's logs as `maskroll/*`, the KL as `kl`.
- **Weights**: after every `publish_every` optimiser steps the policy reaches every live replica as the
  next version: streamed over gRPC (`StreamPublisher`, the default with a queue: no shared filesystem)
  or written under the replicas' `--weights-root` for them to load (`CheckpointPublisher`).

Options whose meaning maskroll replaces or cannot honour are refused by name at construction
(`UnsupportedOption`; the config and the refusals are `trl_options.py`), never ignored. One process
(no multi-GPU data parallelism), no PEFT adapters.
"""

from __future__ import annotations

import collections
import logging
import warnings
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import torch

from maskroll.client import SamplingOptions
from maskroll.client.batching import staleness
from maskroll.trainer_adapter import (
    MaskConfig,
    MaskResult,
    collate,
    compute_masks_for,
    direction_agreement,
    policy_loss,
    token_logprobs,
)
from maskroll.weight_sync import Publisher, make_publisher

from .rollouts import GrpcSource, Job, QueueSource, _Source
from .trl_options import _CTOR_REFUSED, LOSS_TYPES, MaskrollConfig, UnsupportedOption, refusals

with warnings.catch_warnings():
    # TRL warns at import about the vLLM version installed next to it; generation never uses TRL's vLLM.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM", category=UserWarning)
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.data_utils import is_conversational
    from trl.trainer.utils import nanstd

log = logging.getLogger("maskroll.integrations.trl")

Tensor = torch.Tensor

# ---- maths: advantages and the loss, plain functions ------------------------------------------------


def trl_advantages(
    rewards_per_func: Tensor,  # [B, F], nan where a reward function did not apply
    weights: Tensor,  # [F]
    num_generations: int,
    scale_rewards: str,
    multi_objective_aggregation: str,
) -> tuple[Tensor, Tensor, Tensor]:  # advantages [B], rewards [B], std == 0 [B]
    """GRPO advantages exactly as TRL 1.16's `_generate_and_score_completions` computes them."""
    g = num_generations
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [B]
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        if scale_rewards in ("group", "none"):
            std = (
                nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
                if g > 1
                else torch.zeros_like(rewards)
            )
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards={scale_rewards!r}; expected 'batch', 'group' or 'none'")
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    elif multi_objective_aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, g, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"multi_objective_aggregation={multi_objective_aggregation!r}")
    return torch.nan_to_num(adv, nan=0.0), rewards, torch.isclose(std, torch.zeros_like(std))


def maskroll_loss(
    logits: Tensor,  # [B, T, V] logits that predict completion_ids, with grad
    batch: dict[str, Tensor],  # the collated records (MaskrollGRPOTrainer's generation output)
    *,
    mask: MaskConfig,
    is_cap: float,
    aggregation: str,
    max_len: int,
    top_k: int | None = None,
    top_p: float | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
) -> tuple[Tensor, dict[str, Tensor], MaskResult]:
    """Scalar loss, detached metrics and the masks: `policy_loss` (docs/math.md §5) on
    `compute_masks` (§3–§4), with TRL's β · k3 KL to the reference (`batch["ref_logprobs"]`) as its KL
    term: TRL's use_bias_correction_kl weights it by π_a/μ_a, μ (the rollout) as the old policy."""
    temp = batch["temperature"]  # [B]
    lp, stats = token_logprobs(
        logits, batch["completion_ids"], temperature=temp, top_k=top_k, top_p=top_p, return_stats=True
    )  # [B, T]
    res = compute_masks_for(batch, logits.detach(), config=mask, top_k=top_k, top_p=top_p, vocab_stats=stats)
    loss, metrics = policy_loss(
        lp,
        batch["sampled_logprobs"],
        batch["advantages"],
        res.keep,
        is_cap=is_cap,
        aggregation=aggregation,
        max_len=max_len,
        masks=res,
        config=mask,  # its rollout correction (MaskConfig.correction, docs/math.md §9)
        ref_logprobs=batch["ref_logprobs"] if beta != 0.0 else None,
        kl_coef=beta,
        kl_is_weight=bias_correction_kl,
    )
    return loss, metrics, res


def completion_logits(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:  # -> [B, T, V]
    """The logits that predict the completion tokens; only the last T + 1 positions go through the head."""
    t = batch["completion_ids"].shape[1]
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=t + 1,
    )
    return out.logits[:, :t]


# ---- reading the dataloader ahead -------------------------------------------------------------------


class _Lookahead:
    """The epoch iterator, read ahead: each new generation batch is submitted when it is read.

    TRL's dataloader yields each generation batch `every` times in a row (steps_per_generation ×
    num_iterations); the first of each run is submitted. An epoch's iterator ends the read-ahead: the
    next epoch's first batch is submitted when it is needed.
    """

    def __init__(self, every: int, submit: Callable[[list], None], has_room: Callable[[int], bool]) -> None:
        self.every, self.submit, self.has_room = every, submit, has_room
        self._it: Iterator | None = None
        self._buffer: deque = deque()
        self._pos = 0

    def attach(self, it: Iterator) -> None:
        if it is not self._it:
            self._it, self._pos = it, 0
            self._buffer.clear()

    def _read(self) -> list:
        item = next(self._it)
        if self._pos % self.every == 0:
            self.submit(item)
        self._pos += 1
        return item

    def next(self) -> list:
        return self._buffer.popleft() if self._buffer else self._read()

    def fill(self, rows: int) -> None:
        """Read on while the next item repeats a submitted batch or the next batch has room."""
        while self._pos % self.every != 0 or self.has_room(rows):
            try:
                self._buffer.append(self._read())
            except StopIteration:
                return


class _AfterStep(TrainerCallback):
    def __init__(self, trainer: MaskrollGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._after_optimizer_step()


# ---- the trainer ------------------------------------------------------------------------------------


def record_reward(completions, maskroll_reward, **_) -> list[float | None]:
    """The reward the reward stage put in each record (MaskrollConfig.rewards_from_records): a TRL reward
    function like any other, so TRL's weights, advantages and logs treat it as one. None (a record no
    stage scored: evaluation samples come straight from a replica) is TRL's "did not apply"."""
    return list(maskroll_reward)


class MaskrollGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer, generating on maskroll replicas and training with maskroll's masks.

    Takes GRPOTrainer's arguments plus `maskroll` (a MaskrollConfig). See the module docstring for what
    changes, and `refusals` for the options it refuses.
    """

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        *,
        maskroll: MaskrollConfig,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        **kwargs,
    ) -> None:
        if not isinstance(maskroll, MaskrollConfig):
            raise TypeError(f"maskroll must be a MaskrollConfig, got {type(maskroll).__name__}")
        ctor = dict(peft_config=peft_config, tools=tools, rollout_func=rollout_func)
        problems = refusals(args, maskroll.mask, environment_factory=environment_factory, **ctor)
        if not isinstance(model, str):
            from accelerate.utils import is_peft_model

            if is_peft_model(model):
                problems.append(f"model: a PeftModel; {_CTOR_REFUSED['peft_config']}")
        if problems:
            raise UnsupportedOption("MaskrollGRPOTrainer does not support: " + "; ".join(problems))
        self.maskroll = maskroll
        if maskroll.rewards_from_records:  # the stage's reward, as one more TRL reward function
            given = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
            reward_funcs = [*(f for f in given if f is not None), record_reward]
        super().__init__(
            model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        late = []
        if self.accelerator.num_processes > 1:
            late.append(
                f"{self.accelerator.num_processes} processes: MaskrollGRPOTrainer runs on one process"
            )
        if self.aux_loss_enabled:
            late.append("router_aux_loss_coef: the MoE load-balancing loss is not part of maskroll's loss")
        if late:
            raise UnsupportedOption("MaskrollGRPOTrainer does not support: " + "; ".join(late))
        self._top_k = self.top_k or None
        self._top_p = self.top_p if self.top_p < 1.0 else None
        self._options = SamplingOptions(
            max_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            logprobs_k=maskroll.logprobs_k,
        )
        self._source: _Source | None = None
        self._publisher: Publisher | None = None  # made with the source; owns the policy version
        self._held: tuple[str, int] | None = None  # (run, version) the model holds when the source closed
        self._run_taken = False
        # Counts for reports (rollouts unless named): trained, confirmed, completion tokens, the
        # rollout source's stale resubmissions and foreign drops; replicas of the last batch.
        self.rollout_counts = {"received": 0, "acked": 0, "tokens": 0, "stale_resubmitted": 0, "foreign": 0}
        self.last_replicas: dict[str, int] = {}
        self._unacked: list[list] = []  # per generation batch: the groups its micro-steps train on
        self._diagnose: tuple[dict, MaskResult] | None = None
        self._lookahead = _Lookahead(
            self.args.steps_per_generation * self.num_iterations,
            self._submit_generation_batch,
            lambda rows: self._open_source().room() >= rows,
        )
        self.add_callback(_AfterStep(self))

    @property
    def policy_version(self) -> int:
        """The policy version the replicas serve: the publisher's (the queue's run's, + 1 per publish;
        without a queue, the replicas' own at the start); 0 before the source is first opened."""
        return 0 if self._publisher is None else self._publisher.version

    # ---- the rollout source's lifetime ----------------------------------------------------------

    def _open_source(self) -> _Source:
        if self._source is None:
            cfg = self.maskroll
            common = dict(
                batch_size=self.args.generation_batch_size,
                max_staleness=cfg.max_staleness,
                options=self._options,
                timeout=cfg.generation_timeout_s,
                token=cfg.token,
                root_certs=cfg.root_certs,
            )
            if cfg.redis_url is not None:
                # Reopened (evaluate after train, a second train): the run this trainer took up.
                run = "resume" if self._run_taken else cfg.run
                source = QueueSource(
                    cfg.redis_url,
                    cfg.namespace,
                    run=run,
                    partitions=cfg.partitions,
                    reward_stage=cfg.rewards_from_records,
                    **common,
                )
                self._run_taken = True
                source.wait_for_replicas(cfg.min_replicas)
                # A reopened stream publisher is told what the model holds (it keeps no copy on disk).
                stream = cfg.weight_transport == "stream"
                extra = {"resume_from_base": cfg.resume_from_base, "held": self._held} if stream else {}
                self._publisher = make_publisher(
                    cfg.weight_transport, source.broadcaster, root=cfg.weights_root, keep=2, **extra
                )
                # The run's version on trainer and replicas: a resumed run loads its latest weights
                # into the model; a new one publishes the model as version 0 to replicas serving others.
                self._publisher.start(self.accelerator.unwrap_model(self.model))
            else:
                source = GrpcSource(list(cfg.replicas), **common)
                # No run in Redis: versions only grow on a replica, so continue from where they are.
                source.broadcaster.version = max(self.policy_version, source.replica_version())
                self._publisher = make_publisher(
                    "directory", source.broadcaster, root=cfg.weights_root, keep=2
                )
            self._source = source
        return self._source

    def close(self) -> None:
        """Close the connection to the replicas (Redis / gRPC); `train` and `evaluate` reopen it."""
        if self._publisher is not None:
            self._held = getattr(self._publisher, "held", None)  # StreamPublisher's; reopening passes it
            self._publisher.close()  # a StreamPublisher's thread that catches up replicas joining late
        if self._source is not None:
            self.rollout_counts["stale_resubmitted"] += self._source.stats.stale_resubmitted
            self.rollout_counts["foreign"] += self._source.stats.foreign_dropped
            self._source.close()
            self._source = None

    def train(self, *args, **kwargs):
        self._unacked, self._diagnose = [], None
        try:
            self._open_source()
            return super().train(*args, **kwargs)
        finally:
            self.close()

    def evaluate(self, *args, **kwargs):
        opened_here = self._source is None
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if opened_here:
                self.close()

    # ---- generation ---------------------------------------------------------------------------

    def _jobs(self, rows: list[dict], n: int) -> list[Job]:
        """A generation batch's rows (each prompt repeated n times in a row) → one job per prompt."""
        if len(rows) % n:
            raise ValueError(f"{len(rows)} rows do not form whole groups of num_generations={n}")
        heads = [rows[i] for i in range(0, len(rows), n)]
        prompt_ids, _, _ = self._tokenize_prompts([r["prompt"] for r in heads])
        return [Job([int(t) for t in ids], rows[i * n : (i + 1) * n]) for i, ids in enumerate(prompt_ids)]

    def _submit_generation_batch(self, rows: list[dict]) -> None:
        source = self._open_source()
        for job in self._jobs(rows, self.num_generations):
            source.submit(job)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """This step's micro-batches from the read-ahead; then read ahead (and submit) while there is room."""
        self._lookahead.attach(epoch_iterator)
        samples = []
        for _ in range(num_batches):
            try:
                samples.append(self._lookahead.next())
            except StopIteration:
                break
        if samples:
            self._lookahead.fill(len(samples[0]))
        return samples, self._get_num_items_in_batch(samples, device)

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict[str, Tensor]:
        mode = "train" if self.model.training else "eval"
        source = self._open_source()
        if mode == "train":
            taken = source.take(len(inputs), self.policy_version)
            self._unacked.append([g for g, _ in taken])
            records = [r for g, _ in taken for r in g]
            self.rollout_counts["received"] += len(records)
            self.rollout_counts["tokens"] += sum(r.num_tokens for r in records)
            self.last_replicas = dict(collections.Counter(r.replica_id for r in records))
        else:  # evaluation: these very prompts, sampled now by one replica (never queued)
            n = self.num_generations_eval
            taken = [(source.generate_now(job.prompt_ids, n), job) for job in self._jobs(inputs, n)]
        records = [r for g, _ in taken for r in g]
        rows = [job.rows[r.sample_index] for g, job in taken for r in g]
        return self._score(records, rows, mode)

    def _score(self, records: list, rows: list[dict], mode: str) -> dict[str, Tensor]:
        """Rewards (TRL's reward functions), TRL's advantages, and the records collated for the loss."""
        prompts = [row["prompt"] for row in rows]
        if self.maskroll.rewards_from_records:  # record_reward's argument (None: not scored, e.g. eval)
            rows = [{**row, "maskroll_reward": r.reward} for row, r in zip(rows, records, strict=True)]
        completion_ids = [[int(t) for t in r.completion_ids] for r in records]
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompts[0]}):
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            completions = texts
        rewards_per_func = self._calculate_rewards(rows, prompts, completions, completion_ids)
        n = self.num_generations if mode == "train" else self.num_generations_eval
        adv, rewards, std_zero = trl_advantages(
            rewards_per_func,
            self.reward_weights.to(rewards_per_func.device),
            n,
            self.scale_rewards,
            self.multi_objective_aggregation,
        )
        b = collate(
            records,
            np.zeros(len(records)),  # advantages are TRL's (above), not collate's
            pad_id=self._tokenizer.pad_token_id,
            allow_truncation=self.maskroll.mask.replay_truncation,
        )
        response_mask = b.response_mask
        if self.mask_truncated_completions:  # TRL's option: completions cut at max tokens carry no loss
            cut = torch.tensor([r.finish_reason == "length" for r in records])
            response_mask = response_mask & ~cut[:, None]
        out = {
            "input_ids": b.input_ids,
            "attention_mask": b.attention_mask,
            "position_ids": b.position_ids,
            "completion_ids": b.completion_ids,
            "response_mask": response_mask,
            "sampled_logprobs": b.sampled_logprobs,
            "topk_ids": b.topk_ids,
            "topk_logprobs": b.topk_logprobs,
            "temperature": b.temperature,
            "advantages": adv.float(),
            "num_items_in_batch": response_mask.sum(),
        }
        if self.beta != 0.0:
            out["ref_logprobs"] = self._ref_logprobs(out)
        self._log_generation(mode, records, prompts, completions, rewards_per_func, rewards, adv, std_zero)
        return out

    @torch.no_grad()
    def _ref_logprobs(self, batch: dict[str, Tensor]) -> Tensor:  # [B, T]
        chunk = self.args.per_device_train_batch_size
        parts = []
        for s in range(0, batch["input_ids"].shape[0], chunk):
            part = {k: v[s : s + chunk] for k, v in batch.items() if v.dim() > 0}
            logits = completion_logits(self.ref_model, part)
            parts.append(
                token_logprobs(
                    logits,
                    part["completion_ids"],
                    temperature=part["temperature"],
                    top_k=self._top_k,
                    top_p=self._top_p,
                )
            )
        return torch.cat(parts)

    def _log_generation(self, mode, records, prompts, completions, rewards_per_func, rewards, adv, std_zero):
        m = self._metrics[mode]
        lengths = torch.tensor([float(r.num_tokens) for r in records])
        if mode == "train":
            self.state.num_input_tokens_seen += int(sum(len(r.prompt_ids) for r in records) + lengths.sum())
        m["num_tokens"] = [self.state.num_input_tokens_seen]
        m["completions/mean_length"].append(lengths.mean().item())
        m["completions/min_length"].append(lengths.min().item())
        m["completions/max_length"].append(lengths.max().item())
        m["completions/clipped_ratio"].append(float(np.mean([r.finish_reason == "length" for r in records])))
        for i, name in enumerate(self.reward_func_names):
            m[f"rewards/{name}/mean"].append(torch.nanmean(rewards_per_func[:, i]).item())
            m[f"rewards/{name}/std"].append(nanstd(rewards_per_func[:, i]).item())
        m["reward"].append(torch.nanmean(rewards).item())
        m["reward_std"].append(nanstd(rewards).item())
        m["frac_reward_zero_std"].append(std_zero.float().mean().item())
        if mode == "train":
            stale = [float(staleness([r], self.policy_version)) for r in records]
            m["maskroll/staleness"].append(float(np.mean(stale)))
            m["maskroll/policy_version"].append(float(self.policy_version))
            m["maskroll/stale_resubmitted"].append(float(self._source.stats.stale_resubmitted))
        self._logs["prompt"].extend(prompts)
        self._logs["completion"].extend(completions)
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        self._logs["advantages"].extend(adv.tolist())

    # ---- the loss -----------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("MaskrollGRPOTrainer does not return outputs")
        mode = "train" if self.model.training else "eval"
        aggregation = LOSS_TYPES[self.loss_type]
        loss, metrics, res = maskroll_loss(
            completion_logits(model, inputs),
            inputs,
            mask=self.maskroll.mask,
            is_cap=self.maskroll.is_cap,
            aggregation=aggregation,
            max_len=self.max_completion_length,
            top_k=self._top_k,
            top_p=self._top_p,
            beta=self.beta,
            bias_correction_kl=self.args.use_bias_correction_kl,
        )
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type == "dapo":
            # TRL's dapo: the token sum over the whole generation batch's tokens, per optimiser step.
            tokens = inputs["response_mask"].sum().clamp_min(1)
            per_step = inputs["num_items_in_batch"].clamp_min(1)
            if mode == "train":
                per_step = per_step * accumulation / self.args.steps_per_generation
            loss = loss * tokens / per_step
        else:
            loss = loss / accumulation
        for name, value in metrics.items():
            key = "kl" if name == "ref_kl" else f"maskroll/{name}"  # TRL logs its KL term as "kl"
            self._metrics[mode][key].append(float(value))
        if mode == "train" and self.maskroll.direction_diagnostics:
            self._diagnose = ({k: v.detach() for k, v in inputs.items()}, res)
        return loss

    # ---- after each optimiser step: confirm, publish, diagnose ------------------------------------

    def _after_optimizer_step(self) -> None:
        generate_every = self.args.steps_per_generation * self.num_iterations
        exhausted = self._step % generate_every == 0  # the buffered generation batch is used up
        done, self._unacked = (self._unacked, []) if exhausted else (self._unacked[:-1], self._unacked[-1:])
        for groups in done:
            self._source.done(groups)
            self.rollout_counts["acked"] += sum(len(g) for g in groups)
        if self._diagnose is not None:
            self._log_direction_agreement(*self._diagnose)
            self._diagnose = None
        if self.state.global_step % self.maskroll.publish_every == 0:
            self._publisher.publish(self.accelerator.unwrap_model(self.model))  # the next version

    @torch.no_grad()
    def _log_direction_agreement(self, batch: dict[str, Tensor], before: MaskResult) -> None:
        logits = completion_logits(self.model, batch)
        after = compute_masks_for(
            batch, logits, config=self.maskroll.mask, top_k=self._top_k, top_p=self._top_p
        )
        adv = batch["advantages"][:, None].expand_as(before.divergence).double()
        agree = direction_agreement(
            adv,
            before.divergence.double(),
            after.divergence.double(),
            {"ratio": before.ratio_direction, "predictive": before.predicted_direction},
            before.far,
            response_mask=before.response_mask,
        )
        m = self._metrics["train"]
        for rule in ("ratio", "predictive"):
            m[f"maskroll/agree_{rule}_far"].append(agree[rule]["agree_far"])
            m[f"maskroll/agree_{rule}_all"].append(agree[rule]["agree_all"])
        m["maskroll/disagreement_frac_far"].append(agree["_sets"]["disagreement_frac_far"])
