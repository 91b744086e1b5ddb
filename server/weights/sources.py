"""The one weight source contract: where an update's tensors come from, and how an engine loads them.

Three sources, one set of semantics (pause, load, version bump, resume; names, shapes, dtypes and
finite values checked by the one rule set, `tensor_rules`; a failed update leaves the old weights
serving):

- `DirectorySource`: a checkpoint directory under the replica's weights root (UpdateWeights with
  `checkpoint`), checked by `weights.resolve_checkpoint`.
- `StreamedSource`: tensors pushed over gRPC (PushWeights), received by `weight_stream` (`receive`
  picks where). An engine that loads tensors from memory (`update_weights_from_tensors`: the torch
  engine) gets them straight from the stream, one copy of the weights, no disk, checked by the same
  function that checks a checkpoint's tensors. Another (vLLM, whose workers read files by path) gets a
  safetensors file in the replica's private spool, loaded through the very path a directory takes
  (`Engine.update_weights(version, checkpoint)`), so the checks cannot differ; a refused file is
  deleted at once, a loaded one when the next update succeeds (the engine restores from it).
- `CollectiveSource`: an NCCL broadcast from the trainer through vLLM's weight-transfer engine
  (`vllm.distributed.weight_transfer`). Only an engine with `update_weights_collective` (the vLLM
  engine, on GPUs) takes it; others answer UNIMPLEMENTED.

Knows nothing of gRPC; errors are ServiceErrors, translated at the RPC boundary.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from maskroll.proto.heap import trim_heap
from maskroll.proto.tensor_push import CollectiveSpec, WeightsManifest

from ..engines.contract import Engine
from ..errors import InvalidArgument, ServiceError, Unimplemented
from . import checkpoints as weights
from . import receive as weight_stream


@dataclass(frozen=True)
class DirectorySource:
    checkpoint: weights.Checkpoint

    def describe(self) -> str:
        return str(self.checkpoint)


@dataclass(frozen=True)
class StreamedSource:
    manifest: WeightsManifest
    directory: Path | None = None  # in the spool, holding weight_stream.FILE_NAME (see _serving_spool)
    tensors: dict | None = None  # {name: tensor} received into memory; the engine consumes the dict

    def describe(self) -> str:
        where = "memory" if self.directory is None else "the spool"
        n, mb = len(self.manifest.tensors), self.manifest.total_bytes / 1e6
        return f"a push of {n} tensors ({mb:.1f} MB, received into {where})"


async def receive(engine: Engine, manifest: WeightsManifest, rest: AsyncIterator) -> StreamedSource:
    """Receive a push (the data messages `rest` after `manifest`) where `engine` loads it from best."""
    if hasattr(engine, "update_weights_from_tensors"):
        return StreamedSource(manifest, tensors=await weight_stream.receive_tensors(manifest, rest))
    return StreamedSource(manifest, directory=await weight_stream.receive(manifest, rest))


@dataclass(frozen=True)
class CollectiveSource:
    """An NCCL group through vLLM's weight-transfer engine (docs/architecture.md, flow 4)."""

    spec: CollectiveSpec

    def describe(self) -> str:
        c = self.spec
        what = "join" if c.init else f"broadcast of {len(c.tensors)} tensors"
        return f"NCCL {what} via {c.master_address}:{c.master_port} (ranks from {c.rank_offset})"


WeightSource = DirectorySource | StreamedSource | CollectiveSource


# The spool directory each engine (by id) serves its weights from. An engine that loads files (vLLM)
# restores the served weights from them after a failed update (vllm_engine._recover), so the spool file
# of the last successful push stays until another update succeeds: one model on the replica's own disk.
_serving_spool: dict[int, Path] = {}


async def load(engine: Engine, version: int, source: WeightSource) -> tuple[int, float]:
    """Load `source` and make `version` current; returns (paused requests, seconds). Bad content →
    InvalidArgument with the old weights still serving (see `weights.load_checkpoint`)."""
    result = await _load(engine, version, source)
    previous = _serving_spool.pop(id(engine), None)
    if isinstance(source, StreamedSource) and source.directory is not None:
        _serving_spool[id(engine)] = source.directory
    if previous is not None:
        weight_stream.discard(previous)
    return result


async def _load(engine: Engine, version: int, source: WeightSource) -> tuple[int, float]:
    if isinstance(source, DirectorySource):
        return await weights.load_checkpoint(engine, version, source.checkpoint)
    if isinstance(source, StreamedSource):
        if source.tensors is not None:
            return await _load_tensors(engine, version, source.tensors)
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


async def _load_tensors(engine: Engine, version: int, tensors: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    try:
        paused = await engine.update_weights_from_tensors(version, tensors, "the pushed weights")
    except ServiceError:
        raise
    except weights.load_errors() as exc:
        raise InvalidArgument(
            f"pushed weights of version {version} refused: {type(exc).__name__}: {exc}"
        ) from exc
    return paused, time.perf_counter() - t0


async def join_collective(engine: Engine, source: CollectiveSource) -> None:
    """Join the trainer's NCCL group (the rendezvous); no weights change."""
    init = getattr(engine, "init_weight_transfer", None)
    if init is None:
        raise Unimplemented(f"the {engine.name} engine cannot join an NCCL weight-transfer group")
    await init(source.spec)


def release(source: WeightSource) -> None:
    """Free what the source holds on this replica (a streamed push's spool file, or its tensors when
    the load was refused before the engine consumed them), and return the memory the update freed —
    the replaced weights, the push's buffers — to the system (`proto.heap.trim_heap`)."""
    if isinstance(source, StreamedSource):
        if source.directory is not None and source.directory not in _serving_spool.values():
            weight_stream.discard(source.directory)
        if source.tensors is not None:
            source.tensors.clear()
    trim_heap()
