"""maskroll.weight_sync: trainer-side weight publishing — getting a new policy onto every live replica.

Owns the checkpoint layout the replicas load (`checkpoint.py`) and the publisher that writes a version
and announces it to the replicas (`publish.py`). Today's transport is a directory under the replicas'
`--weights-root` (a shared volume); streamed and collective (NCCL) transports belong here too.

May import torch, safetensors and `maskroll.client` (the queue's replica registry and the gRPC
`UpdateWeights` call); never `maskroll.server`. Importing the package itself loads none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .checkpoint import CHECKPOINT_FILE, checkpoint_dir, save_checkpoint
    from .publish import CheckpointPublisher, WeightSyncError

_LAZY = {
    "CHECKPOINT_FILE": "checkpoint",
    "checkpoint_dir": "checkpoint",
    "save_checkpoint": "checkpoint",
    "CheckpointPublisher": "publish",
    "WeightSyncError": "publish",
}

__all__ = ["CHECKPOINT_FILE", "CheckpointPublisher", "WeightSyncError", "checkpoint_dir", "save_checkpoint"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
