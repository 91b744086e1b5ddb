"""CheckpointPublisher: after an optimiser step, write the new policy and make every live replica load it.

One call per version: save the checkpoint (`checkpoint.py` layout), `UpdateWeights(version)` on every
live replica through the queue's registry (in parallel, a timeout each), set the queue's policy version
(so staleness is counted against it), and prune old versions. A replica that refuses or times out is
reported by id; by default any failure raises, because a replica left on old weights keeps producing
records the trainer would count as stale — or worse, train on as if they were fresh.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from .checkpoint import checkpoint_dir, save_checkpoint

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A published version did not reach the replicas it had to reach."""

    def __init__(self, version: int, failed: dict[str, str]) -> None:
        self.version, self.failed = version, failed
        detail = "; ".join(f"{r}: {e}" for r, e in failed.items()) or "no live replica in the namespace"
        super().__init__(f"policy version {version} was not loaded by every replica ({detail})")


class _Broadcaster(Protocol):  # RolloutQueue (sync) has this method
    def broadcast_weights(
        self, version: int, checkpoint_dir: str, timeout: float = ...
    ) -> dict[str, str]: ...


class CheckpointPublisher:
    """Publishes versions 1, 2, … of a model to the replicas behind `queue`, through `root`.

    Args:
        queue: a `maskroll.client.RolloutQueue` (its replica registry and gRPC broadcast are used).
        root: the directory the replicas were started with as `--weights-root` (a shared volume).
        keep: how many newest versions stay on disk (a replica still loading one must find it).
        timeout: seconds each replica may take to load a version.
        require_all: raise `WeightSyncError` if any live replica failed; False raises only when none
            accepted and returns the per-replica results otherwise (the failures are logged).
    """

    def __init__(
        self,
        queue: _Broadcaster,
        root: str | os.PathLike,
        *,
        keep: int = 2,
        timeout: float = 120.0,
        require_all: bool = True,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.queue, self.root = queue, Path(root)
        self.keep, self.timeout, self.require_all = keep, timeout, require_all

    def publish(self, model: Mapping[str, torch.Tensor] | torch.nn.Module, version: int) -> dict[str, str]:
        """Save `model` as `version`, load it on every live replica; returns {replica_id: "ok" | error}."""
        path = save_checkpoint(model, self.root, version)
        results = self.queue.broadcast_weights(version, str(path), timeout=self.timeout)
        failed = {r: e for r, e in results.items() if e != "ok"}
        if failed:
            log.warning("policy version %d: replicas behind: %s", version, failed)
        if (failed and self.require_all) or len(failed) == len(results):
            raise WeightSyncError(version, failed)
        self._prune(version)
        return results

    def _prune(self, version: int) -> None:
        for old in range(version - self.keep, 0, -1):
            d = checkpoint_dir(self.root, old)
            if not d.exists():
                break  # older ones were pruned by an earlier publish
            shutil.rmtree(d)
