"""MaskrollGRPOTrainer with `peft_config=LoraConfig(...)` for real: TRL wraps the model with PEFT, only the
adapter trains, and each version reaches a `maskroll serve --pull --max-lora-rank 8` torch replica (a
private Redis; this module's own, since the shared `cluster` replicas run without LoRA) as the adapter
alone. The replica then serves the trainer's adapter at the trainer's version — its sampled logprobs are
the trainer's PEFT model's — while the trainer's base weights never move; what is pushed per version is
the adapter's bytes. LoRA options the replicas cannot apply are refused at construction, by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PrefixTuningConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from maskroll.app.model_init import encode_text, init_model
from maskroll.client import SamplingOptions, SyncRolloutClient
from maskroll.integrations.trl import MaskrollConfig, MaskrollGRPOTrainer, UnsupportedOption
from maskroll.local.redis_server import LocalRedis
from maskroll.local.replica import LocalReplica, stop_all, wait_all
from maskroll.trainer_adapter import MaskConfig
from maskroll.weight_sync import lora

NAMESPACE = "trl-lora"
LOGPROBS_K = 8
RANK = 8
G = 4  # num_generations
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def lora_replica(tmp_path_factory):
    """(model_dir, redis_url, replica address): one pull-mode torch replica with LoRA on (rank <= 8)."""
    root = tmp_path_factory.mktemp("trl-lora")
    model_dir = init_model(root / "model", seed=0)
    with LocalRedis(appendonly=False, data_dir=root / "redis") as srv:
        args = [
            *("--model", str(model_dir), "--engine", "torch", "--port", "0", "--threads", "1"),
            *("--namespace", NAMESPACE, "--pull", "--replica-id", "lora-0"),
            *("--max-logprobs", str(LOGPROBS_K), "--heartbeat-ttl-s", "3", "--drain-timeout-s", "5"),
            *("--max-lora-rank", str(RANK)),
        ]
        env = {"OMP_NUM_THREADS": "1", "MASKROLL_REDIS_URL": srv.url}
        replica = LocalReplica(args, env=env, log=root / "replica.log", name="replica lora-0").start()
        try:
            wait_all([replica], timeout=180.0)
            yield model_dir, srv.url, replica.address
        finally:
            stop_all([replica], timeout=30.0)


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
        # float32 training: GRPOConfig's default bf16=True runs the forward under CPU bf16 autocast, and the
        # trainer's π would then differ from the float32 μ the replica samples by bf16 rounding (~0.1 nats)
        bf16=False,
    )
    return GRPOConfig(**{**base, **kw})


def _dataset(n: int = 12) -> Dataset:
    words = ["count", "sum", "total", "pin", "year", "page"]
    return Dataset.from_dict({"prompt": [f"{words[i % len(words)]} {i}:" for i in range(n)]})


def digits(completion_ids, **_) -> list[float]:
    return [sum(ord("0") <= t <= ord("9") for t in ids) / 10 for ids in completion_ids]


def _tokenizer(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    return tok


def _lora_config(**kw) -> LoraConfig:
    return LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, **kw)


@torch.no_grad()
def _logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:  # [T]
    """log π(completion token | prefix) at temperature 1: what the replica's μ is when it runs `model`."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()  # [T, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy()


@pytest.mark.slow
def test_trl_lora_publishes_the_adapter_and_the_replica_serves_it(lora_replica, tmp_path):
    model_dir, redis_url, address = lora_replica
    cfg = MaskrollConfig(
        redis_url=redis_url,
        namespace=NAMESPACE,
        run="new",
        weights_root=tmp_path / "save",  # the stream transport's resume copy: adapter directories
        mask=MaskConfig(method="predictive", divergence="topk_kl"),
        logprobs_k=LOGPROBS_K,
        max_staleness=1,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = MaskrollGRPOTrainer(
        model,
        reward_funcs=digits,
        args=_args(tmp_path / "out"),
        train_dataset=_dataset(),
        processing_class=_tokenizer(model_dir),
        peft_config=_lora_config(),
        maskroll=cfg,
    )
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    assert lora.is_lora(peft_model)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
    trainer.train()

    version = trainer.policy_version
    assert version == 3  # version 0 (the adapter as initialised) + one per optimiser step
    # the base did not move: every base tensor bit for bit (PEFT's names mapped back to the base's)
    base_after = lora.base_state_dict(peft_model)
    assert set(base_after) == set(base_before)
    assert all(torch.equal(base_after[k], base_before[k]) for k in base_before)
    spec, adapter = lora.adapter_of(peft_model)
    assert max(t.abs().max().item() for k, t in adapter.items() if k.endswith(".lora_B.weight")) > 1e-3

    # what one replica is sent per version: the adapter, 8 Linears of 128 × 128 at rank 8 in float32
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert adapter_bytes == 2 * 4 * (RANK * 128 + 128 * RANK) * 4 == 65_536
    assert trainer._publisher.last_update_bytes == adapter_bytes
    model_bytes = sum(t.numel() * t.element_size() for t in base_before.values())
    assert adapter_bytes < 0.05 * model_bytes
    # the resume copy of each version is an adapter directory (what `maskroll export-model` reads)
    saved_spec, saved = lora.load_adapter(tmp_path / "save" / f"v{version}")
    assert saved_spec == spec and all(torch.equal(saved[k], adapter[k]) for k in adapter)

    # GetInfo: the trainer's adapter at the trainer's version, on the trainer's base
    with SyncRolloutClient(address) as client:
        info = client.info()
        run_id = trainer._publisher.held[0]
        assert info.max_lora_rank >= RANK
        assert info.base_fingerprint == spec.base_fingerprint == lora.base_fingerprint(peft_model)
        mine = [a for a in info.adapters if a.namespace == NAMESPACE]
        assert [(a.run_id, a.version, a.rank) for a in mine] == [(run_id, version, RANK)], info.adapters
        assert mine[0].name == f"{NAMESPACE}/{run_id}/v{version}"

        # and it samples with it: μ of a fresh sample is the trainer's PEFT model's, not the base's
        prompt = encode_text(model_dir, "count 5:")
        options = SamplingOptions(max_tokens=12, temperature=1.0, logprobs_k=LOGPROBS_K, seed=3)
        (record,) = client.generate_records(prompt, options)
    assert record.adapter == mine[0].name
    assert record.policy_version_first == record.policy_version_last == version
    completion = [int(t) for t in record.completion_ids]
    peft_model.eval()
    with_adapter = _logprobs(peft_model, prompt, completion)
    with peft_model.disable_adapter():
        base_only = _logprobs(peft_model, prompt, completion)
    np.testing.assert_allclose(record.sampled_logprobs, with_adapter, atol=1e-4)
    assert np.abs(with_adapter - base_only).max() > 1e-3  # the adapter matters for these tokens


def test_lora_options_the_replicas_cannot_apply_are_refused(tmp_path):
    model_dir = init_model(tmp_path / "m", seed=0)
    stream = MaskrollConfig(redis_url="redis://127.0.0.1:1/0", namespace=NAMESPACE)

    def make(peft_config, cfg=stream):
        return MaskrollGRPOTrainer(
            str(model_dir),
            reward_funcs=digits,
            args=_args(tmp_path / "out"),
            train_dataset=_dataset(),
            processing_class=_tokenizer(model_dir),
            peft_config=peft_config,
            maskroll=cfg,
        )

    with pytest.raises(UnsupportedOption, match=r"peft_config: LoraConfig\(use_dora=True\): DoRA"):
        make(_lora_config(use_dora=True))
    with pytest.raises(UnsupportedOption, match=r"LoraConfig\(use_rslora=True\): rsLoRA"):
        make(_lora_config(use_rslora=True))
    with pytest.raises(UnsupportedOption, match=r"peft_config: a PrefixTuningConfig .*LoRA adapters only"):
        make(PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    directory = MaskrollConfig(replicas=("127.0.0.1:1",), weights_root=tmp_path / "w")
    with pytest.raises(
        UnsupportedOption, match="peft_config with weight_transport='directory': an adapter reaches"
    ):
        make(_lora_config(), directory)
    # accepted: plain LoRA over the stream transport (nothing is contacted before train())
    trainer = make(_lora_config())
    assert lora.is_lora(trainer.accelerator.unwrap_model(trainer.model))


def test_lora_kl_reference_is_the_base_with_the_adapter_disabled(tmp_path):
    """beta != 0 with PEFT: TRL keeps no ref_model; the reference logprobs are the base's (the adapter
    disabled), computed from the trained model itself — not the adapter's, and not an error."""
    model_dir = init_model(tmp_path / "m", seed=0)
    trainer = MaskrollGRPOTrainer(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=digits,
        args=_args(tmp_path / "out", beta=0.04),
        train_dataset=_dataset(),
        processing_class=_tokenizer(model_dir),
        peft_config=_lora_config(),
        maskroll=MaskrollConfig(redis_url="redis://127.0.0.1:1/0", namespace=NAMESPACE),
    )
    assert trainer.ref_model is None
    peft_model = trainer.accelerator.unwrap_model(trainer.model).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B != 0: an adapter that changes the logprobs
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    prompt, completion = encode_text(model_dir, "sum 3:"), [ord(c) for c in "42 and 7"]
    ids = torch.tensor([prompt + completion])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(ids.shape[1])[None],
        "completion_ids": torch.tensor([completion]),
        "temperature": torch.tensor([1.0]),
    }
    ref = trainer._ref_logprobs(batch)[0].double().numpy()  # [T]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    np.testing.assert_allclose(ref, _logprobs(base, prompt, completion), atol=1e-5)
    assert np.abs(ref - _logprobs(peft_model, prompt, completion)).max() > 1e-2
    np.testing.assert_allclose(  # and afterwards the adapter is enabled again: π is base + adapter
        _logprobs(peft_model, prompt, completion),
        _logprobs(_merged(model_dir, peft_model), prompt, completion),
        atol=1e-5,
    )
    # without PEFT the reference is TRL's ref_model, as before
    full = MaskrollGRPOTrainer(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=digits,
        args=_args(tmp_path / "out-full", beta=0.04),
        train_dataset=_dataset(),
        processing_class=_tokenizer(model_dir),
        maskroll=MaskrollConfig(redis_url="redis://127.0.0.1:1/0", namespace=NAMESPACE),
    )
    assert full.ref_model is not None
    np.testing.assert_allclose(
        full._ref_logprobs(batch)[0].double().numpy(), _logprobs(base, prompt, completion), atol=1e-5
    )


def _merged(model_dir, peft_model):
    spec, tensors = lora.adapter_of(peft_model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(lora.merge(model.state_dict(), spec, tensors))
    return model


def test_a_peft_model_given_pretrained_trains_and_keeps_trl_ref_copy_as_reference(tmp_path):
    """A PeftModel as `model` (an adapter trained before) with beta != 0: TRL adds a frozen "ref" copy of
    the adapter; the KL reference is that copy, and what is published is the "default" adapter alone."""
    from peft import get_peft_model

    model_dir = init_model(tmp_path / "m", seed=0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), _lora_config()
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pretrained = lora.adapter_of(peft_model)[1]
    trainer = MaskrollGRPOTrainer(
        peft_model,
        reward_funcs=digits,
        args=_args(tmp_path / "out", beta=0.04),
        train_dataset=_dataset(),
        processing_class=_tokenizer(model_dir),
        maskroll=MaskrollConfig(redis_url="redis://127.0.0.1:1/0", namespace=NAMESPACE),
    )
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    assert sorted(model.peft_config) == ["default", "ref"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable), sorted(trainable)[:4]
    _, published = lora.adapter_of(model)
    assert set(published) == set(pretrained)
    with torch.no_grad():  # one "optimiser step" on the default adapter: the reference must not follow
        for name, p in model.named_parameters():
            if ".lora_B.default." in name:
                p.mul_(2.0)
    prompt, completion = encode_text(model_dir, "sum 3:"), [ord(c) for c in "42 and 7"]
    ids = torch.tensor([prompt + completion])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(ids.shape[1])[None],
        "completion_ids": torch.tensor([completion]),
        "temperature": torch.tensor([1.0]),
    }
    ref = trainer._ref_logprobs(batch)[0].double().numpy()  # [T]
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = lora.adapter_of(model)[0]
    before.load_state_dict(lora.merge(before.state_dict(), spec, pretrained))
    np.testing.assert_allclose(ref, _logprobs(before, prompt, completion), atol=1e-5)
    assert np.abs(ref - _logprobs(model, prompt, completion)).max() > 1e-2
