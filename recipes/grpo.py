"""An asynchronous GRPO trainer on maskroll: the README's "plug in your own trainer" loop, complete.

One step: take a batch of whole GRPO groups from the rollout queue (admission control keeps the next
batches generating meanwhile, at most `max_staleness` versions behind) → rewards → `collate` (group
advantages) → `token_logprobs` + `compute_masks` + `policy_loss` → optimiser step → publish the new
weights to every replica as the next policy version → ack the batch (after the publish: a trainer
killed in between resumes at that version and acks the batch untrained, data_parallel.py). Diagnostics
on the side: the realised change of the divergence after the step, against each rule's predicted
direction (docs/math.md §7).

Data-parallel: under `torchrun --nproc-per-node N -m maskroll.recipes.grpo_launch` the same `train`
runs on N ranks (data_parallel.py: gloo on CPU, NCCL on GPUs). Rank 0 holds the queue and reads each
global batch (`RankedQueue`: whole groups, split by tokens, scattered); every rank trains its share of
a DDP model (or an FSDP2 one: `sharding="fsdp2"`) with the loss normalised over the global batch
(`policy_loss(..., world=)`); rank 0 records the batch's rollout ids, every rank joins the publish
(only rank 0 sends a plain model), then the ranks meet in `ack` and rank 0 acks — the order that keeps
each record trained exactly once across a killed rank and an elastic restart (data_parallel.py). Rank
0 evaluates, logs and prints.

The run: `train(..., run="new")` (the default) starts a new training run on the namespace from
`model_dir`'s weights — replicas still serving a previous run's weights are made to load these first
(`CheckpointPublisher.start`), and the previous run's leftover jobs and records are never trained on;
`run="resume"` continues the namespace's run from its last published version and checkpoint.

LoRA (`GRPOConfig.lora`, rank > 0): the model is wrapped with PEFT (`lora_model`), only the adapters are
trained and published (the stream transport sends the adapter, a few MB, where the model is hundreds);
masks and loss are unchanged, since log π comes from the adapted model as it would from a full one.

Copy it and change the task (`digits` here), the model and the optimiser. It runs against replicas and a
Redis that already exist; `maskroll demo` (app/demo.py) starts those and calls `train`.
"""

from __future__ import annotations

import collections
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from maskroll.client import (
    RankedQueue,
    RolloutQueue,
    SamplingOptions,
    SyncRolloutClient,
    group_key,
    replicas_elsewhere,
)
from maskroll.trainer_adapter import (
    MaskConfig,
    MaskResult,
    collate,
    compute_masks_for,
    policy_loss,
    token_logprobs,
)
from maskroll.trainer_adapter.collate import Batch
from maskroll.trainer_adapter.distill import distill_advantages
from maskroll.trainer_adapter.forward import completion_logits, realised_agreement
from maskroll.weight_sync import (
    CHECKPOINT_FILE,
    CpuTransport,
    checkpoint_dir,
    is_lora,
    make_publisher,
    read_trained,
    write_trained,
)

from . import data_parallel, digits
from .config import GRPOConfig, LoraConfig


@dataclass
class StepLog:
    """One step's figures. With several ranks, reward, staleness, tokens/s and replicas are the global
    batch's; the mask, divergence, loss and agreement figures are rank 0's share."""

    step: int
    reward: float
    mask_frac: float
    far_frac: float
    divergence_mean: float
    mismatch_kl: float
    staleness: float
    policy_version: int
    tokens_per_s: float
    loss: float
    agree_ratio_far: float
    agree_predictive_far: float
    agree_ratio_all: float
    agree_predictive_all: float
    disagreement_frac_far: float
    seconds: float
    replicas: dict[str, int] = field(default_factory=dict)
    distill_kl: float | None = None  # with distillation: mean log π_a − log π_teacher(a) on the batch


@dataclass(frozen=True)
class StepEvent:
    """What `train(step_hook=...)` is told at each point of a step, on every rank: point is "read"
    (this rank holds its share), "trained" (its optimiser step is done), "published" (the version is
    out) or "acked"; version: the last published version at that point; rollout_ids and groups: this
    rank's share of the global batch."""

    point: str
    step: int
    rank: int
    version: int
    rollout_ids: tuple[str, ...]
    groups: tuple[str, ...]


def lora_model(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` wrapped with PEFT LoRA adapters as `cfg` says (PEFT's defaults otherwise: A random, B = 0, so
    the wrapped model computes the base's outputs until it trains); its base parameters are frozen, so
    only the adapters get gradients."""
    import peft

    config = peft.LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of the full weights a full-model publish sends: the base's parameters (a LoRA model's
    adapters left out), shared tensors counted once (the stream publisher's own figure, in the replicas'
    dtype, replaces it: `weight_figures`)."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=True):
        if ".lora_" in name or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def stream_options(cfg: GRPOConfig, weight_transport: str) -> dict:
    """make_publisher's keywords for the replicas' dtype and deltas (the stream transport's only)."""
    if weight_transport != "stream":
        return {}
    return {"dtype": replica_dtype(cfg), "deltas": cfg.weight_deltas}


def replica_dtype(cfg: GRPOConfig) -> torch.dtype | str:
    """The dtype the trainer sends weights in: --replica-dtype, or "auto": the one the replicas report."""
    return "auto" if cfg.replica_dtype == "auto" else getattr(torch, cfg.replica_dtype)


def weight_figures(publisher, queue) -> dict:
    """summary.json's weight figures (the stream transport's; None where a transport has none): mean bytes
    sent per replica per update after version 0, the replicas pushed a delta or the full version, and
    whether every live replica's weights fingerprint is the trainer's for the last version."""
    inner = getattr(publisher, "inner", publisher)
    fingerprint = getattr(inner, "fingerprint", "")
    match = None
    if fingerprint and queue is not None:
        from maskroll.weight_sync import replica_weights

        served = replica_weights(queue)
        match = bool(served) and all(getattr(w, "fingerprint", None) == fingerprint for w in served.values())
    per_update = getattr(inner, "weight_bytes_per_update", None)
    if per_update is None:  # the directory transport, or no update yet: what one replica is sent whole
        per_update = getattr(inner, "last_update_bytes", None)
    seconds = getattr(inner, "update_seconds", None)
    sent_bytes = getattr(inner, "model_bytes", None)
    return {
        **({"model_bytes": sent_bytes} if sent_bytes else {}),  # as sent: in the replicas' dtype
        "weight_bytes_per_update": per_update,
        "weight_seconds_per_update": sum(seconds) / len(seconds) if seconds else None,
        "weight_updates": dict(getattr(inner, "updates", {})) or None,
        "replicas_match_trainer": match,
    }


def _save_final(model, model_dir: Path, final_dir: Path, written: Path | None = None) -> None:
    """`model` as a Hugging Face model directory with `model_dir`'s tokenizer and generation config;
    written: a checkpoint directory holding its weights (a sharded model's last published version). A
    LoRA model is saved merged (W + scale · B A: a plain model any engine loads); the run's adapters
    themselves are under weights_root (`maskroll export-model`)."""
    import shutil

    if is_lora(model):
        model = model.merge_and_unload()  # in place: training is over
    final_dir.mkdir(parents=True, exist_ok=True)
    if written is None:
        model.save_pretrained(final_dir, safe_serialization=True)
    else:
        model.config.save_pretrained(final_dir)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(final_dir)
        shutil.copy2(Path(written) / CHECKPOINT_FILE, final_dir / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, final_dir / name)


def grpc_auth() -> dict:
    """The replicas' bearer token and TLS roots, from the same variables `maskroll serve` reads."""
    ca = os.environ.get("MASKROLL_HEALTHCHECK_TLS_CA") or os.environ.get("MASKROLL_TLS_CERT")
    return {
        "token": os.environ.get("MASKROLL_AUTH_TOKEN") or None,
        "root_certs": Path(ca).read_bytes() if ca else None,
    }


def masks(logits: torch.Tensor, b: Batch, cfg: MaskConfig, **kw) -> MaskResult:  # logits: [B, T, V]
    """`cfg`'s masks on the batch (kw: compute_masks_for's, e.g. vocab_stats); bench/fidelity_run.py too."""
    return compute_masks_for(b, logits, config=cfg, **kw)


class DigitsTask:
    """The demo's default task (digits.py) in the shape `train(task=...)` takes; arithmetic.QueueTask is
    the other: sample() -> (prompt ids, job metadata), reward(record), held_out(count)."""

    def __init__(self, model_dir: Path, max_tokens: int) -> None:
        self.encode, self.max_tokens = digits.encoder(model_dir), max_tokens

    def sample(self, rng: random.Random) -> tuple[list[int], dict[str, str]]:
        return self.encode(digits.prompts(rng, 1)[0]), {}

    def reward(self, record) -> float:
        return digits.digit_reward(record.completion_ids, self.max_tokens)

    def held_out(self, count: int) -> list[tuple[list[int], dict[str, str]]]:
        return [(self.encode(p), {}) for p in digits.held_out(count)]


def evaluate(address: str, prompts: list, cfg: GRPOConfig, task=None) -> float:
    """Mean reward on held-out prompts, sampled by one replica at its current weights. prompts: token ids,
    or (token ids, metadata) pairs of `task` (default the digits task)."""
    opts = SamplingOptions(
        max_tokens=cfg.max_tokens,
        logprobs_k=0,
        temperature=cfg.temperature,
        n=cfg.eval_n,
        seed=cfg.seed + 777,
    )
    rewards = []
    with SyncRolloutClient(address, **grpc_auth()) as c:
        for p in prompts:
            if task is None:
                rewards += [
                    digits.digit_reward(r.completion_ids, cfg.max_tokens) for r in c.generate_records(p, opts)
                ]
            else:  # the records of a direct request carry no job metadata: the held-out pair's is added
                ids, meta = p
                rewards += [task.reward(replace(r, metadata=meta)) for r in c.generate_records(ids, opts)]
    return sum(rewards) / len(rewards)


def wait_for_replicas(q: RolloutQueue, count: int, timeout: float = 60.0, every: float = 10.0) -> list:
    """The live replicas of q's namespace once there are `count`; says at once and every `every` s
    what is missing and which namespaces on this Redis have replicas (a wrong namespace shows at once);
    TimeoutError after `timeout` s, with the same words."""
    start = time.monotonic()
    told = None
    while len(reps := q.replicas()) < count:
        now = time.monotonic()
        if told is None or now - told >= every or now - start > timeout:
            missing = (
                f"{len(reps)} of {count} replicas registered in namespace {q.namespace!r} after "
                f"{now - start:.0f} s; {replicas_elsewhere(q.namespace, q.namespaces_with_replicas())}"
            )
            if now - start > timeout:
                raise TimeoutError(missing)
            print(f"  waiting for replicas: {missing}", flush=True)
            told = now
        time.sleep(0.1)
    return reps


def fmt(x: float, spec: str) -> str:
    """`x` formatted with `spec`, without the minus sign of a value that rounds to zero: estimators of a
    divergence can be a hair below 0, and "-0.0000" reads as a sign that means something."""
    text = f"{x:{spec}}"
    rounds_to_zero = float(text.strip().rstrip("%")) == 0
    return f"{0.0:{spec}}" if rounds_to_zero else text


def progress(step: int, total: int, log: StepLog) -> str:
    width = 20
    done = int(width * step / total)
    bar = "█" * done + "·" * (width - done)
    return (
        f"[{bar}] step {step:3d}/{total}  reward {fmt(log.reward, '.3f')}  "
        f"masked {fmt(log.mask_frac, '6.2%')}  D {fmt(log.divergence_mean, '.4f')}  "
        f"mismatch KL {fmt(log.mismatch_kl, '.4f')}  "
        f"stale {fmt(log.staleness, '.2f')}  v{log.policy_version}  {log.tokens_per_s:6.0f} tok/s"
    )


def scalar(x) -> float:
    """A metric as a plain float (a tensor is detached first: no autograd warning, no graph kept)."""
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def train(
    cfg: GRPOConfig,
    *,
    redis_url: str,
    namespace: str,
    model_dir: Path,
    weights_root: Path,
    min_replicas: int = 1,
    run: Literal["new", "resume"] = "new",
    weight_transport: CpuTransport = "stream",
    reward_stage: bool = False,
    task=None,
    distill_weight: float | None = None,
    distill_rl: bool = False,
    final_dir: Path | None = None,
    sharding: data_parallel.Sharding = "ddp",
    steps_total: bool = False,
    step_hook: Callable[[StepEvent], None] | None = None,
) -> dict | None:
    """Train against the replicas of `namespace`; returns the run's summary (rewards, steps, versions)
    on rank 0, None on the other ranks. Under torchrun every rank calls it with the same arguments.
    reward_stage: the rollouts are scored by a reward stage (`maskroll reward` with
    digits.digit_reward_fn) and arrive with their rewards, instead of being scored here.
    run: "new" starts a training run from `model_dir`'s weights, "resume" continues the namespace's run
    from its last checkpoint (see the module docstring). weight_transport: "stream" pushes each version
    to the replicas over gRPC (`weights_root` is then the trainer's own copy, for resuming);
    "directory" writes it under `weights_root`, the replicas' shared --weights-root. task: what to train
    on (DigitsTask by default; arithmetic.QueueTask for `maskroll demo --model smollm2`).
    distill_weight: on-policy distillation from the teacher scores the records carry (the teacher stage,
    `maskroll teacher`): the per-token advantage is λ·(log π_teacher(a) − log π_a), plus the group's RL
    advantage when `distill_rl` (docs/math.md §10.1). final_dir: write the final policy there as a
    Hugging Face model directory (with `model_dir`'s tokenizer). sharding: with several ranks, "ddp"
    (each rank holds the model) or "fsdp2" (`fully_shard`: each holds 1/W; data_parallel.wrap).
    steps_total: `cfg.steps` is the run's length in versions, so a resumed run at version v trains
    cfg.steps − v more steps (an elastic restart, grpo_launch.py); False: cfg.steps more steps.
    step_hook: called with a StepEvent on every rank at each point of each step — progress reporting,
    and the fault-injection tests of exactly-once (tests/learner)."""
    collective, world, owned = data_parallel.init_ranks()
    try:
        return _train(
            cfg,
            collective,
            world,
            redis_url=redis_url,
            namespace=namespace,
            model_dir=model_dir,
            weights_root=weights_root,
            min_replicas=min_replicas,
            run=run,
            weight_transport=weight_transport,
            reward_stage=reward_stage,
            task=task,
            distill_weight=distill_weight,
            distill_rl=distill_rl,
            final_dir=final_dir,
            sharding=sharding,
            steps_total=steps_total,
            step_hook=step_hook or (lambda event: None),
        )
    finally:
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(
    cfg: GRPOConfig,
    collective,
    world,
    *,
    redis_url: str,
    namespace: str,
    model_dir: Path,
    weights_root: Path,
    min_replicas: int,
    run: Literal["new", "resume"],
    weight_transport: CpuTransport,
    reward_stage: bool,
    task,
    distill_weight: float | None,
    distill_rl: bool,
    final_dir: Path | None,
    sharding: data_parallel.Sharding,
    steps_total: bool,
    step_hook: Callable[[StepEvent], None],
) -> dict | None:
    import transformers

    ranks, main = collective.world_size, collective.rank == 0
    if cfg.lora.enabled and weight_transport != "stream":
        raise ValueError(
            f"GRPOConfig.lora (rank {cfg.lora.lora_rank}) publishes adapters, which the stream transport "
            f"sends; weight_transport={weight_transport!r} publishes full weights only"
        )
    if cfg.lora.enabled and sharding == "fsdp2" and ranks > 1:
        raise ValueError(
            "GRPOConfig.lora with sharding='fsdp2': a LoRA model is not sharded (its adapters are small, "
            "the base is frozen); use sharding='ddp'"
        )
    if cfg.prompts_per_step < ranks:
        raise ValueError(
            f"GRPOConfig.prompts_per_step={cfg.prompts_per_step} with {ranks} trainer ranks: every rank "
            "trains whole groups, so a step needs at least one prompt (group) per rank"
        )
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    rng = random.Random(cfg.seed)
    mask_cfg = cfg.mask
    opts = SamplingOptions(max_tokens=cfg.max_tokens, logprobs_k=cfg.logprobs_k, temperature=cfg.temperature)
    task = task or DigitsTask(model_dir, cfg.max_tokens)
    eval_prompts = task.held_out(cfg.eval_prompts)

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full_bytes = model_bytes(model)  # the publisher's figure replaces it: in the replicas' dtype
    if cfg.lora.enabled:
        model = lora_model(model, cfg.lora)
    model.to(data_parallel.device()).train()
    auth = grpc_auth()
    with RankedQueue(
        collective,
        redis_url,
        namespace,
        run=run,
        batch_size=cfg.batch_size,  # the global batch: W ranks take the step one process would
        max_staleness=cfg.max_staleness,
        reward_stage=reward_stage,
        **auth,
    ) as rq:
        q = rq.queue  # rank 0's RolloutQueue; None on the other ranks
        eval_address = wait_for_replicas(q, min_replicas)[0].address if main else None
        # ranks > 0 hold no queue; with several ranks every rank joins each publish (a collective)
        publisher = make_publisher(
            weight_transport,
            q,
            collective=collective if ranks > 1 else None,
            root=weights_root,
            keep=2,
            **stream_options(cfg, weight_transport),
        )
        trained = data_parallel.wrap(model, ranks, sharding)  # DDP's wrapper, or `model` sharded in place
        # every replica now samples from the run's current weights, and every rank's `model` holds them
        publisher.start(model)
        if main and run == "resume":  # killed between publish and ack: the last version's batch is trained
            v = q.policy_version
            rq.skip_trained(read_trained(weights_root, q.run_id, after=v - 1, through=v))
        # after wrap: FSDP2 replaces the parameters; with LoRA only the adapters require gradients
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
        reward_before = evaluate(eval_address, eval_prompts, cfg, task) if main else None
        if main:
            print(f"  held-out reward before training: {reward_before:.3f}", flush=True)

        def top_up() -> None:  # admission control: at most (max_staleness + 1) × batch in flight
            while (q.room() or 0) >= cfg.n:
                ids, task_meta = task.sample(rng)
                q.submit(ids, opts, n=cfg.n, metadata={**meta, **task_meta})

        meta = {"max_tokens": str(cfg.max_tokens)}  # what digit_reward_fn needs, in every record
        if main:
            top_up()
        history: list[StepLog] = []
        tokens_total, t_train = 0, time.monotonic()
        first = q.policy_version + 1 if main and steps_total else 1  # steps_total: the run's versions
        first = int(collective.broadcast(first))
        for step in range(first, cfg.steps + 1):
            t0 = time.monotonic()
            # this rank's share of the global batch; rank 0 keeps topping up while it waits
            batch = rq.next_batch(timeout=300, refill=top_up if main else None)
            ids, groups = tuple(r.rollout_id for r in batch), tuple(group_key(r) for r in batch)

            def hook(point: str, step: int = step, ids: tuple = ids, groups: tuple = groups) -> None:
                step_hook(StepEvent(point, step, collective.rank, publisher.version, ids, groups))

            hook("read")
            if main:
                top_up()  # generation of the next batch overlaps with this step
            if reward_stage:  # scored on the rollout side; collate reads the records' rewards
                b = collate(batch)
                rewards = [r.reward for r in batch]
            else:
                rewards = [task.reward(r) for r in batch]
                b = collate(batch, rewards)
            b = b.to(data_parallel.device())
            logits = completion_logits(trained, b)
            lp, stats = token_logprobs(logits, b.completion_ids, temperature=b.temperature, return_stats=True)
            res = masks(logits.detach(), b, mask_cfg, vocab_stats=stats)
            adv, kl = b.advantages, None
            if distill_weight is not None:  # on-policy distillation (docs/math.md §10.1)
                if b.teacher_sampled_logprobs is None:
                    raise ValueError("distillation needs records a teacher scored (maskroll teacher)")
                rl = b.advantages if distill_rl else None
                adv = distill_advantages(
                    lp, b.teacher_sampled_logprobs, rl, weight=distill_weight, response_mask=b.response_mask
                )
                kl = scalar((lp.detach() - b.teacher_sampled_logprobs)[b.response_mask].mean())
            # world: normalised over the global batch, so DDP's gradient average is one process's step
            loss, m = policy_loss(
                lp, b.sampled_logprobs, adv, res.keep, masks=res, config=mask_cfg, world=world
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            hook("trained")
            agree = realised_agreement(model, b, mask_cfg, res)
            # Exactly-once: the batch's ids are written before the version that trains on them is
            # published, and the records are acked after it (data_parallel.py says why in this order).
            if main:
                ids = (r.rollout_id for r in rq.global_batch)
                write_trained(weights_root, publisher.version + 1, q.run_id, ids)
            publisher.publish(model)  # one optimiser step = one policy version; raises if no replica took it
            hook("published")
            rq.ack(batch)  # every rank has stepped; rank 0 acks the global batch
            hook("acked")
            version = publisher.version
            staleness = (version - 1 - b.policy_versions).double()
            shares = collective.all_gather(
                (
                    sum(rewards),
                    len(rewards),
                    int(b.response_mask.sum()),
                    scalar(staleness.sum()),
                    collections.Counter(r.replica_id for r in batch),
                )
            )
            if not main:
                continue
            records = sum(sh[1] for sh in shares)
            tokens_total += sum(sh[2] for sh in shares)
            log = StepLog(
                step=step,
                reward=sum(sh[0] for sh in shares) / records,
                mask_frac=scalar(m["mask_frac"]),
                far_frac=scalar(m["far_frac"]),
                divergence_mean=scalar(m["divergence_mean"]),
                mismatch_kl=scalar(m["mismatch_kl"]),
                staleness=sum(sh[3] for sh in shares) / records,
                policy_version=version,
                tokens_per_s=tokens_total / (time.monotonic() - t_train),
                loss=scalar(loss),
                agree_ratio_far=scalar(agree["ratio"]["agree_far"]),
                agree_predictive_far=scalar(agree["predictive"]["agree_far"]),
                agree_ratio_all=scalar(agree["ratio"]["agree_all"]),
                agree_predictive_all=scalar(agree["predictive"]["agree_all"]),
                disagreement_frac_far=scalar(agree["_sets"]["disagreement_frac_far"]),
                seconds=time.monotonic() - t0,
                replicas=dict(sum((sh[4] for sh in shares), collections.Counter())),
                distill_kl=kl,
            )
            history.append(log)
            print(progress(step, cfg.steps, log), flush=True)
        publisher.close()  # a StreamPublisher's follower thread uses the queue, which closes next
        if not main:
            return None
        reward_after = evaluate(eval_address, eval_prompts, cfg, task)
        print(
            f"  held-out reward after training: {reward_after:.3f} (before: {reward_before:.3f})", flush=True
        )
        replica_versions = {}
        for rep in q.replicas():  # ask each replica: heartbeats refresh only every few seconds
            with SyncRolloutClient(rep.address, **auth) as c:
                info = c.info()
            # a LoRA run's version is its adapter's (the replica's full weights stay the base's, version 0)
            adapter = [a.version for a in info.adapters if a.namespace == namespace]
            replica_versions[rep.replica_id] = adapter[0] if adapter else info.policy_version
        if final_dir is not None:  # the final policy as a Hugging Face model directory
            # a sharded model is whole only in the last version's file, which the publish wrote
            last = (
                checkpoint_dir(weights_root, publisher.version) if sharding == "fsdp2" and ranks > 1 else None
            )
            _save_final(model, model_dir, final_dir, written=last)
        q.cancel_pending_jobs()  # prompts no replica started would only be refused by the next run
        queue_stats = asdict(q.stats)
        weights = weight_figures(publisher, q)
    return {
        "mask_config": asdict(mask_cfg),
        "reward_before": reward_before,
        "reward_after": reward_after,
        "steps": [asdict(h) for h in history],
        "replica_versions": replica_versions,
        "queue": queue_stats,
        "trainer_ranks": ranks,
        "lora_rank": cfg.lora.lora_rank,
        "model_bytes": full_bytes,
        **weights,
    }
