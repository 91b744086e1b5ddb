"""The one weight source contract: where an update's tensors come from, and how an engine loads them.

Three sources, one set of semantics (pause, load, version bump, resume; names, shapes, dtypes and
finite values checked; a failed update leaves the old weights serving):

- `DirectorySource`: a checkpoint directory under the replica's weights root (UpdateWeights with
  `checkpoint`), checked by `weights.resolve_checkpoint`.
- `StreamedSource`: tensors pushed over gRPC (PushWeights), received by `weight_stream` into a
  safetensors file in the replica's private spool. The engine loads it through the very path a
  directory takes (`Engine.update_weights(version, checkpoint)`), so the checks cannot differ; the
  file is deleted once loaded or refused.
- `CollectiveSource`: an NCCL broadcast from the trainer through vLLM's weight-transfer engine
  (`vllm.distributed.weight_transfer`). Only an engine with `update_weights_collective` (the vLLM
  engine, on GPUs) takes it; others answer UNIMPLEMENTED.

Knows nothing of gRPC; errors are ServiceErrors, translated at the RPC boundary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from maskroll.client.tensor_push import CollectiveSpec, WeightsManifest

from . import weight_stream, weights
from .engine import Engine
from .errors import InvalidArgument, ServiceError, Unimplemented


@dataclass(frozen=True)
class DirectorySource:
    checkpoint: weights.Checkpoint

    def describe(self) -> str:
        return str(self.checkpoint)


@dataclass(frozen=True)
class StreamedSource:
    directory: Path  # in the spool, holding weight_stream.FILE_NAME; deleted after the load
    manifest: WeightsManifest

    def describe(self) -> str:
        return f"a push of {len(self.manifest.tensors)} tensors ({self.manifest.total_bytes / 1e6:.1f} MB)"


@dataclass(frozen=True)
class CollectiveSource:
    """An NCCL group through vLLM's weight-transfer engine (docs/architecture.md, flow 4)."""

    spec: CollectiveSpec

    def describe(self) -> str:
        c = self.spec
        what = "join" if c.init else f"broadcast of {len(c.tensors)} tensors"
        return f"NCCL {what} via {c.master_address}:{c.master_port} (ranks from {c.rank_offset})"


WeightSource = DirectorySource | StreamedSource | CollectiveSource


async def load(engine: Engine, version: int, source: WeightSource) -> tuple[int, float]:
    """Load `source` and make `version` current; returns (paused requests, seconds). Bad content →
    InvalidArgument with the old weights still serving (see `weights.load_checkpoint`)."""
    if isinstance(source, DirectorySource):
        return await weights.load_checkpoint(engine, version, source.checkpoint)
    if isinstance(source, StreamedSource):
        checkpoint = weights.checkpoint_of(source.directory)
        try:
            return await weights.load_checkpoint(engine, version, checkpoint)
        except InvalidArgument as e:
            # the message names the spool file; the caller knows the push, not that file
            raise InvalidArgument(f"pushed weights of version {version} refused: {e}") from e
    collective = getattr(engine, "update_weights_collective", None)
    if collective is None:
        raise Unimplemented(
            f"the {engine.name} engine cannot receive weights over NCCL; push them (PushWeights) or send "
            "a checkpoint"
        )
    t0 = time.perf_counter()
    try:
        paused = await collective(version, source.spec)
    except ServiceError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"NCCL weight update failed: {type(exc).__name__}: {exc}") from exc
    return paused, time.perf_counter() - t0


async def join_collective(engine: Engine, source: CollectiveSource) -> None:
    """Join the trainer's NCCL group (the rendezvous); no weights change."""
    init = getattr(engine, "init_weight_transfer", None)
    if init is None:
        raise Unimplemented(f"the {engine.name} engine cannot join an NCCL weight-transfer group")
    await init(source.spec)


def release(source: WeightSource) -> None:
    """Free what the source holds on this replica (a streamed push's spool file)."""
    if isinstance(source, StreamedSource):
        weight_stream.discard(source.directory)
