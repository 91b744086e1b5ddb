"""`maskroll init-model`: deterministic bytes, a byte-level tokenizer that round-trips UTF-8, a model that
transformers loads strictly, and an output distribution that is neither flat nor one-hot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from maskroll.app import cli
from maskroll.app.model_init import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, encode_text, init_model

TEXT = "naïve café — 🙂\n\tbytes: \x00\x7f"


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = _files(init_model(tmp_path / "again", seed=0))
    assert again == _files(tiny_model_dir)
    assert set(again) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    other = _files(init_model(tmp_path / "other", seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in again.items() if k != "model.safetensors"
    }


def test_config_has_the_standard_llama_fields(tiny_model_dir: Path) -> None:
    c = json.loads((tiny_model_dir / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["num_hidden_layers"]) == (
        128,
        4,
        32,
        2,
    )
    assert c["vocab_size"] == VOCAB_SIZE == 259
    assert c["max_position_embeddings"] == 1024
    assert c["torch_dtype"] == "float32" and c["tie_word_embeddings"] is False
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (256, 257, 258)


def test_tokenizer_round_trips_utf8_bytes(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    ids = tok(TEXT)["input_ids"]
    assert ids == [BOS_ID, *TEXT.encode("utf-8")]  # id = byte value, <bos> prepended
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert encode_text(tiny_model_dir, TEXT) == ids
    assert encode_text(tiny_model_dir, TEXT, add_bos=False) == ids[1:]


def test_model_loads_strictly_with_a_peaked_but_not_degenerate_distribution(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (
        info
    )
    assert model.dtype == torch.float32
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # untied
    ids = torch.tensor([encode_text(tiny_model_dir, "The quick brown fox jumps over")])
    with torch.no_grad():
        logp = model(ids).logits[0].log_softmax(-1)  # [P, V]
    entropy = -(logp.exp() * logp).sum(-1)  # [P]
    # seed 0, transformers 5.24: entropy 1.80 .. 4.25 nats per position (mean 3.35, last 3.34) against
    # log V = 5.56, largest probability ~0.2. HF's default init std 0.02 would give 5.53 everywhere.
    assert entropy.min() > 1.0 and entropy.max() < math.log(VOCAB_SIZE) - 1.0
    assert entropy.std() > 0.3  # the distribution depends on the context
    assert 0.05 < logp.exp().amax(-1).mean() < 0.6


def test_cli_writes_the_model_and_rejects_small_heads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["init-model", str(tmp_path / "m"), "--seed", "3", "--max-len", "256"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 256
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["init-model", str(tmp_path / "bad"), "--hidden", "96", "--heads", "4"])  # head_dim 24
    assert exc.value.code == 2
    assert "head_dim" in capsys.readouterr().err
