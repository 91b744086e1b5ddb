"""The trained-ids ledger beside the checkpoints (weight_sync/checkpoint.py): what a resumed run reads
back, what it ignores, and what pruning with the checkpoints removes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from maskroll.weight_sync import read_trained, write_trained
from maskroll.weight_sync.checkpoint import checkpoint_dir, prune, save_checkpoint, trained_path


def test_written_then_read_back_by_version_range(tmp_path):
    write_trained(tmp_path, 1, "runA", ["r3", "r1", "r1"])
    write_trained(tmp_path, 2, "runA", ["r4"])
    write_trained(tmp_path, 3, "runA", ["r5"])  # written before a publish that never recorded v3
    assert json.loads(trained_path(tmp_path, 1).read_text()) == {
        "version": 1,
        "run_id": "runA",
        "rollout_ids": ["r1", "r3"],  # sorted, once each
    }
    assert read_trained(tmp_path, "runA", after=1, through=2) == {"r4"}
    assert read_trained(tmp_path, "runA", after=0, through=2) == {"r1", "r3", "r4"}
    assert read_trained(tmp_path, "runA", after=-5, through=3) == {"r1", "r3", "r4", "r5"}
    assert read_trained(tmp_path, "runB", after=0, through=3) == set()  # another run's files
    assert read_trained(tmp_path, "runA", after=0, through=0) == set()  # version 0 trains on nothing
    # only the ledger remains: no temporary file left behind
    assert sorted(os.listdir(tmp_path / "trained")) == ["v1.json", "v2.json", "v3.json"]


def test_rewritten_ledger_replaces_the_previous_one(tmp_path):
    """A trainer killed before the publish recorded v trains v's records again and writes v anew."""
    write_trained(tmp_path, 4, "runA", ["old1", "old2"])
    write_trained(tmp_path, 4, "runA", ["new1"])
    assert read_trained(tmp_path, "runA", after=3, through=4) == {"new1"}


def test_pruned_with_the_checkpoints(tmp_path):
    sd = {"w": torch.arange(4, dtype=torch.float32)}
    for v in range(1, 6):
        save_checkpoint(sd, tmp_path, v)
        write_trained(tmp_path, v, "runA", [f"r{v}"])
        prune(tmp_path, v, keep=2)
    assert [v for v in range(7) if checkpoint_dir(tmp_path, v).exists()] == [4, 5]
    assert sorted(os.listdir(tmp_path / "trained")) == ["v4.json", "v5.json"]
    assert read_trained(tmp_path, "runA", after=0, through=5) == {"r4", "r5"}


def test_negative_version_refused(tmp_path):
    with pytest.raises(ValueError, match="policy versions are >= 0"):
        write_trained(tmp_path, -1, "runA", ["r"])
