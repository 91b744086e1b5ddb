"""`maskroll export-model` (app/export.py): a LoRA run's saved version merged into its base equals PEFT's
own `merge_and_unload()` and generates PEFT's greedy tokens with plain transformers; without --merge the
adapter directory loads in `PeftModel.from_pretrained`; a full run's version is its model; what is
refused is refused by name, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from maskroll.app import cli
from maskroll.app.export import ExportError, export_model, saved_versions
from maskroll.app.model_init import encode_text, init_model
from maskroll.server.weights.dir_fingerprint import fingerprint_dir
from maskroll.weight_sync import lora
from maskroll.weight_sync.checkpoint import save_checkpoint
from maskroll.weight_sync.model_fingerprint import model_fingerprint

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROMPT = "count 7:"
NEW_TOKENS = 24


def _base(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _peft(model_dir: Path, seed: int):
    """A PEFT LoRA model (rank 8, alpha 16: scale 2) on the base with random A and B: PEFT initialises B to
    zero, which would make every merged weight the base's and every comparison below vacuous."""
    model = get_peft_model(_base(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _greedy(model, model_dir: Path) -> list[int]:
    ids = torch.tensor([encode_text(model_dir, PROMPT)])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A base model and a LoRA run's save root with versions 1 and 2 (two different adapters)."""
    d = tmp_path_factory.mktemp("export")
    base = init_model(d / "base", seed=0)
    adapters = {}
    for version in (1, 2):
        spec, tensors = lora.adapter_of(_peft(base, seed=version))
        lora.save_adapter(d / "root" / f"v{version}", spec, tensors)
        adapters[version] = (spec, tensors)
    return base, d / "root", adapters


def test_merge_equals_peft_merge_and_unload_and_generates_its_tokens(run, tmp_path):
    base, root, _ = run
    out = export_model(root, base, tmp_path / "merged", merge=True)  # default: the newest, v2

    peft_model = _peft(base, seed=2)  # the adapter saved as v2
    expected_tokens = _greedy(peft_model, base)
    assert expected_tokens != _greedy(_base(base), base)  # the adapter changes what greedy decoding says
    reference = {k: v.clone() for k, v in peft_model.merge_and_unload().state_dict().items()}

    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(reference)
    worst = max((exported[k] - reference[k]).abs().max().item() for k in reference)
    assert worst <= 1e-6, worst
    base_sd = load_file(str(base / "model.safetensors"))
    moved = (
        exported["model.layers.0.self_attn.q_proj.weight"] - base_sd["model.layers.0.self_attn.q_proj.weight"]
    )
    assert moved.abs().max().item() > 1e-2  # really merged (scale 2 · B A with entries ~ 0.1)
    assert torch.equal(
        exported["model.layers.0.mlp.up_proj.weight"], base_sd["model.layers.0.mlp.up_proj.weight"]
    )

    # plain transformers on the exported directory: PEFT's greedy tokens
    assert _greedy(_base(out), out) == expected_tokens
    # the base's config, generation config, tokenizer and chat template came along
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    assert (
        AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(base).chat_template
    )
    # a replica started on the export reports the merged weights' fingerprint, not the base's
    assert fingerprint_dir(out) == model_fingerprint(reference) != fingerprint_dir(base)


def test_adapter_export_loads_in_peft_and_matches_the_merged_export(run, tmp_path):
    base, root, adapters = run
    out = export_model(root, base, tmp_path / "adapter", version=1)
    assert sorted(p.name for p in out.iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    config = json.loads((out / lora.CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0)

    peft_model = PeftModel.from_pretrained(_base(base), out).eval()
    _, tensors = adapters[1]
    _, loaded = lora.adapter_of(peft_model)
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)  # bit for bit

    merged = export_model(root, base, tmp_path / "merged-v1", version=1, merge=True)
    assert _greedy(peft_model, base) == _greedy(_base(merged), merged)


def test_full_version_is_exported_as_the_model(tmp_path):
    base = init_model(tmp_path / "base", seed=0)
    model = _base(base)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)  # "trained"
    save_checkpoint(model, tmp_path / "root", 4)
    out = export_model(tmp_path / "root", base, tmp_path / "out", merge=True)
    loaded = _base(out).state_dict()
    want = model.state_dict()
    assert set(loaded) == set(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    assert (out / "tokenizer_config.json").read_bytes() == (base / "tokenizer_config.json").read_bytes()
    assert saved_versions(tmp_path / "root") == {4: "full"}


def _cli(capsys, *args) -> tuple[int, str]:
    rc = cli.main(["export-model", *map(str, args)])
    return rc, capsys.readouterr().err


def test_cli_exports_with_progress_on_stderr(run, tmp_path, capsys):
    base, root, _ = run
    rc, err = _cli(capsys, "--weights-root", root, "--model", base, "--out", tmp_path / "o", "--merge")
    assert rc == 0, err
    lines = err.strip().splitlines()
    assert lines[0].startswith(
        f"export-model: version 2 of {root}: LoRA adapter, rank 8, alpha 16, 8 modules"
    )
    assert lines[-1].startswith(f"export-model: wrote the merged model to {tmp_path / 'o'}")
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_refusals(run, tmp_path, capsys):
    base, root, _ = run
    out = tmp_path / "out"

    rc, err = _cli(capsys, "--weights-root", root, "--version", 7, "--model", base, "--out", out)
    assert rc == 2 and "version 7 is not saved under" in err and "saved versions: 1, 2" in err, err
    assert not out.exists()

    other = init_model(tmp_path / "other-base", seed=1)  # same architecture, other weights
    rc, err = _cli(capsys, "--weights-root", root, "--model", other, "--out", out, "--merge")
    assert rc == 2, err
    assert f"trained on base {fingerprint_dir(base)}, but --model {other} is {fingerprint_dir(other)}" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = _cli(capsys, "--weights-root", root, "--model", base, "--out", out)
    assert rc == 2 and f"--out {out} exists and is not an empty directory" in err, err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    (tmp_path / "empty-root").mkdir()
    with pytest.raises(ExportError, match="holds no saved version"):
        export_model(tmp_path / "empty-root", base, tmp_path / "o2")

    # full weights of another architecture do not fit the base's config
    small = init_model(tmp_path / "small", seed=0, hidden=64, heads=2)
    save_checkpoint(load_file(str(small / "model.safetensors")), tmp_path / "full-root", 1)
    with pytest.raises(
        ExportError, match=r"does not fit --model .*'s tensors \(other shapes \['lm_head.weight'"
    ):
        export_model(tmp_path / "full-root", base, tmp_path / "o3")
    assert not (tmp_path / "o3").exists()


@pytest.mark.slow
def test_maskroll_serve_samples_the_peft_models_distribution_from_the_merged_export(run, tmp_path):
    """`maskroll serve --model <export>` (torch engine, a real process): its μ is the PEFT model's π."""
    from maskroll.client import SamplingOptions, SyncRolloutClient
    from maskroll.local.replica import LocalReplica

    base, root, _ = run
    out = export_model(root, base, tmp_path / "merged", merge=True, progress=lambda _: None)
    args = ["--model", out, "--engine", "torch", "--port", "0", "--threads", "1", "--max-logprobs", "8"]
    prompt = encode_text(base, PROMPT)
    options = SamplingOptions(max_tokens=16, temperature=1.0, logprobs_k=8, seed=0)
    with LocalReplica(args, env={"OMP_NUM_THREADS": "1"}, log=tmp_path / "replica.log") as replica:
        client = SyncRolloutClient(replica.address)
        try:
            info = client.info()
            (record,) = client.generate_records(prompt, options)
        finally:
            client.close()
    assert info.weights_fingerprint == fingerprint_dir(out)
    completion = [int(t) for t in record.completion_ids]
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = _peft(base, seed=2)(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()  # [T, V]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy()  # [T]
    np.testing.assert_allclose(record.sampled_logprobs, expected, atol=1e-4)
