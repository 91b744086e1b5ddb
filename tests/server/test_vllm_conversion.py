"""The vLLM engine's pure conversions, on hand-built inputs: no vLLM needed, so these run everywhere.

vLLM's per-position logprob layout (sampled entry first, then the top K) and its two shapes (1 + K
entries, or K when a merged delta collapsed the sampled token into the top-K) are spelled out here as
the data vLLM 0.32 produces; test_vllm_engine.py checks the same paths against the real engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from maskroll.server.engines.vllm_outputs import logprob_arrays, split_by_version, token_versions


@dataclass
class Flat:
    """The fields of vllm.logprobs.FlatLogprobs that the engine reads."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def add(self, entries: list[tuple[int, float, int]]) -> Flat:
        self.start_indices.append(len(self.token_ids))
        for tok, lp, rank in entries:
            self.token_ids.append(tok)
            self.logprobs.append(lp)
            self.ranks.append(rank)
        self.end_indices.append(len(self.token_ids))
        return self

    def __len__(self) -> int:
        return len(self.start_indices)


def test_full_positions_split_sampled_from_topk() -> None:
    # K = 3. Position 0: sampled 9 is outside the top 3 (rank 7). Position 1: sampled 4 is the top-1 and
    # also appears in the top-K (vLLM's flat form keeps both entries).
    lp = Flat().add([(9, -3.0, 7), (1, -0.5, 1), (2, -1.0, 2), (3, -1.5, 3)])
    lp.add([(4, -0.2, 1), (4, -0.2, 1), (5, -2.0, 2), (6, -2.5, 3)])
    sampled, ranks, ids, values = logprob_arrays(lp, 2, 3)
    np.testing.assert_array_equal(sampled, np.array([-3.0, -0.2], np.float32))
    np.testing.assert_array_equal(ranks, [7, 1])
    np.testing.assert_array_equal(ids, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(values, np.array([[-0.5, -1.0, -1.5], [-0.2, -2.0, -2.5]], np.float32))
    assert (sampled.dtype, ranks.dtype, ids.dtype, values.dtype) == (
        np.float32,
        np.int32,
        np.int32,
        np.float32,
    )
    assert ids.flags.c_contiguous and values.flags.c_contiguous


def test_collapsed_positions_are_rebuilt_in_rank_order() -> None:
    # What a merged delta holds (outputs.py RequestOutput.add -> FlatLogprobs.extend through dicts):
    # position 1's sampled token 5 is the top-2, so its entry was overwritten in place by the top-K
    # entry (positional rank 2) and the position has K = 3 entries, sampled first.
    lp = Flat().add([(9, -3.0, 7), (1, -0.5, 1), (2, -1.0, 2), (3, -1.5, 3)])
    lp.add([(5, -1.1, 2), (8, -0.9, 1), (6, -2.5, 3)])
    sampled, ranks, ids, values = logprob_arrays(lp, 2, 3)
    np.testing.assert_array_equal(sampled, np.array([-3.0, -1.1], np.float32))
    np.testing.assert_array_equal(ranks, [7, 2])
    np.testing.assert_array_equal(ids, [[1, 2, 3], [8, 5, 6]])
    np.testing.assert_array_equal(values, np.array([[-0.5, -1.0, -1.5], [-0.9, -1.1, -2.5]], np.float32))


def test_collapsed_position_with_a_tie_counts_the_tie() -> None:
    # sampled 5 ties with the top-1 (both -0.7): vLLM's rank convention counts logprobs >= the sampled one.
    lp = Flat().add([(5, -0.7, 2), (8, -0.7, 1), (6, -2.5, 3)])
    _, ranks, ids, _ = logprob_arrays(lp, 1, 3)
    assert ranks.tolist() == [2] and ids.tolist() == [[8, 5, 6]]


def test_k_zero_keeps_only_the_sampled_token() -> None:
    lp = Flat().add([(7, -2.0, 5)]).add([(3, -0.1, 1)])
    sampled, ranks, ids, values = logprob_arrays(lp, 2, 0)
    assert sampled.tolist() == pytest.approx([-2.0, -0.1]) and ranks.tolist() == [5, 1]
    assert ids.shape == (2, 0) and values.shape == (2, 0)


def test_malformed_logprobs_raise() -> None:
    with pytest.raises(RuntimeError, match="positions"):
        logprob_arrays(Flat().add([(1, -1.0, 1), (1, -1.0, 1)]), 2, 1)
    with pytest.raises(RuntimeError, match="entries at position 0"):
        logprob_arrays(Flat().add([(1, -1.0, 1)]), 1, 3)


def test_token_versions_and_runs() -> None:
    starts = [("0", 0), ("1", 5), ("2", 7)]
    np.testing.assert_array_equal(token_versions(starts, 3, 6), [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(token_versions(starts, 7, 2), [2, 2])
    assert split_by_version(np.array([0, 0, 1, 1, 2, 2])) == [(0, 2, 0), (2, 4, 1), (4, 6, 2)]
    assert split_by_version(np.array([3, 3, 3])) == [(0, 3, 3)]
    with pytest.raises(RuntimeError, match="do not cover"):
        token_versions([("1", 4)], 2, 3)
