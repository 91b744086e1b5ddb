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
  or written under the replicas' `--weights-root` for them to load (`CheckpointPublisher`). Before each
  publish the ids of the records it trained on go to the ledger beside the checkpoints
  (`weight_sync.write_trained`), after it they are acked: a trainer killed in between and resumed
  (`run="resume"`) acks them untrained (the recipe's exactly-once rule, docs/architecture.md flow 9).

- **Ranks** (`accelerate launch --num_processes W`, DDP): rank 0 alone holds the queue; it submits the
  global generation batch, takes it (one staleness check, one version), scatters whole groups balanced by
  tokens, publishes and acks it after every rank's optimiser step; the loss's denominators are the global
  batch's (`policy_loss(world=...)`), so W ranks take the step one process takes on the same records
  (`trl_ranks.py`; docs/integrations.md "Several processes").

- **LoRA** (`peft_config=LoraConfig(...)`: TRL wraps the model with PEFT; or a PeftModel as the model):
  only the adapter trains; each version reaches the replicas as the adapter alone (the stream transport:
  `StreamPublisher` publishes a PEFT model's adapter, with the base's fingerprint; the replicas, started
  with `--max-lora-rank`, apply it on their base). The KL-to-reference term's reference is the base
  (adapters disabled), or TRL's frozen "ref" copy of a pretrained adapter. What the replicas cannot apply
  (DoRA, rsLoRA, modules_to_save, ...) is refused at construction (`weight_sync.lora`).

Options whose meaning maskroll replaces or cannot honour are refused by name at construction
(`UnsupportedOption`; the config and the refusals are `trl_options.py`), never ignored. No DeepSpeed or
FSDP through accelerate (DDP only).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import torch

from maskroll.client import SamplingOptions
from maskroll.client.batching import staleness
from maskroll.trainer_adapter import MaskResult, collate, token_logprobs
from maskroll.trainer_adapter.distributed import single_process
from maskroll.trainer_adapter.forward import completion_logits, realised_agreement
from maskroll.weight_sync import Publisher, make_publisher, read_trained, write_trained
from maskroll.weight_sync import lora as _lora

from . import trl_ranks
from .rollouts import GrpcSource, Job, QueueSource, _Source
from .trl_maths import maskroll_loss, split_rows, trl_advantages
from .trl_options import LOSS_TYPES, MaskrollConfig, UnsupportedOption, peft_refusals, refusals

with warnings.catch_warnings():
    # TRL warns at import about the vLLM version installed next to it; generation never uses TRL's vLLM.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM", category=UserWarning)
    import trl.trainer.grpo_trainer as _trl_grpo
    from accelerate.utils import DistributedType
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.data_utils import is_conversational
    from trl.trainer.utils import nanstd, shuffle_sequence_dict, use_adapter

log = logging.getLogger("maskroll.integrations.trl")

Tensor = torch.Tensor


@contextlib.contextmanager
def _rewards_not_gathered() -> Iterator[None]:
    """TRL 1.16's `GRPOTrainer._calculate_rewards` ends with accelerate's `gather(rewards_per_func)`
    (trl/trainer/grpo_trainer.py, "Gather the reward per function"): an all-gather of equal-sized
    per-process tensors, TRL's layout. With several processes a rank's share here is whole groups of any
    size, gathered by `trl_ranks.gather_rewards` instead; so for that one call TRL's module-level `gather`
    is the identity."""
    gather = _trl_grpo.gather
    _trl_grpo.gather = lambda tensor: tensor
    try:
        yield
    finally:
        _trl_grpo.gather = gather


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
        ctor = dict(tools=tools, rollout_func=rollout_func)
        problems = refusals(args, maskroll.mask, environment_factory=environment_factory, **ctor)
        from accelerate.utils import is_peft_model

        wrapped = not isinstance(model, str) and is_peft_model(model)
        problems += peft_refusals(peft_config, maskroll, peft_model=wrapped)
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
            peft_config=peft_config,
            **kwargs,
        )
        late = self._rank_refusals() + self._lora_refusals()
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
        # The ranks (accelerate launch --num_processes W): objects through a gloo group, the loss's global
        # denominators through the default group; one process: the same code path, no torch.distributed.
        if self.accelerator.num_processes > 1:
            from maskroll.trainer_adapter.distributed import TorchCollective, torch_world

            self._collective, self._world = TorchCollective(), torch_world()
        else:
            self._collective, self._world = single_process(), None
        self._opened = False  # the source (rank 0) and the publisher (every rank) are open
        self._source: _Source | None = None  # rank 0's; None on the other ranks
        self._publisher: Publisher | None = None  # made with the source; owns the policy version
        self._held: tuple[str, int] | None = None  # (run, version) the model holds when the source closed
        self._run_taken = False
        self._resumed_at = 0  # rank 0: the run's version when the queue opened (before start())
        # Counts for reports (rollouts unless named): trained (this rank's), confirmed (rank 0 confirms the
        # global batch: 0 on the other ranks), completion tokens (this rank's), the rollout source's stale
        # resubmissions and foreign drops (rank 0's); replicas of this rank's last batch.
        self.rollout_counts = {
            "received": 0,
            "acked": 0,
            "tokens": 0,
            "stale_resubmitted": 0,
            "foreign": 0,
            "trained_skipped": 0,  # rank 0: acked untrained on resume, a published version trained on them
        }
        self.last_replicas: dict[str, int] = {}
        self._unacked: list[list] = []  # per generation batch: the groups its micro-steps train on
        self._diagnose: tuple[dict, MaskResult] | None = None
        self._lookahead = _Lookahead(
            self.args.steps_per_generation * self.num_iterations,
            self._submit_generation_batch,
            self._has_room,
        )
        self.add_callback(_AfterStep(self))

    def _lora_refusals(self) -> list[str]:
        """What the replicas could not apply of the PEFT model TRL wrapped (or was given): checked now, on
        the model, rather than refused by every replica at the first publish."""
        from accelerate.utils import is_peft_model

        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            return []
        if not _lora.is_lora(model):
            kind = type(model.peft_config.get(_lora.ADAPTER)).__name__
            return [f"a PeftModel whose adapter {_lora.ADAPTER!r} is a {kind}: the replicas apply LoRA only"]
        try:
            _lora.adapter_of(model, fingerprint="")  # its checks; the base's fingerprint comes at publish
        except _lora.LoraUnsupported as e:
            return [f"peft_config: {e}"]
        return []

    def _rank_refusals(self) -> list[str]:
        """Why these processes cannot train together (empty: one process, or DDP as supported)."""
        w = self.accelerator.num_processes
        if w == 1:
            return []
        out = []
        kind = self.accelerator.distributed_type
        if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
            out.append(
                f"{w} processes under {kind.value}: MaskrollGRPOTrainer runs data-parallel under DDP "
                "(accelerate launch --multi_gpu --num_processes N; on a machine without GPUs that is DDP "
                "over gloo); a sharded model is published by weight_sync's RankedPublisher, but this "
                "trainer is not tested under DeepSpeed or accelerate's FSDP"
            )
        if self.maskroll.redis_url is None:
            out.append(
                f"{w} processes with direct gRPC replicas: several processes need redis_url (rank 0 holds "
                "the queue and scatters its batches)"
            )
        rows, g = self.args.per_device_train_batch_size * self.args.steps_per_generation, self.num_generations
        if rows % g:
            out.append(
                f"per_device_train_batch_size × steps_per_generation = {rows} with {w} processes: each "
                f"process's share of a generation batch must be whole groups of num_generations={g}"
            )
        if g < self.args.steps_per_generation:
            out.append(
                f"num_generations={g} < steps_per_generation={self.args.steps_per_generation} with {w} "
                "processes: a process's share may be one group, fewer rows than its micro-steps"
            )
        return out

    @property
    def policy_version(self) -> int:
        """The policy version the replicas serve: the publisher's (the queue's run's, + 1 per publish;
        without a queue, the replicas' own at the start); 0 before the source is first opened."""
        return 0 if self._publisher is None else self._publisher.version

    # ---- the rollout source's lifetime ----------------------------------------------------------

    def _open_source(self) -> _Source | None:
        """Rank 0's rollout source (None on the other ranks), opened with the publisher on every rank (a
        collective: every rank calls it at the same point)."""
        if not self._opened:
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

                def open_queue() -> None:  # rank 0 only: the one reader of the run
                    self._source = QueueSource(
                        cfg.redis_url,
                        cfg.namespace,
                        run=run,
                        partitions=cfg.partitions,
                        reward_stage=cfg.rewards_from_records,
                        **common,
                    )
                    self._source.wait_for_replicas(cfg.min_replicas)
                    self._resumed_at = self._source.queue.policy_version  # before start() publishes any

                trl_ranks.main_answer(self._collective, open_queue)
                self._run_taken = True
                # A reopened stream publisher is told what the model holds (it keeps no copy on disk).
                extra = cfg.publisher_options(self._held)
                queue = None if self._source is None else self._source.broadcaster
                self._publisher = make_publisher(
                    cfg.weight_transport,
                    queue,
                    # every rank publishes; only rank 0 holds the queue
                    collective=self._collective if self._collective.world_size > 1 else None,
                    root=cfg.weights_root,
                    keep=2,
                    **extra,
                )
                # The run's version on trainer and replicas: a resumed run loads its latest weights
                # into the model (rank 0's, sent to every rank); a new one publishes the model as
                # version 0 to replicas serving others.
                self._publisher.start(self.accelerator.unwrap_model(self.model))
                if run == "resume":  # killed between a publish and its acks: those records are trained
                    trl_ranks.main_answer(self._collective, self._skip_trained)
            else:
                source = GrpcSource(list(cfg.replicas), **common)
                # No run in Redis: versions only grow on a replica, so continue from where they are.
                source.broadcaster.version = max(self.policy_version, source.replica_version())
                self._publisher = make_publisher(
                    "directory", source.broadcaster, root=cfg.weights_root, keep=2
                )
                self._source = source
            self._opened = True
        return self._source

    def _skip_trained(self) -> None:
        """Rank 0, on resume: the records the run's last published version trained on and never acked
        (the ledger `_record_trained` wrote beside the checkpoints) are acked untrained when read back."""
        root = self.maskroll.weights_root
        if root is None or not isinstance(self._source, QueueSource):
            return  # no ledger without a weights_root (nor a run to resume without a queue)
        v, run_id = self._source.queue.policy_version, self._source.queue.run_id
        if v != self._resumed_at:  # resume_from_base: the model never held v's training, so train again
            return
        self._source.skip_trained(read_trained(root, run_id, after=v - 1, through=v))

    def _record_trained(self, batches: list[list]) -> None:
        """Rank 0, before a publish: the ids of every record these generation batches hold — all this
        trainer holds unacked, each trained on by the version about to be published — in the ledger
        beside the checkpoints (`weight_sync.write_trained`, durable). A trainer killed after the publish
        and before the acks finds them on resume (`_skip_trained`); killed before the publish recorded
        the version, it resumes at the previous one, which ignores this ledger."""
        root = self.maskroll.weights_root
        if root is None or not isinstance(self._source, QueueSource):
            return
        ids = [r.rollout_id for groups in batches for g in groups for r in g]
        write_trained(root, self._publisher.version + 1, self._source.queue.run_id, ids)

    def close(self) -> None:
        """Close the connection to the replicas (Redis / gRPC); `train` and `evaluate` reopen it."""
        if self._publisher is not None:
            self._held = getattr(self._publisher, "held", None)  # StreamPublisher's; reopening passes it
            self._publisher.close()  # a StreamPublisher's thread that catches up replicas joining late
        if self._source is not None:
            self.rollout_counts["stale_resubmitted"] += self._source.stats.stale_resubmitted
            self.rollout_counts["foreign"] += self._source.stats.foreign_dropped
            self.rollout_counts["trained_skipped"] += self._source.stats.trained_skipped
            self._source.close()
            self._source = None
        self._opened = False

    def train(self, *args, **kwargs):
        self._unacked, self._diagnose = [], None
        try:
            self._open_source()
            return super().train(*args, **kwargs)
        finally:
            self.close()

    def evaluate(self, *args, **kwargs):
        opened_here = not self._opened
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
        """This rank's rows of a generation batch: the global batch's jobs, submitted by rank 0."""
        self._open_source()
        rows = trl_ranks.gather_rows(self._collective, rows)

        def submit() -> None:
            for job in self._jobs(rows, self.num_generations):
                self._source.submit(job)

        trl_ranks.main_answer(self._collective, submit)

    def _has_room(self, rows: int) -> bool:
        """Whether the queue admits the next generation batch (`rows` per rank): rank 0's answer."""
        self._open_source()
        w = self._collective.world_size
        return trl_ranks.main_answer(self._collective, lambda: self._source.room() >= rows * w)

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

    def _prepare_inputs(self, generation_batch):
        """TRL's, but with several processes the generation batch is split by `split_rows` (shares of
        whole groups differ in size between ranks; TRL's split would drop rows that are then acked)."""
        if self._collective.world_size == 1 or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        every = self.args.steps_per_generation
        if self._step % (every * self.num_iterations) == 0 or self._buffered_inputs is None:
            batch = shuffle_sequence_dict(self._generate_and_score_completions(generation_batch))
            self._buffered_inputs = split_rows(batch, every)
        return self._buffered_inputs[self._step % every]

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict[str, Tensor]:
        mode = "train" if self.model.training else "eval"
        self._open_source()
        if mode == "train":
            # this rank's share of the global batch; rank 0 keeps the global batch's groups to confirm
            # one process tops up the read-ahead while it waits (RankedQueue.next_batch's refill); with
            # several, reading ahead is a collective the other ranks, waiting in the scatter, cannot join
            rows = len(inputs)
            refill = (lambda: self._lookahead.fill(rows)) if self._collective.world_size == 1 else None
            taken, whole = trl_ranks.take_shares(
                self._collective, self._source, rows, self.policy_version, refill=refill
            )
            self._unacked.append(whole)
            records = [r for g, _ in taken for r in g]
            self.rollout_counts["received"] += len(records)
            self.rollout_counts["tokens"] += sum(r.num_tokens for r in records)
            self.last_replicas = dict(collections.Counter(r.replica_id for r in records))
        else:  # evaluation: these very prompts, sampled now by one replica (never queued), via rank 0
            n = self.num_generations_eval
            jobs = self._jobs(inputs, n)
            groups = trl_ranks.generate_on_main(
                self._collective, self._source, [(j.prompt_ids, n) for j in jobs]
            )
            taken = list(zip(groups, jobs, strict=True))
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
        with _rewards_not_gathered():  # [B, F] of this rank's rows
            rewards_per_func = self._calculate_rewards(rows, prompts, completions, completion_ids)
        n = self.num_generations if mode == "train" else self.num_generations_eval
        # TRL's advantages over the global batch (every rank's share holds whole groups, in rank order),
        # so batch-level scaling is the one process's; each rank keeps its own rows
        everyone, mine = trl_ranks.gather_rewards(self._collective, rewards_per_func)
        adv, rewards, std_zero = trl_advantages(
            everyone,
            self.reward_weights.to(rewards_per_func.device),
            n,
            self.scale_rewards,
            self.multi_objective_aggregation,
        )
        adv = adv[mine]
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
            # the generation batch's completion tokens, all ranks' (TRL's dapo normaliser)
            "num_items_in_batch": self._global_sum(response_mask.sum()),
        }
        if self.beta != 0.0:
            out["ref_logprobs"] = self._ref_logprobs(out)
        self._log_generation(mode, records, prompts, completions, everyone, mine, rewards, adv, std_zero)
        return out

    def _global_sum(self, x: Tensor) -> Tensor:
        """x summed over the ranks (a collective with several); x itself with one process."""
        return x if self._world is None else self._world.sum(x)

    @torch.no_grad()
    def _ref_logprobs(self, batch: dict[str, Tensor]) -> Tensor:  # [B, T]
        chunk = self.args.per_device_train_batch_size
        if self.ref_model is not None:
            reference, context = self.ref_model, contextlib.nullcontext
        else:
            # a PEFT model (TRL keeps no ref_model then): the base, adapters disabled, or TRL's frozen
            # "ref" copy of an adapter that was pretrained (TRL's own choice, _generate_and_score_completions)
            peft_model = self.accelerator.unwrap_model(self.model)
            ref = "ref" if "ref" in peft_model.peft_config else None
            reference, context = self.model, lambda: use_adapter(peft_model, adapter_name=ref)
        parts = []
        for s in range(0, batch["input_ids"].shape[0], chunk):
            part = {k: v[s : s + chunk] for k, v in batch.items() if v.dim() > 0}
            with context():
                logits = completion_logits(reference, part)
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

    def _log_generation(self, mode, records, prompts, completions, everyone, mine, rewards, adv, std_zero):
        """Lengths and staleness: this rank's records; rewards: the global batch's (TRL's logs gather
        them too); the completions table: this rank's rows."""
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
            m[f"rewards/{name}/mean"].append(torch.nanmean(everyone[:, i]).item())
            m[f"rewards/{name}/std"].append(nanstd(everyone[:, i]).item())
        m["reward"].append(torch.nanmean(rewards).item())
        m["reward_std"].append(nanstd(rewards).item())
        m["frac_reward_zero_std"].append(std_zero.float().mean().item())
        if mode == "train":
            stale = [float(staleness([r], self.policy_version)) for r in records]
            m["maskroll/staleness"].append(float(np.mean(stale)))
            m["maskroll/policy_version"].append(float(self.policy_version))
            if self._source is not None:  # rank 0's
                m["maskroll/stale_resubmitted"].append(float(self._source.stats.stale_resubmitted))
        self._logs["prompt"].extend(prompts)
        self._logs["completion"].extend(completions)
        for i, name in enumerate(self.reward_func_names):
            self._logs["rewards"][name].extend(everyone[mine, i].tolist())
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
            world=self._world,
        )
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type == "dapo":
            # TRL's dapo: the token sum over the whole generation batch's tokens, per optimiser step
            # (all ranks': maskroll_loss's world normalised by the micro-batch's global token count).
            tokens = self._global_sum(inputs["response_mask"].sum()).clamp_min(1)
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

        def confirm() -> None:  # rank 0, once every rank has stepped: the global batches are trained
            for groups in done:
                self._source.done(groups)
                self.rollout_counts["acked"] += sum(len(g) for g in groups)

        if self._diagnose is not None:
            self._log_direction_agreement(*self._diagnose)
            self._diagnose = None
        if self.state.global_step % self.maskroll.publish_every == 0:
            # Exactly-once across a restart (the recipe's order): the ids this version trains on are
            # recorded, then it is published, then its records acked — a restart in between acks them
            # untrained (`_skip_trained`). Between publishes (publish_every > 1) a batch is acked when
            # used up: its room is the next batches' (admission), and a restarted trainer could not
            # train a previous life's records again anyway (their dataset rows died with it).
            held = done + self._unacked
            trl_ranks.main_answer(self._collective, lambda: self._record_trained(held))
            # the next version; every rank calls it (rank 0 sends), every rank then holds its number
            self._publisher.publish(self.accelerator.unwrap_model(self.model))
        trl_ranks.all_stepped(self._collective, confirm)

    def _log_direction_agreement(self, batch: dict[str, Tensor], before: MaskResult) -> None:
        agree = realised_agreement(
            self.model, batch, self.maskroll.mask, before, top_k=self._top_k, top_p=self._top_p
        )
        m = self._metrics["train"]
        for rule in ("ratio", "predictive"):
            m[f"maskroll/agree_{rule}_far"].append(agree[rule]["agree_far"])
            m[f"maskroll/agree_{rule}_all"].append(agree[rule]["agree_all"])
        m["maskroll/disagreement_frac_far"].append(agree["_sets"]["disagreement_frac_far"])
