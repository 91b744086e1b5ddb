"""What every publisher shares, whatever its transport: the version a publish makes current
(`next_version`), a version's per-replica results and the error that names the replicas left behind
(`checked`, `WeightSyncError`), and a new run's version 0 published before any replica is live
(`publish_first`). The directory, stream and nccl publishers and `ranked.RankedPublisher` all take them
from here. Knows nothing of transports, files or tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from maskroll.client import BroadcastError

if TYPE_CHECKING:
    import torch

OK = ("ok", "unchanged", "adopted")  # a replica that serves the version now


def next_version(last: int, version: int | None) -> int:
    """The version a publish makes current: `version`, or the last published + 1. ValueError if it does
    not move the run forward (0 may be published again while the run is at 0: its starting weights)."""
    version = last + 1 if version is None else int(version)
    if version < last or (version == last and version != 0):
        raise ValueError(f"version {version} does not move the run forward: the last published is {last}")
    return version


def checked(version: int, results: dict[str, str], require_all: bool) -> dict[str, str]:
    """`results` ({replica_id: "ok" | "unchanged" | error}) of publishing `version`; WeightSyncError if
    no replica serves it, or with `require_all` if any failed (the queue has logged them)."""
    failed = {r: e for r, e in results.items() if e not in OK}
    if (failed and require_all) or len(failed) == len(results):
        raise WeightSyncError(version, failed, results)
    return results


class WeightSyncError(BroadcastError):
    """A published version did not reach the replicas it had to reach."""

    def __init__(self, version: int, failed: dict[str, str], results: dict[str, str] | None = None) -> None:
        super().__init__(version, results if results is not None else failed)
        self.failed = failed
        detail = "; ".join(f"{r}: {e}" for r, e in failed.items()) or "no live replica in the namespace"
        self.args = (f"policy version {version} was not loaded by every replica ({detail})",)


def publish_first(publish: Callable[[torch.nn.Module, int], dict[str, str]], model: torch.nn.Module) -> dict:
    """A new run's version 0 through `publish` (a publisher's): its results, {} when no replica is live
    yet; a replica that was there and did not take it raises (WeightSyncError)."""
    try:
        return publish(model, 0)
    except WeightSyncError as e:
        if e.results:
            raise
        return {}
