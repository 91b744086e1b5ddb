"""Trainer-side weight publishing: the checkpoint layout a replica accepts, and the publisher's rules
(every replica or an error naming the ones behind, old versions pruned, nothing half-written, versions
counted from the run, a resumed run loaded back, a new run's version 0 recorded and adopted by the
replicas whose starting weights are the trainer's model). The same publisher against real replicas:
tests/queue/test_run_lifecycle.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from maskroll.client import BroadcastError, ReplicaWeights, RunInfo
from maskroll.server.weights.checkpoints import resolve_checkpoint
from maskroll.weight_sync import (
    CHECKPOINT_FILE,
    CheckpointPublisher,
    WeightSyncError,
    checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from maskroll.weight_sync.model_fingerprint import model_fingerprint


class Replicas:
    """Stands in for a queue's replicas (a publish.Fleet): a fixed answer per replica, calls recorded;
    like the queue's run, it owns the version and a broadcast advances it."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.calls, self.version = answers, [], 0

    def broadcast_weights(self, version: int, checkpoint_dir: str, timeout: float = 120.0) -> dict[str, str]:
        self.calls.append((version, checkpoint_dir, timeout))
        self.version = version
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
    assert resolve_checkpoint("v3", tmp_path).path == out.resolve()


def test_versions_are_not_negative_and_empty_state_dicts_are_refused(tmp_path):
    assert checkpoint_dir(tmp_path, 0) == tmp_path / "v0"  # a run's starting weights
    with pytest.raises(ValueError, match=r"versions are >= 0 .* got -1"):
        checkpoint_dir(tmp_path, -1)
    with pytest.raises(ValueError, match="empty"):
        save_checkpoint({}, tmp_path, 1)


def test_load_checkpoint_restores_a_model_exactly_and_names_a_missing_one(tmp_path):
    trained, fresh = _model(), torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    save_checkpoint(trained, tmp_path, 7)
    load_checkpoint(fresh, tmp_path / "v7")
    for name, t in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path}/v8/model.safetensors"):
        load_checkpoint(fresh, tmp_path / "v8")


def test_publish_reaches_every_replica_and_prunes_old_versions(tmp_path):
    reps = Replicas({"a": "ok", "b": "ok"})
    pub = CheckpointPublisher(reps, tmp_path, keep=2, timeout=7.0)
    m = _model()
    assert pub.publish(m, 0) == {"a": "ok", "b": "ok"}  # a run's starting weights
    for _ in range(4):
        assert pub.publish(m) == {"a": "ok", "b": "ok"}  # the next version by default
    assert [c[0] for c in reps.calls] == [0, 1, 2, 3, 4] and pub.version == 4
    assert reps.calls[-1] == (4, str(tmp_path / "v4"), 7.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3", "v4"]  # v0 pruned like the others


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


def test_a_queue_that_no_replica_answered_becomes_a_weight_sync_error(tmp_path):
    class Nobody(Replicas):
        def broadcast_weights(self, version, checkpoint_dir, timeout=120.0):
            raise BroadcastError(version, {"a": "UNAVAILABLE: connection refused"}, "ns")

    with pytest.raises(WeightSyncError, match="a: UNAVAILABLE") as e:
        CheckpointPublisher(Nobody({}), tmp_path).publish(_model(), 1)
    assert isinstance(e.value, BroadcastError) and e.value.failed == {"a": "UNAVAILABLE: connection refused"}


class RunQueue(Replicas):
    """Stands in for a RolloutQueue that knows its run: the run, what each replica serves, and the two
    ways of moving replicas (broadcast a new version, sync them to the current one)."""

    def __init__(self, run: RunInfo, serving: dict) -> None:
        super().__init__({r: "ok" for r in serving})
        self.run, self.serving, self.synced, self.version = run, serving, 0, run.version

    def replica_weights(self, timeout: float = 10.0) -> dict:
        return dict(self.serving)

    def adopt_replicas(self, fingerprint: str, timeout: float = 10.0) -> dict:
        """As the replicas answer AdoptSource: those on starting weights of this fingerprint take it."""
        took = {r: "ok" for r, w in self.serving.items() if not w.run_id and w.fingerprint == fingerprint}
        for r in took:
            self.serving[r] = ReplicaWeights(self.run.run_id, 0)
        return took

    def broadcast_weights(self, version, checkpoint_dir, timeout=120.0):
        self.run = RunInfo(self.run.run_id, version, checkpoint_dir)
        return super().broadcast_weights(version, checkpoint_dir, timeout)

    def sync_replicas(self, timeout: float = 120.0) -> dict:
        self.synced += 1
        return {r: "unchanged" for r in self.serving}


def test_start_records_a_new_runs_version_0_and_replicas_holding_the_model_adopt_it(tmp_path):
    m = _model()
    mine = model_fingerprint(m)
    serving = {
        "a": ReplicaWeights("", 0, mine),  # started from the trainer's model
        "b": ReplicaWeights("", 0, model_fingerprint(torch.nn.Linear(3, 4))),  # another --model
        "c": ReplicaWeights("run-a", 4),  # another run's weights
    }
    q = RunQueue(RunInfo("run-b"), serving)
    pub = CheckpointPublisher(q, tmp_path)
    assert pub.start(m) == 0
    assert q.serving["a"] == ReplicaWeights("run-b", 0)  # adopted: no load
    assert q.serving["b"].run_id == ""  # a fingerprint that differs is never adopted...
    # ...it (and "c") load version 0, which is saved and recorded for replicas that join later
    assert q.calls == [(0, str(tmp_path / "v0"), 120.0)] and q.run.checkpoint == str(tmp_path / "v0")
    assert torch.equal(load_file(str(tmp_path / "v0" / CHECKPOINT_FILE))["0.weight"], m[0].weight)
    assert pub.publish(_model()) and q.calls[-1][0] == 1


def test_start_resumes_a_run_from_its_latest_checkpoint(tmp_path):
    trained = _model()
    with torch.no_grad():
        trained[0].weight.add_(1.0)
    save_checkpoint(trained, tmp_path, 5)
    q = RunQueue(RunInfo("run-a", 5, str(tmp_path / "v5")), {"a": ReplicaWeights("run-a", 5)})
    restarted = _model()
    pub = CheckpointPublisher(q, tmp_path)
    assert pub.start(restarted) == 5 and q.synced == 1
    assert torch.equal(restarted[0].weight, trained[0].weight)
    before = (tmp_path / "v5" / CHECKPOINT_FILE).read_bytes()
    with pytest.raises(ValueError, match="version 5 does not move the run forward: the last published is 5"):
        pub.publish(_model(), 5)
    assert (tmp_path / "v5" / CHECKPOINT_FILE).read_bytes() == before  # the resume point is untouched
    pub.publish(restarted)
    assert q.calls == [(6, str(tmp_path / "v6"), 120.0)]
    with pytest.raises(TypeError, match=r"needs a maskroll\.client\.RolloutQueue"):
        CheckpointPublisher(Replicas({}), tmp_path).start(restarted)
