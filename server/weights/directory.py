"""The replica's end of the directory transport (UpdateWeights with a checkpoint path; the trainer's end is
weight_sync/directory.py): a checkpoint directory under the replica's --weights-root, checked once by
`checkpoints.resolve_checkpoint` (real paths under the root, regular files, inodes kept) and loaded by the
engine from exactly the files checked. Knows nothing of gRPC; the version rule is weights/updates.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..engines.contract import Engine
from . import checkpoints


@dataclass(frozen=True)
class DirectorySource:
    checkpoint: checkpoints.Checkpoint

    @classmethod
    def resolve(cls, path: str, root: Path | None) -> DirectorySource:
        """The checkpoint at `path` (a client's or the run record's), refused unless it is under `root`
        (PermissionDenied, InvalidArgument; no root: nothing is loaded)."""
        return cls(checkpoints.resolve_checkpoint(path, root))

    def describe(self) -> str:
        return str(self.checkpoint)

    async def load(self, engine: Engine, version: int) -> tuple[int, float]:
        """(paused requests, seconds); InvalidArgument for bad content, the old weights still serving."""
        return await checkpoints.load_checkpoint(engine, version, self.checkpoint)

    def release(self) -> None:
        """Nothing is held: the directory is the trainer's."""
