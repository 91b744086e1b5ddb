"""The trainer's side of LoRA (weight_sync/lora.py, the recipe's config): a PEFT model's adapter in the wire
names, its base's fingerprint (the replicas' own), the merge against PEFT's `merge_and_unload`, PEFT's
directory layout both ways, resume, and the refusal by name of what the replicas cannot apply. On the
tiny `init-model` (hidden 128, 2 layers), float32, CPU; no server needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from maskroll.app.model_init import init_model
from maskroll.proto.tensor_push import LORA_A, LORA_B
from maskroll.weight_sync import lora
from maskroll.weight_sync.model_fingerprint import model_fingerprint

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
IDS = torch.tensor([[256, 72, 105, 33, 10, 50, 51]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("lora_trainer") / "tiny", seed=0)


def _base(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _peft(model_dir: Path, seed: int = 1, **config):
    """rank 8, alpha 16 (scale 2) on the four attention projections, B random: PEFT's B = 0 would make
    every comparison with the base vacuous."""
    kw = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS, **config}
    torch.manual_seed(seed)  # PEFT draws A from the global generator
    model = get_peft_model(_base(model_dir), LoraConfig(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def test_adapter_of_names_shapes_and_values(model_dir):
    model = _peft(model_dir)
    spec, tensors = lora.adapter_of(model)
    assert lora.is_lora(model) and not lora.is_lora(_base(model_dir))
    assert (spec.rank, spec.alpha, spec.scale) == (8, 16.0, 2.0)
    assert spec.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")
    modules = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in TARGETS]
    assert list(tensors) == [m + s for m in modules for s in (LORA_A, LORA_B)]
    for m in modules:
        assert tuple(tensors[m + LORA_A].shape) == (8, 128)
        assert tuple(tensors[m + LORA_B].shape) == (128, 8)
        peft_a = model.get_parameter(f"base_model.model.{m}.lora_A.default.weight")
        peft_b = model.get_parameter(f"base_model.model.{m}.lora_B.default.weight")
        assert torch.equal(tensors[m + LORA_A], peft_a) and torch.equal(tensors[m + LORA_B], peft_b)
    # 8 modules × (8·128 + 128·8) float32 values
    assert sum(t.nbytes for t in tensors.values()) == 8 * 2 * 8 * 128 * 4 == 65536
    # copies on CPU: an optimiser step after the snapshot does not change what is being sent
    a = tensors[modules[0] + LORA_A].clone()
    with torch.no_grad():
        model.get_parameter(f"base_model.model.{modules[0]}.lora_A.default.weight").add_(1.0)
    assert torch.equal(tensors[modules[0] + LORA_A], a)


def test_base_fingerprint_is_the_unwrapped_model_s_and_the_replica_s(model_dir):
    from maskroll.server.weights.dir_fingerprint import fingerprint_dir

    base = _base(model_dir)
    unwrapped = model_fingerprint(base)
    model = _peft(model_dir)
    assert lora.base_fingerprint(model) == unwrapped == fingerprint_dir(model_dir)
    assert lora.adapter_of(model)[0].base_fingerprint == unwrapped
    # the base's names and tensors, PEFT's prefix and .base_layer removed, no lora_ tensor
    sd = lora.base_state_dict(model)
    assert sorted(sd) == sorted(base.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in base.state_dict().items())
    # a model trained in full is not a LoRA model: its own fingerprint
    assert lora.base_fingerprint(base) == unwrapped


def test_merge_equals_peft_merge_and_unload(model_dir):
    model = _peft(model_dir, seed=2)
    spec, tensors = lora.adapter_of(model)
    base_sd = _base(model_dir).state_dict()
    merged = lora.merge(base_sd, spec, tensors)
    expected = model.merge_and_unload().state_dict()  # PEFT's own merge of the same adapter
    assert sorted(merged) == sorted(expected)
    changed = 0
    for name, w in expected.items():
        assert merged[name].dtype == torch.float32
        assert torch.allclose(merged[name], w, atol=1e-6, rtol=0), name
        changed += not torch.equal(merged[name], base_sd[name])
    assert changed == 8  # exactly the adapted projections moved
    q = "model.layers.1.self_attn.q_proj"  # W' = W + (alpha / r) · B A, by hand
    by_hand = base_sd[q + ".weight"] + 2.0 * tensors[q + LORA_B] @ tensors[q + LORA_A]
    assert torch.allclose(merged[q + ".weight"], by_hand, atol=1e-6, rtol=0)
    assert merged["lm_head.weight"] is base_sd["lm_head.weight"]  # untouched tensors are not copied


def test_save_and_load_round_trip_and_peft_reads_the_directory(model_dir, tmp_path):
    model = _peft(model_dir, seed=3)
    spec, tensors = lora.adapter_of(model)
    out = lora.save_adapter(tmp_path / "v3", spec, tensors, base_model=str(model_dir))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    spec2, tensors2 = lora.load_adapter(out)
    assert spec2 == spec  # the base fingerprint too (the safetensors metadata)
    assert sorted(tensors2) == sorted(tensors)  # safetensors keeps its keys sorted
    assert all(torch.equal(tensors2[k], v) for k, v in tensors.items())
    # PEFT itself loads it, and computes what the trained model computes
    loaded = PeftModel.from_pretrained(_base(model_dir), str(out)).eval()
    with torch.no_grad():
        want, got = model(IDS).logits, loaded(IDS).logits
        assert float((want - _base(model_dir)(IDS).logits).abs().max()) > 1e-2  # the adapter matters
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_load_adapter_reads_peft_s_own_save_pretrained(model_dir, tmp_path):
    model = _peft(model_dir, seed=4)
    model.save_pretrained(tmp_path / "peft")
    spec, tensors = lora.load_adapter(tmp_path / "peft")
    want_spec, want = lora.adapter_of(model)
    assert (spec.rank, spec.alpha, spec.target_modules) == (8, 16.0, want_spec.target_modules)
    assert spec.base_fingerprint == ""  # PEFT's directory names no base
    assert sorted(tensors) == sorted(want) and all(torch.equal(tensors[k], v) for k, v in want.items())


def test_load_into_resumes_the_adapter(model_dir):
    trained = _peft(model_dir, seed=5)
    _, tensors = lora.adapter_of(trained)
    fresh = _peft(model_dir, seed=6)
    lora.load_into(fresh, tensors)
    with torch.no_grad():
        assert torch.allclose(fresh(IDS).logits, trained(IDS).logits, atol=1e-6, rtol=0)
    with pytest.raises(KeyError, match="missing"):
        lora.load_into(fresh, {k: v for k, v in list(tensors.items())[1:]})
    bad = dict(tensors)
    bad["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 128)
    with pytest.raises(ValueError, match=r"\[4, 128\] does not fit the model's \[8, 128\]"):
        lora.load_into(fresh, bad)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"use_rslora": True}, "rsLoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        (
            {"target_modules": ["q_proj", "embed_tokens"]},
            "'model.embed_tokens' is a Embedding, not a torch.nn.Linear",
        ),
        ({"lora_bias": True}, "lora_bias"),
    ],
)
def test_what_the_replicas_cannot_apply_is_refused_by_name(model_dir, config, words):
    model = get_peft_model(
        _base(model_dir), LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": TARGETS, **config})
    )
    with pytest.raises(lora.LoraUnsupported) as e:
        lora.adapter_of(model)
    assert words in str(e.value)


def test_a_base_parameter_left_trainable_is_refused(model_dir):
    model = _peft(model_dir)
    model.get_parameter("base_model.model.lm_head.weight").requires_grad_(True)
    with pytest.raises(
        lora.LoraUnsupported, match=r"base parameters require gradients \(base_model\.model\.lm_head"
    ):
        lora.adapter_of(model)


def test_only_the_default_adapter_is_published(model_dir):
    model = _peft(model_dir)
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    spec, tensors = lora.adapter_of(model)  # "default" still active: the other one is not sent
    assert spec.rank == 8 and len(tensors) == 16
    model.set_adapter("other")
    with pytest.raises(lora.LoraUnsupported, match="active PEFT adapter is 'other'"):
        lora.adapter_of(model)


def test_the_full_weight_transports_refuse_a_lora_model(model_dir, tmp_path):
    from maskroll.weight_sync import make_publisher

    class Fleet:  # publish() needs only a version and a broadcast, never reached here
        version = 0

        def broadcast_weights(self, *a, **k):
            raise AssertionError("nothing is broadcast")

    pub = make_publisher("directory", Fleet(), root=tmp_path)
    with pytest.raises(lora.LoraUnsupported, match="LoRA runs publish with the stream transport"):
        pub.publish(_peft(model_dir), 1)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_merge_refuses_an_adapter_that_does_not_fit_the_base(model_dir):
    spec, tensors = lora.adapter_of(_peft(model_dir))
    base_sd = _base(model_dir).state_dict()
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    with pytest.raises(KeyError, match=r"model\.layers\.7\.self_attn\.q_proj\.weight"):
        lora.merge(base_sd, spec, renamed)
    with pytest.raises(ValueError, match="not a LoRA tensor"):
        lora.merge(base_sd, spec, {**tensors, "lm_head.weight": base_sd["lm_head.weight"]})


# ---- the recipe's side ------------------------------------------------------------------------------


def test_lora_config_defaults_and_validation():
    from maskroll.recipes.config import GRPOConfig
    from maskroll.recipes.config import LoraConfig as RecipeLora

    off = GRPOConfig().lora
    assert (off.lora_rank, off.enabled, off.lora_dropout) == (0, False, 0.0)
    assert off.lora_target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert RecipeLora(lora_rank=8).alpha == 16.0 and RecipeLora(lora_rank=8, lora_alpha=4).alpha == 4.0
    assert RecipeLora(lora_rank=4, lora_target_modules=["q_proj"]).lora_target_modules == ("q_proj",)
    for bad, words in (
        ({"lora_rank": -1}, "lora_rank=-1"),
        ({"lora_rank": 8, "lora_alpha": 0}, "lora_alpha=0"),
        ({"lora_dropout": 1.0}, "lora_dropout=1.0"),
        ({"lora_target_modules": "q_proj"}, "lora_target_modules='q_proj'"),
    ):
        with pytest.raises(ValueError, match=words):
            RecipeLora(**bad)


def test_the_run_file_of_trainer_ranks_keeps_the_lora_config(tmp_path):
    from maskroll.recipes.config import GRPOConfig
    from maskroll.recipes.config import LoraConfig as RecipeLora
    from maskroll.recipes.grpo_launch import read_config, write_config

    cfg = GRPOConfig(steps=3, lora=RecipeLora(lora_rank=8, lora_target_modules=("q_proj", "v_proj")))
    path = write_config(tmp_path / "run.json", cfg, result=tmp_path / "result.json")
    assert read_config(path)[0] == cfg


def test_the_recipe_trains_only_the_adapters(model_dir):
    from maskroll.recipes.config import LoraConfig as RecipeLora
    from maskroll.recipes.grpo import lora_model, model_bytes

    base = _base(model_dir)
    full = model_bytes(base)
    assert full == sum(p.numel() * 4 for p in base.parameters())
    model = lora_model(base, RecipeLora(lora_rank=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 16 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert model_bytes(model) == full  # the base's bytes, adapters left out
    spec, tensors = lora.adapter_of(model)
    assert (spec.rank, spec.alpha) == (8, 16.0)
    # PEFT's initialisation: B = 0, so version 0 of a LoRA run computes the base's outputs exactly
    assert all(not t.any() for k, t in tensors.items() if k.endswith(LORA_B))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _base(model_dir)(IDS).logits)
    # one optimiser step moves only adapter tensors
    before = {k: v.clone() for k, v in lora.base_state_dict(model).items()}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    model(IDS).logits.logsumexp(-1).mean().backward()
    opt.step()
    after = lora.base_state_dict(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert any(t.any() for k, t in lora.adapter_of(model)[1].items() if k.endswith(LORA_B))


def test_demo_flags(tmp_path):
    from maskroll.app.demo import parse

    cfg, _ = parse(["--lora-rank", "8", "--out", str(tmp_path)])
    assert (cfg.grpo.lora.lora_rank, cfg.grpo.lora.alpha) == (8, 16.0)
    assert parse(["--out", str(tmp_path)])[0].grpo.lora.lora_rank == 0
    with pytest.raises(SystemExit):
        parse(["--lora-rank", "8", "--weight-transport", "directory"])


# ---- the stream publisher: a real Redis, then a real replica ----------------------------------------


@pytest.fixture(scope="module")
def redis_url():
    from maskroll.local.redis_server import LocalRedis

    with LocalRedis() as r:
        yield r.url


def _recipe_lora(model_dir: Path, seed: int = 0):
    """The recipe's LoRA model (rank 8, alpha 16 on the attention projections, B = 0 as PEFT starts)."""
    from maskroll.recipes.config import LoraConfig as RecipeLora
    from maskroll.recipes.grpo import lora_model

    torch.manual_seed(seed)
    return lora_model(_base(model_dir), RecipeLora(lora_rank=8))


def _adapter_step(model, seed: int) -> None:
    """A stand-in for an optimiser step: every adapter tensor moves (B away from 0), the base never."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_a_lora_run_publishes_its_adapter_saves_it_and_resumes_from_it(model_dir, redis_url, tmp_path):
    """No replica yet: version 0 is recorded (a replica joining later is pushed it), each version's
    adapter is written under save_root in PEFT's layout, and a restarted trainer loads it back."""
    from maskroll.client import RolloutQueue
    from maskroll.weight_sync import make_publisher

    ns = "lora-resume"
    model = _recipe_lora(model_dir)
    with RolloutQueue(redis_url, ns, run="new", batch_size=2) as q:
        pub = make_publisher("stream", q, root=tmp_path, follow_s=None)
        assert pub.start(model) == 0 and q.policy_version == 0
        manifest = pub._manifest  # what the follower pushes a replica that joins
        assert manifest.namespace == ns and manifest.adapter.rank == 8
        assert manifest.adapter.base_fingerprint == model_fingerprint(_base(model_dir))
        assert pub.last_update_bytes == manifest.total_bytes == 65536
        assert pub.last_sent_bytes == 0  # no replica: nothing sent
        assert lora.load_adapter(tmp_path / "v0")[0] == manifest.adapter
        _adapter_step(model, 1)
        with pytest.raises(Exception, match="no live replica"):  # recorded, but nobody took it
            pub.publish(model)
        assert q.policy_version == 1
        pub.close()
    _, trained = lora.adapter_of(model)
    fresh = _recipe_lora(model_dir, seed=9)  # another A; B = 0
    with RolloutQueue(redis_url, ns, run="resume", batch_size=2) as q:
        pub = make_publisher("stream", q, root=tmp_path, follow_s=None)
        assert pub.start(fresh) == 1
        _, resumed = lora.adapter_of(fresh)
        assert all(torch.equal(resumed[k], v) for k, v in trained.items())
        assert pub._manifest.version == 1 and pub._manifest.adapter is not None
        pub.close()
    # a full model cannot resume a LoRA run's directory: refused by name, nothing loaded
    with RolloutQueue(redis_url, ns, run="resume", batch_size=2) as q:
        pub = make_publisher("stream", q, root=tmp_path, follow_s=None)
        with pytest.raises(RuntimeError, match="holds a LoRA adapter"):
            pub.start(_base(model_dir))
        pub.close()
    # ... nor a LoRA model a full run's checkpoint
    from maskroll.proto.run_record import STREAM_CHECKPOINT
    from maskroll.weight_sync.checkpoint import save_checkpoint

    with RolloutQueue(redis_url, "full-run", run="new", batch_size=2) as q:
        q.record_version(1, STREAM_CHECKPOINT)
    save_checkpoint(_base(model_dir), tmp_path / "full", 1)
    with RolloutQueue(redis_url, "full-run", run="resume", batch_size=2) as q:
        pub = make_publisher("stream", q, root=tmp_path / "full", follow_s=None)
        with pytest.raises(RuntimeError, match="holds no LoRA adapter"):
            pub.start(_recipe_lora(model_dir))
        pub.close()


@pytest.mark.slow
def test_a_replica_is_sent_the_adapter_only_and_samples_with_it(model_dir, redis_url, tmp_path):
    """start → the replica serves the adapter v0 (the base's outputs); an optimiser step → v1, and the
    bytes sent are the adapter's (under 5 % of the model's); the replica's logprobs are then the
    trainer's adapted model's; a replica started mid-run is pushed the current adapter by the follower."""
    import sys
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "queue"))
    from procs import Replicas

    from maskroll.client import RolloutQueue, SamplingOptions, SyncRolloutClient
    from maskroll.recipes.grpo import model_bytes
    from maskroll.weight_sync.stream import StreamPublisher

    ns = "lora-replica"
    prompt = [256, 84, 104, 101]
    opts = SamplingOptions(max_tokens=1, logprobs_k=1, seed=3)
    reps = Replicas(model_dir, redis_url, ns, log_dir=tmp_path)
    try:
        reps.start("lora-0", "--max-lora-rank", "8")
        reps.wait_ready()
        model = _recipe_lora(model_dir)
        adapter_bytes = sum(t.nbytes for t in lora.adapter_of(model)[1].values())
        with RolloutQueue(redis_url, ns, run="new", batch_size=2) as q:
            deadline = time.monotonic() + 30
            while not q.replicas():
                assert time.monotonic() < deadline, "the replica never registered"
                time.sleep(0.1)
            address = q.replicas()[0].address
            run_id = q.run_id
            with StreamPublisher(q, follow_s=0.3, timeout=60) as pub, SyncRolloutClient(address) as c:
                assert pub.start(model) == 0
                info = c.info()
                assert [(a.namespace, a.run_id, a.version, a.rank) for a in info.adapters] == [
                    (ns, run_id, 0, 8)
                ]
                assert pub.last_update_bytes == pub.last_sent_bytes == adapter_bytes == 65536
                # v0 = B = 0: the base's outputs
                rec = c.generate_record(prompt, opts)
                assert rec.adapter == f"{ns}/{run_id}/v0" and rec.policy_version_first == 0
                with torch.no_grad():
                    base_lp = torch.log_softmax(_base(model_dir)(torch.tensor([prompt])).logits[0, -1], -1)
                assert abs(float(rec.sampled_logprobs[0]) - float(base_lp[int(rec.completion_ids[0])])) < 1e-4

                _adapter_step(model, 2)
                assert pub.publish(model) == {"lora-0": "ok"}
                info = c.info()
                assert [(a.run_id, a.version) for a in info.adapters] == [(run_id, 1)]
                assert pub.last_update_bytes == pub.last_sent_bytes == adapter_bytes
                full = model_bytes(model)
                assert full == sum(p.numel() * 4 for p in _base(model_dir).parameters())
                assert adapter_bytes < 0.05 * full, (adapter_bytes, full)
                # the replica samples with the trainer's adapter: its logprob is the adapted model's
                rec = c.generate_record(prompt, opts)
                assert rec.adapter == f"{ns}/{run_id}/v1" and rec.policy_version_first == 1
                with torch.no_grad():
                    lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
                assert float((lp - base_lp).abs().max()) > 1e-2  # the step changed the policy
                assert abs(float(rec.sampled_logprobs[0]) - float(lp[int(rec.completion_ids[0])])) < 1e-4

                # a replica that joins mid-run: the follower pushes it the current adapter
                reps.start("lora-1", "--max-lora-rank", "8")
                reps.wait_ready()
                late = {r.replica_id: r.address for r in q.replicas()}["lora-1"]
                with SyncRolloutClient(late) as c1:
                    deadline = time.monotonic() + 60
                    while [(a.run_id, a.version) for a in c1.info().adapters] != [(run_id, 1)]:
                        assert time.monotonic() < deadline, c1.info().adapters
                        time.sleep(0.2)
                    rec = c1.generate_record(prompt, opts)
                assert rec.adapter == f"{ns}/{run_id}/v1"
                assert abs(float(rec.sampled_logprobs[0]) - float(lp[int(rec.completion_ids[0])])) < 1e-4
    finally:
        reps.stop_all()


def _torchrun(mode: str, model_dir: Path, redis_url: str, ns: str, out: Path) -> list[dict]:
    import os
    import subprocess
    import sys

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("lora_ranks.py")), "--model", str(model_dir), "--redis", redis_url]
    cmd += ["--namespace", ns, "--mode", mode, "--root", str(out / "root"), "--out", str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_ddp_ranks_publish_the_adapter_from_rank_0_and_fsdp2_is_refused(model_dir, redis_url, tmp_path):
    """torchrun, 2 gloo ranks, DDP over the recipe's LoRA model: rank 0 publishes the adapter, every rank
    gets the same versions and results; the replica then samples with exactly the adapter the ranks
    hold after DDP's averaged step. FSDP2 + LoRA is refused on both ranks, by name, before any push."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "queue"))
    from procs import Replicas

    from maskroll.client import SamplingOptions, SyncRolloutClient

    ns = "lora-ddp"
    reps = Replicas(model_dir, redis_url, ns, log_dir=tmp_path)
    try:
        reps.start("lora-r0", "--max-lora-rank", "8")
        reps.wait_ready()
        reports = _torchrun("ddp", model_dir, redis_url, ns, tmp_path / "ddp")
        assert [(r["start_version"], r["version"]) for r in reports] == [(0, 1), (0, 1)]
        assert reports[0]["results"] == reports[1]["results"] == {"lora-r0": "ok"}
        assert reports[0]["adapter_sum"] == reports[1]["adapter_sum"]  # DDP kept the ranks equal
        assert reports[0]["last_update_bytes"] == 65536
        root = tmp_path / "ddp" / "root"
        assert sorted(p.name for p in root.iterdir()) == ["v0", "v1"]  # keep=2: the adapters of v0, v1
        _, tensors = lora.load_adapter(root / "v1")  # the resume copy is the adapter published
        _, published = lora.load_adapter(tmp_path / "ddp" / "adapter_v1")
        assert all(torch.equal(tensors[k], v) for k, v in published.items())
        assert any(t.any() for k, t in tensors.items() if k.endswith(LORA_B))  # the step moved B
        # the replica samples with it: its logprob is the local model's with that adapter
        local = _recipe_lora(model_dir)
        lora.load_into(local, tensors)
        prompt = [256, 84, 104, 101]
        address = {r.replica_id: r for r in _live(redis_url, ns)}["lora-r0"].address
        with SyncRolloutClient(address) as c:
            info = c.info()
            rec = c.generate_record(prompt, SamplingOptions(max_tokens=1, logprobs_k=1, seed=3))
        assert [(a.namespace, a.version) for a in info.adapters] == [(ns, 1)]
        assert rec.policy_version_first == 1 and rec.adapter.endswith("/v1")
        with torch.no_grad():
            lp = torch.log_softmax(local.eval()(torch.tensor([prompt])).logits[0, -1], -1)
        assert abs(float(rec.sampled_logprobs[0]) - float(lp[int(rec.completion_ids[0])])) < 1e-4
    finally:
        reps.stop_all()
    reports = _torchrun("fsdp", model_dir, redis_url, "lora-fsdp", tmp_path / "fsdp")
    for r in reports:
        assert r["error"].startswith("LoraUnsupported: a LoRA model sharded with FSDP2"), r


def _live(redis_url: str, ns: str):
    from maskroll.client import RolloutQueue

    with RolloutQueue(redis_url, ns, run="resume", batch_size=2) as q:
        return q.replicas()
