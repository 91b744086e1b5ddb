"""collate with the rewards the stage put in the records: the same tensors and group advantages as the
same rewards passed by hand; a batch mixing scored and unscored records refused, naming one of each."""

from __future__ import annotations

import numpy as np
import pytest

from maskroll.proto.records import RolloutRecord, Semantics
from maskroll.trainer_adapter import collate


def _rec(rid: str, group: str, reward: float | None) -> RolloutRecord:
    t, k = 3, 2
    return RolloutRecord(
        rollout_id=rid,
        request_id=group,
        prompt_ids=np.array([5, 6], np.int32),
        completion_ids=np.array([7, 8, 9][:t], np.int32),
        sampled_logprobs=-np.ones(t, np.float32),
        sampled_ranks=np.ones(t, np.int32),
        topk_ids=np.zeros((t, k), np.int32),
        topk_logprobs=-np.ones((t, k), np.float32),
        finish_reason="stop",
        semantics=Semantics(logprobs_k=k, temperature=1.0),
        job_id=group,
        group_id=group,
        reward=reward,
        reward_verifier="test" if reward is not None else "",
    )


def test_the_records_rewards_give_the_group_advantages_by_hand() -> None:
    # group x: rewards 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3); group y: 2, 4 -> ±1/sqrt(2)
    recs = [
        _rec("a", "x", 1.0),
        _rec("b", "x", 0.0),
        _rec("c", "x", 0.0),
        _rec("d", "y", 2.0),
        _rec("e", "y", 4.0),
    ]
    b = collate(recs)
    s = np.sqrt(1 / 3)
    np.testing.assert_allclose(
        b.advantages.numpy(),
        [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, -1 / np.sqrt(2), 1 / np.sqrt(2)],
        rtol=1e-4,
    )
    assert b.rewards.tolist() == [1.0, 0.0, 0.0, 2.0, 4.0]
    by_hand = collate(recs, [1.0, 0.0, 0.0, 2.0, 4.0])
    assert np.array_equal(by_hand.advantages.numpy(), b.advantages.numpy())
    # an explicit list wins over the records' own (a trainer that re-scores)
    assert collate(recs, [0.0] * 5).rewards.tolist() == [0.0] * 5


def test_a_batch_mixing_scored_and_unscored_records_is_refused_by_name() -> None:
    recs = [_rec("scored-1", "x", 0.5), _rec("unscored-1", "x", None), _rec("scored-2", "x", 1.0)]
    with pytest.raises(
        ValueError, match=r"mixes scored and unscored.*'scored-1' is scored \(0.5\), 'unscored-1' is not"
    ):
        collate(recs)
    with pytest.raises(ValueError, match="none of the 2 records carries a reward: pass rewards="):
        collate([_rec("u1", "x", None), _rec("u2", "x", None)])
    assert collate(recs, [1.0, 0.0, 1.0]).rewards.tolist() == [1.0, 0.0, 1.0]  # given: no mixing check
