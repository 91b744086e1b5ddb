"""collate: padding layout, group-normalised advantages by hand, the semantic checks of docs/math.md §6."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskroll.client.records import RolloutRecord, Semantics
from maskroll.trainer_adapter import SemanticsError, collate, group_advantages


def _rec(job: str, prompt: list[int], completion: list[int], k: int = 2, **sem) -> RolloutRecord:
    t = len(completion)
    return RolloutRecord(
        rollout_id=f"{job}-{len(completion)}",
        request_id=job,
        prompt_ids=np.array(prompt, np.int32),
        completion_ids=np.array(completion, np.int32),
        sampled_logprobs=-np.arange(1, t + 1, dtype=np.float32),
        sampled_ranks=np.ones(t, np.int32),
        topk_ids=np.arange(t * k, dtype=np.int32).reshape(t, k),
        topk_logprobs=-np.ones((t, k), np.float32),
        finish_reason="stop",
        semantics=Semantics(logprobs_k=k, **{"temperature": 1.0, **sem}),
        job_id=job,
        policy_version_first=2,
    )


def test_layout_left_pads_prompts_right_pads_completions() -> None:
    recs = [_rec("a", [5, 6, 7], [8, 9]), _rec("b", [4], [3, 2, 1])]
    b = collate(recs, [1.0, 0.0], pad_id=0)
    assert b.prompt_len == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 4, 3, 2, 1]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.completion_ids.tolist() == [[8, 9, 0], [3, 2, 1]]
    assert b.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert b.sampled_logprobs[0].tolist() == [-1.0, -2.0, 0.0]
    assert b.topk_ids.shape == (2, 3, 2) and b.topk_ids[1, 2].tolist() == [4, 5]
    # the logits at prompt_len-1+t predict completion token t
    s = b.completion_logits_slice
    assert (s.start, s.stop) == (2, 5)
    assert torch.equal(
        b.input_ids[:, s.start + 1 : s.stop + 1][b.response_mask], b.completion_ids[b.response_mask]
    )
    assert b.policy_versions.tolist() == [2, 2]


def test_group_advantages_by_hand() -> None:
    # group x: rewards 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3); group y alone -> 0
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 5.0]), ["x", "x", "x", "y"], eps=0.0)
    s = np.sqrt(1 / 3)
    np.testing.assert_allclose(adv, [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0], rtol=1e-6)
    dr = group_advantages(np.array([1.0, 0.0]), ["x", "x"], normalize_std=False)
    np.testing.assert_allclose(dr, [0.5, -0.5])
    same = group_advantages(np.array([2.0, 2.0]), ["x", "x"])
    np.testing.assert_allclose(same, [0.0, 0.0])


def test_semantic_checks() -> None:
    with pytest.raises(SemanticsError, match="truncation"):
        collate([_rec("a", [1], [2], top_k=5)], [0.0])
    ok = collate([_rec("a", [1], [2], top_p=0.9)], [0.0], allow_truncation=True)
    assert (ok.top_k, ok.top_p) == (None, 0.9)
    with pytest.raises(SemanticsError, match="mix truncation"):
        collate([_rec("a", [1], [2], top_k=5), _rec("b", [1], [2])], [0.0, 1.0], allow_truncation=True)
    with pytest.raises(SemanticsError, match="K"):
        collate([_rec("a", [1], [2], k=2), _rec("b", [1], [2], k=3)], [0.0, 1.0])
    raw = _rec("a", [1], [2])
    raw.semantics = Semantics(logprobs_mode="raw", logprobs_k=2)
    with pytest.raises(SemanticsError, match="processed"):
        collate([raw], [0.0])
    with pytest.raises(ValueError, match="rewards"):
        collate([_rec("a", [1], [2])], [0.0, 1.0])


def test_per_sequence_temperature() -> None:
    b = collate([_rec("a", [1], [2], temperature=0.7), _rec("b", [1], [2], temperature=1.3)], [0.0, 1.0])
    assert b.temperature.dtype == torch.float64 and b.temperature.tolist() == [0.7, 1.3]


@pytest.mark.parametrize("t", [0.0, -0.5, float("nan"), float("inf")])
def test_a_record_with_an_invalid_temperature_is_refused_by_the_sdk_rule(t) -> None:
    recs = [_rec("a", [1], [2]), _rec("b", [1], [2], temperature=t), _rec("c", [1], [2])]
    with pytest.raises(SemanticsError) as err:
        collate(recs, [0.0, 1.0, 0.5])
    assert str(err.value).startswith(f"semantics.temperature must be finite and > 0, got {t} (there is no")
    assert str(err.value).endswith("(1 of 3 records)")
