"""maskroll.weight_sync: trainer-side weight publishing — getting a new policy onto every live replica.

One `Publisher` protocol (start / publish / version / close) and one factory, `make_publisher(transport,
queue, ...)` (factory.py), over three transports with one run semantics: "stream" (`StreamPublisher`,
`stream.py`, the default of `maskroll demo` and the deployment) pushes each version's tensors to every
replica over gRPC (PushWeights: no shared filesystem); "directory" (`CheckpointPublisher`,
`directory.py`) writes it in the checkpoint layout (`checkpoint.py`) under the replicas' `--weights-root`
(a shared volume) and announces it (UpdateWeights); "nccl" (`NcclPublisher`, `nccl.py`, GPUs only)
sends it over NCCL through vLLM's weight-transfer engine. A data-parallel trainer passes
`collective=` (its ranks' control plane) and gets a `RankedPublisher` (`ranked.py`) on every rank: rank 0
publishes, an FSDP2 model is gathered one parameter at a time by every rank (`sharded.py`). The calls to the
replicas themselves — broadcast, push, sync, what each serves — are `broadcast.py`, which takes a
`maskroll.client.RolloutQueue` for its replica registry, run and policy version: a restarted trainer
resumes at the run's last version, from its checkpoint, and with `read_trained` / `write_trained` (the
ledger of the rollout ids each version trained on, beside the checkpoints) trains no record twice.
A PEFT LoRA model is published as its adapter (`lora.py`: wire names, base fingerprint, merge, PEFT's
directory layout) by the stream transport.

May import torch, safetensors and `maskroll.client` (the queue's replica registry, run and the gRPC
client); never `maskroll.server`. Importing the package itself loads none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .broadcast import broadcast_weights, push_weights, replica_weights, sync_replicas
    from .checkpoint import (
        CHECKPOINT_FILE,
        checkpoint_dir,
        load_checkpoint,
        read_trained,
        save_checkpoint,
        write_trained,
    )
    from .directory import CheckpointPublisher
    from .factory import CpuTransport, Publisher, Transport, make_publisher
    from .lora import (
        LoraUnsupported,
        adapter_of,
        base_fingerprint,
        is_lora,
        load_adapter,
        merge,
        save_adapter,
    )
    from .nccl import NcclPublisher
    from .ranked import RankedPublisher
    from .stream import StreamPublisher
    from .versions import WeightSyncError

_LAZY = {
    "CHECKPOINT_FILE": "checkpoint",
    "checkpoint_dir": "checkpoint",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "write_trained": "checkpoint",
    "read_trained": "checkpoint",
    "CheckpointPublisher": "directory",
    "WeightSyncError": "versions",
    "StreamPublisher": "stream",
    "RankedPublisher": "ranked",
    "NcclPublisher": "nccl",
    "Publisher": "factory",
    "Transport": "factory",
    "CpuTransport": "factory",
    "make_publisher": "factory",
    "is_lora": "lora",
    "adapter_of": "lora",
    "base_fingerprint": "lora",
    "merge": "lora",
    "save_adapter": "lora",
    "load_adapter": "lora",
    "LoraUnsupported": "lora",
    "broadcast_weights": "broadcast",
    "push_weights": "broadcast",
    "replica_weights": "broadcast",
    "sync_replicas": "broadcast",
}

__all__ = [
    "CHECKPOINT_FILE",
    "CheckpointPublisher",
    "CpuTransport",
    "LoraUnsupported",
    "NcclPublisher",
    "Publisher",
    "RankedPublisher",
    "StreamPublisher",
    "Transport",
    "WeightSyncError",
    "adapter_of",
    "base_fingerprint",
    "broadcast_weights",
    "checkpoint_dir",
    "is_lora",
    "load_adapter",
    "load_checkpoint",
    "make_publisher",
    "merge",
    "push_weights",
    "read_trained",
    "replica_weights",
    "save_adapter",
    "save_checkpoint",
    "sync_replicas",
    "write_trained",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
