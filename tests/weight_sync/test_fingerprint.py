"""The weights fingerprint (proto/weights_fingerprint.py): the same weights hash alike however they are held
(float32 or bfloat16, a module or a state dict, a checkpoint read by rows on a replica, tied tensors),
and other weights — one changed value at a sampled position, another shape, another name — do not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskroll.proto.weights_fingerprint import SAMPLE, sample_indices, weights_fingerprint
from maskroll.server.weights.dir_fingerprint import fingerprint_dir
from maskroll.weight_sync.model_fingerprint import model_fingerprint


def _llama(tie: bool) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tie,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).to(torch.float32)  # bf16-exact values


def test_sample_positions_are_spread_and_bounded():
    assert sample_indices(5).tolist() == [0, 1, 2, 3, 4]
    idx = sample_indices(10_000)
    assert len(idx) == SAMPLE and idx[0] == 0 and idx[-1] == 9_999 and np.all(np.diff(idx) > 0)


@pytest.mark.parametrize("tie", [False, True])
def test_a_checkpoint_on_a_replica_and_the_model_in_a_trainer_agree(tmp_path, tie):
    model = _llama(tie)
    fp = model_fingerprint(model)
    model.save_pretrained(tmp_path / "m")  # safetensors; a tied lm_head is not stored
    assert fingerprint_dir(tmp_path / "m") == fp
    assert model_fingerprint(model.to(torch.bfloat16)) == fp  # the same weights in bfloat16
    assert model_fingerprint(dict(model.state_dict())) == fp


def test_a_tied_lm_head_stored_anyway_counts_once(tmp_path):
    """A directory that stores the tied lm_head beside the embedding (SmolLM2's conversion does) hashes
    like the model, which holds it once; without the tie, the stored lm_head is a weight of its own."""
    from safetensors.torch import save_file

    model = _llama(True)
    model.save_pretrained(tmp_path / "m")
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in state
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    assert fingerprint_dir(tmp_path / "m") == model_fingerprint(model)
    cfg = tmp_path / "m" / "config.json"
    cfg.write_text(cfg.read_text().replace('"tie_word_embeddings": true', '"tie_word_embeddings": false'))
    assert fingerprint_dir(tmp_path / "m") != model_fingerprint(model)


def test_other_weights_give_another_fingerprint():
    model = _llama(False)
    fp = model_fingerprint(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    w = sd["model.norm.weight"]
    w[int(sample_indices(w.numel())[3])] += 0.25
    assert model_fingerprint(sd) != fp
    renamed = {("x." + k if k == "model.norm.weight" else k): v for k, v in model.state_dict().items()}
    assert model_fingerprint(renamed) != fp
    assert weights_fingerprint([]) == ""
    with pytest.raises(ValueError, match="sample of shape"):
        weights_fingerprint([("a", (1000,), np.zeros(3, np.float32))])
