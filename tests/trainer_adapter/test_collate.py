"""collate: padding layout, group-normalised advantages by hand, the semantic checks of docs/math.md §6."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maskroll.proto.records import RolloutRecord, Semantics
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


# ---- multi-turn records (an agent session): the loss mask is the response mask ----------------------


def _multi_turn(
    completion: list[int], mask: list[int], segment_starts=(), k: int = 2, versions=()
) -> RolloutRecord:
    """A multi-turn record as a replica decodes it: logprob arrays zero where the model did not sample."""
    t = len(completion)
    gen = np.array(mask, bool)
    sampled = np.where(gen, -np.arange(1, t + 1, dtype=np.float32) / 4, 0).astype(np.float32)
    topk_ids = np.where(gen[:, None], (np.arange(t * k).reshape(t, k) % 16), 0).astype(np.int32)
    topk_lp = np.where(gen[:, None], np.full((t, k), -0.5, np.float32), 0).astype(np.float32)
    return RolloutRecord(
        rollout_id="s-0",
        request_id="s",
        prompt_ids=np.array([1, 2], np.int32),
        completion_ids=np.array(completion, np.int32),
        sampled_logprobs=sampled,
        sampled_ranks=gen.astype(np.int32),
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        finish_reason="stop",
        semantics=Semantics(logprobs_k=k),
        job_id="s",
        policy_version_first=3,
        policy_version_last=versions[-1][1] if versions else 3,
        version_changes=list(versions),
        schema_version=2,
        loss_mask=gen,
        segment_starts=list(segment_starts),
        num_turns=2,
    )


def test_the_response_mask_of_a_multi_turn_record_is_its_loss_mask() -> None:
    rec = _multi_turn([5, 6, 7, 8, 9, 10], [1, 1, 0, 0, 0, 1], versions=[(5, 4)])
    assert not rec.problems()
    b = collate([rec, _rec("b", [4], [3, 2])], [1.0, 0.0])
    assert b.response_mask.tolist() == [[True, True, False, False, False, True], [True, True] + [False] * 4]
    assert b.input_ids[0].tolist() == [1, 2, 5, 6, 7, 8, 9, 10]  # the tool tokens are context, in place
    assert b.record_index.tolist() == [0, 1] and b.policy_versions.tolist() == [3, 2]


def test_segments_of_an_edited_history_become_rows_with_their_own_context() -> None:
    # turn 1 sampled [5, 6]; the client edited its history: a fresh prompt [1, 2, 3, 4], then [11, 12]
    rec = _multi_turn(
        [5, 6, 1, 2, 3, 4, 11, 12], [1, 1, 0, 0, 0, 0, 1, 1], segment_starts=[2], versions=[(6, 9)]
    )
    assert not rec.problems()
    other = _rec("b", [4], [3])
    rec.group_id = other.group_id = "g"  # one GRPO group of two records, three rows
    b = collate([rec, other], [2.0, 0.0], normalize_std=False)
    assert b.record_index.tolist() == [0, 0, 1]
    assert b.prompt_len == 4
    assert b.input_ids.tolist() == [[0, 0, 1, 2, 5, 6], [1, 2, 3, 4, 11, 12], [0, 0, 0, 4, 3, 0]]
    assert b.response_mask.tolist() == [[True, True], [True, True], [True, False]]
    np.testing.assert_allclose(b.sampled_logprobs[1].numpy(), [-7 / 4, -8 / 4])
    assert b.rewards.tolist() == [2.0, 2.0, 0.0]  # each row its record's reward and advantage
    assert b.advantages.tolist() == [1.0, 1.0, -1.0]  # r − mean over the group's records, not rows
    assert b.policy_versions.tolist() == [3, 9, 2]


def test_masks_and_loss_ignore_what_the_model_did_not_sample() -> None:
    from maskroll.trainer_adapter import MaskConfig, compute_masks, policy_loss, token_logprobs

    mask = [1, 1, 0, 0, 0, 1, 1]
    clean = _multi_turn([5, 6, 7, 8, 9, 10, 3], mask)
    noisy = _multi_turn([5, 6, 7, 8, 9, 10, 3], mask)
    gen = clean.generated
    # what a replica never sends for context tokens, replaced by garbage: nothing may change
    noisy.sampled_logprobs[~gen] = -9.0
    noisy.topk_ids[~gen] = 15
    noisy.topk_logprobs[~gen] = -0.01

    def loss_and_grad(rec):
        other = _rec("g", [1, 2], [4, 4, 4], k=2)
        rec.group_id = other.group_id = "grp"  # one group: advantages ±0.71, so gradients flow
        b = collate([rec, other], [1.0, 0.0])
        torch.manual_seed(0)
        logits = torch.randn(2, b.input_ids.shape[1], 16, dtype=torch.float64)[:, b.completion_logits_slice]
        logits.requires_grad_(True)
        lp = token_logprobs(logits, b.completion_ids)
        cfg = MaskConfig(method="predictive", divergence="topk_kl", estimator="proportional", delta=0.05)
        res = compute_masks(
            logits.detach(), b.completion_ids, b.sampled_logprobs.double(), b.topk_ids,
            b.topk_logprobs.double(), b.advantages.double(), config=cfg, response_mask=b.response_mask,
        )  # fmt: skip
        loss, _ = policy_loss(lp, b.sampled_logprobs.double(), b.advantages.double(), res.keep, masks=res)
        loss.backward()
        return loss.detach(), logits.grad, res.keep, b.response_mask

    loss_a, grad_a, keep_a, resp = loss_and_grad(clean)
    loss_b, grad_b, keep_b, _ = loss_and_grad(noisy)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b) and torch.equal(keep_a, keep_b)
    assert not keep_a[~resp].any() and keep_a[resp].any()
    assert grad_a[0][~resp[0]].abs().sum() == 0  # no gradient through tool / template tokens
    assert grad_a[0][resp[0]].abs().sum() > 0


def test_compute_masks_for_reads_the_batch() -> None:
    """compute_masks_for(batch, logits) is compute_masks with the batch's fields spelled out — from a
    Batch, or from a dict of the same tensors (TRL's micro-batches) — and takes a Batch's truncation."""
    from maskroll.trainer_adapter import MaskConfig, compute_masks, compute_masks_for

    recs = [_rec("a", [1, 2], [3, 4, 5], k=2, top_p=0.9), _rec("a", [1], [6, 7], k=2, top_p=0.9)]
    recs[1].rollout_id = "a-2b"
    b = collate(recs, [1.0, 0.0], allow_truncation=True)
    logits = torch.randn(2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cfg = MaskConfig(method="predictive", divergence="topk_tv", delta=0.05, replay_truncation=True)
    want = compute_masks(
        logits, b.completion_ids, b.sampled_logprobs, b.topk_ids, b.topk_logprobs, b.advantages,
        config=cfg, temperature=b.temperature, top_p=0.9, response_mask=b.response_mask,
    )  # fmt: skip
    as_dict = {k: v for k, v in b.__dict__.items() if isinstance(v, torch.Tensor)}
    for got in (
        compute_masks_for(b, logits, config=cfg),
        compute_masks_for(b, logits, config=cfg, top_p=0.9),
        compute_masks_for(as_dict, logits, config=cfg, top_p=0.9),
    ):
        for name, value in want.__dict__.items():
            assert torch.equal(getattr(got, name), value), name
    untruncated = compute_masks(
        logits, b.completion_ids, b.sampled_logprobs, b.topk_ids, b.topk_logprobs, b.advantages,
        config=cfg, temperature=b.temperature, response_mask=b.response_mask,
    )  # fmt: skip
    assert not torch.equal(untruncated.logprobs, want.logprobs)  # top_p = 0.9 was replayed on π
    with pytest.raises(ValueError, match=r"top_k, top_p = \(None, 0\.5\), but the batch was collated with"):
        compute_masks_for(b, logits, config=cfg, top_p=0.5)
    # the Batch's truncation is read: without replay the masks refuse the truncated batch
    with pytest.raises(ValueError, match="sampled with truncation"):
        compute_masks_for(b, logits, config=MaskConfig(method="predictive", divergence="topk_tv"))
