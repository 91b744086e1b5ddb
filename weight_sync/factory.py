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

import enum
import os
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from maskroll.client import RolloutQueue

    from .directory import Fleet

Transport = Literal["directory", "stream", "nccl"]
TRANSPORTS: tuple[Transport, ...] = typing.get_args(Transport)
# The transports that need no GPU: the ones the recipe, the TRL trainer and `maskroll demo` offer
# (the nccl transport needs CUDA on both ends and is made with the model it sends, NcclPublisher).
CpuTransport = Literal["stream", "directory"]


class _Unset(enum.Enum):
    UNSET = "unset"


# A keyword left out of make_publisher: the publisher's own default applies. Not None, which is a value
# of its own for some (follow_s=None: no follower thread; held=None: nothing held).
UNSET = _Unset.UNSET

# The keywords of make_publisher that belong to some transports only: any other given is refused.
OPTIONS: dict[str, frozenset[str]] = {
    "directory": frozenset({"keep", "require_all"}),
    "stream": frozenset(
        {"keep", "require_all", "follow_s", "chunk_bytes", "resume_from_base", "held", "dtype", "deltas"}
    ),
    "nccl": frozenset(
        {"model", "master_address", "master_port", "tensor_parallel_size", "packed", "backend", "dtype"}
    ),
}


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
    timeout: float | None = None,
    keep: int | _Unset = UNSET,
    require_all: bool | _Unset = UNSET,
    follow_s: float | _Unset | None = UNSET,
    chunk_bytes: int | _Unset = UNSET,
    resume_from_base: bool | _Unset = UNSET,
    held: tuple[str, int] | _Unset | None = UNSET,
    dtype: torch.dtype | str | _Unset | None = UNSET,
    deltas: str | _Unset = UNSET,
    model: torch.nn.Module | _Unset = UNSET,
    master_address: str | _Unset = UNSET,
    master_port: int | _Unset = UNSET,
    tensor_parallel_size: int | _Unset = UNSET,
    packed: bool | _Unset = UNSET,
    backend: str | _Unset = UNSET,
) -> Publisher:
    """The publisher of `transport` for the replicas behind `queue` (a RolloutQueue; "directory" also
    takes a `directory.Fleet`, e.g. a fixed list of replicas with no queue).

    Every transport:
        root: "directory": the replicas' `--weights-root` (required); "stream": the trainer's own copy of
            each version, for resuming after a restart (None: none); "nccl": must be None.
        timeout: seconds each replica may take per version (None: the transport's, 120 s for directory
            and stream, 600 s for nccl).
        collective: the trainer ranks' control plane (`maskroll.client.ranks.Collective`, e.g.
            `trainer_adapter.distributed.TorchCollective()`), for a data-parallel trainer: every rank calls
            make_publisher, start and publish, with `queue` on rank 0 and None on the others, and gets a
            `ranked.RankedPublisher` (a plain or DDP model is published by rank 0 alone; an FSDP2 model is
            gathered one parameter at a time by every rank). None: one process.
    "directory" and "stream":
        keep: versions kept under root (default 2).
        require_all: raise WeightSyncError when any live replica failed (default True); False raises only
            when none took the version.
    "stream" only (StreamPublisher):
        follow_s: seconds between the follower's rounds, which push the current version to replicas that
            joined since (default 5.0; None: no follower thread).
        chunk_bytes: bytes per PushWeights message (default 4 MiB; under the replicas'
            --max-message-bytes).
        resume_from_base: a resumed run with no copy of its version under root publishes the model as a
            new version instead of refusing (default False).
        held: the (run id, version) the model already holds, from an earlier publisher's `held`.
        dtype: the replicas' dtype (torch.bfloat16, "bfloat16"): weights cast to it and sent in it;
            None: the model's own; "auto" (default): the one the live replicas report at start(). (Also
            "nccl"'s, with backend "sparse_nccl": below.)
        deltas: "auto" (default): each version after the first as a delta on the last to the replicas
            serving it (delta.py), the full version to the others; "off": every version whole.
    "nccl" only (NcclPublisher; required: model, master_address, master_port):
        model: the module whose parameters are sent (NCCL reads them in place).
        master_address, master_port: the NCCL group's rendezvous, reachable by every replica.
        tensor_parallel_size: each replica's vLLM workers (ranks per replica; default 1).
        packed: vLLM's packed broadcast (default True; backend "nccl" only).
        backend: vLLM's weight-transfer backend, as the replicas' `weight_transfer_config` names it:
            "nccl" (default: every parameter whole) or "sparse_nccl" (the elements whose bits changed
            since the last version, nccl_sparse.py; not with an FSDP2 model, nor packed). "nccl_m2n" is
            refused: not wired.
        dtype: backend "sparse_nccl" only: the replicas' dtype, in which bits are compared and values sent
            (torch.bfloat16 or its name; default None: the model's own; no "auto").

    A keyword that does not apply to `transport` raises ValueError naming it and the transport."""
    if transport not in TRANSPORTS:
        # "collective": the NCCL transport's name before it was "nccl" (collective= is the ranks' plane)
        was = " (the NCCL transport is 'nccl')" if transport == "collective" else ""
        raise ValueError(f"transport={transport!r}; expected one of {', '.join(map(repr, TRANSPORTS))}{was}")
    given = {
        name: value
        for name, value in (
            ("keep", keep),
            ("require_all", require_all),
            ("follow_s", follow_s),
            ("chunk_bytes", chunk_bytes),
            ("resume_from_base", resume_from_base),
            ("held", held),
            ("dtype", dtype),
            ("deltas", deltas),
            ("model", model),
            ("master_address", master_address),
            ("master_port", master_port),
            ("tensor_parallel_size", tensor_parallel_size),
            ("packed", packed),
            ("backend", backend),
        )
        if value is not UNSET
    }
    foreign = sorted(set(given) - OPTIONS[transport])
    if foreign:
        owners = {name: [t for t, names in OPTIONS.items() if name in names] for name in foreign}
        detail = "; ".join(f"{name}: {' / '.join(ts)} only" for name, ts in owners.items())
        raise ValueError(f"transport {transport!r} takes no {', '.join(foreign)} ({detail})")
    if transport == "directory" and root is None:
        raise ValueError("transport 'directory' needs root: the directory the replicas use as --weights-root")
    if transport == "nccl" and root is not None:
        raise ValueError("transport 'nccl' keeps no copy of the weights: root must be None")
    if transport == "nccl":
        missing = [name for name in ("model", "master_address", "master_port") if name not in given]
        if missing:
            raise ValueError(f"transport 'nccl' needs {', '.join(missing)}")
    if timeout is not None:
        given["timeout"] = timeout
    if collective is not None:
        from .ranked import RankedPublisher

        if collective.rank != 0 and transport == "nccl":
            from .nccl import NcclPublisher

            if queue is not None:
                raise ValueError(f"rank {collective.rank}: only rank 0 holds the queue; pass queue=None")
            inner = NcclPublisher(None, rank=collective.rank, **given)
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
        return RankedPublisher(_make(transport, queue, root, given), collective, transport)
    if queue is None:
        raise ValueError(f"make_publisher({transport!r}) needs the queue whose replicas it publishes to")
    return _make(transport, queue, root, given)


def _make(transport: Transport, queue, root, options: dict[str, Any]) -> Publisher:
    """One process's publisher (rank 0's, for several): `options` checked by make_publisher."""
    if transport == "directory":
        from .directory import CheckpointPublisher

        return CheckpointPublisher(queue, root, **options)
    if transport == "stream":
        from .stream import StreamPublisher

        return StreamPublisher(queue, save_root=root, **options)
    from .nccl import NcclPublisher

    return NcclPublisher(queue, **options)
