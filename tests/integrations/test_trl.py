"""MaskrollGRPOTrainer for real: TRL's training loop against two `maskroll serve --pull` replicas and a
private Redis (the module's `cluster`), then direct gRPC to the same replicas. Reward functions see the
completions that are trained on, the loss is the trainer adapter's (the same gradient, a planted far
token masked), versions advance on every replica, unsupported TRL options are refused by name.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import redis
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from maskroll.client import SamplingOptions, SyncRolloutClient
from maskroll.integrations.rollouts import Job, QueueSource
from maskroll.integrations.trl import (
    LOSS_TYPES,
    MaskrollConfig,
    MaskrollGRPOTrainer,
    UnsupportedOption,
    maskroll_loss,
    trl_advantages,
)
from maskroll.proto.streams import StreamKeys
from maskroll.trainer_adapter import MaskConfig, collate, compute_masks, policy_loss, token_logprobs
from maskroll.trainer_adapter.forward import completion_logits

G = 4  # num_generations
DIGITS = set(range(ord("0"), ord("9") + 1))


def _args(out, **kw) -> GRPOConfig:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,  # two prompts × G per step
        num_generations=G,
        max_completion_length=10,
        max_steps=3,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        loss_type="bnpo",
    )
    return GRPOConfig(**{**base, **kw})


def _dataset(n: int = 12) -> Dataset:
    words = ["count", "sum", "total", "pin", "year", "page"]
    return Dataset.from_dict(
        {"prompt": [f"{words[i % len(words)]} {i}:" for i in range(n)], "row_id": list(range(n))}
    )


def _tokenizer(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    return tok


class DigitReward:
    """Fraction of digit tokens; remembers every call (thread-safe: TRL may call it from one thread)."""

    __name__ = "digits"

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._lock = threading.Lock()

    def __call__(self, prompts, completions, completion_ids, row_id, **kw):
        with self._lock:
            call = {"prompts": list(prompts), "completions": list(completions), "ids": completion_ids}
            self.calls.append({**call, "row": row_id})
        return [sum(t in DIGITS for t in ids) / 10 for ids in completion_ids]


def _replica_versions(cluster) -> dict[str, int]:
    out = {}
    for name, address in cluster.addresses.items():
        with SyncRolloutClient(address) as c:
            out[name] = c.info().policy_version
    return out


@pytest.mark.slow
def test_trl_training_run_through_the_queue(cluster, tmp_path):
    """3 steps of TRL's loop: reward calls, masks in the logs, versions on both replicas, overlap."""
    reward = DigitReward()
    ds = _dataset()
    cfg = MaskrollConfig(
        redis_url=cluster.redis_url,
        namespace=cluster.namespace,
        run="new",
        weights_root=cluster.weights_root,
        mask=MaskConfig(method="predictive", divergence="topk_kl"),
        logprobs_k=cluster.logprobs_k,
        max_staleness=1,
        min_replicas=2,
        direction_diagnostics=True,
    )
    model = AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float32)
    trainer = MaskrollGRPOTrainer(
        model,
        reward_funcs=reward,
        args=_args(tmp_path),
        train_dataset=ds,
        processing_class=_tokenizer(cluster.model_dir),
        maskroll=cfg,
    )
    before = _replica_versions(cluster)
    trainer.train()

    # TRL's reward function: once per generation batch, with the completions that were trained on
    assert len(reward.calls) == 3
    tok = _tokenizer(cluster.model_dir)
    for call in reward.calls:
        assert len(call["completions"]) == 8
        for prompt, row, text, ids in zip(
            call["prompts"], call["row"], call["completions"], call["ids"], strict=True
        ):
            assert prompt == ds[row]["prompt"]  # the dataset row travelled with its job
            assert text == tok.decode(ids, skip_special_tokens=True)
        rows = call["row"]
        assert all(len(set(rows[i : i + G])) == 1 for i in range(0, 8, G)), rows  # whole groups
    # every replica loaded every published version
    assert _replica_versions(cluster) == {k: v + 3 for k, v in before.items()}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        for key in ("reward", "rewards/digits/mean", "maskroll/mask_frac", "maskroll/divergence_mean"):
            assert key in h and h[key] is not None and math.isfinite(h[key]), (key, h)
        assert 0.0 <= h["maskroll/mask_frac"] <= 1.0
        assert h["maskroll/staleness"] <= 1.0  # max_staleness
    # generation overlapped the optimiser: a later batch was sampled by the previous version
    assert max(h["maskroll/staleness"] for h in logs[1:]) >= 0.5
    assert "maskroll/agree_predictive_far" in logs[-1]
    assert trainer._source is None  # train() closed its queue connection and its event-loop thread
    assert not [t.name for t in threading.enumerate() if t.name.startswith("maskroll-queue")]
    assert trainer.rollout_counts["acked"] == trainer.rollout_counts["received"] == 3 * 8


@pytest.mark.slow
def test_trl_with_rewards_scored_by_the_reward_stage(cluster, tmp_path):
    """rewards_from_records: jobs go through a real `maskroll reward` process; TRL's own reward function
    still runs, and the records' reward is one more (`record_reward`): the stage's value for exactly the
    rows trained on (the row's column travelled as job metadata)."""
    import os
    import pathlib
    import subprocess
    import sys

    here = pathlib.Path(__file__).resolve().parent
    command = [sys.executable, "-m", "maskroll.app.cli", "reward", "--redis-url", cluster.redis_url]
    command += ["--namespace", cluster.namespace, "--reward", "trl_stage_rewards:row_reward"]
    stage = subprocess.Popen(
        [*command, "--tokenizer", str(cluster.model_dir), "--log-every-s", "1"],
        env={**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "reward.log", "w"),  # noqa: SIM115 (closed with the process)
    )
    try:
        reward = DigitReward()
        cfg = MaskrollConfig(
            redis_url=cluster.redis_url,
            namespace=cluster.namespace,
            run="new",
            weights_root=cluster.weights_root,
            mask=MaskConfig(method="predictive", divergence="topk_kl"),
            logprobs_k=cluster.logprobs_k,
            max_staleness=1,
            min_replicas=2,
            rewards_from_records=True,
        )
        model = AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float32)
        trainer = MaskrollGRPOTrainer(
            model,
            reward_funcs=reward,
            args=_args(tmp_path),
            train_dataset=_dataset(),
            processing_class=_tokenizer(cluster.model_dir),
            maskroll=cfg,
        )
        trainer.train()
    finally:
        stage.terminate()
        assert stage.wait(timeout=30) == 0, (tmp_path / "reward.log").read_text()[-3000:]
    assert len(reward.calls) == 3  # TRL's own reward function keeps working
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h, call in zip(logs, reward.calls, strict=True):
        want = float(np.mean([row / 100 for row in call["row"]]))
        assert h["rewards/record_reward/mean"] == pytest.approx(want, abs=1e-6), (h, call["row"])
        assert math.isfinite(h["rewards/digits/mean"])
    assert trainer.rollout_counts["acked"] == 3 * 8


def _records(cluster, trainer, n_prompts: int = 2):
    """Fresh records of two dataset prompts from a replica, with their dataset rows (trainer's jobs)."""
    rows = [row for row in _dataset(n_prompts) for _ in range(G)]
    source = trainer._open_source()
    jobs = trainer._jobs(rows, G)
    records, job_rows = [], []
    for job in jobs:
        group = source.generate_now(job.prompt_ids, G)
        records += group
        job_rows += [job.rows[r.sample_index] for r in group]
    return records, job_rows


def _adapter_gradient(model, records, advantages, mask: MaskConfig, aggregation, max_len):
    """The README's loop on the same records: collate → token_logprobs → compute_masks → policy_loss."""
    model.zero_grad()
    b = collate(records, np.zeros(len(records)))
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    logits = logits[:, b.completion_logits_slice]
    lp, stats = token_logprobs(logits, b.completion_ids, temperature=b.temperature, return_stats=True)
    res = compute_masks(
        logits.detach(),
        b.completion_ids,
        b.sampled_logprobs,
        b.topk_ids,
        b.topk_logprobs,
        advantages,
        config=mask,
        temperature=b.temperature,
        response_mask=b.response_mask,
        vocab_stats=stats,
    )
    loss, _ = policy_loss(
        lp, b.sampled_logprobs, advantages, res.keep, aggregation=aggregation, max_len=max_len, masks=res
    )
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, res


@pytest.mark.slow
def test_loss_is_the_adapters_and_masks_a_planted_far_token_over_grpc(cluster, tmp_path):
    """Direct gRPC mode (no Redis): the trainer's loss gradient equals the adapter's on the same records
    for every loss_type; a planted far token (μ_a shrunk 150×: PPO ratio ≫ 1 + ε_high) is masked; one
    training step publishes a version to both replicas over gRPC."""
    mask = MaskConfig(method="ppo")
    addresses = tuple(cluster.addresses.values())
    cfg = MaskrollConfig(
        replicas=addresses, weights_root=cluster.weights_root, mask=mask, logprobs_k=cluster.logprobs_k
    )
    model = AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float64)
    trainer = MaskrollGRPOTrainer(
        model,
        reward_funcs=DigitReward(),
        args=_args(tmp_path, max_steps=1),
        train_dataset=_dataset(),
        processing_class=_tokenizer(cluster.model_dir),
        maskroll=cfg,
    )
    records, rows = _records(cluster, trainer)
    # plant: the first token of the first record with A > 0 gets μ_a = π_a / 150 (the replicas serve
    # trained weights, so π_a is the trainer's): PPO's ratio 150 ≫ 1 + ε_high, moving away
    batch = trainer._score(records, rows, "train")
    i = int(torch.nonzero(batch["advantages"] > 0)[0])
    with torch.no_grad():
        lp = token_logprobs(completion_logits(trainer.model, batch), batch["completion_ids"])
    records[i].sampled_logprobs = records[i].sampled_logprobs.copy()
    records[i].sampled_logprobs[0] = float(lp[i, 0]) - math.log(150.0)
    top = records[i].topk_ids[0] == records[i].completion_ids[0]
    records[i].topk_logprobs = records[i].topk_logprobs.copy()
    records[i].topk_logprobs[0][top] = records[i].sampled_logprobs[0]
    batch = trainer._score(records, rows, "train")
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    for loss_type, aggregation in LOSS_TYPES.items():
        trainer.loss_type = loss_type
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, batch).backward()
        ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        theirs, res = _adapter_gradient(
            trainer.model, records, batch["advantages"], mask, aggregation, trainer.max_completion_length
        )
        for name in ours:
            msg = f"{loss_type}: {name}"
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-9, atol=1e-12, msg=msg)
        assert not bool(res.keep[i, 0]) and bool(res.far[i, 0]), "the planted token must be far and masked"
    # the trainer's own masks: the planted token, and only tokens of that sign and beyond the clip range
    logits = completion_logits(trainer.model, batch)
    _, _, res = maskroll_loss(logits, batch, mask=mask, is_cap=10.0, aggregation="token_mean", max_len=10)
    assert not bool(res.keep[i, 0])
    assert trainer._metrics["train"]["maskroll/mask_frac"][-1] > 0
    trainer.close()

    before = _replica_versions(cluster)
    trainer.train()  # one step through GrpcSource: generation, loss, publish over gRPC
    assert _replica_versions(cluster) == {k: v + 1 for k, v in before.items()}
    assert trainer.rollout_counts["acked"] == 8
    assert not [t.name for t in threading.enumerate() if t.name.startswith("maskroll-generate")]


def test_unsupported_trl_options_are_refused_by_name(tmp_path):
    from maskroll.app.model_init import init_model

    model_dir = init_model(tmp_path / "m", seed=0)
    cfg = MaskrollConfig(redis_url="redis://127.0.0.1:1/0", weights_root=tmp_path)
    args = _args(
        tmp_path, use_vllm=True, loss_type="cispo", epsilon=0.3, top_p=0.9, entropy_coef=0.01, min_p=0.1
    )
    with pytest.raises(UnsupportedOption) as e:
        MaskrollGRPOTrainer(
            str(model_dir), reward_funcs=DigitReward(), args=args, train_dataset=_dataset(), maskroll=cfg
        )
    msg = str(e.value)
    named = (
        "use_vllm=True",
        "loss_type='cispo'",
        "epsilon=0.3",
        "top_p=0.9",
        "entropy_coef=0.01",
        "min_p=0.1",
    )
    for name in named:
        assert name in msg, (name, msg)
    with pytest.raises(UnsupportedOption, match="tools: tool calling"):
        MaskrollGRPOTrainer(
            str(model_dir),
            reward_funcs=DigitReward(),
            args=_args(tmp_path),
            train_dataset=_dataset(),
            tools=[len],
            maskroll=cfg,
        )
    assert MaskrollConfig(redis_url="redis://x").weight_transport == "stream"  # no shared filesystem
    assert MaskrollConfig(replicas=("h:1",), weights_root=tmp_path).weight_transport == "directory"
    with pytest.raises(ValueError, match="weights_root is required with weight_transport='directory'"):
        MaskrollConfig(redis_url="redis://x", weight_transport="directory")
    with pytest.raises(ValueError, match="'stream' needs redis_url"):
        MaskrollConfig(replicas=("h:1",), weight_transport="stream")
    with pytest.raises(ValueError, match="weight_transport='nfs'; expected 'stream' or 'directory'"):
        MaskrollConfig(redis_url="redis://x", weight_transport="nfs")
    with pytest.raises(ValueError, match=r"redis_url .* or replicas"):
        MaskrollConfig(weights_root=tmp_path)


def test_trl_advantages_by_hand():
    # two groups of two; rewards 1, 0 | 3, 3: the second group has no spread
    r = torch.tensor([[1.0], [0.0], [3.0], [3.0]])
    adv, _, zero = trl_advantages(r, torch.ones(1), 2, "group", "sum_then_normalize")
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # (r − mean) / (unbiased std + 1e-4), TRL's epsilon
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0]))
    assert zero.tolist() == [False, False, True, True]
    adv, _, _ = trl_advantages(r, torch.ones(1), 2, "none", "sum_then_normalize")
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dr_grpo"])
def test_the_kl_term_is_trls(loss_type, bias_correction):
    """beta adds TRL's term — per_token_kl, use_bias_correction_kl and the loss_type's normalisation as
    TRL 1.16's GRPOTrainer.compute_loss writes them — to the policy term, loss and gradient; `ref_kl`,
    which compute_loss logs as TRL's `kl`, is TRL's masked mean of per_token_kl."""
    g = torch.Generator().manual_seed(0)
    b, t, v, beta = 4, 5, 11, 0.3
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    mu = (logits + torch.randn(b, t, v, generator=g, dtype=torch.float64)).log_softmax(-1)
    ids = torch.multinomial(mu.exp().reshape(-1, v), 1, generator=g).reshape(b, t)
    topk_lp, topk_ids = mu.topk(3, dim=-1)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[2, 3:] = False
    batch = dict(
        completion_ids=ids,
        response_mask=mask,
        sampled_logprobs=mu.gather(-1, ids[..., None])[..., 0],
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        temperature=torch.ones(b, dtype=torch.float64),
        advantages=torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=torch.float64),
        ref_logprobs=token_logprobs(torch.randn(b, t, v, generator=g, dtype=torch.float64), ids),
    )
    kw = dict(mask=MaskConfig(method="ppo"), is_cap=10.0, aggregation=LOSS_TYPES[loss_type], max_len=t + 2)
    x0, x1, x2 = (logits.clone().requires_grad_(True) for _ in range(3))
    policy, _, _ = maskroll_loss(x0, batch, **kw)
    policy.backward()
    loss, metrics, _ = maskroll_loss(x1, batch, beta=beta, bias_correction_kl=bias_correction, **kw)
    loss.backward()

    # TRL 1.16, GRPOTrainer.compute_loss
    lp, ref, m = token_logprobs(x2, ids), batch["ref_logprobs"], mask.double()
    per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
    if bias_correction:
        per_token_kl = per_token_kl * torch.exp(lp - batch["sampled_logprobs"])
    trl_kl = {
        "bnpo": lambda x: (x * m).sum() / m.sum().clamp(min=1.0),
        "grpo": lambda x: ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean(),
        "dr_grpo": lambda x: (x * m).sum() / (x.size(0) * (t + 2)),
    }[loss_type](per_token_kl)
    (beta * trl_kl).backward()

    kl_term = loss.detach() - policy.detach()
    torch.testing.assert_close(kl_term, beta * trl_kl.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(x1.grad - x0.grad, x2.grad, rtol=1e-9, atol=1e-13)
    assert float(x2.grad.abs().max()) > 1e-3
    want_logged = float((per_token_kl * m).sum() / m.sum())
    assert float(metrics["ref_kl"]) == pytest.approx(want_logged, rel=1e-12)


class _Killed(BaseException):
    """The trainer process dying (SIGKILL) at the point of the fault-injection hook: nothing after it
    runs, no except Exception catches it."""


@pytest.mark.slow
def test_trl_killed_between_publish_and_ack_resumes_exactly_once(cluster, tmp_path, monkeypatch):
    """A trainer dies right after publishing version 2 and before acking the batch it trained on; the
    resumed one (run="resume", a fresh model from the base weights) loads version 2, acks that batch
    untrained (the ledger beside the checkpoints), trains new records only and continues at 3, 4."""
    import maskroll.integrations.trl as trl_module
    from maskroll.integrations import trl_ranks
    from maskroll.weight_sync import read_trained

    trained: list[list[str]] = []  # per generation batch: the rollout ids this process trained on
    real_take = trl_ranks.take_shares

    def take_spy(*args, **kwargs):
        mine, whole = real_take(*args, **kwargs)
        trained.append(sorted(r.rollout_id for g, _ in mine for r in g))
        return mine, whole

    monkeypatch.setattr(trl_ranks, "take_shares", take_spy)
    kill_after: dict[str, int | None] = {"version": 2}
    real_make = trl_module.make_publisher

    def make_publisher(*args, **kwargs):  # the fault-injection hook: die once `version` is published
        pub = real_make(*args, **kwargs)
        publish = pub.publish

        def publish_then_die(model, version=None):
            out = publish(model, version)
            if pub.version == kill_after["version"]:
                raise _Killed(f"killed after publishing version {pub.version}")
            return out

        pub.publish = publish_then_die
        return pub

    monkeypatch.setattr(trl_module, "make_publisher", make_publisher)
    root = tmp_path / "trainer-weights"  # the trainer's own copy (stream transport) and the ledger

    def trainer(run: str, steps: int) -> MaskrollGRPOTrainer:
        cfg = MaskrollConfig(
            redis_url=cluster.redis_url,
            namespace=cluster.namespace,
            run=run,
            weights_root=root,
            logprobs_k=cluster.logprobs_k,
            max_staleness=1,
            min_replicas=2,
        )
        return MaskrollGRPOTrainer(
            AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float32),
            reward_funcs=DigitReward(),
            args=_args(tmp_path / run, max_steps=steps),
            train_dataset=_dataset(),
            processing_class=_tokenizer(cluster.model_dir),
            maskroll=cfg,
        )

    first = trainer("new", 3)
    with pytest.raises(_Killed):
        first.train()
    assert [len(ids) for ids in trained] == [8, 8]  # batch A (v1, acked), batch B (v2, not acked)
    batch_a, batch_b = trained
    assert first.rollout_counts["acked"] == 8  # A only: B died between its publish and its ack
    run_id = redis.Redis.from_url(cluster.redis_url).hget(StreamKeys(cluster.namespace).run, "run_id")
    ledger = read_trained(root, run_id.decode(), after=1, through=2)
    assert ledger == set(batch_b)  # written before version 2 was published

    kill_after["version"] = None
    trained.clear()
    second = trainer("resume", 2)
    second.train()
    assert second.rollout_counts["trained_skipped"] == 8  # B came back at once and was acked untrained
    assert [len(ids) for ids in trained] == [8, 8]
    resumed = {rid for ids in trained for rid in ids}
    assert not resumed & (set(batch_a) | set(batch_b))  # no record trained twice
    assert second.rollout_counts["acked"] == 16  # every record trained is acked once
    assert _replica_versions(cluster) == {name: 4 for name in cluster.addresses}  # v2 → 3, 4
    # the ledgers of the resumed versions name exactly what they trained on
    assert read_trained(root, run_id.decode(), after=2, through=4) == resumed


def test_queue_source_completes_a_batch_when_fewer_jobs_than_a_batch_are_in_flight(cluster):
    """The demo's last-step hang: a trainer holding part of its batch (a group left over from a read
    that brought more than it needed) asks the queue only for what is missing — here one group, when a
    whole batch is two — and gets it, instead of waiting for a batch no job in flight can fill."""
    opts = SamplingOptions(max_tokens=4, logprobs_k=cluster.logprobs_k)
    raw = redis.Redis.from_url(cluster.redis_url)
    # The run the tests before this one left (its replicas serve its weights), or a new one if alone.
    run = "resume" if raw.exists(StreamKeys(cluster.namespace).run) else "new"
    source = QueueSource(
        cluster.redis_url,
        cluster.namespace,
        batch_size=2 * G,
        max_staleness=0,
        options=opts,
        timeout=60,
        run=run,
    )
    try:
        # The replicas keep the version the tests before this one left them at: train "at" that one.
        version = max(_replica_versions(cluster).values())
        source.queue.set_policy_version(version)
        first, second, third = (Job([5 + i, 6, 7], list(range(G))) for i in range(3))
        source.submit(first)
        source.submit(second)
        deadline = time.monotonic() + 60
        while raw.xlen(StreamKeys(cluster.namespace).rollouts) < 2 * G:  # both groups published ...
            assert time.monotonic() < deadline, "the replicas did not run the two jobs within 60 s"
            time.sleep(0.1)
        (group, job), *more = source.take(G, version)  # ... so one read brings both: one stays held
        assert not more and len(group) == G
        source.done([group])
        source.submit(third)  # two groups in flight now, one of them already read
        t0 = time.monotonic()
        taken = source.take(2 * G, version)
        assert time.monotonic() - t0 < 30  # before the fix: the queue waited for a second new group
        assert {j.job_id for _, j in taken} == {first.job_id, second.job_id, third.job_id} - {job.job_id}
        source.done([g for g, _ in taken])
        assert source.queue.in_flight == 0 and source.stats.taken == 3
        assert source.queue.max_in_flight == 2 * G  # asking for less did not shrink the admission limit
    finally:
        source.close()
        raw.close()


def test_queue_source_refills_while_it_waits(cluster):
    """take() with nothing in flight: the trainer's refill (every REFILL_S without records) submits the
    job whose group then completes the batch — without it, a take whose room was freed while it waited
    (records dropped as stale, a previous life's read first) waits for records no job will make."""
    opts = SamplingOptions(max_tokens=4, logprobs_k=cluster.logprobs_k)
    raw = redis.Redis.from_url(cluster.redis_url)
    run = "resume" if raw.exists(StreamKeys(cluster.namespace).run) else "new"
    source = QueueSource(
        cluster.redis_url, cluster.namespace, batch_size=G, max_staleness=0, options=opts, timeout=60, run=run
    )
    try:
        version = max(_replica_versions(cluster).values())
        source.queue.set_policy_version(version)
        job, calls = Job([9, 8, 7], list(range(G))), []

        def refill() -> None:
            calls.append(source.queue.in_flight)
            if len(calls) == 1:
                source.submit(job)

        taken = source.take(G, version, refill)
        assert [j.job_id for _, j in taken] == [job.job_id]
        assert [r.sample_index for r in taken[0][0]] == list(range(G))
        assert calls[0] == 0  # called while nothing was in flight: the submit is the refill's
        source.done([taken[0][0]])
        assert source.queue.in_flight == 0
        assert source.queue.consumer == f"{cluster.namespace}-rank0"  # stable across restarts
    finally:
        source.close()
        raw.close()


def test_a_rollout_correction_chosen_in_the_mask_config_is_the_trl_loss_too():
    """MaskrollConfig.mask's correction (here sequence-level masked IS) reaches TRL's loss: the same loss
    and metrics as `policy_loss` with that config."""
    from maskroll.trainer_adapter import compute_masks_for, policy_loss

    g = torch.Generator().manual_seed(1)
    b, t, v = 3, 6, 9
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    mu = (logits + 0.7 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).log_softmax(-1)
    ids = torch.multinomial(mu.exp().reshape(-1, v), 1, generator=g).reshape(b, t)
    topk_lp, topk_ids = mu.topk(3, dim=-1)
    batch = dict(
        completion_ids=ids,
        response_mask=torch.ones(b, t, dtype=torch.bool),
        sampled_logprobs=mu.gather(-1, ids[..., None])[..., 0],
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        temperature=torch.ones(b, dtype=torch.float64),
        advantages=torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64),
    )
    cfg = MaskConfig(method="ppo", correction="seq_mis", correction_low=0.5, correction_high=2.0)
    loss, metrics, _ = maskroll_loss(
        logits, batch, mask=cfg, is_cap=10.0, aggregation="token_mean", max_len=t
    )
    lp = token_logprobs(logits, ids)
    res = compute_masks_for(batch, logits, config=cfg)
    want, want_m = policy_loss(
        lp, batch["sampled_logprobs"], batch["advantages"], res.keep, masks=res, config=cfg
    )
    plain, _, _ = maskroll_loss(
        logits, batch, mask=MaskConfig(method="ppo"), is_cap=10.0, aggregation="token_mean", max_len=t
    )
    torch.testing.assert_close(loss, want)
    assert float(metrics["correction_mask_frac"]) == float(want_m["correction_mask_frac"]) > 0
    assert float(loss) != float(plain)  # the correction dropped sequences the plain loss keeps
