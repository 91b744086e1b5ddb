"""`split_groups`: one global batch split between data-parallel trainer ranks (client/batching.py).

Whole groups to one rank, every record exactly once, balanced by completion tokens with the greedy
rule's bound (heaviest − lightest share ≤ the largest group's tokens), the same shares every time.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from maskroll.client.batching import group_key, split_groups
from maskroll.proto.records import RolloutRecord, Semantics


def _record(job: str, index: int, tokens: int, size: int) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=f"{job}:{index}",
        request_id=f"{job}-{index}",
        prompt_ids=np.array([1, 2], np.int32),
        completion_ids=np.arange(tokens, dtype=np.int32),
        sampled_logprobs=np.zeros(tokens, np.float32),
        sampled_ranks=np.ones(tokens, np.int32),
        topk_ids=np.zeros((tokens, 0), np.int32),
        topk_logprobs=np.zeros((tokens, 0), np.float32),
        finish_reason="length",
        semantics=Semantics(temperature=1.0, logprobs_k=0, engine="test"),
        job_id=job,
        sample_index=index,
        group_size=size,
    )


def _batch(token_counts: dict[str, list[int]]) -> list[RolloutRecord]:
    """Records of groups {job: [tokens of each sample]}, interleaved as a reader could deliver them."""
    recs = [_record(job, i, t, len(ts)) for job, ts in token_counts.items() for i, t in enumerate(ts)]
    random.Random(7).shuffle(recs)
    return recs


def _tokens(share: list[RolloutRecord]) -> int:
    return sum(r.num_tokens for r in share)


def test_whole_groups_every_record_once_and_order_kept():
    recs = _batch({f"j{g}": [g + 1, 2 * g + 1, 3] for g in range(7)})
    shares = split_groups(recs, 3)
    assert sorted(r.rollout_id for s in shares for r in s) == sorted(r.rollout_id for r in recs)
    owners: dict[str, set[int]] = {}
    for rank, share in enumerate(shares):
        for r in share:
            owners.setdefault(group_key(r), set()).add(rank)
    assert all(len(ranks) == 1 for ranks in owners.values()) and len(owners) == 7
    position = {r.rollout_id: i for i, r in enumerate(recs)}
    for share in shares:  # each share keeps the batch's order
        assert [position[r.rollout_id] for r in share] == sorted(position[r.rollout_id] for r in share)


def test_balanced_by_tokens_not_records():
    # Four groups of 4 records: 100, 10, 10 and 80 tokens. Two groups per rank (balanced by records)
    # gives at best 110 / 90; largest first to the lightest share: a (100) -> rank 0, d (80) -> rank 1,
    # then b and c (10 each) -> rank 1: 100 / 100, with 4 records against 12.
    recs = _batch({"a": [25] * 4, "b": [5, 5, 0, 0], "c": [10, 0, 0, 0], "d": [20] * 4})
    shares = split_groups(recs, 2)
    assert [_tokens(s) for s in shares] == [100, 100]
    assert {group_key(r) for r in shares[0]} == {"a"}
    assert {group_key(r) for r in shares[1]} == {"b", "c", "d"}
    assert [len(s) for s in shares] == [4, 12]  # records are not what is balanced


def test_greedy_bound_on_random_batches():
    rng = random.Random(3)
    for trial in range(200):
        ranks = rng.randint(1, 8)
        groups = {f"g{trial}-{i}": [rng.randint(0, 64) for _ in range(rng.randint(2, 8))] for i in range(30)}
        recs = _batch(groups)
        loads = [_tokens(s) for s in split_groups(recs, ranks)]
        largest = max(sum(ts) for ts in groups.values())
        assert max(loads) - min(loads) <= largest, (ranks, loads, largest)
        assert sum(loads) == sum(sum(ts) for ts in groups.values())


def test_deterministic_and_ties_by_rank():
    recs = _batch({f"j{i}": [4, 4] for i in range(6)})  # six equal groups of 8 tokens
    first = split_groups(recs, 4)
    assert [[r.rollout_id for r in s] for s in first] == [
        [r.rollout_id for r in s] for s in split_groups(list(recs), 4)
    ]
    # equal groups in order of first appearance: ranks 0..3 get one each, then ranks 0 and 1 a second
    seen = list(dict.fromkeys(group_key(r) for r in recs))
    assert [sorted({group_key(r) for r in s}) for s in first] == [
        sorted([seen[0], seen[4]]),
        sorted([seen[1], seen[5]]),
        [seen[2]],
        [seen[3]],
    ]


def test_zero_token_groups_still_fill_empty_shares():
    # Groups whose samples stopped at once (0 tokens) must not leave a share empty while another holds two
    recs = _batch({"z1": [0, 0], "z2": [0, 0], "x": [3, 3]})
    shares = split_groups(recs, 3)
    assert all(shares) and sorted(_tokens(s) for s in shares) == [0, 0, 6]


def test_fewer_groups_than_ranks_leaves_empty_shares():
    shares = split_groups(_batch({"a": [1, 2], "b": [3, 4]}), 4)
    assert [_tokens(s) for s in shares] == [7, 3, 0, 0]
    assert split_groups([], 2) == [[], []]


@pytest.mark.parametrize("ranks", [0, -1, 1.5, True])
def test_bad_rank_count(ranks):
    with pytest.raises(ValueError, match="ranks="):
        split_groups(_batch({"a": [1, 1]}), ranks)
