"""Trainer-side weight publishing: the checkpoint layout a replica accepts, and the publisher's rules
(every replica or an error naming the ones behind, old versions pruned, nothing half-written)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from maskroll.server.weights import resolve_checkpoint
from maskroll.weight_sync import (
    CHECKPOINT_FILE,
    CheckpointPublisher,
    WeightSyncError,
    checkpoint_dir,
    save_checkpoint,
)


class Replicas:
    """Stands in for RolloutQueue.broadcast_weights: a fixed answer per replica, calls recorded."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.calls = answers, []

    def broadcast_weights(self, version: int, checkpoint_dir: str, timeout: float = 120.0) -> dict[str, str]:
        self.calls.append((version, checkpoint_dir, timeout))
        return dict(self.answers)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_checkpoint_round_trips_exact_values_and_is_accepted_by_a_replica(tmp_path):
    m = _model()
    # a transposed (non-contiguous) view must be written as its values, not refused
    sd = {**m.state_dict(), "extra.t": torch.arange(6.0).reshape(2, 3).T}
    out = save_checkpoint(sd, tmp_path, 3)
    assert out == tmp_path / "v3" == checkpoint_dir(tmp_path, 3)
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_FILE]  # no temporary file left
    back = load_file(str(out / CHECKPOINT_FILE))
    assert set(back) == set(sd)
    for name, t in sd.items():
        assert torch.equal(back[name], t), name
    assert back["extra.t"][2, 1].item() == 5.0
    # the replica's own path rule accepts the layout under its weights root
    assert resolve_checkpoint("v3", tmp_path) == out.resolve()


def test_versions_start_at_one_and_empty_state_dicts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="start at 1"):
        checkpoint_dir(tmp_path, 0)
    with pytest.raises(ValueError, match="empty"):
        save_checkpoint({}, tmp_path, 1)


def test_publish_reaches_every_replica_and_prunes_old_versions(tmp_path):
    reps = Replicas({"a": "ok", "b": "ok"})
    pub = CheckpointPublisher(reps, tmp_path, keep=2, timeout=7.0)
    m = _model()
    for v in range(1, 5):
        assert pub.publish(m, v) == {"a": "ok", "b": "ok"}
    assert [c[0] for c in reps.calls] == [1, 2, 3, 4]
    assert reps.calls[-1] == (4, str(tmp_path / "v4"), 7.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3", "v4"]


def test_a_replica_behind_raises_by_default_and_names_it(tmp_path):
    pub = CheckpointPublisher(Replicas({"a": "ok", "b": "FAILED_PRECONDITION: version 1 <= 10"}), tmp_path)
    with pytest.raises(WeightSyncError, match="b: FAILED_PRECONDITION") as e:
        pub.publish(_model(), 1)
    assert e.value.failed == {"b": "FAILED_PRECONDITION: version 1 <= 10"}


def test_partial_publish_is_allowed_when_asked_but_none_accepting_always_raises(tmp_path):
    partial = CheckpointPublisher(Replicas({"a": "ok", "b": "timeout"}), tmp_path, require_all=False)
    assert partial.publish(_model(), 1) == {"a": "ok", "b": "timeout"}
    nobody = CheckpointPublisher(Replicas({"a": "timeout"}), tmp_path, require_all=False)
    with pytest.raises(WeightSyncError, match="a: timeout"):
        nobody.publish(_model(), 2)
    empty = CheckpointPublisher(Replicas({}), tmp_path, require_all=False)
    with pytest.raises(WeightSyncError, match="no live replica"):
        empty.publish(_model(), 3)
