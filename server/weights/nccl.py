"""The replica's end of the NCCL transport (UpdateWeights with a CollectiveSource; the trainer's end is
weight_sync/nccl.py): tensors broadcast from the trainer's rank 0 through vLLM's weight-transfer engine
(`vllm.distributed.weight_transfer`, docs/architecture.md flow 4). Only an engine that declares it
(`Engine.weight_capabilities.nccl`: the vLLM engine, on GPUs) takes it; others answer UNIMPLEMENTED.
The spec names vLLM's backend ("nccl": every tensor whole; "sparse_nccl": per tensor `changed` (index,
value) pairs, written in place); a spec the receiver cannot take (`CollectiveSpec.check`) is refused
before the engine is asked, since a receive that does not match the trainer's sends hangs NCCL. That the
backend is the one the engine's workers were started with is the engine's check.
Knows nothing of gRPC; the version rule is weights/updates.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from maskroll.proto.tensor_push import SPARSE_NCCL, CollectiveSpec

from ..engines.contract import Engine
from ..errors import InvalidArgument, ServiceError, Unimplemented


@dataclass(frozen=True)
class NcclSource:
    spec: CollectiveSpec

    def describe(self) -> str:
        c = self.spec
        if c.init:
            what = "join"
        elif c.backend == SPARSE_NCCL:
            n = sum(t.changed for t in c.tensors)
            what = f"sparse broadcast of {n} elements in {len(c.tensors)} tensors"
        else:
            what = f"broadcast of {len(c.tensors)} tensors"
        return f"NCCL {what} via {c.master_address}:{c.master_port} (ranks from {c.rank_offset})"

    async def load(self, engine: Engine, version: int) -> tuple[int, float]:
        """Receive the listed tensors and make `version` current: (paused requests, seconds)."""
        _check_takes_nccl(engine, "receive weights over NCCL; push them (PushWeights) or send a checkpoint")
        _check_spec(self.spec)
        t0 = time.perf_counter()
        try:
            paused = await engine.update_weights_collective(version, self.spec)
        except ServiceError:
            raise
        except (ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"NCCL weight update failed: {type(exc).__name__}: {exc}") from exc
        return paused, time.perf_counter() - t0

    def release(self) -> None:
        """Nothing is held: the tensors went straight into the engine."""


async def join(engine: Engine, source: NcclSource) -> None:
    """Join the trainer's NCCL group (the rendezvous, `spec.init`); no weights change."""
    _check_takes_nccl(engine, "join an NCCL weight-transfer group")
    _check_spec(source.spec)
    try:
        await engine.init_weight_transfer(source.spec)
    except ServiceError:
        raise
    except (ValueError, RuntimeError) as exc:  # as load(): e.g. a backend the engine was not started with
        raise InvalidArgument(f"NCCL join failed: {type(exc).__name__}: {exc}") from exc


def _check_spec(spec: CollectiveSpec) -> None:
    try:
        spec.check()
    except ValueError as exc:
        raise InvalidArgument(f"NCCL weight update refused: {exc}") from exc


def _check_takes_nccl(engine: Engine, what: str) -> None:
    if not engine.weight_capabilities.nccl:
        raise Unimplemented(f"the {engine.name} engine cannot {what}")
