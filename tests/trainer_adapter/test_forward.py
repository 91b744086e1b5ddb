"""trainer_adapter/forward.py: which positions' logits predict the completion (worked by hand on a model
whose logits name their position, and bit for bit against a real model's full logits sliced), and the
realised direction agreement of a hand-made step on four tokens (docs/math.md §7)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from maskroll.trainer_adapter import MaskConfig, compute_masks_for
from maskroll.trainer_adapter.collate import Batch
from maskroll.trainer_adapter.forward import completion_logits, realised_agreement


class Positions(torch.nn.Module):
    """logits[b, l, v] = 100 b + l + v / 4 over the whole sequence; honours logits_to_keep (the last n)."""

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep=0):
        b, n = input_ids.shape
        full = (
            100.0 * torch.arange(b)[:, None, None]
            + torch.arange(n)[None, :, None]
            + torch.arange(3)[None, None, :] / 4
        )
        return SimpleNamespace(logits=full[:, -logits_to_keep:] if logits_to_keep else full)


def _rows(p: int, t: int, b: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.arange(b * (p + t)).reshape(b, p + t) % 7
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(p + t).expand(b, -1),
        "completion_ids": ids[:, p:],
    }


def test_completion_token_t_is_predicted_by_position_p_minus_1_plus_t() -> None:
    # P = 3, T = 2: token 0 by position 2, token 1 by position 3; row 1 adds 100
    got = completion_logits(Positions(), _rows(3, 2))  # [2, 2, 3]
    assert got.tolist() == [
        [[2.0, 2.25, 2.5], [3.0, 3.25, 3.5]],
        [[102.0, 102.25, 102.5], [103.0, 103.25, 103.5]],
    ]


def test_a_real_models_completion_logits_are_its_full_logits_sliced_bit_for_bit() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    rows = _rows(5, 4, b=3)
    rows["attention_mask"][0, :2] = 0  # a left-padded prompt
    rows["position_ids"] = (rows["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    t = rows["completion_ids"].shape[1]
    batch = Batch(
        **rows,
        response_mask=torch.ones(3, t, dtype=torch.bool),
        sampled_logprobs=torch.zeros(3, t),
        topk_ids=torch.zeros(3, t, 1, dtype=torch.long),
        topk_logprobs=torch.zeros(3, t, 1),
        rewards=torch.zeros(3),
        advantages=torch.zeros(3),
        temperature=torch.ones(3, dtype=torch.float64),
        top_k=None,
        top_p=None,
        policy_versions=torch.zeros(3, dtype=torch.long),
        prompt_len=5,
    )
    with torch.no_grad():
        full = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, batch.completion_logits_slice]  # the recipe's definition before this module
        assert torch.equal(completion_logits(model, batch), full)
        assert torch.equal(completion_logits(model, rows), full)  # TRL's dict of the same tensors


class Fixed(torch.nn.Module):
    """A 'model' whose completion logits are `logits` [B, T, V] (the positions before are never read)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
        b, t, v = self.logits.shape
        full = torch.full((b, input_ids.shape[1], v), float("nan"), dtype=self.logits.dtype)
        full[:, -(t + 1) : -1] = self.logits
        return SimpleNamespace(logits=full[:, -logits_to_keep:])


def _two_token_logits(pi_a: list[float]) -> torch.Tensor:  # -> [1, T, 2]: π(token 0) = σ(ℓ0 − ℓ1)
    return torch.tensor([[[math.log(p / (1 - p)), 0.0] for p in pi_a]], dtype=torch.float64)


def test_realised_agreement_of_a_hand_made_step() -> None:
    # One row, V = 2, every sampled token is token 0, μ_a = 0.5, A = +1; binary TV, δ = 0.15.
    # token:        0     1     2     3     4 (padding)
    # π_a before:   0.8   0.6   0.3   0.45  0.9
    # π_a after:    0.9   0.55  0.25  0.5   0.1
    # D before:     0.3   0.1   0.2   0.05         far (D > δ): tokens 0, 2
    # D after:      0.4   0.05  0.25  0            ΔD: + − + −
    # A·(π_a − μ_a): + + − −   (binary TV's P̂ has the ratio's sign: the two rules agree everywhere)
    # agree with sign ΔD: 0 yes, 1 no, 2 no, 3 yes → agree_all 2/4; far 0, 2 → agree_far 1/2
    # masked (far ∧ away): token 0, ΔD > 0 → wrong_mask 0; kept ∧ far: token 2, ΔD > 0 → unsafe_keep 1
    t = 5
    rows = _rows(3, t, b=1)
    batch = {
        **rows,
        "completion_ids": torch.zeros(1, t, dtype=torch.long),
        "sampled_logprobs": torch.full((1, t), math.log(0.5), dtype=torch.float64),
        "topk_ids": torch.tensor([[[0, 1]] * t]),
        "topk_logprobs": torch.full((1, t, 2), math.log(0.5), dtype=torch.float64),
        "advantages": torch.ones(1, dtype=torch.float64),
        "temperature": torch.ones(1, dtype=torch.float64),
        "response_mask": torch.tensor([[True, True, True, True, False]]),
    }
    cfg = MaskConfig(divergence="binary_tv", delta=0.15)
    before = compute_masks_for(batch, _two_token_logits([0.8, 0.6, 0.3, 0.45, 0.9]), config=cfg)
    assert before.far.tolist() == [[True, False, True, False, False]]
    got = realised_agreement(Fixed(_two_token_logits([0.9, 0.55, 0.25, 0.5, 0.1])), batch, cfg, before)
    for rule in ("ratio", "predictive"):
        assert got[rule]["agree_all"] == pytest.approx(0.5)
        assert got[rule]["agree_far"] == pytest.approx(0.5)
        assert got[rule]["unsafe_keep"] == pytest.approx(1.0)
        assert got[rule]["wrong_mask"] == pytest.approx(0.0)
        assert got[rule]["mask_frac"] == pytest.approx(0.25)
        assert math.isnan(got[rule]["agree_disagreement"])  # the rules never disagree here
    assert got["_sets"] == {"far_frac": 0.5, "disagreement_frac_far": 0.0}
