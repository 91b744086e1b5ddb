"""maskroll.weight_sync: trainer-side weight publishing — getting a new policy onto every live replica.

Two transports, one run semantics: `StreamPublisher` (`stream.py`, the default of `maskroll demo` and
the deployment) pushes each version's tensors to every replica over gRPC (PushWeights: no shared
filesystem); `CheckpointPublisher` (`publish.py`) writes it in the checkpoint layout (`checkpoint.py`)
under the replicas' `--weights-root` (a shared volume) and announces it (UpdateWeights). The NCCL
transport through vLLM's weight-transfer engine is `collective.py` (GPUs only). The
publisher knows the training run (through `maskroll.client.RolloutQueue`): a restarted trainer resumes
at the run's last version, from its checkpoint.

May import torch, safetensors and `maskroll.client` (the queue's replica registry and the gRPC
`UpdateWeights` call); never `maskroll.server`. Importing the package itself loads none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .checkpoint import CHECKPOINT_FILE, checkpoint_dir, load_checkpoint, save_checkpoint
    from .publish import CheckpointPublisher, WeightSyncError
    from .stream import StreamPublisher

_LAZY = {
    "CHECKPOINT_FILE": "checkpoint",
    "checkpoint_dir": "checkpoint",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "CheckpointPublisher": "publish",
    "WeightSyncError": "publish",
    "StreamPublisher": "stream",
}

__all__ = [
    "CHECKPOINT_FILE",
    "CheckpointPublisher",
    "StreamPublisher",
    "WeightSyncError",
    "checkpoint_dir",
    "load_checkpoint",
    "save_checkpoint",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
