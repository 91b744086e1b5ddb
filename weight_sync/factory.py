"""One Publisher protocol, one factory: how a trainer gets a policy version onto the replicas.

Every publisher does the same four things, whatever the transport:

    pub = make_publisher("stream", q, root="./ckpt")   # or "directory", "nccl"
    pub.start(model)        # trainer and replicas on the run's current version; returns it
    pub.publish(model)      # the next version (pub.version + 1) on every live replica, or an error
    pub.version             # the last version published: the queue's policy version (its run's)
    pub.close()             # stop what the publisher runs (StreamPublisher's follower thread)

Transports: "directory" (`CheckpointPublisher`: a checkpoint under the replicas' shared
`--weights-root`, loaded by UpdateWeights), "stream" (`StreamPublisher`: PushWeights over gRPC, no
shared filesystem), "nccl" (`NcclPublisher`: NCCL through vLLM's weight transfer; GPUs). The trainer
ranks' control plane (`collective=`, `client.ranks.Collective`) is another thing: it carries the ranks'
agreement, never weights to the replicas.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from maskroll.client import RolloutQueue

    from .directory import Fleet

Transport = Literal["directory", "stream", "nccl"]
TRANSPORTS: tuple[Transport, ...] = ("directory", "stream", "nccl")


class Publisher(Protocol):
    """What CheckpointPublisher, StreamPublisher and NcclPublisher share."""

    @property
    def version(self) -> int:
        """The last version published (the trainer's policy version; one owner: the queue's run)."""
        ...

    def start(self, model: torch.nn.Module) -> int:
        """Put the trainer and every live replica on the run's current version; returns that version."""
        ...

    def publish(
        self, model: Mapping[str, torch.Tensor] | torch.nn.Module, version: int | None = None
    ) -> dict[str, str]:
        """Publish `model` as `version` (default: the last + 1): recorded in the run, then on every live
        replica; {replica_id: "ok" | "unchanged" | error}. Raises when replicas were left behind."""
        ...

    def close(self) -> None:
        """Release what the publisher runs (never the queue: it is the caller's)."""
        ...


def make_publisher(
    transport: Transport,
    queue: RolloutQueue | Fleet | None,
    *,
    collective: Any = None,
    root: str | os.PathLike | None = None,
    keep: int = 2,
    timeout: float | None = None,
    **options: Any,
) -> Publisher:
    """The publisher of `transport` for the replicas behind `queue` (a RolloutQueue; "directory" also
    takes a `publish.Fleet`, e.g. a fixed list of replicas with no queue).

    root: "directory": the replicas' `--weights-root` (required); "stream": the trainer's own copy of
    each version, for resuming after a restart (None: none); "nccl": not used. keep: versions
    kept under root. timeout: seconds each replica may take per version (default: the transport's).
    options: the transport's own arguments — require_all ("directory", "stream"); follow_s, chunk_bytes,
    resume_from_base ("stream": a resumed run with no copy of its version under root publishes the model
    as a new version instead of refusing), held ("stream": the (run, version) the model holds, from an
    earlier publisher's `held`); model, master_address, master_port, tensor_parallel_size,
    packed ("nccl").

    collective: the trainer ranks' control plane (`maskroll.client.ranks.Collective`, e.g.
    `trainer_adapter.distributed.TorchCollective()`), for a data-parallel trainer: every rank calls
    make_publisher, start and publish, with `queue` on rank 0 and None on the others, and gets a
    `ranked.RankedPublisher` (a plain or DDP model is published by rank 0 alone; an FSDP2 model is
    gathered one parameter at a time by every rank). None: one process, as before."""
    if transport not in TRANSPORTS:
        # "collective": the NCCL transport's name before it was "nccl" (collective= is the ranks' plane)
        was = " (the NCCL transport is 'nccl')" if transport == "collective" else ""
        raise ValueError(f"transport={transport!r}; expected one of {', '.join(map(repr, TRANSPORTS))}{was}")
    if transport == "directory" and root is None:
        raise ValueError("transport 'directory' needs root: the directory the replicas use as --weights-root")
    if transport == "nccl" and root is not None:
        raise ValueError("transport 'nccl' keeps no copy of the weights: root must be None")
    if collective is not None:
        from .ranked import RankedPublisher

        if collective.rank != 0 and transport == "nccl":
            from .nccl import NcclPublisher

            if queue is not None:
                raise ValueError(f"rank {collective.rank}: only rank 0 holds the queue; pass queue=None")
            if timeout is not None:
                options["timeout"] = timeout
            inner = NcclPublisher(None, rank=collective.rank, **options)
            return RankedPublisher(inner, collective, transport)
        if collective.rank != 0:
            if queue is not None:
                raise ValueError(
                    f"rank {collective.rank}: only rank 0 holds the queue and talks to the replicas; "
                    "pass queue=None on the other ranks"
                )
            return RankedPublisher(None, collective, transport)
        if queue is None:
            raise ValueError("rank 0 publishes through the queue's replicas: pass its queue")
        inner = make_publisher(transport, queue, root=root, keep=keep, timeout=timeout, **options)
        return RankedPublisher(inner, collective, transport)
    if queue is None:
        raise ValueError(f"make_publisher({transport!r}) needs the queue whose replicas it publishes to")
    if timeout is not None:
        options["timeout"] = timeout
    if transport == "directory":
        from .directory import CheckpointPublisher

        return CheckpointPublisher(queue, root, keep=keep, **options)
    if transport == "stream":
        from .stream import StreamPublisher

        return StreamPublisher(queue, save_root=root, keep=keep, **options)
    from .nccl import NcclPublisher

    return NcclPublisher(queue, **options)
