"""The directory transport's trainer end (the replica's: server/weights/directory.py): CheckpointPublisher,
which after an optimiser step writes the new policy and makes every live replica load it.

One call per version: save the checkpoint (`checkpoint.py` layout), then `broadcast_weights`
(broadcast.py) records the version as the run's latest in Redis, makes it the trainer's policy version
(so staleness is counted against it, and newer records are refused) and calls `UpdateWeights(version,
run id)` on every live replica in parallel, a timeout each; finally old versions are pruned. A
replica that refuses or times out is reported by id; by default any failure raises, because a replica
left on old weights keeps producing records the trainer would count as stale — or worse, train on as
if they were fresh.

Before the loop, `start(model)` puts trainer and replicas on the run's current version: a resumed run
loads its latest checkpoint into the model and brings every replica to it; a new run publishes the
model as version 0 when some replica serves other weights (a previous run's), so that no replica ever
samples for this run from weights the run does not have.

The publisher sends through a `Fleet`: the live replicas of a `RolloutQueue`'s run (`QueueFleet`, the
usual case), or a fixed list of replicas with no queue (maskroll.integrations.rollouts). The fleet owns
the version the publisher advances — for a queue, the queue's policy version (its run's). The rules
every publisher shares (the next version, per-replica results) are `versions.py`'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from maskroll.client import BroadcastError, ReplicaWeights

from . import broadcast
from .checkpoint import CHECKPOINT_FILE, checkpoint_dir, load_checkpoint, prune, save_checkpoint
from .lora import refuse_lora
from .model_fingerprint import model_fingerprint
from .versions import WeightSyncError, checked, next_version, publish_first

if TYPE_CHECKING:
    from maskroll.client import RolloutQueue, RunInfo

log = logging.getLogger(__name__)


class Fleet(Protocol):
    """What CheckpointPublisher.publish needs: the version it advances (the last published; its one
    owner) and a broadcast that publishes the next one. start() needs a queue's run too (QueueFleet)."""

    @property
    def version(self) -> int: ...

    def broadcast_weights(
        self, version: int, checkpoint_dir: str, timeout: float = ...
    ) -> dict[str, str]: ...


class QueueFleet:
    """The live replicas of a RolloutQueue's run, as a Fleet: weight_sync.broadcast on the queue. Its
    version is the queue's policy version (the run's)."""

    def __init__(self, queue: RolloutQueue) -> None:
        self.queue = queue

    @property
    def version(self) -> int:
        return self.queue.policy_version

    @property
    def run(self) -> RunInfo:
        return self.queue.run

    def broadcast_weights(self, version: int, checkpoint_dir: str, timeout: float = 120.0) -> dict[str, str]:
        return broadcast.broadcast_weights(self.queue, version, checkpoint_dir, timeout)

    def replica_weights(self, timeout: float = 10.0) -> dict[str, ReplicaWeights | str]:
        return broadcast.replica_weights(self.queue, timeout)

    def sync_replicas(self, timeout: float = 120.0) -> dict[str, str]:
        return broadcast.sync_replicas(self.queue, timeout)

    def adopt_replicas(self, fingerprint: str, timeout: float = 10.0) -> dict[str, str]:
        return broadcast.adopt_replicas(self.queue, fingerprint, timeout)


def _starting(adopted: Mapping[str, str], results: Mapping[str, str]) -> str:
    """How a new run's version 0 reached the replicas, for the log."""
    took = {r: "adopted (its starting weights are this model)" for r, e in adopted.items() if e == "ok"}
    loaded = {r: e for r, e in results.items() if e != "unchanged" or r not in took}
    return ", ".join(f"{r}: {e}" for r, e in {**loaded, **took}.items()) or "no live replica yet"


def fleet_of(queue: RolloutQueue | Fleet) -> Fleet:
    """A RolloutQueue's QueueFleet; anything else is taken to be a Fleet already."""
    from maskroll.client import RolloutQueue

    return QueueFleet(queue) if isinstance(queue, RolloutQueue) else queue


class CheckpointPublisher:
    """Publishes versions of a model to the replicas behind `queue`, through `root`.

        q = RolloutQueue(url, "run1", run="new", batch_size=64, max_staleness=1)   # or run="resume"
        pub = CheckpointPublisher(q, "/shared/ckpt")
        version = pub.start(model)            # resume: `model` now holds the run's latest version
        for step in ...:
            ...                               # an optimiser step
            pub.publish(model)                # version + 1: saved, recorded, loaded by every replica

    Args:
        queue: a `maskroll.client.RolloutQueue` (its run, replica registry and policy version are used);
            `publish` alone works with any `Fleet` (a version and `broadcast_weights`).
        root: the directory the replicas were started with as `--weights-root` (a shared volume).
        keep: how many newest versions stay on disk (a replica still loading one must find it).
        timeout: seconds each replica may take to load a version.
        require_all: raise `WeightSyncError` if any live replica failed; False raises only when none
            accepted and returns the per-replica results otherwise (the failures are logged).
    """

    def __init__(
        self,
        queue: RolloutQueue | Fleet,
        root: str | os.PathLike,
        *,
        keep: int = 2,
        timeout: float = 120.0,
        require_all: bool = True,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        # absolute: UpdateWeights resolves a relative path against the replica's weights root, not our cwd
        self.queue, self.root = queue, Path(root).absolute()
        self.fleet = fleet_of(queue)
        self.keep, self.timeout, self.require_all = keep, timeout, require_all

    @property
    def version(self) -> int:
        """The last version published: the fleet's — a queue's run's (recorded in Redis, so it survives
        a restart)."""
        return self.fleet.version

    def start(self, model: torch.nn.Module) -> int:
        """Put the trainer and every live replica on the run's current version; returns that version.

        A resumed run at version v > 0 loads its checkpoint of v into `model` (optimiser state is the
        trainer's own business) and makes every replica that does not serve v of this run load it. A
        run at version 0 saves `model` as its version 0 and records it (so a replica that joins later
        loads it); live replicas whose starting weights are `model`'s (equal weights fingerprints,
        GetInfo) adopt it without loading, the others load it — a replica started with another
        `--model` never serves the run a model the trainer does not train. Raises WeightSyncError as
        `publish` does (no live replica yet is not an error here)."""
        fleet = self.fleet
        run = getattr(fleet, "run", None)
        if run is None or not hasattr(fleet, "replica_weights"):
            raise TypeError("start() needs a maskroll.client.RolloutQueue: it reads the run and the replicas")
        refuse_lora(model, "directory")
        if run.version > 0:
            own = checkpoint_dir(self.root, run.version)
            load_checkpoint(model, own if own.exists() or not run.checkpoint else run.checkpoint)
            log.info("resumed run %s at version %d from %s", run.run_id, run.version, run.checkpoint or own)
            self._checked(run.version, lambda: fleet.sync_replicas(timeout=self.timeout))
            return run.version
        adopted = fleet.adopt_replicas(model_fingerprint(model)) if hasattr(fleet, "adopt_replicas") else {}
        results = publish_first(self.publish, model)
        log.info("run %s starts at version 0: %s", run.run_id, _starting(adopted, results))
        return 0

    def publish(
        self, model: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None
    ) -> dict[str, str]:
        """Save `model` as `version` (default: the last version + 1), record it as the run's latest and
        load it on every live replica; returns {replica_id: "ok" | "unchanged" | error}."""
        # checked before saving: writing <root>/v<last> again would change the run's resume point
        version = next_version(self.version, version)
        refuse_lora(model, "directory")  # a PeftModel's state dict is not what the replicas load
        path = save_checkpoint(model, self.root, version)
        results = self._checked(
            version, lambda: self.fleet.broadcast_weights(version, str(path), timeout=self.timeout)
        )
        self._prune(version)
        return results

    def written_path(self, version: int) -> Path:
        """Where a sharded model's version is written (`sharded.write_gathered`) before
        `publish_written`: `<root>/v<version>/model.safetensors`, the layout the replicas load."""
        return checkpoint_dir(self.root, version) / CHECKPOINT_FILE

    def publish_written(self, written) -> dict[str, str]:
        """Publish a version already written into `written_path(version)` (a `sharded.WrittenVersion`:
        gathered one parameter at a time by every rank): recorded, loaded by every live replica, old
        versions pruned; as publish()."""
        version = next_version(self.version, written.manifest.version)
        path = str(Path(written.path).parent)
        results = self._checked(
            version, lambda: self.fleet.broadcast_weights(version, path, timeout=self.timeout)
        )
        self._prune(version)
        return results

    def close(self) -> None:
        """Nothing to release (no thread, no connection of its own): here so that a trainer closes either
        publisher the same way (StreamPublisher.close stops its follower thread)."""

    def _checked(self, version: int, broadcast) -> dict[str, str]:
        try:
            results = broadcast()
        except BroadcastError as e:  # raised when no live replica loaded it
            raise WeightSyncError(version, e.failed, e.results) from e
        return checked(version, results, self.require_all)

    def _prune(self, version: int) -> None:
        prune(self.root, version, self.keep)  # the checkpoints and their trained-ids ledgers
